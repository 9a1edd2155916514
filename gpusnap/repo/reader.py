"""The one read path: a snapshot image rebuilt from its locations runs (docs/format.md §5.4).

plan() walks an image's page list alongside its runs (metadata only, no pack is read) and
cuts the image into jobs of at most `job_bytes`, each with its place in the output;
assemble() hands a job's pages blobs to one native call (native.decode_job, without the
GIL: each blob read, its header checked, decoded into place, then every page checked
against its id from the page list), lays the tail out after them and checks every data
blob against its blake3. Sequential reading (read_image: restore's stream
feed, export, describe) and the parallel materializer (repo/parallel_read.py, worker
threads) run exactly these two functions; they differ only in job size and scheduling.

The runs come from the snapshot's locations file, or, when that is missing or unusable,
from one built in memory from the repository index (Snapshot.reading_locations): one path.
Nothing read is trusted: a wrong run gives a checksum failure, never a wrong byte.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from array import array
from pathlib import Path
from typing import Iterator

import blake3

from gpusnap.repo import fsutil, native, readahead
from gpusnap.repo.format import (KIND_DATA, KIND_PAGES, PAGE_ID_LEN, PAGE_SIZE,
                                 READ_CHUNK, ZERO_CHUNK, FormatError, blob_id)
from gpusnap.repo.format.locations import Locations, LocationsInvalid
from gpusnap.repo.store import BlobReader, pack_path

PREFETCH_MIN = 8 << 20     # pages images at least this big are read ahead in a thread
PREFETCH_DEPTH = 3         # chunks (<= 1 MiB each) read ahead
PAGE_FDS = 16              # pack fds a RunReader keeps open for pages (a job needing more is decoded in parts)

_tokens = itertools.count(1)


class Job:
    """A piece of one pages image: `size` bytes at offset `pos`. pieces: ("z", nbytes) zero
    pages | ("r", run, slot, count) pages of a run | ("d", run, blob id, length) the tail;
    ids/kinds: what the job's pages are checked against (kind 0: a zero page, not checked)."""
    __slots__ = ("pos", "size", "pieces", "ids", "kinds", "npages", "data")

    def __init__(self, pos: int):
        self.pos = pos
        self.size = 0
        self.pieces: list = []
        self.ids: list = []
        self.kinds = bytearray()
        self.npages = 0
        self.data = False


class RunReader:
    """Reads the blobs runs point to (one per reading thread): open pack fds by pack
    number for the native decoder of pages (which keeps the last blob it decoded for part
    of a job for this reader's next job: `token`), and for data blobs a BlobReader and a
    small FIFO of them, keyed by (pack_no, offset)."""

    def __init__(self, root: Path, loc: Locations, cache_blobs: int = 32):
        self.root = root
        self.loc = loc
        self.br = BlobReader(root)
        self.cache: dict = {}
        self.cache_blobs = cache_blobs
        self.names: dict[int, bytes] = {}
        self.fds: dict[int, int] = {}
        self.token = next(_tokens)

    def close(self) -> None:
        self.br.close()
        self.cache.clear()
        self.close_fds()

    def close_fds(self) -> None:
        fsutil.close_all(self.fds)

    def open_pack(self, pack_no: int) -> int:
        """An open fd of the pack (kept until close_fds). Raises OSError."""
        fd = self.fds[pack_no] = os.open(pack_path(self.root, self.pack_name(pack_no)), os.O_RDONLY | os.O_CLOEXEC)
        return fd

    def pack_name(self, pack_no: int) -> bytes:
        n = self.names.get(pack_no)
        if n is None:
            if len(self.names) >= 64:
                self.names.clear()
            n = self.names[pack_no] = self.loc.pack(pack_no)[0]
        return n

    def get(self, r) -> bytes:
        key = (r[0], r[1])
        c = self.cache
        data = c.get(key)
        if data is not None:
            return data
        data = self.br.read_at(self.pack_name(r[0]), r[1], r[2], r[3], r[4], r[5], r[6])
        if len(c) >= self.cache_blobs:
            del c[next(iter(c))]
        c[key] = data
        return data


