"""Pack writing, pack reading and the in-memory index of a repository."""

from __future__ import annotations

import os
import queue
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

from gpusnap.repo import fsutil
from gpusnap.repo.codec import decompress
from gpusnap.repo.faults import fault
from gpusnap.repo.format import BLOB_HEADER, KIND_PAGES, PAGE_ID_LEN, FormatError, IndexBlob, encode_blob_header, encode_index, encode_pack_header, encode_pack_trailer, pack_namer, parse_blob_header, parse_index, HEX64

DEFAULT_PACK_TARGET = 32 << 20
PACK_HEADER_SIZE = 16


def pack_path(root: Path, pack_hash: bytes) -> Path:
    h = pack_hash.hex()
    return root / "packs" / h[:2] / h


# =====================================================================================
# writing packs
# =====================================================================================

@dataclass(slots=True)
class PendingBlob:
    offset: int
    kind: int
    codec: int
    n_pages: int
    raw_len: int
    stored_len: int
    ids: bytes


class PackWriter:
    """Appends blobs to a temporary pack; at target size the pack is finished: trailer,
    fsync, rename to packs/ab/<pack name>.

    The pack's name is the blake3 of its descriptor (docs/format.md §3): the pack header,
    every blob header with the blob's ids, and the trailer, hashed here as blobs are added
    (~300 bytes per 16-page group), not the payload: every page and data blob is checked
    against its id when it is read, so hashing every pack byte a second time (after the page
    ids already hashed every page once) bought nothing but ~2 µs per page.

    add() is thread-safe and cheap: it assigns the blob its offset and hands the bytes to
    one background thread that writes them (os.writev releases the GIL), so the kernel copy
    overlaps with the page pipeline. The queue is bounded (backpressure): at most QUEUE_MAX
    hand-offs (add_many() calls, ~1 MiB each from the page pipeline, or one pack segment)
    wait in memory."""

    QUEUE_MAX = 8

    def __init__(self, root: Path, target_size: int = DEFAULT_PACK_TARGET):
        self.root = root
        self.target = target_size
        self.lock = threading.Lock()
        self.done: list[tuple[bytes, list[PendingBlob]]] = []
        self.bytes_written = 0
        self._pos = 0                 # size of the current pack so far (0 = no current pack)
        self._blobs: list[PendingBlob] = []
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

    def add_many(self, items: list) -> None:
        """Append blobs [(kind, codec, n_pages, raw_len, payload, ids)], in order, as one
        hand-off to the writer thread (one queue item and one writev per pack segment
        instead of one per blob: the queue hand-offs cost more than the blobs' bookkeeping)."""
        with self.lock:
            if self._err is not None:
                raise self._err
            if self._closed:
                raise RuntimeError("pack writer is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gpusnap-pack-writer", daemon=True)
                self._thread.start()
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
                self._blobs.append(PendingBlob(self._pos, kind, codec, n_pages, raw_len, stored, ids))
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

    def finish(self) -> list[tuple[bytes, list[PendingBlob]]]:
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
    # Two threads, so that writing and flushing to disk overlap with each other and with
    # the page pipeline:
    #   writer: writes the bytes (os.writev releases the GIL; the kernel copy into the page
    #           cache is the main cost left per byte) and passes finished packs on to
    #   syncer: starts writeback early (sync_file_range every SYNC_STEP bytes, as the writer
    #           reports progress), then per finished pack fsync, close, rename. The parent
    #           directories are fsynced once, in finish(), before the caller writes the
    #           index (docs/format.md §5.3: every pack is durable and renamed first).
    # An fsync in the pipeline used to stall it for the time the disk took to write each
    # 32 MiB pack: ~0.6-0.9 s of a 512 MiB dump on the team's machines.
    SYNC_STEP = 8 << 20

    def _run(self) -> None:
        fd = -1
        tmp = None
        q = self._q
        sq: queue.Queue = queue.Queue()
        st = threading.Thread(target=self._sync_run, args=(sq,), name="gpusnap-pack-syncer", daemon=True)
        st.start()
        pos = flushed = 0
        step = self.SYNC_STEP
        try:
            while True:
                op, a, b = q.get()
                if op == "stop":
                    break
                if self._err is not None:
                    continue          # drain after an error so producers never block
                try:
                    if op == "blobs":
                        _write_all(fd, a)
                        pos += sum(map(len, a))
                        if pos - flushed >= step:
                            sq.put(("flush", fd, (flushed, pos - flushed)))
                            flushed = pos
                    elif op == "open":
                        tmp, fd = fsutil.create_tmp(self.root / "tmp", "pack-")
                        self._tmps.append(tmp)
                        fault("pack:opened")
                        hdr = encode_pack_header()
                        _write_all(fd, [hdr])
                        pos, flushed = len(hdr), 0
                    elif op == "close":
                        blobs, name = b
                        _write_all(fd, [a])
                        pos += len(a)
                        sq.put(("close", (fd, tmp, blobs), (name, pos)))
                        fd = -1       # the syncer closes it after the fsync
                except BaseException as e:     # reported to the next add()/finish()
                    self._err = e
        finally:
            if fd >= 0:
                os.close(fd)
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
                self.done.append((ph, blobs))
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


