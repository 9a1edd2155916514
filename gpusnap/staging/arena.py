"""The staging arena: the memory a dump's pages images are staged in (staging.py), faulted
in by threads of its own before CRIU starts. Fresh anonymous memory costs a page fault and
a zeroed page per 4 KiB (~0.1 s per 256 MiB here): inside the freeze that would lengthen
it, and on the main thread it would add to the preflight; in threads started as the dump
begins it overlaps the preflight on another core. In transparent huge pages where the
machine keeps its memory (huge_pages_wanted), one fault covers 2 MiB.

Given a `room` (how much memory the process may still take), the threads look at it as they
go and stop short of running memory out: a budget set by hand above what a memory cgroup
leaves, or a machine filling up meanwhile, then stages in the slots faulted in and spills the
rest, instead of the OOM killer ending the dump."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from pathlib import Path
from typing import Callable

from gpusnap import settings

SEG = 4 << 20            # a pages image is staged in slots of this size
_MADV_POPULATE_WRITE = 23
PAGE_REPORTING_ORDER = Path("/sys/module/page_reporting/parameters/page_reporting_order")
HPAGE_PMD_SIZE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
# the guard keeps a quarter of the room free, at least RESERVE_MIN, at most RESERVE_MAX (unless
# that is more): what the dump itself takes beside its arena once CRIU runs (the spill's bounce
# buffers, the pipeline, CRIU, imports; 65-90 MiB measured here) and what the job may grow by
RESERVE_MIN = 96 << 20
RESERVE_MAX = 256 << 20
LOOK_EVERY = 16           # slots between two looks at the room, while more than LOOK_CLOSE is left
LOOK_CLOSE = 1 << 30      # (a look costs ~0.2 ms, faulting a slot in ~1.5 ms)

try:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    libc.memset.restype = ctypes.c_void_p
except (OSError, AttributeError):  # not glibc: populate by writing, never punch
    libc = None


def populate(m: mmap.mmap) -> None:
    """Fault in all of the small mapping m now (best effort)."""
    if libc is None:
        return
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    if libc.madvise(addr, len(m), _MADV_POPULATE_WRITE) != 0:
        libc.memset(addr, 0, len(m))


def huge_pages_wanted(order_file: Path = PAGE_REPORTING_ORDER, pmd_file: Path = HPAGE_PMD_SIZE) -> bool:
    """Whether the arena asks for transparent huge pages (MADV_HUGEPAGE; $GPUSNAP_ARENA_THP=0/1
    decides instead). With memory the machine keeps, a 1 GiB arena faulted in in 0.01-0.07 s
    instead of 0.12-0.19 s, and the scan after the freeze walked it ~25 % faster (fewer TLB
    misses; docs/benchmark.md, 2026-12-07 (fourth)). Not where free page reporting hands
    free blocks of a huge page's size or smaller back to a hypervisor (page_reporting_order
    at most the huge page's order: a balloon's VM, as the ones measured here): a huge page,
    free only as a whole block, is exactly what the host took back, and faulting it in again
    cost 0.7-0.8 s per ~270 MiB there. Without a reporting device the order reads -1 (a huge
    number): huge pages."""
    env = settings.get("GPUSNAP_ARENA_THP", "")
    if env in ("0", "1"):
        return env == "1"
    try:
        order = int(order_file.read_text())
    except (OSError, ValueError):
        return True                       # no page reporting in this kernel
    try:
        hpage_order = (int(pmd_file.read_text()) // mmap.PAGESIZE).bit_length() - 1
    except (OSError, ValueError):
        hpage_order = 9
    return order > hpage_order


def _populate_threads() -> int:
    """Two threads from 2 cores on: the page faults of separate slots run in parallel
    (~0.07 s for 288 MiB here against ~0.1 s with one), and once the preflight on the main
    thread is done its core would only wait."""
    return 2 if len(os.sched_getaffinity(0)) >= 2 else 1


class Arena:
    """The staging slots' memory: `nslots` SEG-sized slots, faulted in by `threads` threads
    started here, each taking the next slot (the madvise runs without the GIL). ready()
    waits for them; close() (idempotent) stops each at its next slot (a dump refused by its
    preflight must not wait for gigabytes to be faulted in), waits for them, then unmaps.

    room: how much memory this process may still take, and where that figure comes from
    (system/memcg.available, passed in by the dump). Before the first slot and then every
    LOOK_EVERY slots (every slot once less than LOOK_CLOSE is left) the threads stop where
    faulting in what they may fault in before the next look would leave less than the
    reserve: a quarter of the first look's room, between RESERVE_MIN and RESERVE_MAX. Slots
    [0, usable) are faulted in then; `short` says where and why it stopped.

    capacity: slots mapped (address space only) beyond the `nslots` faulted in, for grow_to()
    (a GPU job's device memory, known once the preflight has asked the driver); keep: bytes the
    guard keeps free beyond its reserve (that device memory again: the checkpoint brings it
    into the job's host memory, later, inside the freeze)."""

    def __init__(self, nslots: int, threads: int | None = None, huge: bool | None = None,
                 room: Callable[[], tuple[int | None, str]] | None = None, capacity: int = 0, keep: int = 0):
        self.usable = nslots          # slots [0, usable) are (being) faulted in; fewer once the guard stops
        self.short: str | None = None
        self.populated = 0            # bytes faulted in so far
        self._closing = False
        self._count = threading.Lock()
        self._next = 0                # the next slot to fault in
        self._room = room
        self._look_at = 0             # the slot before which the room is looked at next
        self._reserve: int | None = None
        self._keep = keep             # more to keep free: the job's own growth to come (a GPU job's)
        self.map = None
        for n in dict.fromkeys((max(nslots, capacity), nslots)):
            try:     # (where the kernel commits address space strictly, the capacity may be refused)
                self.map = mmap.mmap(-1, n * SEG, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                break
            except OSError:
                if n == nslots:
                    raise
        self.nslots = len(self.map) // SEG     # slots mapped
        self.huge = False             # asked for transparent huge pages (the kernel may still give 4 KiB)
        if huge_pages_wanted() if huge is None else huge:
            try:
                self.map.madvise(mmap.MADV_HUGEPAGE)
                self.huge = True
            except (OSError, AttributeError):   # no THP in this kernel
                pass
        self._nthreads = max(1, min(threads or _populate_threads(), max(nslots, 1)))
        self._running = 0             # threads faulting in (a thread that found no slot left is not)
        self._threads: list[threading.Thread] = []
        with self._count:
            self._start()

    def _start(self) -> None:
        """Start threads up to _nthreads (the lock held)."""
        for _ in range(self._nthreads - self._running):
            t = threading.Thread(target=self._populate, name="gpusnap-arena", daemon=True)
            self._running += 1
            self._threads.append(t)
            t.start()

    def grow_to(self, nslots: int, keep: int = 0) -> None:
        """Fault in up to `nslots` slots (at most those mapped), unless closing or stopped
        by the guard, which from now on keeps `keep` bytes more free (the job's own growth
        to come); threads that had finished are started again."""
        with self._count:
            self._keep = max(self._keep, keep)
            if self._closing or self.short is not None or nslots <= self.usable:
                return
            self._look_at = min(self._look_at, self._next)     # look before the next slot
            self.usable = min(self.nslots, nslots)
            if self._next < self.usable:
                self._start()

    @classmethod
    def sized(cls, budget: int, prealloc: int, room=None, capacity: int = 0, keep: int = 0) -> "Arena | None":
        """An arena for `prealloc` bytes (the job's expected image size) within `budget`,
        `capacity` bytes mapped; None when not one slot fits."""
        nslots = min(max(0, int(budget)), max(0, int(prealloc))) // SEG
        return cls(nslots, room=room, capacity=max(0, int(capacity)) // SEG, keep=keep) if nslots else None

    def _take(self) -> tuple[int, bool]:
        """The next slot to fault in (-1: none) and whether to look at the room first."""
        with self._count:
            if self._closing or self._next >= self.usable:
                self._running -= 1       # (with the decision: grow_to starts another if needed)
                return -1, False
            slot = self._next
            self._next += 1
            look = self._room is not None and slot >= self._look_at
            if look:
                self._look_at = self.nslots     # the others go on meanwhile, without looking
            return slot, look

    def _enough(self, slot: int) -> bool:
        """Whether the room left allows faulting in `slot` and those up to the next look."""
        try:
            left, where = self._room()
        except (OSError, ValueError):
            left, where = None, ""
        with self._count:
            if left is None:                    # unknown: faulted in as asked
                self._look_at = self.nslots
                return True
            if self._reserve is None:
                self._reserve = max(RESERVE_MIN, min(RESERVE_MAX, left // 4))
            every = LOOK_EVERY if left >= LOOK_CLOSE else 1
            self._look_at = slot + every
            if left - (every + self._nthreads) * SEG >= self._reserve + self._keep:
                return True
            if slot < self.usable:
                self.short = (f"faulted in {slot * SEG >> 20} of {self.usable * SEG >> 20} MiB: "
                              f"{where} (kept free: {(self._reserve + self._keep) >> 20} MiB)")
                self.usable = slot
            self._running -= 1
            return False

    def _populate(self) -> None:
        """Fault in the next slot until none is left."""
        try:
            a = self.map
            addr = None if libc is None else ctypes.addressof(ctypes.c_char.from_buffer(a))
            # slot by slot: the madvise holds the mmap lock, and the preflight on the main
            # thread (malloc, thread stacks, fork) must not wait for the whole arena
            while True:
                slot, look = self._take()
                if slot < 0 or look and not self._enough(slot):
                    return
                off = slot * SEG
                if addr is None:
                    a[off:off + SEG] = bytes(SEG)
                elif libc.madvise(addr + off, SEG, _MADV_POPULATE_WRITE) != 0:
                    libc.memset(addr + off, 0, SEG)     # kernels before 5.14: touch every page
                self._done()
        except (OSError, ValueError, MemoryError):
            # pages not faulted in here are faulted on first use: slower, never wrong
            with self._count:
                self._running -= 1

    def _done(self) -> None:
        with self._count:
            self.populated += SEG

    def ready(self) -> None:
        """Wait until every page is faulted in (a failure leaves pages to fault on first use)."""
        self._join()

    def _join(self) -> None:
        while True:     # (grow_to may have started more meanwhile)
            with self._count:
                left = [t for t in self._threads if t.is_alive()]
            if not left:
                return
            for t in left:
                t.join()

    def close(self) -> None:
        with self._count:
            self._closing = True
        self._join()
        try:
            self.map.close()
        except BufferError:      # a view is still exported: the GC frees it
            pass