def _runs(snap, name: str, loc: Locations, image_no: int):
    """-> (next_run(kind), end()): the image's runs one at a time, each checked to be of the
    kind the page list needs; end() checks that none is left over."""
    runs = loc.iter_runs(image_no)

    def next_run(kind):
        try:
            r = next(runs)
        except StopIteration:
            raise snap.corrupt(f"locations file ends before image {name} does") from None
        except LocationsInvalid as e:
            raise snap.corrupt(f"locations file of {name}: {e}") from None
        if r[2] != kind:
            raise snap.corrupt(f"locations file of {name} disagrees with its page list")
        return r

    def end():
        try:
            next(runs)
        except StopIteration:
            return
        except LocationsInvalid as e:
            raise snap.corrupt(f"locations file of {name}: {e}") from None
        raise snap.corrupt(f"locations file has more runs than image {name} needs")
    return next_run, end


def _dropped(drop: list, di: int, first: int, n: int) -> tuple[int, int]:
    """Of the zero pages [first, first + n), how many the sorted runs `drop` (from index di
    on) leave out; -> (count, next di)."""
    out = 0
    while di < len(drop) and drop[di][0] < first + n:
        lo, hi = max(first, drop[di][0]), min(first + n, drop[di][0] + drop[di][1])
        if drop[di][0] < first and hi <= first:
            raise ValueError("a run to leave out covers pages that are not zero")
        out += max(0, hi - lo)
        if drop[di][0] + drop[di][1] > first + n:
            break
        di += 1
    return out, di


