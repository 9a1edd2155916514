"""Staging: CRIU's image bytes parked between the stream pipes and the page pipeline.

While CRIU streams, the job stands frozen until every byte has left the pipes (the
post-dump gate, gpusnap/criu/gate.py). The page pipeline (hashing, dedup, compression,
packing) is several times slower than raw CRIU writing image files, so the pipes are
drained into staging first, and the pipeline (the "ingest") reads from there:

* memory: one anonymous arena, faulted in before CRIU starts (fresh memory costs a page
  fault and a zeroed page per 4 KiB; inside the freeze that was as slow as the pipeline
  itself), cut into SEG-sized slots that pages images fill with plain reads; small images
  are kept as bytes. Both count against the budget. The faulting-in (~0.1 s per 256 MiB)
  runs in a thread of its own (Arena), started as the dump begins, so it overlaps the
  preflight on another core instead of adding to it.
* beyond the budget: a spill file on the repository's filesystem (REPO/tmp), written with
  O_DIRECT from a few bounce buffers, two writes in flight (spill.py: no page cache to
  allocate inside the freeze), or where the filesystem refuses O_DIRECT, filled by
  splice(2) from the pipe (the kernel copies into the page cache, as raw CRIU does). The
  file has no name while in use (O_TMPFILE, or created exclusively 0600 and unlinked at
  once), so no exit path, SIGKILL included, can leave it behind; `sweep()` removes a named
  one that a crash between its creation and its unlink left (run by the next dump).

The drain never waits for the ingest; the ingest releases slots, memory and file space
(punched holes) as it goes. Copying matters: CRIU splices references to the job's own
pages into the pipe, so bytes are safe only once copied out (memory) or written into the
spill file's page cache.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from pathlib import Path

from gpusnap.staging.arena import SEG, Arena, libc as _libc
from gpusnap.staging.segments import Hold, Segment, StagedImage, StagingCancelled
from gpusnap.staging import spill as spill_mod
from gpusnap.staging.spill import PREFIX, sweep  # noqa: F401
from gpusnap.staging.budget import (JOB_MARGIN, _mem_available, choose_budget,  # noqa: F401
                                    default_budget, parse_size)
from gpusnap import settings

SMALL_READ = 1 << 18     # reads for small (non-pages) images
READAHEAD = 2            # spill extents read ahead of the one the ingest reads
_MADV_DONTNEED = 4
_FALLOC_PUNCH = 0x01 | 0x02   # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE


def _read_into(fd: int, view: memoryview) -> int:
    """Fill `view` from the pipe `fd` (fewer bytes only at EOF); -> how many were read."""
    got = 0
    while got < len(view):
        n = os.readv(fd, [view[got:]])
        if not n:
            break
        got += n
    return got


class Staging:
    """Staging for one dump. budget: bytes of memory staging may hold; arena: the slots'
    memory (Arena), owned by this staging from now on; prealloc: without one, how much memory
    to fault in now (the job's expected image size; more is taken as plain memory)."""

    def __init__(self, spill_dir: Path, budget: int, prealloc: int = 0, arena: Arena | None = None):
        self.spill_dir = Path(spill_dir)
        self.budget = max(0, int(budget))
        self.budget_choice = "given"       # how the budget was chosen (choose_budget), reported
        self.cancelled = False
        self.go = threading.Event()        # the ingest may run (set at the gate, or at once)
        self.sealed = False                # everything is staged: slots released are not reused
        self._lock = threading.Lock()
        self._mem = 0                      # bytes of memory holding staged data now
        self.peak_memory = 0
        self.staged = 0
        self.spilled = 0
        self.spill_peak = 0
        self._spill_live = 0
        self._spill_fd: int | None = None
        self._spill_end = 0
        self._direct: spill_mod.DirectWriter | None = None   # the spill's O_DIRECT writer, if any
        self._direct_fd: int | None = None
        self.spill_mode = ""               # "direct" or "splice", once something spilled
        if arena is None:
            arena = Arena.sized(self.budget, prealloc)
            if arena is not None:
                arena.ready()
        self._owner = arena
        self._arena = None                 # the arena's mmap
        self._view: memoryview | None = None
        self._free: list[int] = []
        self.arena_bytes = 0
        self.huge_pages = bool(arena is not None and arena.huge)
        self.arena_short: str | None = None   # why the arena was faulted in short of its size (Arena.short)
        if arena is not None:
            nslots = min(arena.usable, self.budget // SEG)
            self._arena = arena.map
            self._view = memoryview(arena.map)
            self._free = list(range(nslots - 1, -1, -1))
            self.arena_bytes = nslots * SEG

    def ready(self) -> None:
        """Wait until the arena is faulted in: before CRIU starts (the freeze must not fault).
        Where its guard stopped it short of memory running out, only the slots faulted in
        are used: the rest spills."""
        owner = self._owner
        if owner is None:
            return
        owner.ready()
        with self._lock:
            self._free = [s for s in self._free if s < owner.usable]
            self.arena_bytes = min(self.arena_bytes, owner.usable * SEG)
            self.arena_short = owner.short

    # -- accounting --------------------------------------------------------------------
    def _charge(self, n: int) -> bool:
        with self._lock:
            if self._mem + n > self.budget:
                return False
            self._mem += n
            self.peak_memory = max(self.peak_memory, self._mem)
            return True

    def memory_in_use(self) -> int:
        return self._mem

    # -- drain side (one thread per image) ------------------------------------------------
    def stage_pipe(self, fd: int, image: StagedImage, pages: bool, counter=None) -> int:
        """Move everything from the pipe `fd` into staging until EOF; -> bytes staged."""
        total = 0
        while True:
            if self.cancelled:
                raise StagingCancelled()
            n = self._stage_pages(fd, image) if pages else self._stage_small(fd, image)
            if n < 0:
                n = self._stage_spill(fd, image)
            if n == 0:
                break
            total += n
            with self._lock:
                self.staged += n
            if counter is not None:
                counter(n)
        self._written(image, wait=True)    # "drained" means on disk: the gate opens after this
        image.end()
        return total

    def _written(self, image: StagedImage, wait: bool) -> None:
        """Forget image's direct spill writes that have ended (wait: for every one); raise
        the first write's failure."""
        if wait:
            for seg in image.writing:
                self._wait_written(seg)
        image.writing = [s for s in image.writing if not s.ready.is_set()]
        if self._direct is not None and self._direct.error is not None:
            raise self._direct.error

    def _stage_pages(self, fd: int, image: StagedImage) -> int:
        """Fill one arena slot (or fresh memory, within the budget); -1: no memory left."""
        slot = -1
        with self._lock:
            if self._free and self._mem + SEG <= self.budget:
                slot = self._free.pop()
                self._mem += SEG
                self.peak_memory = max(self.peak_memory, self._mem)
        if slot < 0:
            return -1
        view = None
        got = 0
        try:
            view = self._slot_view(slot, SEG)
            got = _read_into(fd, view)
        except BaseException:
            self._free_slot(slot)
            raise
        finally:
            if view is not None:
                view.release()
        if not got:
            self._free_slot(slot)
            return 0
        image.put(Segment(got, slot=slot))
        return got

    def _stage_small(self, fd: int, image: StagedImage) -> int:
        if not self._charge(SMALL_READ):
            return -1
        try:
            data = os.read(fd, SMALL_READ)
        finally:
            with self._lock:
                self._mem -= SMALL_READ
        if not data:
            return 0
        with self._lock:        # charge what was read (may pass the budget by one read)
            self._mem += len(data)
            self.peak_memory = max(self.peak_memory, self._mem)
        image.put(Segment(len(data), data=data))
        return len(data)

    def _stage_spill(self, fd: int, image: StagedImage) -> int:
        """splice one extent of the pipe into the spill file; 0 at EOF."""
        sfd = self._spill()
        if self._direct is not None:
            return self._stage_direct(fd, image)
        with self._lock:
            off = self._spill_end
            self._spill_end += SEG
        got = 0
        while got < SEG:
            n = os.splice(fd, sfd, SEG - got, offset_dst=off + got)
            if not n:
                break
            got += n
        if got:
            with self._lock:
                self.spilled += got
                self._spill_live += got
                self.spill_peak = max(self.spill_peak, self._spill_live)
            image.put(Segment(got, offset=off))
        return got

    def _wait_written(self, seg: Segment) -> None:
        """Until seg's direct write has ended; a cancelled staging stops waiting (its writer
        may be closed already)."""
        while not seg.ready.wait(0.2):
            if self.cancelled:
                raise StagingCancelled()

    def _stage_direct(self, fd: int, image: StagedImage) -> int:
        """Copy one extent of the pipe into a bounce buffer, and have it written with
        O_DIRECT while the next is read; 0 at EOF."""
        w = self._direct
        self._written(image, wait=False)
        i, view = w.take(lambda: self.cancelled)
        got = 0
        try:
            got = _read_into(fd, view)
        except BaseException:
            w.give_back(i)
            raise
        finally:
            view.release()
        if not got:
            w.give_back(i)
            return 0
        with self._lock:
            off = self._spill_end
            self._spill_end += SEG
            self.spilled += got
            self._spill_live += got
            self.spill_peak = max(self.spill_peak, self._spill_live)
        seg = Segment(got, offset=off)
        seg.ready = threading.Event()
        image.writing.append(seg)
        w.submit(i, seg, got)
        image.put(seg)
        return got

    def _spill(self) -> int:
        with self._lock:
            if self._spill_fd is not None:
                return self._spill_fd
            self._spill_fd = spill_mod.open_file(self.spill_dir)
            if settings.get("GPUSNAP_STAGING_DIRECT") != "0":    # "0": splice (tests, comparisons)
                self._direct_fd = spill_mod.open_direct(self._spill_fd)
            if self._direct_fd is not None:
                self._direct = spill_mod.DirectWriter(self._direct_fd)
            self.spill_mode = "direct" if self._direct is not None else "splice"
            return self._spill_fd

    # -- ingest side ---------------------------------------------------------------------
    def read(self, seg: Segment):
        """The segment's bytes: a view of its slot (valid until release()), or bytes."""
        if seg.slot >= 0:
            return self._slot_view(seg.slot, seg.length)
        if seg.data is not None:
            return seg.data
        if seg.ready is not None:
            self._wait_written(seg)
            if self._direct is not None and self._direct.error is not None:
                raise OSError(errno.EIO, f"the staging file's write failed: {self._direct.error}")
            try:   # the next extents (most likely this image's next) read ahead meanwhile
                os.posix_fadvise(self._spill_fd, seg.offset + SEG, READAHEAD * SEG, os.POSIX_FADV_WILLNEED)
            except (OSError, TypeError):
                pass
        parts = []
        got = 0
        while got < seg.length:
            b = os.pread(self._spill_fd, seg.length - got, seg.offset + got)
            if not b:
                raise OSError(errno.EIO, "staging file is shorter than what was staged")
            parts.append(b)
            got += len(b)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _slot_view(self, slot: int, length: int) -> memoryview:
        view = self._view
        try:
            return view[slot * SEG:slot * SEG + length]
        except (TypeError, ValueError):     # closed (None, or released) by an unwinding dump
            raise StagingCancelled() from None

    def hold(self, seg: Segment) -> Hold | None:
        """A Hold on seg when it is a slot (bytes and spill extents are copied out on read)."""
        return Hold(self, seg) if seg.slot >= 0 else None

    def retain(self, seg: Segment, n: int) -> None:
        with self._lock:
            if seg.refs <= 0:
                raise RuntimeError("staged segment retained after it was freed")
            seg.refs += n

    def release(self, seg: Segment, n: int = 1) -> None:
        """Let go of n claims on seg; the last one frees it."""
        with self._lock:
            seg.refs -= n
            if seg.refs > 0:
                return
        if seg.slot >= 0:
            self._free_slot(seg.slot)
            seg.slot = -1
        elif seg.data is not None:
            with self._lock:
                self._mem -= seg.length
            seg.data = None
        elif seg.offset >= 0:
            with self._lock:
                self._spill_live -= seg.length
                fd = self._spill_fd
            if fd is not None and _libc is not None:
                # give the disk space and page cache back now, so dirty staging is never written back
                _libc.fallocate(fd, _FALLOC_PUNCH, seg.offset, SEG)
            seg.offset = -1

    def _free_slot(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)
            self._mem -= SEG
            arena = self._arena if self.sealed else None
        if arena is not None and _libc is not None:
            # nothing more will be staged: give the slot's memory back while the job runs on
            try:
                addr = ctypes.addressof(ctypes.c_char.from_buffer(arena, slot * SEG))
            except ValueError:       # closed meanwhile by an unwinding dump: nothing to give back
                return
            _libc.madvise(addr, SEG, _MADV_DONTNEED)

    def seal(self) -> None:
        """Every pipe is drained: from now on released slots go back to the system."""
        self.sealed = True

    # -- end -------------------------------------------------------------------------------
    def cancel(self) -> None:
        self.cancelled = True
        self.go.set()

    def stats(self) -> dict:
        return {"budget": self.budget, "budget_choice": self.budget_choice, "arena_bytes": self.arena_bytes,
                "arena_huge_pages": self.huge_pages, "arena_short": self.arena_short, "staged_bytes": self.staged,
                "memory_peak": self.peak_memory, "spilled_bytes": self.spilled, "spill_peak": self.spill_peak,
                "spill_mode": self.spill_mode}

    def close(self) -> None:
        """Free everything (idempotent). Views handed out must be released first."""
        with self._lock:
            fd, self._spill_fd = self._spill_fd, None
            direct, dfd, self._direct, self._direct_fd = self._direct, self._direct_fd, None, None
        if direct is not None:
            direct.close()           # (waits for the writes in flight)
        if dfd is not None:
            os.close(dfd)
        if fd is not None:
            os.close(fd)
        with self._lock:             # (_free_slot takes the arena under the lock)
            view, owner, self._view, self._arena, self._owner = self._view, self._owner, None, None, None
        if view is not None:
            try:
                view.release()
            except BufferError:      # an ingest thread still holds a view: the GC frees it
                pass
        if owner is not None:
            owner.close()
