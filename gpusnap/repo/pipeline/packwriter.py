"""PackWriter: the dump side's pack files (docs/format.md §3): blobs appended by a background
thread (around the page cache where the filesystem allows), each pack named by the blake3
of its descriptor, fsynced and renamed into packs/ab/ when it reaches its target size."""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path

from gpusnap.repo import fsutil
from gpusnap.system.faults import fault
from gpusnap.repo.pipeline.packout import DirectBuffer, PackOut, direct_wanted, start_writeback
from gpusnap.repo.format import BLOB_HEADER, PACK_HEADER, Blob, encode_blob_header, encode_pack_header, encode_pack_trailer, pack_namer
from gpusnap.repo.store import pack_path

DEFAULT_PACK_TARGET = 32 << 20
PACK_HEADER_SIZE = PACK_HEADER.size


def packed_size(stored: list[int], target_size: int = DEFAULT_PACK_TARGET) -> int:
    """The bytes PackWriter writes for blobs of these payload sizes, in this order (packs cut
    where _add_many cuts them): what a prune's dry run reports its rewrite would write."""
    from gpusnap.repo.format import PACK_TRAILER

    total = pos = 0
    for n in stored:
        if pos == 0:
            pos = PACK_HEADER.size
        pos += BLOB_HEADER.size + n
        if pos >= target_size:
            total, pos = total + pos + PACK_TRAILER.size, 0
    return total + (pos + PACK_TRAILER.size if pos else 0)


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

    def finished(self) -> list[tuple[bytes, list[Blob]]]:
        """The packs finished so far (fsynced and renamed; their directories not yet fsynced)."""
        return list(self.done)

    def abort(self, delete_finished: bool = True, keep: frozenset = frozenset()) -> None:
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
                if ph in self._created and ph not in keep:    # keep: an index file names them
                    fsutil.unlink_quiet(pack_path(self.root, ph))
        self.done = []

    # -- the background threads ----------------------------------------------------------
    # Threads, so that copying, writing and flushing to disk overlap with each other and with
    # the page pipeline:
    #   writer: copies the bytes into a bounce buffer (O_DIRECT, see packout.PackOut; buffered
    #           packs are written here) and passes finished packs on to
    #   flushers (two): write the full bounce buffers while the writer fills the next one;
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
            buf = DirectBuffer() if direct_wanted() else None
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
                        out = PackOut(fd, buf)
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
                    start_writeback(a, *b)
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
