"""Staging on its own (gpusnap/staging/): real pipes, a real spill file on the test's
filesystem; what goes in comes out, in order, from memory or from the file, within the
budget, and nothing is left behind."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from gpusnap import staging as st
from staging_helpers import _ingest, _pattern, _stage


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
@pytest.mark.parametrize("direct", ["1", "0"])
def test_beyond_the_budget_bytes_spill_to_an_unnamed_file(tmp_path, monkeypatch, named, direct):
    """direct "1": the spill is written with O_DIRECT from bounce buffers (ext4, XFS: the
    test's filesystem must take O_DIRECT), "0": spliced through the page cache."""
    monkeypatch.setenv("GPUSNAP_STAGING_NAMED", named)      # "1": created 0600 by name, then unlinked
    monkeypatch.setenv("GPUSNAP_STAGING_DIRECT", direct)
    data = _pattern(6 * st.SEG + 4096 * 3 + 17)
    s = st.Staging(tmp_path, budget=2 * st.SEG, prealloc=2 * st.SEG)
    try:
        image = _stage(s, data, pages=True)
        assert s.peak_memory <= s.budget
        assert s.spilled >= len(data) - 2 * st.SEG and s.staged == len(data)
        assert s.stats()["spill_mode"] == ("direct" if direct == "1" else "splice")
        # "drained" means written: every extent's write has ended once stage_pipe returns
        assert not image.writing
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


def test_a_held_slot_is_freed_only_by_its_last_claim(tmp_path):
    """Page groups point into staging slots (sinks.PagesSink, with a Hold): the slot goes back
    only when the ingest and every claim have let go; until then the drain spills rather
    than overwrite it. Bytes and spill extents are copied out on read: no Hold."""
    data = _pattern(st.SEG)
    s = st.Staging(tmp_path, budget=st.SEG, prealloc=st.SEG)
    try:
        image = _stage(s, data, pages=True)
        seg = image.take()
        hold = s.hold(seg)
        assert hold is not None and s.memory_in_use() == st.SEG
        hold.retain(2)
        s.release(seg)                          # the ingest's own claim
        assert s.memory_in_use() == st.SEG and not s._free
        # the only slot is still pointed into: new pages go to the spill file, not over it
        second = _stage(s, _pattern(st.SEG, seed=8), pages=True)
        assert s.spilled == st.SEG
        view = s.read(seg)
        assert bytes(view) == data
        view.release()
        hold.release(1)
        assert s.memory_in_use() == st.SEG
        hold.release(1)                         # the last claim frees it
        assert s.memory_in_use() == 0 and s._free == [seg.slot if seg.slot >= 0 else 0]
        with pytest.raises(RuntimeError):
            hold.retain(1)                      # a freed slot cannot be claimed again
        spilled = second.take()
        assert s.hold(spilled) is None
        s.release(spilled)
    finally:
        s.close()


def test_a_dump_pointing_into_reused_slots_stores_exactly_its_pages(tmp_path, monkeypatch):
    """The page pipeline with groups pointing into staging slots (no copy), two slots for
    twelve slots' worth of pages. The pack writer is held back (its lock taken) while the
    whole image is staged, so the first groups sit in the compressors with views of both
    slots when the drain looks for more: it must spill rather than reuse them. Then the
    rest flows, slots are released and refilled. The snapshot reads back exactly (every page
    checked against its id), and every claim is let go by the time it is committed."""
    from gpusnap.repo import Repository
    from gpusnap.repo.pipeline import sinks

    monkeypatch.setattr(sinks, "COMPRESS_WORKERS", 2)
    rnd = __import__("random").Random(3)
    # random pages (stored raw: the pack writer reads them straight from the slot) with
    # compressible ones between them, and repeats (dedup) and zero pages
    pages = []
    for i in range(12 * st.SEG // 4096):
        k = rnd.random()
        pages.append(bytes(4096) if k < 0.05 else ((b"tensor %d " % (i % 50)) * 500)[:4096] if k < 0.3
                     else pages[rnd.randrange(len(pages))] if k < 0.35 and pages else rnd.randbytes(4096))
    data = b"".join(pages)
    assert len(data) == 12 * st.SEG
    repo = Repository.open(tmp_path / "repo", create=True)
    s = st.Staging(tmp_path, budget=2 * st.SEG, prealloc=2 * st.SEG)
    errors = []
    with repo.writer_lock():
        wr = repo.new_snapshot("zero-copy", compress="auto")
        sink = wr.image_sink("pages-1.img")

        staged = []
        ready = threading.Event()

        def ingest():
            try:
                ready.wait()
                image = staged[0]
                while (seg := image.take()) is not None:
                    view = s.read(seg)
                    sink.write(view, s.hold(seg))
                    if isinstance(view, memoryview):
                        view.release()
                    s.release(seg)
                sink.close()
            except BaseException as e:     # noqa: BLE001 - reported below
                errors.append(e)

        t = threading.Thread(target=ingest, daemon=True)
        try:
            with wr.packer.lock:                 # the pack writer takes nothing for now
                t.start()
                _stage(s, data, pages=True, started=lambda im: (staged.append(im), ready.set()))
                assert s.spilled == len(data) - 2 * st.SEG     # the held slots were not reused
            t.join()
            assert not errors, errors
            snap = wr.commit()
        finally:
            s.close()
    assert s.staged == len(data) and s.memory_in_use() == 0     # every claim let go
    assert b"".join(snap.read_image("pages-1.img")) == data


def test_direct_spill_keeps_stream_order_with_writes_in_flight(tmp_path, monkeypatch):
    """Many extents through the direct writer (two writes in flight, four bounce buffers,
    completing in any order) while an ingest takes them as they come: the bytes come out
    in the pipe's order, and a read waits for its extent's write."""
    monkeypatch.setenv("GPUSNAP_STAGING_DIRECT", "1")
    data = _pattern(24 * st.SEG + 8192, seed=11)
    s = st.Staging(tmp_path, budget=0)
    out: list[bytes] = []
    threads: list[threading.Thread] = []

    def started(image):
        t = threading.Thread(target=lambda: out.append(_ingest(s, image)))
        t.start()
        threads.append(t)
    try:
        _stage(s, data, pages=True, chunk=1 << 20, started=started)
        for t in threads:
            t.join()
        assert s.spilled == len(data) and s.stats()["spill_mode"] == "direct"
        assert out == [data]
    finally:
        s.close()
    assert os.listdir(tmp_path) == []


def test_default_budget_choice(monkeypatch):
    """Half the available memory (no fixed ceiling), never more than the job (+16 MiB),
    and the reason said; GPUSNAP_STAGING_BUDGET wins."""
    monkeypatch.delenv("GPUSNAP_STAGING_BUDGET", raising=False)
    budget, why = st.choose_budget()
    avail = st._mem_available()
    assert abs(budget - avail // 2) < 256 << 20 and why == f"half the {budget * 2 >> 20} MiB available"
    assert st.choose_budget(None, (200 << 20, "the 200 MiB a cgroup leaves")) == (100 << 20, "half the 200 MiB a cgroup leaves")
    small, why = st.choose_budget(job_bytes=8 << 20)
    assert small == (8 << 20) + st.JOB_MARGIN and why.startswith("the job's 8 MiB")
    assert abs(st.choose_budget(job_bytes=1 << 40)[0] - budget) < 64 << 20   # (MemAvailable moves)
    monkeypatch.setenv("GPUSNAP_STAGING_BUDGET", "96M")
    assert st.choose_budget(job_bytes=1 << 20) == (96 << 20, "GPUSNAP_STAGING_BUDGET")
    assert st.default_budget() == 96 << 20


def test_a_cancelled_staging_stops_waiting_for_direct_writes(tmp_path):
    """An unwinding dump cancels the staging: neither a read waiting for an extent's write
    nor a drain waiting for a free bounce buffer stays blocked (the writer may be closed)."""
    from gpusnap.staging import spill

    s = st.Staging(tmp_path, budget=0)
    fd = os.open(tmp_path, os.O_RDWR | os.O_TMPFILE, 0o600)
    dfd = spill.open_direct(fd)
    w = spill.DirectWriter(dfd, nbuf=1, nthreads=1)
    try:
        seg = st.Segment(4096, offset=0)
        seg.ready = threading.Event()            # a write that never ends
        held = w.take()                          # the only buffer, not given back
        s.cancel()
        with pytest.raises(st.StagingCancelled):
            s.read(seg)
        with pytest.raises(st.StagingCancelled):
            w.take(lambda: s.cancelled)
        held[1].release()
        w.give_back(held[0])
    finally:
        w.close()
        os.close(dfd)
        os.close(fd)
        s.close()