def encode_index_file(packs: list[tuple[bytes, list]]) -> bytes:
    """The index file (docs/format.md §4) covering `packs` ([(pack hash, [blob records])])."""
    names = []
    blobs = []
    for pno, (ph, recs) in enumerate(packs):
        names.append(ph)
        for r in recs:
            blobs.append(IndexBlob(pno, r.offset, r.kind, r.codec, r.n_pages, r.raw_len, r.stored_len, r.ids))
    return encode_index(names, blobs)


def write_index_file(root: Path, packs: list[tuple[bytes, list]], on_name=None) -> tuple[Path, int] | None:
    """Write one index file covering `packs` ([(pack hash, [blob records])]); -> (path, size).
    on_name(path) is called with the final path before anything is written (so that an
    abort can tell whether the index got there, SnapshotWriter._abort)."""
    if not packs:
        return None
    data = encode_index_file(packs)
    dest = root / "index" / data[-32:].hex()
    if on_name is not None:
        on_name(dest)
    fsutil.write_file_atomic(root / "tmp", dest, data)
    return dest, len(data)


def index_pack_names(path: Path) -> list[bytes]:
    """The pack names an index file lists, from its header alone (no checksum check: a
    cheap look for recovery; the full parse checks everything). Raises OSError, FormatError."""
    from gpusnap.repo.format import INDEX_HEADER, INDEX_MAGIC
    with open(path, "rb") as f:
        head = f.read(INDEX_HEADER.size)
        if len(head) < INDEX_HEADER.size:
            raise FormatError("index file too short")
        magic, _version, _flags, n_packs, _n_blobs = INDEX_HEADER.unpack(head)
        if magic != INDEX_MAGIC:
            raise FormatError("bad index magic")
        raw = f.read(32 * n_packs)
    if len(raw) != 32 * n_packs:
        raise FormatError("index file too short for its pack list")
    return [raw[i:i + 32] for i in range(0, len(raw), 32)]


# =====================================================================================
# the in-memory index
# =====================================================================================

@dataclass(slots=True)
class BlobLoc:
    pack: bytes
    offset: int
    kind: int
    codec: int
    n_pages: int
    raw_len: int
    stored_len: int
    ids: bytes


