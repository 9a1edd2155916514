"""The dump side: SnapshotWriter and its per-image sinks (the page pipeline)."""

from __future__ import annotations

import os
import queue
import shutil
import threading
import time
from pathlib import Path

import blake3

from gpusnap.errors import NoSpace, RepositoryError
from gpusnap.repo import fsutil, locations, native
from gpusnap.repo.pipeline import pagetable
from gpusnap.repo.codec import CODEC_AUTO, codec_name, compress
from gpusnap.repo.format import PAGE_ID_LEN as ID_LEN, CODEC_NONE, CODEC_SHUF4_ZSTD, KIND_DATA, KIND_PAGES, PAGE_SIZE, PL_RECORD, PL_PAGES, PL_ZERO, encode_manifest, encode_pl_tail, FORMAT_VERSION
from gpusnap.repo.faults import fault
from gpusnap.repo.store import PackWriter, write_index_file

GROUP_PAGES = 16          # new pages compressed together (docs/compression.md)
BATCH = 1 << 20           # pages sink processes input in batches of this many bytes
DATA_CHUNK = 1 << 20      # non-pages images are cut into blobs of this size
# After a group fails to compress, skip trying for this many groups (doubling up to
# the max), then probe again: incompressible memory costs no wasted compressor time.
SKIP_MAX = 8
# Compressor threads per pages image: compression (lz4, zstd, the native shuffle) runs
# without the GIL; on fp32 state one thread is busy ~80 % of CRIU's stream phase. One core
# is left to CRIU and the page scan: on 2 cores a second compressor gained nothing (the
# cores were the limit), so it takes 3 or more (up to 4). GPUSNAP_COMPRESS_THREADS=N sets it.
def _compress_workers() -> int:
    env = os.environ.get("GPUSNAP_COMPRESS_THREADS", "")
    n = int(env) if env.isdigit() else (os.cpu_count() or 1) - 1
    return max(1, min(4, n))


COMPRESS_WORKERS = _compress_workers()
LZ4_FUTILE = 4            # auto: lz4 lost this many groups in a row: stop trying it first...
LZ4_PROBE = 16            # ...except on every 16th group


def is_pages_image(filename: str) -> bool:
    return filename.startswith("pages-") and filename.endswith(".img")


class _Counters:
    __slots__ = ("pages_total", "pages_zero", "pages_dedup", "pages_compressed", "pages_raw",
                 "bytes_raw", "blobs_total", "blobs_dedup", "blobs_new", "bytes_new_raw", "bytes_new_stored")

    def __init__(self):
        for k in self.__slots__:
            setattr(self, k, 0)

    def as_dict(self):
        return {k: getattr(self, k) for k in self.__slots__}


class _CompressState:
    """One compressor thread's heuristics (PagesSink._store_group)."""
    __slots__ = ("skip", "skip_next", "lz4_futile", "since_probe")

    def __init__(self):
        self.skip = 0             # groups left to store raw without trying
        self.skip_next = 1
        self.lz4_futile = 0       # groups in a row where lz4 lost to shuffle4-zstd
        self.since_probe = 0


class ImageSink:
    """Base: one per CRIU image, written by one thread."""

    def __init__(self, w: "SnapshotWriter", filename: str, no: int):
        self.w = w
        self.filename = filename
        self.no = no
        self.c = _Counters()
        self.size = 0
        self.closed = False
        self.failed = False

    def write(self, data) -> None:
        if self.closed:
            raise RepositoryError(f"write to closed image {self.filename}")
        try:
            self._write(data)
        except OSError as e:
            self.failed = True
            if e.errno == 28:
                raise NoSpace(f"repository {self.w.repo.path} is full while storing {self.filename}",
                              "free space or prune old snapshots (gpusnap prune --keep-last N)") from e
            raise RepositoryError(f"storing {self.filename} failed: {e}") from e
        except BaseException:
            self.failed = True
            raise

    def close(self) -> None:
        if self.closed:
            return
        try:
            entry = self._close()
        except BaseException:
            self.failed = True
            raise
        self.closed = True
        self.w._image_done(self, entry)

    # -- shared helpers ---------------------------------------------------------------
    def _store_data(self, chunk: bytes) -> bytes:
        """Store one data blob (dedup by blake3-256); -> its id."""
        bid = blake3.blake3(chunk).digest()
        c = self.c
        c.blobs_total += 1
        w = self.w
        if bid in w.known_data or bid in w.claimed_data or w.claimed_data.setdefault(bid, self) is not self:
            c.blobs_dedup += 1
            return bid
        codec, payload = compress(chunk, w.codec)
        w.packer.add(KIND_DATA, codec, 0, len(chunk), payload, bid)
        c.blobs_new += 1
        c.bytes_new_raw += len(chunk)
        c.bytes_new_stored += len(payload)
        return bid


