"""The page pipeline's sinks: one per image a dump writes. PagesSink scans pages (zero,
known, new), groups the new ones, compresses them in worker threads and hands them to the
pack writer, writing the image's page list as it goes; DataSink (datasink.py) stores any
other image as content-addressed data blobs. Both report their image's manifest entry to their
SnapshotWriter (repo/pipeline/writer.py) when closed.

Over 400 lines because PagesSink's ways in (bytes, zero runs, a copy's known pages by id),
its scan, its groups and its compressor threads share one state (the buffer, the pending
zero run, the open group, the page list) that must change in one order."""

from __future__ import annotations

import os
import queue
import threading

import blake3

from gpusnap.errors import NoSpace, RepositoryError
from gpusnap.repo import encoder, native
from gpusnap.repo.format import (CODEC_NONE, KIND_DATA, KIND_PAGES, PAGE_SIZE, PL_PAGES, PL_RECORD,
                                 encode_pl_tail, encode_pl_zero)
from gpusnap.repo.format import PAGE_ID_LEN as ID_LEN
from gpusnap.repo.pipeline import pagetable
from gpusnap.staging import segments
from gpusnap.system import proc
from gpusnap import settings

GROUP_PAGES = 16          # new pages compressed together (docs/compression.md)
BATCH = 1 << 20           # pages sink processes input in batches of this many bytes
DATA_CHUNK = 1 << 20      # non-pages images are cut into blobs of this size
# Compressor threads per pages image (up to 4): each batch is compressed in one native call
# without the GIL (repo/encoder.py). From 4 cores on, the ingest overlaps CRIU's stream
# (ops/dump.py), so one core is left to CRIU and the page scan; on 2-3 cores it starts only
# once the job resumed, and two compressors shortened fp32 storing by ~15 % on 2 cores
# (docs/benchmark.md). GPUSNAP_COMPRESS_THREADS=N sets it.
def _compress_workers() -> int:
    env = settings.get("GPUSNAP_COMPRESS_THREADS", "")
    cores = proc.usable_cores()
    n = int(env) if env.isdigit() else max(cores - 1, min(cores, 2))
    return max(1, min(4, n))


COMPRESS_WORKERS = _compress_workers()

class Counters:
    __slots__ = ("pages_total", "pages_zero", "pages_dedup", "pages_compressed", "pages_raw",
                 "bytes_raw", "blobs_total", "blobs_dedup", "blobs_new", "bytes_new_raw", "bytes_new_stored")

    def __init__(self):
        for k in self.__slots__:
            setattr(self, k, 0)

    def as_dict(self):
        return {k: getattr(self, k) for k in self.__slots__}


class ImageSink:
    """Base: one per CRIU image, written by one thread."""

    def __init__(self, w, filename: str, no: int):      # w: its pipeline.writer.SnapshotWriter
        self.w = w
        self.filename = filename
        self.no = no
        self.c = Counters()
        self.size = 0
        self.closed = False
        self.failed = False

    def write(self, data, hold=None, zero_pages: int = 0) -> None:
        """Store data (the image's next bytes). hold: a staging.Hold when data is a view of a
        staging slot that may be pointed into beyond this call (PagesSink), else None.
        zero_pages (PagesSink, data empty): the next n pages are zero, said without their
        bytes (an import's zero run): O(1) whatever n."""
        if self.closed:
            raise RepositoryError(f"write to closed image {self.filename}")
        try:
            if zero_pages:
                self._zero_pages(zero_pages)
            else:
                self._write(data, hold)
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
        codec, payload = encoder.encode_blob(chunk, w.codec)
        w.packer.add(KIND_DATA, codec, 0, len(chunk), payload, bid)
        c.blobs_new += 1
        c.bytes_new_raw += len(chunk)
        c.bytes_new_stored += len(payload)
        return bid


