"""The staging arena: the memory a dump's pages images are staged in (staging.py), faulted
in by threads of its own before CRIU starts. Fresh anonymous memory costs a page fault and
a zeroed page per 4 KiB (~0.1 s per 256 MiB here): inside the freeze that would lengthen
it, and on the main thread it would add to the preflight; in threads started as the dump
begins it overlaps the preflight on another core. In transparent huge pages where the
machine keeps its memory (huge_pages_wanted), one fault covers 2 MiB."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from pathlib import Path

from gpusnap import settings

SEG = 4 << 20            # a pages image is staged in slots of this size
_MADV_POPULATE_WRITE = 23
PAGE_REPORTING_ORDER = Path("/sys/module/page_reporting/parameters/page_reporting_order")
HPAGE_PMD_SIZE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")

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
    started here, slot by slot, taking turns (the madvise runs without the GIL). ready()
    waits for them; close() (idempotent) stops each at its next slot (a dump refused by its
    preflight must not wait for gigabytes to be faulted in), waits for them, then unmaps."""

    def __init__(self, nslots: int, threads: int | None = None, huge: bool | None = None):
        self.nslots = nslots
        self.populated = 0            # bytes faulted in so far
        self._closing = False
        self._count = threading.Lock()
        self.map = mmap.mmap(-1, nslots * SEG, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.huge = False             # asked for transparent huge pages (the kernel may still give 4 KiB)
        if huge_pages_wanted() if huge is None else huge:
            try:
                self.map.madvise(mmap.MADV_HUGEPAGE)
                self.huge = True
            except (OSError, AttributeError):   # no THP in this kernel
                pass
        n = max(1, min(threads or _populate_threads(), nslots))
        self._threads = [threading.Thread(target=self._populate, args=(k, n), name="gpusnap-arena", daemon=True)
                         for k in range(n)]
        for t in self._threads:
            t.start()

    @classmethod
    def sized(cls, budget: int, prealloc: int) -> "Arena | None":
        """An arena for `prealloc` bytes (the job's expected image size) within `budget`;
        None when not one slot fits."""
        nslots = min(max(0, int(budget)), max(0, int(prealloc))) // SEG
        return cls(nslots) if nslots else None

    def _populate(self, first: int, step: int) -> None:
        """Fault in slots first, first + step, ..."""
        try:
            a = self.map
            if libc is None:
                for off in range(first * SEG, len(a), step * SEG):
                    a[off:off + SEG] = bytes(SEG)
                    self._done()
                return
            addr = ctypes.addressof(ctypes.c_char.from_buffer(a))   # (the temporary export ends here)
            # slot by slot: the madvise holds the mmap lock, and the preflight on the main
            # thread (malloc, thread stacks, fork) must not wait for the whole arena
            for off in range(first * SEG, len(a), step * SEG):
                if self._closing:
                    return
                if libc.madvise(addr + off, SEG, _MADV_POPULATE_WRITE) != 0:
                    libc.memset(addr + off, 0, SEG)     # kernels before 5.14: touch every page
                self._done()
        except (OSError, ValueError, MemoryError):
            pass    # pages not faulted in here are faulted on first use: slower, never wrong

    def _done(self) -> None:
        with self._count:
            self.populated += SEG

    def ready(self) -> None:
        """Wait until every page is faulted in (a failure leaves pages to fault on first use)."""
        for t in self._threads:
            t.join()

    def close(self) -> None:
        self._closing = True
        for t in self._threads:
            t.join()
        try:
            self.map.close()
        except BufferError:      # a view is still exported: the GC frees it
            pass