class DataSink(ImageSink):
    """Any image that is not pages-*.img: 1 MiB chunks stored as content-addressed blobs."""

    def __init__(self, w, filename, no):
        super().__init__(w, filename, no)
        self.buf = bytearray()
        self.h = blake3.blake3()
        self.blobs: list[str] = []

    def _write(self, data) -> None:
        self.size += len(data)
        self.h.update(data)
        self.buf += data
        while len(self.buf) >= DATA_CHUNK:
            chunk = bytes(self.buf[:DATA_CHUNK])
            del self.buf[:DATA_CHUNK]
            self.blobs.append(self._store_data(chunk).hex())

    def _close(self) -> dict:
        if self.buf:
            self.blobs.append(self._store_data(bytes(self.buf)).hex())
            self.buf = bytearray()
        self.c.bytes_raw = self.size
        return {"name": self.filename, "type": "blob", "size": self.size,
                "digest": self.h.hexdigest(), "blobs": self.blobs}


class PagesSink(ImageSink):
    """pages-*.img: the page pipeline (zero runs, blake3 page ids, dedup, grouped compression).

    Two stages per image: the writing thread scans each batch (zero test and page ids in
    native code without the GIL, gpusnap/repo/native.py), builds the page list and
    decides dedup; full groups of new pages go to this sink's compressor thread, which
    compresses them (lz4/zstd release the GIL on large buffers) and hands them to the
    pack writer. So one big image keeps two cores busy."""

    QUEUE_MAX = 4         # batches of groups waiting for the compressors (~1 MiB each)

    def __init__(self, w, filename, no):
        super().__init__(w, filename, no)
        self.buf = bytearray()
        self.pieces: list = []         # the current group: buffer slices of whole pages
        self.group_ids: list[bytes] = []
        self.gn = 0                    # pages in the current group
        self.ready: list = []          # full groups of this batch, handed over in one piece
        self.zero_pending = 0
        self.pl_name = f"pl-{no:06d}"
        self.pl_path = w.tmpdir / self.pl_name
        fd = os.open(self.pl_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)
        self.pl = os.fdopen(fd, "wb", buffering=1 << 16)
        self.pl_h = blake3.blake3()
        self.pl_size = 0
        self._q: queue.Queue | None = None
        self._threads: list[threading.Thread] = []
        self._count_lock = threading.Lock()
        self._err: BaseException | None = None

    def _pl_write(self, b: bytes) -> None:
        self.pl.write(b)
        self.pl_h.update(b)
        self.pl_size += len(b)

    def _write(self, data) -> None:
        n = len(data)
        if not n:
            return
        self.size += n
        buf = self.buf
        if buf or n < PAGE_SIZE:
            buf += data
            if len(buf) >= BATCH:
                take = len(buf) - len(buf) % PAGE_SIZE
                chunk = bytes(buf[:take])
                del buf[:take]
                self._process(chunk, take)
            return
        if type(data) is not bytes:
            data = bytes(data)
        take = n - n % PAGE_SIZE
        self._process(data, take)
        if take != n:
            buf += data[take:]

    def _process(self, buf: bytes, end: int) -> None:
        """The hot loop. buf[0:end] is whole pages; buf is immutable (bytes): groups keep
        slices of it until the compressor is done with them."""
        if self._err is not None:
            raise self._err
        npages = end // PAGE_SIZE
        kinds, ids, ndata = native.scan(buf, npages)
        ids = bytes(ids)
        w = self.w
        # the dedup decision for the whole batch in one call (pagetable.py: native, locked)
        newidx = pagetable.claim(w.known_pages, w.claimed_pages, kinds, ids, npages)
        zero = self.zero_pending
        out: list[bytes] = []
        nzero = 0
        pos = 0
        pack = PL_RECORD.pack
        find = kinds.find
        while pos < npages:
            if not kinds[pos]:
                j = find(1, pos)
                if j < 0:
                    j = npages
                zero += j - pos
                nzero += j - pos
                pos = j
                continue
            j = find(0, pos)
            if j < 0:
                j = npages
            if zero:
                out.append(pack(PL_ZERO, zero))
                zero = 0
            out.append(pack(PL_PAGES, j - pos))
            out.append(ids[pos * ID_LEN:j * ID_LEN])
            pos = j
        self.zero_pending = zero
        if out:
            self._pl_write(b"".join(out))
        c = self.c
        c.pages_total += npages
        c.pages_zero += nzero
        c.pages_dedup += ndata - len(newidx)
        if newidx:
            self._add_new(memoryview(buf), newidx, [ids[i * ID_LEN:(i + 1) * ID_LEN] for i in newidx])
            self._hand_over()

    def _add_new(self, mv, newidx: list[int], newids: list[bytes]) -> None:
        """Append the new pages (indices into mv, in order) to groups; a run of consecutive
        pages becomes one slice, so a group of adjacent pages costs no copy at all."""
        gp = self.w.group_pages
        k = 0
        nn = len(newidx)
        while k < nn:
            pieces = self.pieces          # (a new list after each flush)
            take = min(gp - self.gn, nn - k)
            a = newidx[k]
            b = newidx[k + take - 1]
            if b - a == take - 1:
                pieces.append(mv[a * PAGE_SIZE:(b + 1) * PAGE_SIZE])
            else:
                pieces.extend(mv[i * PAGE_SIZE:(i + 1) * PAGE_SIZE] for i in newidx[k:k + take])
            self.group_ids.extend(newids[k:k + take])
            self.gn += take
            k += take
            if self.gn >= gp:
                self._flush_group()

    def _flush_group(self) -> None:
        n = self.gn
        if not n:
            return
        self.ready.append((self.pieces, b"".join(self.group_ids), n))
        self.pieces = []
        self.group_ids = []
        self.gn = 0

    def _hand_over(self) -> None:
        """Pass the batch's full groups to the compressor threads as one queue item (a queue
        hand-off per group cost more than the group's own bookkeeping)."""
        if not self.ready:
            return
        if not self._threads:
            self._q = queue.Queue(self.QUEUE_MAX)
            nw = 1 if self.w.codec == CODEC_NONE else COMPRESS_WORKERS
            self._threads = [threading.Thread(target=self._compressor, name=f"gpusnap-pages-{self.no}.{k}",
                                              daemon=True) for k in range(nw)]
            for t in self._threads:
                t.start()
        if self._err is not None:
            raise self._err
        batch, self.ready = self.ready, []
        self._q.put(batch)

    def _compressor(self) -> None:
        """One compressor thread: batches from the queue, in whatever order the threads take
        them (blob order in packs is free). Its heuristics' state is its own, so each thread
        decides from the data it sees; the counters are added up under a lock."""
        q = self._q
        st = _CompressState()
        c = _Counters()
        try:
            while True:
                batch = q.get()
                if batch is None:
                    break
                if self._err is not None:
                    continue              # drain after an error so the producer never blocks
                try:
                    self.w.packer.add_many([self._store_group(st, c, *g) for g in batch])
                except BaseException as e:    # reported to the next write()/close()
                    self._err = e
        finally:
            with self._count_lock:
                for k in ("pages_raw", "pages_compressed", "bytes_new_raw", "bytes_new_stored"):
                    setattr(self.c, k, getattr(self.c, k) + getattr(c, k))

    def _store_group(self, st: "_CompressState", c: _Counters, pieces: list, ids: bytes, n: int) -> tuple:
        """Compress one group (or not): -> the blob for PackWriter.add_many()."""
        raw = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        w = self.w
        if st.skip or w.codec == CODEC_NONE:
            st.skip = max(st.skip - 1, 0)
            codec, payload = CODEC_NONE, raw
        else:
            lz4_first = w.codec != CODEC_AUTO or st.lz4_futile < LZ4_FUTILE or st.since_probe >= LZ4_PROBE
            codec, payload = compress(raw, w.codec, lz4_first=lz4_first)
            st.since_probe = 0 if lz4_first else st.since_probe + 1
            if codec == CODEC_NONE:
                payload = raw
                st.skip = st.skip_next
                st.skip_next = min(st.skip_next * 2, SKIP_MAX)
            else:
                st.skip_next = 1
            # auto: after LZ4_FUTILE groups in a row where lz4 lost to the float codec, stop
            # trying lz4 first (its attempt was ~20 % of the compressor's time on fp32
            # state) except on every LZ4_PROBE-th group
            st.lz4_futile = st.lz4_futile + 1 if codec == CODEC_SHUF4_ZSTD else 0
        if codec == CODEC_NONE:
            c.pages_raw += n
        else:
            c.pages_compressed += n
        c.bytes_new_raw += len(raw)
        c.bytes_new_stored += len(payload)
        return (KIND_PAGES, codec, n, len(raw), payload, ids)

    def _stop_compressor(self) -> None:
        # abort() (main thread) and close() (the image's drain thread) may both get here
        ts, self._threads = self._threads, []
        for _ in ts:
            self._q.put(None)
        for t in ts:
            t.join()

    def _close(self) -> dict:
        buf = self.buf
        if len(buf) >= PAGE_SIZE:
            take = len(buf) - len(buf) % PAGE_SIZE
            chunk = bytes(buf[:take])
            del buf[:take]
            self._process(chunk, take)
        self._flush_group()
        self._hand_over()
        self._stop_compressor()
        if self._err is not None:
            raise self._err
        if self.zero_pending:
            self._pl_write(PL_RECORD.pack(PL_ZERO, self.zero_pending))
            self.zero_pending = 0
        if buf:
            # A trailing partial page (CRIU never writes one, but no byte is lost if it does).
            tail = bytes(buf)
            bid = self._store_data(tail)
            self._pl_write(encode_pl_tail(len(tail), bid))
            self.buf = bytearray()
        self.pl.flush()
        os.fsync(self.pl.fileno())
        self.pl.close()
        self.c.bytes_raw = self.size
        return {"name": self.filename, "type": "pages", "size": self.size, "digest": self.pl_h.hexdigest(),
                "pagelist": self.pl_name, "pagelist_size": self.pl_size,
                "pages": self.c.pages_total, "pages_zero": self.c.pages_zero, "pages_dedup": self.c.pages_dedup,
                "pages_compressed": self.c.pages_compressed, "pages_raw": self.c.pages_raw}

    def _abort(self) -> None:
        self._err = self._err or RepositoryError("snapshot aborted")
        self._stop_compressor()
        try:
            self.pl.close()
        except OSError:
            pass


