"""The sequential reader's read-ahead (repo/reader.py _read_pages): the pack ranges of the
next jobs asked for with POSIX_FADV_WILLNEED, so that a single reading thread (the restore's
stream feed on 2 cores, export, small images) finds them in the page cache instead of
waiting on each pread: from a cold cache the disk then works while the thread checks the
pages before, without a second thread taking CPU from CRIU (docs/benchmark.md, 2026-12-06
second). Only a hint: whatever fails here, the decode reads and reports it itself.
"""

from __future__ import annotations

import collections
import os

from gpusnap.repo.format import BLOB_HEADER

JOBS = 4                   # jobs (<= 1 MiB each) asked for ahead of the one being decoded
MERGE_GAP = 64 << 10       # blobs of one pack at most this far apart are asked for as one range


def ahead(reader, jobs, max_fds: int):
    """The jobs of the iterator `jobs` in order, each one's pack ranges asked for (advise)
    JOBS jobs before it is yielded."""
    window: collections.deque = collections.deque()
    for job in jobs:
        advise(reader, job, max_fds)
        window.append(job)
        if len(window) > JOBS:
            yield window.popleft()
    while window:
        yield window.popleft()


def advise(reader, job, max_fds: int) -> None:
    """Ask for the packs' bytes of job's pages runs (reader: a reader.RunReader, whose pack
    fds are used and, up to max_fds open, opened). Blobs of one pack that follow each other
    (up to MERGE_GAP apart) are asked for as one range."""
    rng = None
    for p in job.pieces:
        if p[0] != "r":
            continue
        r = p[1]                   # pack_no, offset, kind, codec, n_pages, raw_len, stored_len
        lo, hi = r[1], r[1] + BLOB_HEADER.size + r[6]
        if rng is not None and rng[0] == r[0] and rng[1] <= lo <= rng[2] + MERGE_GAP:
            rng[2] = max(rng[2], hi)
            continue
        if rng is not None:
            _willneed(reader, max_fds, *rng)
        rng = [r[0], lo, hi]
    if rng is not None:
        _willneed(reader, max_fds, *rng)


def _willneed(reader, max_fds: int, pack_no: int, lo: int, hi: int) -> None:
    try:
        fd = reader.fds.get(pack_no)
        if fd is None:
            if len(reader.fds) >= max_fds:
                return
            fd = reader.open_pack(pack_no)
        os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