def plan(snap, name: str, loc: Locations, image_no: int, job_bytes: int,
         drop: list | None = None) -> Iterator[Job]:
    """The jobs of one pages image, in order (metadata only: no pack is read here). drop:
    sorted (first page, count) runs of zero pages to leave out (criu/sparse.py)."""
    next_run, end = _runs(snap, name, loc, image_no)
    job = Job(0)
    run = None
    slot = left = 0
    page = di = 0
    drop = drop or []
    for rec in snap.iter_page_refs(name):
        kind = rec[0]
        if kind == "pages":
            ids = rec[1]
            n = len(ids) // PAGE_ID_LEN
            if di < len(drop) and drop[di][0] < page + n:
                raise ValueError(f"{name}: a run to leave out covers pages that are not zero")
            page += n
            o = 0
            while o < n:
                if not left:
                    run = next_run(KIND_PAGES)
                    slot, left = run[7], run[8]
                k = min(n - o, left, max(1, (job_bytes - job.size) // PAGE_SIZE))
                job.pieces.append(("r", run, slot, k))
                job.ids.append(ids[o * PAGE_ID_LEN:(o + k) * PAGE_ID_LEN])
                job.kinds += b"\x01" * k
                job.npages += k
                job.size += k * PAGE_SIZE
                job.data = True
                slot += k
                left -= k
                o += k
                if job.size >= job_bytes:
                    yield job
                    job = Job(job.pos + job.size)
        elif kind == "zero":
            skip, di = _dropped(drop, di, page, rec[1]) if drop else (0, 0)
            page += rec[1]
            rem = (rec[1] - skip) * PAGE_SIZE
            while rem:
                k = min(rem, max(PAGE_SIZE, job_bytes - job.size))
                job.pieces.append(("z", k))
                job.ids.append(bytes(k // PAGE_SIZE * PAGE_ID_LEN))
                job.kinds += bytes(k // PAGE_SIZE)
                job.npages += k // PAGE_SIZE
                job.size += k
                rem -= k
                if job.size >= job_bytes:
                    yield job
                    job = Job(job.pos + job.size)
        else:                       # the tail: last in a page list, after every page
            if left or di < len(drop):
                raise snap.corrupt(f"locations file of {name} disagrees with its page list")
            job.pieces.append(("d", next_run(KIND_DATA), rec[2], rec[1]))
            job.size += rec[1]
            job.data = True
    if left:
        raise snap.corrupt(f"locations file of {name} disagrees with its page list")
    if di < len(drop):
        raise ValueError(f"{name}: a run to leave out lies past the image's end")
    end()
    if job.size:
        yield job


def _blob(snap, name: str, reader: RunReader, r) -> bytes:
    try:
        return reader.get(r)
    except FileNotFoundError:
        raise snap.corrupt(f"{name}: pack missing", reader.pack_name(r[0])) from None
    except (OSError, FormatError) as e:
        raise snap.corrupt(f"{name}: {e}", reader.pack_name(r[0])) from None


def _data_blob(snap, name: str, reader: RunReader, r, bid: bytes) -> bytes:
    data = _blob(snap, name, reader, r)
    if blob_id(data) != bid:
        raise snap.corrupt(f"blob {bid.hex()[:16]} of {name} fails its checksum", reader.pack_name(r[0]))
    return data


def _pack_of_page(job: Job, reader: RunReader, page: int) -> bytes | None:
    """The pack the job's page number `page` was read from (for the error message)."""
    at = 0
    for p in job.pieces:
        n = p[1] // PAGE_SIZE if p[0] == "z" else p[3] if p[0] == "r" else 0
        if page < at + n:
            return reader.pack_name(p[1][0]) if p[0] == "r" else None
        at += n
    return None


def _decode_pages(snap, name: str, job: Job, reader: RunReader, buf: bytearray) -> None:
    """The job's pages runs decoded into buf and every page checked: one native call
    (more only when the job needs more than PAGE_FDS packs open at once)."""
    fds = reader.fds
    if len(fds) > PAGE_FDS:
        reader.close_fds()
    a = array("q")
    packs: list[int] = []           # pack number of each piece in `a` (for error messages)
    pos = 0
    for p in job.pieces:
        if p[0] == "r":
            r = p[1]
            pn = r[0]
            fd = fds.get(pn)
            if fd is None:
                if len(fds) >= PAGE_FDS and packs:
                    _decode_call(snap, name, job, reader, a, packs, buf, False)
                    a = array("q")
                    packs = []
                    reader.close_fds()
                try:
                    fd = reader.open_pack(pn)
                except FileNotFoundError:
                    raise snap.corrupt(f"{name}: pack missing", reader.pack_name(pn)) from None
                except OSError as e:
                    raise snap.corrupt(f"{name}: {e}", reader.pack_name(pn)) from None
            a.extend((fd, pn, r[1], r[2], r[3], r[4], r[5], r[6], p[2], p[3], pos))
            packs.append(pn)
            pos += p[3] * PAGE_SIZE
        elif p[0] == "z":
            pos += p[1]
    _decode_call(snap, name, job, reader, a, packs, buf, True)


def _decode_call(snap, name: str, job: Job, reader: RunReader, a: array, packs: list, buf, check: bool) -> None:
    npages = job.npages if check else 0
    ids = b"".join(job.ids) if npages else b""
    bad = native.decode_job(a, len(packs), buf, npages, ids, job.kinds, reader.token)
    if bad is None:
        return
    code, piece, detail, msg = bad
    if code == native.DECODE_PAGE:
        raise snap.corrupt(f"a page of {name} fails its checksum", _pack_of_page(job, reader, detail))
    pack = reader.pack_name(packs[piece])
    if code == native.DECODE_IO:
        raise snap.corrupt(f"{name}: {OSError(detail, os.strerror(detail))}", pack)
    if code == native.DECODE_CODEC:
        msg = _reference_error(reader, pack, a[piece * native.PIECE_FIELDS + 2:piece * native.PIECE_FIELDS + 8]) or msg
    raise snap.corrupt(f"{name}: {msg}", pack)


def _reference_error(reader: RunReader, pack: bytes, rec) -> str | None:
    """Why the Python decoder (store.decode_blob's reference, codec.decompress) refuses the
    blob whose payload the native one could not decode, so both say it in the same words
    (the C libraries word their reasons differently from python-zstandard); None when it
    does not refuse it. Only ever on this error path."""
    try:
        reader.br.read_at(pack, *rec, python=True)
    except FormatError as e:
        return str(e)
    except OSError:
        return None
    return None


def assemble(snap, name: str, job: Job, reader: RunReader) -> bytearray | None:
    """The job's bytes, every page and the tail checked; None for a job of zero pages only."""
    if not job.data:
        return None
    buf = bytearray(job.size)
    if job.npages:
        _decode_pages(snap, name, job, reader, buf)
    p = job.pieces[-1]
    if p[0] == "d":                 # the tail: last in a job, after every page
        data = _data_blob(snap, name, reader, p[1], p[2])
        if len(data) != p[3]:
            raise snap.corrupt(f"tail of {name} has the wrong length")
        pos = job.size - p[3]
        buf[pos:job.size] = data
    return buf


def _read_pages(snap, name: str, loc: Locations, image_no: int, drop: list | None = None) -> Iterator:
    reader = RunReader(snap.repo.path, loc)
    try:
        for job in readahead.ahead(reader, plan(snap, name, loc, image_no, READ_CHUNK, drop), PAGE_FDS):
            buf = assemble(snap, name, job, reader)
            if buf is None:         # all zero: the shared zero chunk (a hole for the materializer)
                buf = ZERO_CHUNK if job.size == READ_CHUNK else bytes(job.size)
            yield buf
    finally:
        reader.close()


def _read_blobs(snap, im: dict, loc: Locations, image_no: int) -> Iterator[bytes]:
    """A blob image: its data blobs in order, each checked, then the whole image's digest."""
    name = im["name"]
    next_run, end = _runs(snap, name, loc, image_no)
    reader = RunReader(snap.repo.path, loc)
    try:
        h = blake3.blake3()
        n = 0
        for bh in im["blobs"]:
            data = _data_blob(snap, name, reader, next_run(KIND_DATA), bytes.fromhex(bh))
            reader.cache.clear()       # data blobs are rarely shared inside one image
            n += len(data)
            if n > im["size"]:
                raise snap.corrupt(f"image {name} longer than recorded")
            h.update(data)
            for o in range(0, len(data), READ_CHUNK):
                yield data[o:o + READ_CHUNK]
        if n != im["size"] or h.hexdigest() != im["digest"]:
            raise snap.corrupt(f"image {name} does not match its recorded size/checksum")
        end()
    finally:
        reader.close()


def read_image(snap, im: dict, loc: Locations, image_no: int, drop: list | None = None) -> Iterator:
    """The original bytes of one image in chunks of at most READ_CHUNK (bytes or bytearray;
    an all-zero chunk of READ_CHUNK is ZERO_CHUNK itself), less the zero-page runs `drop`
    (pages images only). Big pages images are built one step ahead in a helper thread (the
    checks run without the GIL) while the caller uses the previous chunk."""
    if im["type"] == "blob":
        return _read_blobs(snap, im, loc, image_no)
    it = _read_pages(snap, im["name"], loc, image_no, drop)
    if int(im.get("size", 0)) >= PREFETCH_MIN:
        return _prefetched(it)
    return it


def _prefetched(it: Iterator, depth: int = PREFETCH_DEPTH) -> Iterator:
    """Run the generator `it` in a helper thread, `depth` items ahead; exceptions reach the
    caller in order. Closing this generator early stops and closes `it` (in its thread)."""
    q: queue.Queue = queue.Queue(depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for x in it:
                if not put((0, x)):
                    return
            put((1, None))
        except BaseException as e:   # noqa: BLE001 - handed to the consumer
            put((2, e))
        finally:
            it.close()

    t = threading.Thread(target=run, name="gpusnap-read-ahead", daemon=True)
    t.start()
    try:
        while True:
            tag, x = q.get()
            if tag == 0:
                yield x
            elif tag == 1:
                return
            else:
                raise x
    finally:
        stop.set()
        t.join()
