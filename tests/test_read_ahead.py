"""The sequential read path (reader.read_image: restore's stream feed on few cores, export,
materializing small images) asks the kernel to read the packs' bytes of the next jobs ahead
(POSIX_FADV_WILLNEED), so a single reading thread does not wait on each pread from a cold
page cache: the bytes read are the same, every blob of the image is asked for ahead of its
job, contiguous blobs as one range, and a refused hint changes nothing."""

from __future__ import annotations

import os
import random

import pytest

from gpusnap.repo import Repository, readahead, reader
from gpusnap.repo.format import BLOB_HEADER, READ_CHUNK
from repo_helpers import PAGE, dump, read_all, text_page


def _image(n_pages: int) -> bytes:
    rnd = random.Random(3)
    out = []
    for i in range(n_pages):
        k = i % 5
        out.append(bytes(PAGE) if k == 0 else text_page(rnd) if k == 1 else rnd.randbytes(PAGE))
    return b"".join(out)


@pytest.fixture
def snap(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    data = _image(3 * READ_CHUNK // PAGE + 77)        # several jobs, a partial last one
    s, _ = dump(repo, {"pages-1.img": data}, compress="auto")
    return s, data


@pytest.mark.parametrize("ahead", [0, 1, 4])
def test_same_bytes_whatever_the_read_ahead(snap, monkeypatch, ahead):
    s, data = snap
    monkeypatch.setattr(readahead, "JOBS", ahead)
    assert read_all(s, "pages-1.img") == data


def test_every_blob_asked_for_ahead(snap, monkeypatch):
    s, data = snap
    calls = []
    real = os.posix_fadvise

    def spy(fd, off, n, advice):
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), off, n, advice))
        return real(fd, off, n, advice)

    monkeypatch.setattr(readahead.os, "posix_fadvise", spy)
    monkeypatch.setattr(readahead, "JOBS", 2)
    assert read_all(s, "pages-1.img") == data
    assert calls and all(a == os.POSIX_FADV_WILLNEED for *_, a in calls)
    # every pages blob the image's runs point to lies within a range asked for
    loc = s.reading_locations()
    jobs = list(reader.plan(s, "pages-1.img", loc, s.image_no("pages-1.img"), READ_CHUNK, None))
    blobs = {(p[1][0], p[1][1], BLOB_HEADER.size + p[1][6]) for j in jobs for p in j.pieces if p[0] == "r"}
    rd = reader.RunReader(s.repo.path, loc)
    try:
        names = {pn: os.path.realpath(reader.pack_path(s.repo.path, rd.pack_name(pn))) for pn, _, _ in blobs}
    finally:
        rd.close()
    for pn, off, n in blobs:
        assert any(path == names[pn] and o <= off and off + n <= o + m for path, o, m, _ in calls), (pn, off)
    assert len(calls) < len(blobs)                    # contiguous blobs: one range


def test_a_refused_hint_changes_nothing(snap, monkeypatch):
    s, data = snap

    def refuse(*a):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(readahead.os, "posix_fadvise", refuse)
    assert read_all(s, "pages-1.img") == data