class SnapshotWriter:
    """One dump in progress. image_sink() may be called from many threads at once."""

    def __init__(self, repo, name: str, codec: int, meta: dict | None, group_pages: int = GROUP_PAGES,
                 pack_target: int | None = None):
        self.repo = repo
        self.name = name
        self.codec = codec
        self.meta = dict(meta or {})
        self.group_pages = group_pages
        self.created = time.time()
        locations.preload_numpy()         # needed at commit; loads while the dump streams
        # records whose pack is missing or short are left out: never dedup against them
        idx = repo._load_index(refresh=True, check_packs=True)
        self.index = idx                  # for the locations file at commit (locations.py)
        self.known_pages = idx.page_table()
        self.known_data = idx.data_loc
        self.claimed_pages = pagetable.PageTable()
        self.claimed_data: dict = {}
        root = repo.path
        self.tmpdir = root / "snapshots" / f".tmp-{name}-{os.getpid()}-{int(self.created * 1e6)}"
        fsutil.mkdir_private(self.tmpdir)
        self.packer = PackWriter(root, **({"target_size": pack_target} if pack_target else {}))
        self.lock = threading.Lock()
        self.sinks: list[ImageSink] = []
        self.images: dict[str, dict] = {}
        self.image_counters: list[_Counters] = []
        self.stats: dict = {}
        self.state = "open"
        self._index_dest: Path | None = None   # the dump's index file, once its name is known
        fault("writer:open")

    def image_sink(self, filename: str) -> ImageSink:
        with self.lock:
            if self.state != "open":
                raise RepositoryError(f"snapshot writer is {self.state}")
            if filename in self.images or any(s.filename == filename for s in self.sinks):
                raise RepositoryError(f"image {filename} written twice in one snapshot")
            no = len(self.sinks)
            cls = PagesSink if is_pages_image(filename) else DataSink
            s = cls(self, filename, no)
            self.sinks.append(s)
            return s

    def _image_done(self, sink: ImageSink, entry: dict) -> None:
        with self.lock:
            self.images[sink.filename] = entry

    def _totals(self) -> _Counters:
        t = _Counters()
        for s in self.sinks:
            for k in t.__slots__:
                setattr(t, k, getattr(t, k) + getattr(s.c, k))
        return t

    def commit(self, extra_meta: dict | None = None):
        """Make the snapshot durable and visible, in this order (docs/format.md §5.3):
          1. packs: each fsynced and renamed into packs/ab/ as it fills; here the last one,
             then the directories that received packs are fsynced;
          2. the dump's index file: temp, fsync, rename into index/, fsync index/ -- from
             here on the packs are named and stay, whatever happens next;
          3. locations, manifest (page lists were fsynced as their images closed) in
             snapshots/.tmp-*/, fsync of that directory;
          4. rename .tmp-* to snapshots/<dir>, fsync snapshots/: the commit point.
        Whatever stops it (an exception, a signal, a full disk) before step 4 leaves no
        snapshot, and _abort() removes only what nothing names."""
        with self.lock:
            if self.state != "open":
                raise RepositoryError(f"snapshot writer is {self.state}")
            self.state = "committing"
        try:
            fault("commit:start")
            bad = [s.filename for s in self.sinks if not s.closed or s.failed]
            if bad:
                raise RepositoryError(f"cannot commit: images not completed: {', '.join(sorted(bad))}")
            root = self.repo.path
            packs = self.packer.finish()
            fault("commit:packs-durable")
            ires = write_index_file(root, packs, on_name=self._set_index_dest)
            index_bytes = ires[1] if ires else 0
            fault("commit:index-renamed")
            # -- locations hook (gpusnap/repo/locations.py, docs/format.md §5.4) --
            loc_bytes = locations.write_at_commit(self, packs)
            fault("commit:locations-written")
            t = self._totals()
            if extra_meta:
                self.meta.update(extra_meta)
            pl_bytes = sum(e.get("pagelist_size", 0) for e in self.images.values())
            stats = t.as_dict()
            stats["bytes_packs"] = self.packer.bytes_written
            stats["bytes_index"] = index_bytes
            stats["bytes_locations"] = loc_bytes
            stats["packs_new"] = len(packs)
            body = {
                "format": "gpusnap-snapshot", "version": FORMAT_VERSION,
                "repo_id": self.repo.config["id"], "name": self.name, "created": self.created,
                "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created)),
                "compress": codec_name(self.codec), "group_pages": self.group_pages,
                "meta": self.meta,
                "images": [self.images[k] for k in sorted(self.images)],
                "stats": stats,
            }
            # bytes_stored counts what this dump added: packs, index, page lists, manifest.
            data, _ = encode_manifest(body)
            stats["bytes_stored"] = 0
            for _ in range(3):   # the number's own digits change the manifest size: iterate to a fixed point
                total = self.packer.bytes_written + index_bytes + loc_bytes + pl_bytes + len(data)
                if stats["bytes_stored"] == total:
                    break
                stats["bytes_stored"] = total
                data, _ = encode_manifest(body)
            fsutil.write_private(self.tmpdir / "manifest", data)
            fsutil.fsync_dir(self.tmpdir)
            fault("commit:manifest-written")
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self.created))
            snaps = root / "snapshots"
            dest = snaps / f"{self.name}-{stamp}"
            k = 1
            while dest.exists():      # same name within the same second (we hold the writer lock)
                k += 1
                dest = snaps / f"{self.name}-{stamp}-{k}"
            self.stats = dict(stats)
            os.rename(self.tmpdir, dest)
            self.state = "committed"      # (a signal just before this line: _abort() is harmless)
            fault("commit:snapshot-renamed")
            fsutil.fsync_dir(snaps)
            fault("commit:done")
            return self.repo.snapshot_at(dest)
        except BaseException as e:
            if self.state != "committed":
                self._abort()
            if isinstance(e, OSError) and e.errno == 28:
                raise NoSpace(f"repository {self.repo.path} is full: {e}",
                              "free space or prune old snapshots (gpusnap prune --keep-last N)") from e
            if isinstance(e, OSError):
                raise RepositoryError(f"writing snapshot failed: {e}") from e
            raise

    def _set_index_dest(self, dest: Path) -> None:
        self._index_dest = dest

    def abort(self) -> None:
        with self.lock:
            if self.state in ("committed", "aborted"):
                return
            self.state = "aborting"
        self._abort()

    def _abort(self) -> None:
        """Remove what nothing names, nothing else (docs/format.md §5.3, recovery rules):
        the snapshot's .tmp- directory (unless the commit's rename already made it a
        snapshot), temporary pack files, and the packs this dump created only while no
        index file names them. Whether the index got into index/ is read from the
        directory, not from a flag, so a signal between the rename and any bookkeeping
        cannot make it wrong; we hold the writer lock, so nobody else writes it."""
        fault("abort:start")
        for s in self.sinks:
            if isinstance(s, PagesSink):
                s._abort()
        named = self._index_dest is not None and os.path.lexists(self._index_dest)
        self.packer.abort(delete_finished=not named)
        fault("abort:packs-done")
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        self.state = "aborted"
