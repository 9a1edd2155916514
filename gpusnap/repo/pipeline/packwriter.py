"""PackWriter: the dump side's pack files (docs/format.md §3): blobs appended by a background
thread (around the page cache where the filesystem allows), each pack named by the blake3
of its descriptor, fsynced and renamed into packs/ab/ when it reaches its target size."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import queue
import threading
from pathlib import Path

from gpusnap.repo import fsutil
from gpusnap.repo.faults import fault
from gpusnap.repo.format import BLOB_HEADER, PACK_HEADER, Blob, encode_blob_header, encode_pack_header, encode_pack_trailer, pack_namer
from gpusnap.repo.store import pack_path

DEFAULT_PACK_TARGET = 32 << 20
PACK_HEADER_SIZE = PACK_HEADER.size


class PackWriter:
    """Appends blobs to a temporary pack; at target size the pack is finished: trailer,
    fsync, rename to packs/ab/<pack name>.

    The pack's name is the blake3 of its descriptor (docs/format.md §3): the pack header,
    every blob header with the blob's ids, and the trailer, hashed here as blobs are added
    (~300 bytes per 16-page group), not the payload: every page and data blob is checked
    against its id when it is read, so hashing every pack byte a second time (after the page
    ids already hashed every page once) bought nothing but ~2 µs per page.

    add() is thread-safe and cheap: it assigns the blob its offset and hands the bytes to
    one background thread that writes them (without the GIL), so the writes overlap with
    the page pipeline. The queue is bounded (backpressure): at most QUEUE_MAX
    hand-offs (add_many() calls, ~1 MiB each from the page pipeline, or one pack segment)
    wait in memory."""

    QUEUE_MAX = 8

    def __init__(self, root: Path, target_size: int = DEFAULT_PACK_TARGET):
        self.root = root
        self.target = target_size
        self.lock = threading.Lock()
        self.done: list[tuple[bytes, list[Blob]]] = []
        self.bytes_written = 0
        self._pos = 0                 # size of the current pack so far (0 = no current pack)
        self._blobs: list[tuple] = []   # the current pack's blobs: Blob fields but the pack's name
        self._namer = None            # blake3 of the current pack's descriptor so far
        self._q: queue.Queue = queue.Queue(self.QUEUE_MAX)
        self._err: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._tmps: list[Path] = []
        self._created: set[bytes] = set()  # packs this writer put in place (no file of that name before)
        self._dirs: set[Path] = set()     # directories that received a pack, fsynced in finish()
        self._dirs_new = False            # a packs/ab/ directory was created: fsync packs/ too
        self._closed = False

    # -- producer side (any thread) -----------------------------------------------------
    def add(self, kind: int, codec: int, n_pages: int, raw_len: int, payload: bytes, ids: bytes) -> None:
        self.add_many([(kind, codec, n_pages, raw_len, payload, ids)])

    def add_many(self, items: list, done=None) -> None:
        """Append blobs [(kind, codec, n_pages, raw_len, payload, ids)], in order, as one
        hand-off to the writer thread (one queue item and one writev per pack segment
        instead of one per blob: the queue hand-offs cost more than the blobs' bookkeeping).

        done: called exactly once when the payloads are no longer needed: by the writer
        thread once it has written (or, after an error, dropped) them, or here when nothing
        was handed over. Payloads may be views of memory the caller reuses after that
        (staging slots, sinks.PagesSink)."""
        queued = False
        try:
            with self.lock:
                if self._err is not None:
                    raise self._err
                if self._closed:
                    raise RuntimeError("pack writer is closed")
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="gpusnap-pack-writer", daemon=True)
                    self._thread.start()
                queued = True
                try:
                    self._add_many(items)
                finally:
                    if done is not None:     # after the payloads it covers, whatever happened
                        self._q.put(("done", None, done))
        finally:
            if done is not None and not queued:
                done()

    def _add_many(self, items: list) -> None:
        """(lock held, writer thread running) add_many's work."""
        put = self._q.put
        bufs: list = []
        desc: list = []
        for kind, codec, n_pages, raw_len, payload, ids in items:
            if self._pos == 0:
                put(("open", None, None))
                self._pos = PACK_HEADER_SIZE
                self._blobs = []
                self._namer = pack_namer()
            stored = len(payload)
            self._blobs.append((self._pos, kind, codec, n_pages, raw_len, stored, ids))
            hdr = encode_blob_header(kind, codec, n_pages, raw_len, stored)
            bufs.append(hdr)
            bufs.append(payload)
            desc.append(hdr)
            desc.append(ids)
            self._pos += BLOB_HEADER.size + stored
            if self._pos >= self.target:
                put(("blobs", bufs, None))
                bufs = []
                self._close_pack(desc)
                desc = []
        if bufs:
            put(("blobs", bufs, None))
        if desc:
            self._namer.update(b"".join(desc))

    def _close_pack(self, desc: list) -> None:
        """(lock held) Finish the current pack's name and queue its trailer."""
        tr = encode_pack_trailer(len(self._blobs))
        desc.append(tr)
        self._namer.update(b"".join(desc))
        self._q.put(("close", tr, (self._blobs, self._namer.digest())))
        self._namer = None
        self._pos = 0

    def finish(self) -> list[tuple[bytes, list[Blob]]]:
        with self.lock:
            if not self._closed:
                self._closed = True
                if self._thread is not None:
                    if self._pos:
                        self._close_pack([])
                    self._q.put(("stop", None, None))
        if self._thread is not None:
            self._thread.join()
        if self._err is not None:
            raise self._err
        self._sync_dirs()
        return self.done

    def abort(self, delete_finished: bool = True) -> None:
        """Stop; remove the temporary pack files, and, with delete_finished, the packs this
        writer created. The caller decides that only when no index file names them (an
        index is written after finish(), so before it exists nothing names them: their pages
        were new to the repository). A pack of the same name that existed before this writer
        (same name, same layout and ids, docs/format.md §3) is never deleted: an index may
        name it. With delete_finished=False (an index names them) every finished pack stays."""
        with self.lock:
            self._closed = True
            if self._thread is not None and self._thread.is_alive():
                self._q.put(("stop", None, None))
        if self._thread is not None:
            self._thread.join()
        for t in self._tmps:
            fsutil.unlink_quiet(t)
        self._tmps = []
        if delete_finished:
            for ph, _ in self.done:
                if ph in self._created:
                    fsutil.unlink_quiet(pack_path(self.root, ph))
        self.done = []

    # -- the background threads ----------------------------------------------------------
    # Three threads, so that copying, writing and flushing to disk overlap with each other
    # and with the page pipeline:
    #   writer: copies the bytes into a bounce buffer (O_DIRECT, see _PackOut; buffered
    #           packs are written here) and passes finished packs on to
    #   flusher: writes each full bounce buffer while the writer fills the other one;
    #   syncer: for buffered packs starts writeback early (sync_file_range every SYNC_STEP
    #           bytes, as the writer reports progress), then per finished pack fsync, close,
    #           rename; and lets go of the payloads' memory (add_many's done). The parent
    #           directories are fsynced once, in finish(), before the caller writes the
    #           index (docs/format.md §5.3: every pack is durable and renamed first).
    # An fsync in the pipeline used to stall it for the time the disk took to write each
    # 32 MiB pack: ~0.6-0.9 s of a 512 MiB dump on the team's machines.
    SYNC_STEP = 8 << 20

    def _run(self) -> None:
        out = None
        q = self._q
        sq: queue.Queue = queue.Queue()
        st = threading.Thread(target=self._sync_run, args=(sq,), name="gpusnap-pack-syncer", daemon=True)
        st.start()
        try:
            buf = _DirectBuffer() if _direct_wanted() else None
        except OSError:               # no 4 MiB to spare: buffered writes need none
            buf = None
        try:
            while True:
                op, a, b = q.get()
                if op == "stop":
                    break
                if op == "done":      # the payloads before it are copied out (or dropped):
                    sq.put(("call", b, None))    # let go of them off this thread (madvise)
                    continue
                if self._err is not None:
                    continue          # drain after an error so producers never block
                try:
                    if op == "blobs":
                        out.write(a)
                        if not out.direct and out.pos - out.flushed >= self.SYNC_STEP:
                            sq.put(("flush", out.fd, (out.flushed, out.pos - out.flushed)))
                            out.flushed = out.pos
                    elif op == "open":
                        tmp, fd = fsutil.create_tmp(self.root / "tmp", "pack-")
                        self._tmps.append(tmp)
                        out = _PackOut(fd, buf)
                        fault("pack:opened")
                        out.write([encode_pack_header()])
                    elif op == "close":
                        blobs, name = b
                        out.write([a])
                        out.finish()
                        sq.put(("close", (out.fd, tmp, blobs), (name, out.pos)))
                        out = None    # the syncer closes it after the fsync
                except BaseException as e:     # reported to the next add()/finish()
                    self._err = e
        finally:
            if buf is not None:
                buf.close()           # (waits for the flusher: nothing writes the fd below then)
            if out is not None:
                os.close(out.fd)
            sq.put(("stop", None, None))
            st.join()

    def _sync_run(self, sq: queue.Queue) -> None:
        while True:
            op, a, b = sq.get()
            if op == "stop":
                break
            if op == "flush":
                if self._err is None:
                    _start_writeback(a, *b)
                continue
            if op == "call":
                try:
                    a()
                except BaseException as e:
                    self._err = self._err or e
                continue
            fd, tmp, blobs = a
            try:
                if self._err is not None or b is None:
                    continue
                ph, size = b
                os.fsync(fd)
                dest = pack_path(self.root, ph)
                if not dest.parent.is_dir():
                    fsutil.mkdir_private(dest.parent)
                    self._dirs_new = True
                # A pack of this name may already exist (the same pages again after their
                # index was lost): ours replaces it (same layout and ids, so every index
                # record naming it stays right), but it is not ours to delete on abort.
                if not os.path.lexists(dest):
                    self._created.add(ph)
                os.rename(tmp, dest)
                self._dirs.add(dest.parent)
                self._tmps.remove(tmp)
                self.bytes_written += size
                self.done.append((ph, [Blob(ph, *t) for t in blobs]))
                fault("pack:renamed")
            except BaseException as e:
                self._err = e
            finally:
                os.close(fd)

    def _sync_dirs(self) -> None:
        """fsync every directory that received a pack (and packs/ when a new one was made)."""
        dirs = sorted(self._dirs)
        if self._dirs_new:
            dirs.append(self.root / "packs")
        for d in dirs:
            fsutil.fsync_dir(d)
        self._dirs.clear()
        self._dirs_new = False


try:
    import ctypes as _ctypes
    _libc = _ctypes.CDLL(None, use_errno=True)
    _sfr = _libc.sync_file_range
    _sfr.argtypes = [_ctypes.c_int, _ctypes.c_int64, _ctypes.c_int64, _ctypes.c_uint]
    _sfr.restype = _ctypes.c_int
except (OSError, AttributeError):      # not Linux/glibc: the final fsync does all the work
    _sfr = None
_SFR_WRITE = 2                         # SYNC_FILE_RANGE_WRITE: start writeback, do not wait


def _start_writeback(fd: int, off: int, n: int) -> None:
    if _sfr is not None:
        _sfr(fd, off, n, _SFR_WRITE)   # advisory: an error here shows up in the fsync


_IOV_MAX = 1024


def _direct_wanted() -> bool:
    """Pack bytes bypass the page cache unless GPUSNAP_PACK_DIRECT=0 (for measuring)."""
    return os.environ.get("GPUSNAP_PACK_DIRECT", "1") != "0"


class _DirectBuffer:
    """The writer thread's two aligned bounce buffers for O_DIRECT writes, reused for every
    pack of a dump (so they cost their page faults once), and the thread that writes them
    out (_Flusher): the writer fills one while the other is on its way to the disk. With one
    buffer the copy into it and the device's write took turns, and once the page pipeline
    kept up, that turn-taking was the storing phase's longest thread."""

    SIZE = 4 << 20               # each buffer
    ALIGN = 4096                 # O_DIRECT wants offsets, lengths and addresses aligned to the
                                 # logical block size; 4 KiB covers 512-byte and 4K devices

    def __init__(self):
        self.map = mmap.mmap(-1, 2 * self.SIZE)
        whole = memoryview(self.map)
        self.views = [whole[:self.SIZE], whole[self.SIZE:]]
        whole.release()
        self.io = _Flusher(self.views)

    def close(self) -> None:
        self.io.stop()
        for v in self.views:
            v.release()
        self.map.close()


class _Flusher:
    """One thread writing full bounce buffers (in the order submitted) to their pack files;
    wait(i) blocks until buffer i is free again and raises the first write error."""

    def __init__(self, views: list):
        self.views = views
        self._q: queue.Queue = queue.Queue()
        self._free = [threading.Event(), threading.Event()]
        for e in self._free:
            e.set()
        self.err: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gpusnap-pack-flusher", daemon=True)
        self._thread.start()

    def submit(self, out: "_PackOut", i: int, n: int, at: int) -> None:
        self._free[i].clear()
        self._q.put((out, i, n, at))

    def wait(self, i: int) -> None:
        self._free[i].wait()
        if self.err is not None:
            raise self.err

    def drain(self) -> None:
        for i in (0, 1):
            self.wait(i)

    def stop(self) -> None:
        """Finish what was submitted, then end the thread (before any fd it writes is closed)."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()

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


class _PackOut:
    """One temporary pack file being written.

    Pack bytes are written once and read only by a later restore or verify, so they go
    around the page cache (O_DIRECT, through _DirectBuffer) where the filesystem allows:
    buffered, every byte costs a copy into freshly allocated page cache, which is most of
    the storing phase's kernel time, and then again in the fsync; direct, the copy is into
    one of two reused buffers and the device reads it from there. A filesystem that refuses
    O_DIRECT (tmpfs before 6.6, some FUSE ones) gets plain buffered writes."""

    def __init__(self, fd: int, buf: _DirectBuffer | None):
        self.fd = fd
        self.pos = 0                 # bytes of the pack so far (including any still in buf)
        self.flushed = 0             # not direct: writeback started up to here
        self.buf = None
        self.cur = 0                 # the bounce buffer being filled
        self.fill = 0
        self.written = 0             # through buf: bytes handed to the flusher (a multiple of ALIGN)
        self.direct = False          # O_DIRECT is set (buf stays in use after a fallback)
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
        """Hand the current buffer's first n bytes to the flusher; go on in the other buffer
        once its previous write is done."""
        io = self.buf.io
        io.submit(self, self.cur, n, self.written)
        self.written += n
        self.fill = 0
        self.cur ^= 1
        io.wait(self.cur)

    def pwrite(self, view, n: int, at: int) -> None:
        """(the flusher's thread) Write view[:n] at offset at."""
        done = 0
        while done < n:
            try:
                k = os.pwrite(self.fd, view[done:n], at + done)
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP) or not self.direct or at or done:
                    raise
                # the filesystem took the flag but not the write: buffered from here on
                self._buffered()
                continue
            if k <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
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
