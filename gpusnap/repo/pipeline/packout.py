"""Pack file output for the pack writer (packwriter.py): O_DIRECT writes through reused
aligned bounce buffers, filled in turn while flusher threads write the full ones; plain
buffered writes where the filesystem refuses O_DIRECT; early writeback for buffered packs."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import queue
import threading

from gpusnap import settings

try:
    import ctypes as _ctypes
    _libc = _ctypes.CDLL(None, use_errno=True)
    _sfr = _libc.sync_file_range
    _sfr.argtypes = [_ctypes.c_int, _ctypes.c_int64, _ctypes.c_int64, _ctypes.c_uint]
    _sfr.restype = _ctypes.c_int
except (OSError, AttributeError):      # not Linux/glibc: the final fsync does all the work
    _sfr = None
_SFR_WRITE = 2                         # SYNC_FILE_RANGE_WRITE: start writeback, do not wait


def start_writeback(fd: int, off: int, n: int) -> None:
    if _sfr is not None:
        _sfr(fd, off, n, _SFR_WRITE)   # advisory: an error here shows up in the fsync


_IOV_MAX = 1024


def direct_wanted() -> bool:
    """Pack bytes bypass the page cache unless GPUSNAP_PACK_DIRECT=0 (for measuring)."""
    return settings.get("GPUSNAP_PACK_DIRECT", "1") != "0"


class DirectBuffer:
    """The writer thread's aligned bounce buffers for O_DIRECT writes, reused for every pack
    of a dump (so they cost their page faults once), and the threads that write them out
    (_Flusher): the writer fills one while the others are on their way to the disk. With one
    buffer the copy into it and the device's write took turns; with one write in flight at a
    time the device idled between two (512 MiB with `dd oflag=direct` here: 0.23-0.37 s one
    4 MiB write at a time, 0.17-0.21 s two at a time)."""

    SIZE = 4 << 20               # each buffer
    COUNT = 4                    # buffers: WRITERS in flight, the rest filled meanwhile
    WRITERS = 2
    ALIGN = 4096                 # O_DIRECT wants offsets, lengths and addresses aligned to the
                                 # logical block size; 4 KiB covers 512-byte and 4K devices

    def __init__(self):
        self.map = mmap.mmap(-1, self.COUNT * self.SIZE)
        whole = memoryview(self.map)
        self.views = [whole[i * self.SIZE:(i + 1) * self.SIZE] for i in range(self.COUNT)]
        whole.release()
        self.io = _Flusher(self.views, max(1, min(self.WRITERS, self.COUNT - 1)))

    def close(self) -> None:
        self.io.stop()
        for v in self.views:
            v.release()
        self.map.close()


class _Flusher:
    """Threads writing full bounce buffers to their pack files (a pack's writes may complete
    out of order: each has its own offset, and the file is fsynced only after drain());
    wait(i) blocks until buffer i is free again and raises the first write error."""

    def __init__(self, views: list, threads: int):
        self.views = views
        self._q: queue.Queue = queue.Queue()
        self._free = [threading.Event() for _ in views]
        for e in self._free:
            e.set()
        self.err: BaseException | None = None
        self._threads = [threading.Thread(target=self._run, name="gpusnap-pack-flusher", daemon=True)
                         for _ in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, out: "PackOut", i: int, n: int, at: int) -> None:
        self._free[i].clear()
        self._q.put((out, i, n, at))

    def wait(self, i: int) -> None:
        self._free[i].wait()
        if self.err is not None:
            raise self.err

    def drain(self) -> None:
        for i in range(len(self.views)):
            self.wait(i)

    def stop(self) -> None:
        """Finish what was submitted, then end the threads (before any fd they write is closed)."""
        for t in self._threads:
            if t.is_alive():
                self._q.put(None)
        for t in self._threads:
            t.join()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            out, i, n, at = item
            try:
                if self.err is None:
                    out.pwrite(self.views[i], n, at)
            except BaseException as e:     # raised to the writer by its next wait()
                self.err = e
            finally:
                self._free[i].set()


class PackOut:
    """One temporary pack file being written.

    Pack bytes are written once and read only by a later restore or verify, so they go
    around the page cache (O_DIRECT, through DirectBuffer) where the filesystem allows:
    buffered, every byte costs a copy into freshly allocated page cache, which is most of
    the storing phase's kernel time, and then again in the fsync; direct, the copy is into
    one of two reused buffers and the device reads it from there. A filesystem that refuses
    O_DIRECT (tmpfs before 6.6, some FUSE ones) gets plain buffered writes."""

    def __init__(self, fd: int, buf: DirectBuffer | None):
        self.fd = fd
        self.pos = 0                 # bytes of the pack so far (including any still in buf)
        self.flushed = 0             # not direct: writeback started up to here
        self.buf = None
        self.cur = 0                 # the bounce buffer being filled
        self.fill = 0
        self.written = 0             # through buf: bytes handed to the flusher (a multiple of ALIGN)
        self.direct = False          # O_DIRECT is set (buf stays in use after a fallback)
        self.direct_ok = False       # a direct write of this file went through
        if buf is not None:
            try:
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
                self.buf, self.direct = buf, True
            except OSError:
                pass

    def write(self, bufs: list) -> None:
        if self.buf is None:
            _write_all(self.fd, bufs)
            self.pos += sum(map(len, bufs))
            return
        size = self.buf.SIZE
        view = self.buf.views[self.cur]
        for b in bufs:
            mv = memoryview(b).cast("B")
            n, off = len(mv), 0
            while off < n:
                k = min(n - off, size - self.fill)
                view[self.fill:self.fill + k] = mv[off:off + k]
                self.fill += k
                off += k
                if self.fill == size:
                    self._flush(size)
                    view = self.buf.views[self.cur]
            self.pos += n

    def finish(self) -> None:
        """Write what is left in the buffer and wait for the flusher (the syncer fsyncs the
        file next); the tail is padded to ALIGN for O_DIRECT and the file cut back to the
        pack's length."""
        if self.buf is None:
            return
        padded = False
        if self.fill:
            tail = -(-self.fill // self.buf.ALIGN) * self.buf.ALIGN
            self.buf.views[self.cur][self.fill:tail] = bytes(tail - self.fill)
            self._flush(tail)
            padded = True
        self.buf.io.drain()
        if padded:
            os.ftruncate(self.fd, self.pos)

    def _flush(self, n: int) -> None:
        """Hand the current buffer's first n bytes to the flusher; go on in the next buffer
        once its previous write is done."""
        io = self.buf.io
        io.submit(self, self.cur, n, self.written)
        self.written += n
        self.fill = 0
        self.cur = (self.cur + 1) % len(self.buf.views)
        io.wait(self.cur)

    def pwrite(self, view, n: int, at: int) -> None:
        """(a flusher thread) Write view[:n] at offset at."""
        done, retried = 0, False
        while done < n:
            try:
                k = os.pwrite(self.fd, view[done:n], at + done)
            except OSError as e:
                # the filesystem took the flag but refuses direct writes: buffered from here
                # on, and this write again (another flusher may have seen it first)
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP) or done or retried or self.direct_ok:
                    raise
                retried = True
                if self.direct:
                    self._buffered()
                continue
            if k <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if self.direct:
                self.direct_ok = True
            done += k
            if done < n and self.direct:
                # short (the disk filling up): the rest is unaligned, so buffered, where a
                # full disk reports itself as ENOSPC rather than as a misaligned write
                self._buffered()

    def _buffered(self) -> None:
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self.direct = False


def _write_all(fd: int, bufs: list) -> None:
    if len(bufs) > _IOV_MAX:
        for i in range(0, len(bufs), _IOV_MAX):
            _write_all(fd, bufs[i:i + _IOV_MAX])
        return
    total = sum(map(len, bufs))
    n = os.writev(fd, bufs)
    if n != total:                       # short write: finish it piecewise
        data = b"".join(bytes(b) for b in bufs)[n:]
        while data:
            k = os.write(fd, data)
            data = data[k:]
