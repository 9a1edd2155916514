"""A snapshot's images written out as files, decoded in parallel (for `criu restore -D`).

The same reading as Snapshot.read_image (through the snapshot's locations file, every page
checked against its id from the page list, every data blob against its blake3), but cut into
independent jobs of about JOB_BYTES, each with its place in the output file: one pass over the
page list and the runs (metadata only) makes the jobs; worker threads read and decompress the
blobs, assemble the job's bytes, check them (native, without the GIL) and pwrite() them at
their offset. A job that is nothing but zero pages is not written (a hole).

Snapshots without a usable locations file are written sequentially through read_image.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import blake3

from gpusnap.repo import native
from gpusnap.repo.format import BLOB_HEADER, CODEC_NONE, KIND_DATA, KIND_PAGES, PAGE_ID_LEN, PAGE_SIZE, _ZCHUNK, FormatError
from gpusnap.repo.locations import LocationsInvalid, RunReader

JOB_BYTES = 4 << 20


class _Job:
    __slots__ = ("pos", "size", "pieces", "ids", "kinds", "npages", "data")

    def __init__(self, pos: int):
        self.pos = pos
        self.size = 0
        self.pieces: list = []     # ("z", nbytes) | ("r", run, slot, count) | ("d", run, blob id, length)
        self.ids: list = []
        self.kinds = bytearray()
        self.npages = 0
        self.data = False


def _jobs(snap, name: str, loc, image_no: int):
    """The jobs of one pages image, in order (metadata only: no pack is read here)."""
    runs = loc.iter_runs(image_no)

    def next_run(kind):
        try:
            r = next(runs)
        except StopIteration:
            raise snap._corrupt(f"locations file ends before image {name} does") from None
        except LocationsInvalid as e:
            raise snap._corrupt(f"locations file of {name}: {e}") from None
        if r[2] != kind:
            raise snap._corrupt(f"locations file of {name} disagrees with its page list")
        return r

    job = _Job(0)
    run = None
    slot = left = 0
    for rec in snap.iter_page_refs(name):
        kind = rec[0]
        if kind == "pages":
            ids = rec[1]
            n = len(ids) // PAGE_ID_LEN
            o = 0
            while o < n:
                if not left:
                    run = next_run(KIND_PAGES)
                    slot, left = run[7], run[8]
                k = min(n - o, left, max(1, (JOB_BYTES - job.size) // PAGE_SIZE))
                job.pieces.append(("r", run, slot, k))
                job.ids.append(ids[o * PAGE_ID_LEN:(o + k) * PAGE_ID_LEN])
                job.kinds += b"\x01" * k
                job.npages += k
                job.size += k * PAGE_SIZE
                job.data = True
                slot += k
                left -= k
                o += k
                if job.size >= JOB_BYTES:
                    yield job
                    job = _Job(job.pos + job.size)
        elif kind == "zero":
            rem = rec[1] * PAGE_SIZE
            while rem:
                k = min(rem, max(PAGE_SIZE, JOB_BYTES - job.size))
                job.pieces.append(("z", k))
                job.ids.append(bytes(k // PAGE_SIZE * PAGE_ID_LEN))
                job.kinds += bytes(k // PAGE_SIZE)
                job.npages += k // PAGE_SIZE
                job.size += k
                rem -= k
                if job.size >= JOB_BYTES:
                    yield job
                    job = _Job(job.pos + job.size)
        else:
            if left:
                raise snap._corrupt(f"locations file of {name} disagrees with its page list")
            job.pieces.append(("d", next_run(KIND_DATA), rec[2], rec[1]))
            job.size += rec[1]
            job.data = True
    if left:
        raise snap._corrupt(f"locations file of {name} disagrees with its page list")
    try:
        next(runs)
    except StopIteration:
        pass
    except LocationsInvalid as e:
        raise snap._corrupt(f"locations file of {name}: {e}") from None
    else:
        raise snap._corrupt(f"locations file has more runs than image {name} needs")
    if job.size:
        yield job


class _Readers(threading.local):
    def __init__(self, root: Path, loc):
        self.reader = RunReader(root, loc)


def _reader(readers, all_readers: list, lock: threading.Lock):
    if not hasattr(readers, "registered"):
        readers.registered = True
        with lock:
            all_readers.append(readers.reader)
    return readers.reader


def _build_job(snap, name: str, job: _Job, reader) -> bytearray | None:
    """The job's bytes, every page checked; None for a job of zero pages only."""
    if not job.data:
        return None

    def blob(r):
        try:
            return reader.get(r)
        except FileNotFoundError:
            raise snap._corrupt(f"{name}: pack missing", reader.pack_name(r[0])) from None
        except (OSError, FormatError) as e:
            raise snap._corrupt(f"{name}: {e}", reader.pack_name(r[0])) from None

    buf = bytearray(job.size)
    mv = memoryview(buf)
    pos = 0
    for p in job.pieces:
        if p[0] == "r":
            r = p[1]
            n = p[3] * PAGE_SIZE
            s = p[2] * PAGE_SIZE
            if r[3] == CODEC_NONE:
                # stored raw: read the pages straight into place (one copy instead of three);
                # the page checks below catch anything the run might point at wrongly
                try:
                    fd = reader.br._fd(reader.pack_name(r[0]))
                    got = os.preadv(fd, [mv[pos:pos + n]], r[1] + BLOB_HEADER.size + s)
                except FileNotFoundError:
                    raise snap._corrupt(f"{name}: pack missing", reader.pack_name(r[0])) from None
                except OSError as e:
                    raise snap._corrupt(f"{name}: {e}", reader.pack_name(r[0])) from None
                if got != n:
                    raise snap._corrupt(f"{name}: pack truncated", reader.pack_name(r[0]))
            else:
                b = memoryview(blob(r))
                mv[pos:pos + n] = b[s:s + n]
            pos += n
        elif p[0] == "z":
            pos += p[1]
        else:
            data = blob(p[1])
            if len(data) != p[3]:
                raise snap._corrupt(f"tail of {name} has the wrong length")
            if blake3.blake3(data).digest() != p[2]:
                raise snap._corrupt(f"blob {p[2].hex()[:16]} of {name} fails its checksum",
                                    reader.pack_name(p[1][0]))
            mv[pos:pos + len(data)] = data
            pos += len(data)
    if job.npages:
        bad = native.verify(buf, job.npages, b"".join(job.ids), job.kinds)
        if bad >= 0:
            raise snap._corrupt(f"a page of {name} fails its checksum")
    return buf


