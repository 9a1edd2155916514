"""The spill file: made with no name (open_file), swept where a crash left a named one
(sweep), and its direct writer: staged bytes beyond the budget reach the disk around the
page cache (O_DIRECT), from a few bounce buffers, two writes in flight.

Why: splicing the pipe into the spill file (the first way, still the fallback) copied every
byte into fresh page cache, inside the freeze. That is what raw CRIU pays for its image
files too, but gpusnap paid it on top of its staging arena: the arena had taken the memory
freed a moment ago, so the page cache had to come from memory the guest had not used
lately, which the VMs measured here back on first touch (a 4 GiB dump's freeze: 4.9-6.5 s
against raw CRIU's 5.3 s). A copy into a bounce buffer runs at memcpy speed and an O_DIRECT
write at the disk's (1.2 GB/s one at a time here, more with two), with no page cache to
allocate, to write back later, or to punch out: the freeze no longer depends on how much
memory the machine has to hand out, and the bytes are on disk once the freeze ends.

The buffers are a small constant outside the staging budget (NBUF slots of SEG bytes)."""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
from pathlib import Path

from gpusnap import settings
from gpusnap.staging.arena import SEG, populate
from gpusnap.staging.segments import StagingCancelled

NBUF = 4            # bounce buffers: the drain fills one while up to NBUF - 1 are written
NTHREADS = 2        # writes in flight
PREFIX = "staging-"  # a named spill file: PREFIX + the dump's PID + a random part
ALIGN = 4096        # O_DIRECT: lengths and offsets in multiples of the logical block size


def open_file(spill_dir: Path) -> int:
    """A new spill file in spill_dir, open for reading and writing, with no name: O_TMPFILE,
    or where the filesystem has none, created exclusively 0600 and unlinked at once (sweep()
    removes one a crash left between the two)."""
    flags = os.O_RDWR | os.O_CLOEXEC
    if settings.get("GPUSNAP_STAGING_NAMED") != "1":   # (tests: the named fallback)
        try:
            return os.open(spill_dir, flags | os.O_TMPFILE | os.O_EXCL, 0o600)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                raise
    path = spill_dir / f"{PREFIX}{os.getpid()}-{os.urandom(6).hex()}"   # (secrets would load OpenSSL)
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.unlink(path)
    return fd


def sweep(spill_dir: Path) -> list[str]:
    """Remove spill files left by dumps that died (their PID is gone). The caller holds the
    repository's exclusive lock (a dump: while it is the only writer), so no live dump of
    this repository, on this machine or another, can own one."""
    removed = []
    try:
        names = os.listdir(spill_dir)
    except OSError:
        return removed
    for n in names:
        if not n.startswith(PREFIX):
            continue
        try:
            pid = int(n[len(PREFIX):].split("-")[0])
        except ValueError:
            pid = 0
        if pid > 0 and pid != os.getpid() and os.path.exists(f"/proc/{pid}"):
            continue
        try:
            os.unlink(spill_dir / n)
            removed.append(n)
        except OSError:
            pass
    return removed


def open_direct(fd: int) -> int | None:
    """A second descriptor of the spill file `fd`, for O_DIRECT writes; None where the
    filesystem refuses O_DIRECT (tmpfs on older kernels, some FUSE): then the caller splices."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
    except (OSError, AttributeError):
        return None


class DirectWriter:
    """Writes SEG-sized extents of the spill file from its own bounce buffers.

    take() gives the drain a free buffer (waiting while every one is being written); the
    drain fills it and submit()s it with the extent's Segment, whose `ready` Event is set
    once the bytes are on disk (or the write failed: `error` says so). close() waits for
    every write, then frees the buffers."""

    def __init__(self, fd: int, nbuf: int | None = None, nthreads: int | None = None):
        nbuf, nthreads = nbuf or NBUF, nthreads or NTHREADS
        self.fd = fd
        self.error: BaseException | None = None
        self.map = mmap.mmap(-1, nbuf * SEG, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._view = memoryview(self.map)
        populate(self.map)      # (inside the freeze: 16 MiB faulted in at once, not page by page)
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(nbuf):
            self._free.put(i)
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name="gpusnap-spill", daemon=True)
                         for _ in range(nthreads)]
        for t in self._threads:
            t.start()

    def take(self, cancelled=lambda: False) -> tuple[int, memoryview]:
        """A free buffer, waiting while all are being written; StagingCancelled once
        cancelled() (a closed writer returns no more buffers)."""
        while True:
            try:
                i = self._free.get(timeout=0.2)
                break
            except queue.Empty:
                if cancelled():
                    raise StagingCancelled() from None
        return i, self._view[i * SEG:(i + 1) * SEG]

    def give_back(self, i: int) -> None:
        """A buffer taken and not submitted (nothing was read into it)."""
        self._free.put(i)

    def submit(self, i: int, seg, length: int) -> None:
        self._work.put((i, seg, length))

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            i, seg, length = item
            try:
                if self.error is None:
                    # the tail of an image is padded to the block size (never read back: the
                    # segment's length is what counts)
                    n = (length + ALIGN - 1) // ALIGN * ALIGN
                    buf = self._view[i * SEG:i * SEG + n]
                    done = 0
                    while done < n:
                        done += os.pwrite(self.fd, buf[done:], seg.offset + done)
                    buf.release()
            except BaseException as e:  # noqa: BLE001 - reaches the drain and the ingest
                self.error = e
            finally:
                self._free.put(i)
                seg.ready.set()

    def close(self) -> None:
        for _ in self._threads:
            self._work.put(None)
        for t in self._threads:
            t.join()
        self._view.release()
        try:
            self.map.close()
        except BufferError:
            pass