class PagesSink(ImageSink):
    """pages-*.img: the page pipeline (zero runs, blake3 page ids, dedup, grouped compression).

    Two stages per image: the writing thread scans each batch (zero test and page ids in
    native code without the GIL, gpusnap/repo/native.py), builds the page list and
    decides dedup; full groups of new pages go to this sink's compressor thread, which
    compresses each batch of them in one native call without the GIL (encoder.Encoder) and
    hands them to the pack writer. So one big image keeps two cores busy."""

    QUEUE_MAX = 4         # batches of groups waiting for the compressors (~1 MiB each)

    def __init__(self, w, filename, no):
        super().__init__(w, filename, no)
        self.buf = bytearray()
        self.pieces: list = []         # the current group: buffer slices of whole pages
        self.group_ids: list[bytes] = []
        self.group_holds: list = []    # the staging Holds its pieces point into (one per piece)
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
        self._threads_lock = threading.Lock()
        self._stopped = False              # aborted: no compressor starts again
        self._count_lock = threading.Lock()
        self._err: BaseException | None = None

    def _pl_write(self, b: bytes) -> None:
        self.pl.write(b)
        self.pl_h.update(b)
        self.pl_size += len(b)

    def _write(self, data, hold=None) -> None:
        n = len(data)
        if not n:
            return
        self.size += n
        buf = self.buf
        if buf or n < PAGE_SIZE:
            buf += data
            if len(buf) >= BATCH:
                take = len(buf) - len(buf) % PAGE_SIZE
                # _process only reads the batch during the call: hand it the buffer itself
                # and keep the rest (less than a page) as the new buffer, not a copy of the batch
                self.buf = buf[take:]
                self._process(buf, take)
            return
        # No copy of the whole batch: the scan reads the caller's buffer in place (a staging
        # slot, writable), and each new group points into it (with a hold) or is copied out
        # of it (_add_new). A read-only view becomes bytes first: native code can take the
        # address of bytes, not of the view.
        if type(data) is memoryview and data.readonly:
            data, hold = bytes(data), None
        take = n - n % PAGE_SIZE
        self._process(data, take, hold)
        if take != n:
            buf += data[take:]

    def _zero_pages(self, n: int) -> None:
        self._whole_pages_first()
        self.size += n * PAGE_SIZE
        self.c.pages_total += n
        self.c.pages_zero += n
        self.zero_pending += n

    def write_known(self, ids: bytes) -> None:
        """The next pages, by their ids alone: pages known_pages or claimed_pages holds (a
        copy's pages the destination has, ops/serve.py). Page-list records only, counted as
        deduplicated; the commit's locations file must find each id (else it fails)."""
        if self.closed:
            raise RepositoryError(f"write to closed image {self.filename}")
        n = len(ids) // ID_LEN
        self._whole_pages_first()
        out = [encode_pl_zero(self.zero_pending)] if self.zero_pending else []
        self.zero_pending = 0
        for o in range(0, n, 1 << 20):      # a page-list record holds at most 2^20 pages
            k = min(1 << 20, n - o)
            out += [PL_RECORD.pack(PL_PAGES, k), ids[o * ID_LEN:(o + k) * ID_LEN]]
        self._pl_write(b"".join(out))
        self.size += n * PAGE_SIZE
        self.c.pages_total += n
        self.c.pages_dedup += n

    def _whole_pages_first(self) -> None:
        """Before pages said without bytes: the buffered whole pages go first."""
        buf = self.buf
        if len(buf) % PAGE_SIZE:       # a partial page is the image's tail: nothing follows it
            raise RepositoryError(f"pages after a partial page in {self.filename}")
        if buf:
            self.buf = bytearray()
            self._process(buf, len(buf))

    def _process(self, buf, end: int, hold=None) -> None:
        """The hot loop. buf[0:end] is whole pages; buf (bytes or a writable buffer) is only
        read during this call, unless hold (a staging.Hold on it) is given: then groups
        point into it (claims on the hold), else they take copies of their pages."""
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
                out.append(encode_pl_zero(zero))
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
            self._add_new(memoryview(buf), newidx, ids, hold)
            self._hand_over()

    def _add_new(self, mv, newidx: list[int], ids: bytes, hold=None) -> None:
        """Append the new pages (indices into mv, in order) to groups. A run of consecutive
        pages is one slice of the ids and either a view of mv (with hold: the slot stays
        until the pack writer has the group's bytes, one claim per view) or one copy of its
        pages (fresh small allocations that malloc reuses; bytes need no copy for the
        native shuffle and plane estimate, where a read-only view would): no per-page
        Python on the common path. Pages that are not consecutive are copied together."""
        gp = self.w.group_pages
        k = 0
        nn = len(newidx)
        views = 0
        while k < nn:
            take = min(gp - self.gn, nn - k)
            a = newidx[k]
            b = newidx[k + take - 1]
            if b - a == take - 1:
                if hold is not None:
                    self.pieces.append(mv[a * PAGE_SIZE:(b + 1) * PAGE_SIZE])
                    self.group_holds.append(hold)
                    views += 1
                else:
                    self.pieces.append(mv[a * PAGE_SIZE:(b + 1) * PAGE_SIZE].tobytes())
                self.group_ids.append(ids[a * ID_LEN:(b + 1) * ID_LEN])
            else:
                sel = newidx[k:k + take]
                self.pieces.append(b"".join([mv[i * PAGE_SIZE:(i + 1) * PAGE_SIZE] for i in sel]))
                self.group_ids.append(b"".join([ids[i * ID_LEN:(i + 1) * ID_LEN] for i in sel]))
            self.gn += take
            k += take
            if self.gn >= gp:
                self._flush_group()
        if views:
            hold.retain(views)      # before any of these groups is handed over

    def _flush_group(self) -> None:
        n = self.gn
        if not n:
            return
        self.ready.append((self.pieces, b"".join(self.group_ids), n, self.group_holds))
        self.pieces = []
        self.group_ids = []
        self.group_holds = []
        self.gn = 0

    def _hand_over(self) -> None:
        """Pass the batch's full groups to the compressor threads as one queue item (a queue
        hand-off per group cost more than the group's own bookkeeping)."""
        if not self.ready:
            return
        if not self._threads:
            # under the lock, and only started threads are listed: an abort from the main
            # thread (a signal) may stop the compressors while this drain thread starts them
            with self._threads_lock:
                if self._stopped:
                    raise self._err or RepositoryError("snapshot aborted")
                self._q = queue.Queue(self.QUEUE_MAX)
                nw = 1 if self.w.codec == CODEC_NONE else COMPRESS_WORKERS
                for k in range(nw):
                    t = threading.Thread(target=self._compressor, name=f"gpusnap-pages-{self.no}.{k}", daemon=True)
                    t.start()
                    self._threads.append(t)
        if self._err is not None:
            raise self._err
        batch, self.ready = self.ready, []
        self._q.put(batch)

    def _compressor(self) -> None:
        """One compressor thread: batches from the queue, in whatever order the threads take
        them (blob order in packs is free). Its heuristics' state is its own, so each thread
        decides from the data it sees; the counters are added up under a lock."""
        q = self._q
        st = None
        c = Counters()
        try:
            while True:
                batch = q.get()
                if batch is None:
                    break
                done = segments.releaser(g[3] for g in batch)    # the groups' staging claims
                if self._err is not None:
                    if done is not None:
                        done()
                    continue              # drain after an error so the producer never blocks
                try:
                    if st is None:
                        st = encoder.Encoder()
                    blobs = self._store_batch(st, c, batch)
                except BaseException as e:    # reported to the next write()/close()
                    self._err = e
                    if done is not None:
                        done()
                    continue
                try:
                    self.w.packer.add_many(blobs, done)    # done: once the writer has the bytes
                except BaseException as e:
                    self._err = e
        finally:
            if st is not None:
                st.close()
            with self._count_lock:
                for k in ("pages_raw", "pages_compressed", "bytes_new_raw", "bytes_new_stored"):
                    setattr(self.c, k, getattr(self.c, k) + getattr(c, k))

    def _store_batch(self, enc: encoder.Encoder, c: Counters, batch: list) -> list:
        """Compress a batch of groups (or not) in one native call without the GIL
        (encoder.Encoder: codec.compress's choices and payloads, with the skip and lz4-first
        heuristics carried in st) -> the blobs for PackWriter.add_many(). A compressed
        payload is a view of the batch's native output buffer; a raw one is the group's bytes
        (or its view of a staging slot)."""
        raws = [p[0] if len(p) == 1 else b"".join(p) for p, _, _, _ in batch]
        res, out = enc.encode(raws, self.w.codec)
        mv = memoryview(out)
        blobs = []
        off = raw_pages = stored = 0
        for i, (_, ids, n, _) in enumerate(batch):
            raw = raws[i]
            codec, ln = res[2 * i], res[2 * i + 1]
            if codec == CODEC_NONE:
                payload = raw
                raw_pages += n
            else:
                payload = mv[off:off + ln]
                off += ln
            stored += ln
            blobs.append((KIND_PAGES, codec, n, len(raw), payload, ids))
        npages = sum(g[2] for g in batch)
        c.pages_raw += raw_pages
        c.pages_compressed += npages - raw_pages
        c.bytes_new_raw += sum(map(len, raws))
        c.bytes_new_stored += stored
        return blobs

    def _stop_compressor(self, for_good: bool = False) -> None:
        # abort() (main thread) and close() (the image's drain thread) may both get here;
        # after an abort (for_good) no compressor is started again
        with self._threads_lock:
            self._stopped = self._stopped or for_good
            ts, self._threads = self._threads, []
        for _ in ts:
            self._q.put(None)
        for t in ts:
            t.join()

    def _close(self) -> dict:
        buf = self.buf
        if len(buf) >= PAGE_SIZE:
            take = len(buf) - len(buf) % PAGE_SIZE
            chunk, buf = buf, buf[take:]          # as in _write: no copy of the batch
            self.buf = buf
            self._process(chunk, take)
        self._flush_group()
        self._hand_over()
        self._stop_compressor()
        if self._err is not None:
            raise self._err
        if self.zero_pending:
            self._pl_write(encode_pl_zero(self.zero_pending))
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
        self._stop_compressor(for_good=True)
        try:
            self.pl.close()
        except OSError:
            pass