def _run_job(snap, name: str, fd: int, job: _Job, readers, all_readers: list, lock: threading.Lock,
             done: list) -> int:
    done[0] += job.size                             # progress only: an unlocked add is close enough
    buf = _build_job(snap, name, job, _reader(readers, all_readers, lock))
    if buf is None:
        return 0                                    # all zero pages: a hole
    mv = memoryview(buf)
    off = 0
    while off < job.size:
        off += os.pwrite(fd, mv[off:], job.pos + off)
    return job.size


def parallel_ok(snap, name: str) -> bool:
    """Whether iter_image_parallel can read this image (a big pages image, a locations file)."""
    im = snap.image(name)
    return im["type"] == "pages" and int(im.get("size", 0)) > JOB_BYTES and snap.locations() is not None


def iter_image_parallel(snap, name: str, threads: int):
    """The image's bytes in order, like Snapshot.read_image, built by `threads` workers a
    bounded window ahead (2 jobs per worker). For the stream path."""
    from collections import deque

    loc = snap.locations()
    readers = _Readers(snap.repo.path, loc)
    lock = threading.Lock()
    all_readers: list = []
    zero = bytes(JOB_BYTES)

    def build(job):
        return job, _build_job(snap, name, job, _reader(readers, all_readers, lock))

    ex = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gpusnap-read")
    window: deque = deque()
    try:
        jobs = _jobs(snap, name, loc, snap._image_no[name])
        more = True
        while more or window:
            while more and len(window) < 2 * threads:
                job = next(jobs, None)
                if job is None:
                    more = False
                else:
                    window.append(ex.submit(build, job))
            if window:
                job, buf = window.popleft().result()
                if buf is None:
                    yield zero if job.size == JOB_BYTES else bytes(job.size)
                else:
                    yield buf
    finally:
        for f in window:
            f.cancel()
        ex.shutdown(wait=True)
        for r in all_readers:
            r.close()


def _create(d: Path, name: str) -> int:
    from gpusnap.criu import protocol

    protocol.check_filename(name)
    return os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _write_sequential(snap, d: Path, name: str, stop: threading.Event, done: list) -> int:
    fd = _create(d, name)
    pos = written = 0
    try:
        it = snap.read_image(name)
        try:
            for chunk in it:
                if stop.is_set():
                    return written
                n = len(chunk)
                if chunk is not _ZCHUNK:     # all-zero 1 MiB: a hole
                    view = memoryview(chunk)
                    off = 0
                    while off < n:
                        off += os.pwrite(fd, view[off:], pos + off)
                    written += n
                pos += n
                done[0] += n                 # progress only: an unlocked add is close enough
        finally:
            it.close()
        os.ftruncate(fd, pos)
    finally:
        os.close(fd)
    return written


def write_images(snap, d: Path, threads: int, stop: threading.Event, done: list) -> int:
    """Write every image of `snap` into directory `d` (which must be empty and private);
    returns the bytes written (holes excluded). Raises CorruptSnapshot on any bad byte, and
    OSError on a write failure; `stop` set by the caller ends the work early."""
    loc = snap.locations()
    names = sorted(snap.image_names(), key=lambda n: -int(snap.image(n).get("size", 0) or 0))
    big = [n for n in names if loc is not None and snap.image(n)["type"] == "pages"
           and int(snap.image(n).get("size", 0)) > JOB_BYTES]
    small = [n for n in names if n not in big]
    written = 0
    lock = threading.Lock()
    all_readers: list = []
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gpusnap-images") as ex:
        futs = [ex.submit(_write_sequential, snap, d, n, stop, done) for n in small]
        readers = _Readers(snap.repo.path, loc) if big else None
        try:
            for name in big:
                im = snap.image(name)
                fd = _create(d, name)
                pending: set = set()
                try:
                    image_no = snap._image_no[name]
                    total = 0
                    for job in _jobs(snap, name, loc, image_no):
                        if stop.is_set():
                            break
                        total = job.pos + job.size
                        pending.add(ex.submit(_run_job, snap, name, fd, job, readers, all_readers, lock, done))
                        while len(pending) >= 2 * threads:     # bounded memory: jobs in flight
                            fin, pending = wait(pending, return_when=FIRST_COMPLETED)
                            for f in fin:
                                written += f.result()
                    fin, pending = wait(pending)
                    for f in fin:
                        written += f.result()
                    if total != im["size"]:
                        raise snap._corrupt(f"image {name} rebuilds to {total} bytes, not {im['size']}")
                    os.ftruncate(fd, total)
                finally:
                    # no job may still write through this fd once it is closed (or reused)
                    wait(pending)
                    os.close(fd)
            for f in futs:
                written += f.result()
        except BaseException:
            stop.set()
            raise
        finally:
            for r in all_readers:
                r.close()
    return written
