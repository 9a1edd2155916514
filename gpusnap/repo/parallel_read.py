"""A snapshot's images decoded in parallel: written out as files (repo/materialize.py, for
`criu restore -D`), or as the parallel stream feed.

The same reading as Snapshot.read_image (repo/reader.py: reader.plan cuts an image into
jobs, reader.assemble builds and checks one), with jobs of JOB_BYTES run by worker threads
that pwrite() each at its offset. A job that is nothing but zero pages is not written (a
hole). Blob images and small pages images are written sequentially through read_image.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

from gpusnap.repo import reader
from gpusnap.errors import CorruptSnapshot
from gpusnap.repo.format import ZERO_CHUNK
from gpusnap.repo.format.names import image_name_problem

JOB_BYTES = 4 << 20


class _Readers(threading.local):
    def __init__(self, root: Path, loc):
        self.reader = reader.RunReader(root, loc)


def _reader(readers, all_readers: list, lock: threading.Lock):
    if not hasattr(readers, "registered"):
        readers.registered = True
        with lock:
            all_readers.append(readers.reader)
    return readers.reader


def _run_job(snap, name: str, fd: int, job: reader.Job, readers, all_readers: list, lock: threading.Lock,
             done: list) -> int:
    done[0] += job.size                             # progress only: an unlocked add is close enough
    buf = reader.assemble(snap, name, job, _reader(readers, all_readers, lock))
    if buf is None:
        return 0                                    # all zero pages: a hole
    mv = memoryview(buf)
    off = 0
    while off < job.size:
        off += os.pwrite(fd, mv[off:], job.pos + off)
    return job.size


def parallel_ok(snap, name: str) -> bool:
    """Whether iter_image_parallel is worth its threads for this image (a big pages image)."""
    im = snap.image(name)
    return im["type"] == "pages" and int(im.get("size", 0)) > JOB_BYTES


def iter_image_parallel(snap, name: str, threads: int, drop: list | None = None):
    """The image's bytes in order, like Snapshot.read_image (less the zero-page runs
    `drop`), built by `threads` workers a bounded window ahead (2 jobs per worker). For the
    stream path."""
    from collections import deque

    loc = snap.reading_locations()
    readers = _Readers(snap.repo.path, loc)
    lock = threading.Lock()
    all_readers: list = []
    zero = bytes(JOB_BYTES)

    def build(job):
        return job, reader.assemble(snap, name, job, _reader(readers, all_readers, lock))

    ex = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gpusnap-read")
    window: deque = deque()
    try:
        jobs = reader.plan(snap, name, loc, snap.image_no(name), JOB_BYTES, drop)
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
    if image_name_problem(name):     # (the manifest's names were checked; never a path)
        raise CorruptSnapshot(f"snapshot image name {name!r} is not a plain file name")
    return os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _write_sequential(snap, d: Path, name: str, stop: threading.Event, done: list, sparse=None) -> int:
    fd = _create(d, name)
    pos = written = 0
    try:
        if sparse is not None and name in sparse.pagemaps:
            it = (b for b in (sparse.pagemaps[name],))   # (a generator: closed below)
        else:
            it = snap.read_image(name, sparse.drop.get(name) if sparse is not None else None)
        try:
            for chunk in it:
                if stop.is_set():
                    return written
                n = len(chunk)
                if chunk is not ZERO_CHUNK:     # all-zero 1 MiB: a hole
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


def _inside(holes: list | None, lo: int, hi: int) -> bool:
    """Whether bytes [lo, hi) lie within one of the sorted (start, end) ranges `holes`."""
    if not holes:
        return False
    import bisect

    i = bisect.bisect_right(holes, lo, key=lambda h: h[0]) - 1
    return i >= 0 and holes[i][1] >= hi


def write_images(snap, d: Path, threads: int, stop: threading.Event, done: list, sparse=None,
                 holes: dict | None = None) -> int:
    """Write every image of `snap` into directory `d` (which must be empty and private);
    returns the bytes written (holes excluded). Raises CorruptSnapshot on any bad byte, and
    OSError on a write failure; `stop` set by the caller ends the work early. sparse: a
    criu/sparse.py plan (zero-page runs left out, pagemaps to match). holes: pages image ->
    sorted (start, end) byte ranges not to write (the lazy restore's pages, which CRIU does
    not read: criu/lazypages.py); a job wholly inside one is left a hole."""
    loc = snap.reading_locations()
    names = sorted(snap.image_names(), key=lambda n: -int(snap.image(n).get("size", 0) or 0))
    big = [n for n in names if parallel_ok(snap, n)]
    small = [n for n in names if n not in big]
    written = 0
    lock = threading.Lock()
    all_readers: list = []
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gpusnap-images") as ex:
        futs = [ex.submit(_write_sequential, snap, d, n, stop, done, sparse) for n in small]
        readers = _Readers(snap.repo.path, loc) if big else None
        try:
            for name in big:
                im = snap.image(name)
                fd = _create(d, name)
                pending: set = set()
                try:
                    total = 0
                    drop = sparse.drop.get(name) if sparse is not None else None
                    size = sparse.size.get(name, im["size"]) if sparse is not None else im["size"]
                    skip = holes.get(name) if holes else None
                    for job in reader.plan(snap, name, loc, snap.image_no(name), JOB_BYTES, drop):
                        if stop.is_set():
                            break
                        total = job.pos + job.size
                        if _inside(skip, job.pos, total):
                            done[0] += job.size
                            continue
                        pending.add(ex.submit(_run_job, snap, name, fd, job, readers, all_readers, lock, done))
                        while len(pending) >= 2 * threads:     # bounded memory: jobs in flight
                            fin, pending = wait(pending, return_when=FIRST_COMPLETED)
                            for f in fin:
                                written += f.result()
                    fin, pending = wait(pending)
                    for f in fin:
                        written += f.result()
                    if total != size:
                        raise snap.corrupt(f"image {name} rebuilds to {total} bytes, not {size}")
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