@dataclass
class RepoIndex:
    """Union of all index files. Page ids -> blob_no << 8 | slot, as a dict (page_loc,
    built on first use) or as a PageTable (page_table(), built on first use: the dump's
    choice, a third of the memory); data_loc: blob id -> blob_no. The first index file (by
    name) to list an id wins."""

    blobs: list[BlobLoc] = field(default_factory=list)
    data_loc: dict = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    bad_files: dict = field(default_factory=dict)     # name -> reason
    blob_file: list[int] = field(default_factory=list)  # blob_no -> index into files
    # load(check_packs=True): pack -> names of the index files whose records were left out
    missing_packs: dict = field(default_factory=dict)   # ... because the pack is missing
    short_packs: dict = field(default_factory=dict)     # ... because it ends before the record
    _page_loc: dict | None = field(default=None, repr=False)
    _page_table: object = field(default=None, repr=False)

    @property
    def page_loc(self) -> dict:
        if self._page_loc is None:
            d: dict = {}
            setd = d.setdefault
            for bno, b in enumerate(self.blobs):
                if b.kind == KIND_PAGES:
                    ids = b.ids
                    base = bno << 8
                    for s in range(b.n_pages):
                        setd(ids[s * PAGE_ID_LEN:(s + 1) * PAGE_ID_LEN], base | s)
            self._page_loc = d
        return self._page_loc

    def page_table(self):
        """The page locations as a pagetable.PageTable."""
        if self._page_table is None:
            from gpusnap.repo.pipeline.pagetable import PageTable
            t = PageTable(hint=sum(b.n_pages for b in self.blobs if b.kind == KIND_PAGES))
            step = 1 << 16                # blobs per call: bounds the joined ids (~16 MiB)
            for lo in range(0, len(self.blobs), step):
                part = [(bno, b) for bno, b in enumerate(self.blobs[lo:lo + step], lo) if b.kind == KIND_PAGES]
                t.add_runs(b"".join(b.ids for _, b in part), [bno << 8 for bno, _ in part],
                           [b.n_pages for _, b in part])
            self._page_table = t
        return self._page_table

    @classmethod
    def load(cls, root: Path, names: list[str] | None = None, check_packs: bool = False) -> "RepoIndex":
        """The union of index files `names` (default: all of index/). With check_packs, a
        record whose pack is missing, or shorter than the record's end, is left out (and
        counted in missing_packs / short_packs): a dump must never deduplicate against data
        that is not there."""
        idx = cls()
        d = root / "index"
        if names is None:
            names = sorted(os.listdir(d))
        sizes = None
        if check_packs:       # the pack lists first (file headers), so files are parsed one at a time
            packs: set = set()
            for name in names:
                if HEX64.match(name):
                    try:
                        packs.update(index_pack_names(d / name))
                    except (OSError, FormatError):
                        pass          # reported by the parse below
            sizes = pack_sizes(root, packs)
        for name in names:
            if name.startswith("."):
                continue
            if not HEX64.match(name):
                idx.bad_files[name] = "unexpected file in index/"
                continue
            try:
                with open(d / name, "rb") as f:
                    data = f.read()
                if len(data) >= 32 and data[-32:].hex() != name:
                    raise FormatError("file name is not its checksum")
                parsed = parse_index(data)
            except FileNotFoundError:
                continue
            except (OSError, FormatError) as e:
                idx.bad_files[name] = str(e)
                continue
            if sizes is not None:
                for ph in parsed.packs:
                    if ph not in sizes:       # (the file changed between the two reads)
                        sizes.update(pack_sizes(root, [ph]))
            idx.add_file(name, parsed, sizes)
        return idx

    def add_file(self, name, parsed, sizes: dict | None = None) -> None:
        """Add one parsed index file; with `sizes` (pack -> size, None = missing), records
        whose data is not in the pack are left out (load(check_packs=True))."""
        if self._page_loc is not None or self._page_table is not None:
            raise RuntimeError("add_file() after the page locations were built")
        fno = len(self.files)
        self.files.append(name)
        data_loc = self.data_loc
        for b in parsed.blobs:
            ph = parsed.packs[b.pack_no]
            if sizes is not None:
                size = sizes.get(ph)
                if size is None:
                    self.missing_packs.setdefault(ph, set()).add(name)
                    continue
                if b.offset + BLOB_HEADER.size + b.stored_len + 16 > size:
                    self.short_packs.setdefault(ph, set()).add(name)
                    continue
            bno = len(self.blobs)
            self.blobs.append(BlobLoc(ph, b.offset, b.kind, b.codec, b.n_pages,
                                      b.raw_len, b.stored_len, b.ids))
            self.blob_file.append(fno)
            if b.kind != KIND_PAGES:
                data_loc.setdefault(b.ids, bno)

    def packs_present(self, root: Path) -> bool:
        """Is every pack this index uses still there and long enough? (one stat per pack)"""
        need = self.packs()
        sizes = pack_sizes(root, set(need))
        return all(sizes.get(ph) is not None and sizes[ph] >= end for ph, end in need.items())

    def packs(self) -> dict[bytes, int]:
        """pack hash -> minimal plausible size (end of its last indexed blob + trailer)."""
        out: dict[bytes, int] = {}
        for b in self.blobs:
            end = b.offset + BLOB_HEADER.size + b.stored_len + 16
            if out.get(b.pack, 0) < end:
                out[b.pack] = end
        return out


