"""Staging on its own (gpusnap/repo/pipeline/staging.py): real pipes, a real spill file on the test's
filesystem; what goes in comes out, in order, from memory or from the file, within the
budget, and nothing is left behind."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from gpusnap.repo.pipeline import staging as st


def _pattern(n: int, seed: int = 7) -> bytes:
    import random

    return random.Random(seed).randbytes(n)


def _stage(staging: st.Staging, data: bytes, pages: bool, chunk: int = 1 << 16) -> st.StagedImage:
    """A writer thread feeds `data` through a pipe, as CRIU does, while the drain stages it."""
    r, w = os.pipe()

    def feed():
        view = memoryview(data)
        while view:
            n = os.write(w, view[:chunk])
            view = view[n:]
        os.close(w)

    t = threading.Thread(target=feed)
    t.start()
    image = st.StagedImage(staging, "pages-1.img" if pages else "core-1.img")
    try:
        staging.stage_pipe(r, image, pages)
    finally:
        os.close(r)
        t.join()
    return image


def _ingest(staging: st.Staging, image: st.StagedImage) -> bytes:
    out = []
    while (seg := image.take()) is not None:
        data = staging.read(seg)
        out.append(bytes(data))
        if isinstance(data, memoryview):
            data.release()
        staging.release(seg)
    return b"".join(out)


@pytest.mark.parametrize("pages", [True, False])
def test_within_the_budget_everything_stays_in_memory(tmp_path, pages):
    data = _pattern(9 * st.SEG + 12345)
    s = st.Staging(tmp_path, budget=64 << 20, prealloc=64 << 20)
    try:
        image = _stage(s, data, pages)
        assert s.spilled == 0 and s.staged == len(data)
        assert 0 < s.peak_memory <= s.budget
        assert _ingest(s, image) == data
        assert s.memory_in_use() == 0            # every slot and buffer given back
    finally:
        s.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("named", ["0", "1"])
def test_beyond_the_budget_bytes_spill_to_an_unnamed_file(tmp_path, monkeypatch, named):
    monkeypatch.setenv("GPUSNAP_STAGING_NAMED", named)      # "1": created 0600 by name, then unlinked
    data = _pattern(6 * st.SEG + 4096 * 3 + 17)
    s = st.Staging(tmp_path, budget=2 * st.SEG, prealloc=2 * st.SEG)
    try:
        image = _stage(s, data, pages=True)
        assert s.peak_memory <= s.budget
        assert s.spilled >= len(data) - 2 * st.SEG and s.staged == len(data)
        fd = s._spill_fd
        link = os.readlink(f"/proc/self/fd/{fd}")
        assert link.startswith(str(tmp_path)) and link.endswith("(deleted)"), link
        assert os.fstat(fd).st_mode & 0o777 == 0o600
        assert os.listdir(tmp_path) == []        # never visible under a name while in use
        blocks_full = os.fstat(fd).st_blocks
        assert _ingest(s, image) == data
        # consumed extents are punched out: disk space and page cache come back at once
        assert os.fstat(fd).st_blocks < blocks_full // 4
    finally:
        s.close()
    assert os.listdir(tmp_path) == []


def test_sweep_removes_spill_files_of_dead_dumps_only(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = tmp_path / f"{st.PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{st.PREFIX}{os.getppid()}-def"   # a live process's (not ours)
    other = tmp_path / "pack-1234.tmp"
    for p in (leftover, live, other):
        p.write_bytes(b"x")
    assert st.sweep(tmp_path) == [leftover.name]
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, other.name])


def test_cancel_wakes_an_ingest_waiting_for_data(tmp_path):
    s = st.Staging(tmp_path, budget=0)
    image = st.StagedImage(s, "pages-1.img")
    raised = []

    def ingest():
        try:
            image.take()
        except st.StagingCancelled:
            raised.append(True)

    t = threading.Thread(target=ingest)
    t.start()
    s.cancel()
    t.join(10)
    assert raised == [True] and not t.is_alive()
    s.close()


def test_sizes_parse():
    assert st.parse_size("512M") == 512 << 20
    assert st.parse_size("1.5G") == 3 << 29
    assert st.parse_size("64KiB") == 64 << 10
    assert st.parse_size("4096") == 4096
    with pytest.raises(ValueError):
        st.parse_size("lots")


def test_sealed_staging_gives_released_slots_back(tmp_path):
    """After the gate (seal), a consumed slot's memory is returned while the job runs on:
    the arena's own resident pages drop to none."""
    import ctypes

    def arena_rss_kib(arena) -> int:
        """Resident KiB of exactly the arena's pages (mincore(2))."""
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        pages = len(arena) // 4096
        vec = ctypes.create_string_buffer(pages)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(arena))
        assert libc.mincore(addr, len(arena), vec) == 0, ctypes.get_errno()
        return sum(b & 1 for b in vec.raw) * 4

    data = _pattern(16 * st.SEG)
    s = st.Staging(tmp_path, budget=64 << 20, prealloc=64 << 20)
    try:
        image = _stage(s, data, pages=True)
        assert arena_rss_kib(s._arena) >= 60 << 10          # faulted in, and filled
        s.seal()
        assert _ingest(s, image) == data
        assert arena_rss_kib(s._arena) < 1 << 10             # every consumed slot given back
    finally:
        s.close()


def test_closed_under_an_ingest_thread_it_cancels_instead_of_failing(tmp_path):
    """A dump being unwound closes its staging while an ingest thread may still read and
    release slots (seen as a traceback on stderr after a SIGHUP): reading then says
    cancelled, releasing does nothing, neither raises anything else."""
    s = st.Staging(tmp_path, budget=16 << 20, prealloc=16 << 20)
    image = _stage(s, _pattern(3 * st.SEG), pages=True)
    s.seal()
    first, second = image.take(), image.take()
    view = s.read(first)
    assert bytes(view[:16]) == _pattern(3 * st.SEG)[:16]
    view.release()
    s.close()
    s.release(first)                       # the arena is gone: nothing to give back, no error
    with pytest.raises(st.StagingCancelled):
        s.read(second)
    s.release(second)