def pack_sizes(root: Path, packs) -> dict[bytes, int | None]:
    """pack name -> its size in bytes, or None when it is missing (never follows a symlink
    as a pack: a symlink counts as missing)."""
    out: dict[bytes, int | None] = {}
    for ph in packs:
        try:
            st = os.lstat(pack_path(root, ph))
        except (FileNotFoundError, NotADirectoryError):
            out[ph] = None
            continue
        out[ph] = st.st_size if stat.S_ISREG(st.st_mode) else None
    return out


# =====================================================================================
# reading blobs
# =====================================================================================

class BlobReader:
    """Reads and decompresses blobs; a small LRU of decompressed blobs and open pack fds.
    One per reading thread (not shared), so no locking."""

    def __init__(self, root: Path, index: RepoIndex, cache_blobs: int = 32, max_fds: int = 16):
        self.root = root
        self.index = index
        self.cache: dict[int, bytes] = {}
        self.cache_blobs = cache_blobs
        self.fds: dict[bytes, int] = {}
        self.max_fds = max_fds

    def close(self) -> None:
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()
        self.cache.clear()

    def _fd(self, pack: bytes) -> int:
        fd = self.fds.get(pack)
        if fd is None:
            if len(self.fds) >= self.max_fds:
                k = next(iter(self.fds))
                os.close(self.fds.pop(k))
            fd = os.open(pack_path(self.root, pack), os.O_RDONLY | os.O_CLOEXEC)
            self.fds[pack] = fd
        return fd

    def read_raw(self, loc: BlobLoc) -> bytes:
        """Read + validate header + decompress. Raises FormatError / OSError."""
        fd = self._fd(loc.pack)
        want = BLOB_HEADER.size + loc.stored_len
        data = os.pread(fd, want, loc.offset)
        if len(data) != want:
            raise FormatError(f"pack truncated: blob at offset {loc.offset} cut short")
        h = parse_blob_header(data, 0)
        if (h.kind, h.codec, h.n_pages, h.raw_len, h.stored_len) != (
                loc.kind, loc.codec, loc.n_pages, loc.raw_len, loc.stored_len):
            raise FormatError(f"blob header at offset {loc.offset} disagrees with the index")
        return decompress(memoryview(data)[BLOB_HEADER.size:], loc.codec, loc.raw_len)

    def get(self, bno: int) -> bytes:
        c = self.cache
        data = c.get(bno)
        if data is not None:
            return data
        data = self.read_raw(self.index.blobs[bno])
        if len(c) >= self.cache_blobs:
            del c[next(iter(c))]        # FIFO eviction: cheap, good enough for streaming reads
        c[bno] = data
        return data
