"""The staging arena (gpusnap/staging/arena.py): faulted in by a thread of its own,
every page resident once ready() returns, and gone (thread and mapping) once closed, also
when a dump that began one is refused."""

from __future__ import annotations

import ctypes
import subprocess
import threading
import time
from pathlib import Path

import pytest

from gpusnap.errors import GpusnapError
from gpusnap.ops import dump as dump_mod
from gpusnap import staging as st
from gpusnap.staging import arena as arena_mod
from gpusnap.staging.arena import SEG, Arena
from staging_helpers import _ingest, _stage


def _addr(arena: Arena) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(arena.map))


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def _resident(addr: int, length: int) -> int | None:
    """Bytes of [addr, addr+length) resident in memory (mincore(2): exact for this range,
    whatever VMA the kernel merged it into); None when any of it is not mapped (ENOMEM)."""
    pages = length // 4096
    vec = ctypes.create_string_buffer(pages)
    if _libc.mincore(addr, length, vec) != 0:
        assert ctypes.get_errno() == 12, ctypes.get_errno()
        return None
    return sum(b & 1 for b in vec.raw) * 4096


def _arena_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gpusnap-arena"]


def test_every_page_is_resident_once_ready():
    arena = Arena(6)
    addr = _addr(arena)
    arena.ready()
    assert not _arena_threads()
    assert _resident(addr, 6 * SEG) == 6 * SEG
    arena.close()
    assert arena.map.closed          # unmapped
    arena.close()       # idempotent


def test_close_while_faulting_in_waits_then_unmaps():
    arena = Arena(64)    # 256 MiB: closed at once, most likely while the thread still runs
    arena.close()
    assert not _arena_threads()
    assert arena.map.closed


@pytest.mark.parametrize("threads", [1, 2])
def test_close_stops_the_faulting_at_the_next_slot(monkeypatch, threads):
    """A refused dump closes its arena at once: each thread stops after the slot it is in
    instead of faulting in the rest (here the second slot is held until close)."""
    real = arena_mod.libc
    calls = []
    made: list[Arena] = []     # the thread may reach the second slot before Arena() returns

    class HeldLibc:
        memset = real.memset

        def madvise(self, addr, length, advice):
            calls.append(addr)
            if len(calls) == 2:            # the second slot: wait until close() has begun
                deadline = time.monotonic() + 10
                while not (made and made[0]._closing) and time.monotonic() < deadline:
                    time.sleep(0.001)
            return real.madvise(addr, length, advice)

    monkeypatch.setattr(arena_mod, "libc", HeldLibc())
    arena = Arena(64, threads=threads)
    made.append(arena)
    while len(calls) < 2:
        time.sleep(0.001)
    arena.close()
    assert not _arena_threads() and arena.map.closed
    if threads == 1:
        assert len(calls) == 2 and arena.populated == 2 * SEG
    else:   # the other thread went on until close began: a few slots, not the 64
        assert 2 <= len(calls) < 32 and arena.populated == len(calls) * SEG


def test_sized_stays_within_the_budget():
    assert Arena.sized(SEG - 1, 1 << 30) is None
    assert Arena.sized(1 << 30, 0) is None
    a = Arena.sized(3 * SEG + 5, 1 << 30)
    try:
        assert a.nslots == 3
    finally:
        a.close()


def test_staging_takes_the_arena_over_and_frees_it(tmp_path):
    arena = Arena(4)
    s = st.Staging(tmp_path, budget=2 * SEG, arena=arena)
    s.ready()
    assert s.arena_bytes == 2 * SEG      # the budget, not the arena, bounds what staging holds
    s.close()
    assert arena.map.closed


def test_a_refused_dump_leaves_no_arena_behind(tmp_path, monkeypatch):
    """The arena is begun before the preflight; a dump refused after that (here: the
    repository path is a file) must not leave its thread or its memory behind."""
    made: list[Arena] = []
    init = Arena.__init__

    def recording_init(self, nslots, **kw):
        init(self, nslots, **kw)
        made.append(self)

    monkeypatch.setattr(Arena, "__init__", recording_init)
    job = subprocess.Popen(["sleep", "60"])
    not_a_repo = tmp_path / "file"
    not_a_repo.write_text("x")
    try:
        # (the kept traceback keeps the dump's frames alive: only an explicit close frees the arena)
        with pytest.raises(GpusnapError) as refused:
            dump_mod.dump(dump_mod.DumpRequest(pid=job.pid, repo=not_a_repo, staging_budget=64 << 20))
        assert refused.traceback
        assert made, "the dump began no arena"
        assert not _arena_threads()
        assert all(a.map.closed for a in made)
        assert job.poll() is None        # and the job runs on
    finally:
        job.kill()
        job.wait()


@pytest.mark.parametrize("order, wanted", [
    ("9\n", False),            # a balloon's VM reporting 2 MiB blocks to its host (this one)
    ("10\n", False),           # larger blocks only: a free huge page is reported with its neighbour
    ("11\n", True),            # (scripts/host_memory.py holds it here for a benchmark run)
    ("4294967295\n", True),    # -1: no reporting device registered (bare metal)
    (None, True),              # no page reporting in this kernel
    ("junk", True),
])
def test_huge_pages_unless_free_huge_pages_go_back_to_a_host(tmp_path, monkeypatch, order, wanted):
    monkeypatch.delenv("GPUSNAP_ARENA_THP", raising=False)
    f = tmp_path / "page_reporting_order"
    if order is not None:
        f.write_text(order)
    pmd = tmp_path / "hpage_pmd_size"
    pmd.write_text("2097152\n")
    if order == "10\n":        # a 4 MiB huge page (order 10): reporting at 10 takes it back
        pmd.write_text("4194304\n")
        assert arena_mod.huge_pages_wanted(f, pmd) is False
        pmd.write_text("2097152\n")
        assert arena_mod.huge_pages_wanted(f, pmd) is True
        return
    assert arena_mod.huge_pages_wanted(f, pmd) is wanted


@pytest.mark.parametrize("env", ["0", "1"])
def test_the_setting_decides_over_the_machine(tmp_path, monkeypatch, env):
    monkeypatch.setenv("GPUSNAP_ARENA_THP", env)
    f = tmp_path / "page_reporting_order"
    f.write_text("9\n" if env == "1" else "4294967295\n")
    assert arena_mod.huge_pages_wanted(f) is (env == "1")


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of this process's mapping that holds addr (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split(None, 1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not arena_mod.HPAGE_PMD_SIZE.exists(), reason="kernel without transparent huge pages")
@pytest.mark.parametrize("env", ["0", "1"])
def test_the_arena_asks_for_huge_pages_and_still_holds_every_page(tmp_path, monkeypatch, env):
    """"hg" in smaps' VmFlags is MADV_HUGEPAGE on the mapping; whether the kernel then had a
    free 2 MiB block is its business (it falls back to 4 KiB pages, never to less memory)."""
    monkeypatch.setenv("GPUSNAP_ARENA_THP", env)
    arena = Arena(4)
    s = st.Staging(tmp_path, budget=4 * SEG, arena=arena)
    try:
        s.ready()
        addr = _addr(arena)
        assert arena.huge is (env == "1")
        assert ("hg" in _vm_flags(addr)) is (env == "1")
        assert _resident(addr, 4 * SEG) == 4 * SEG
        assert s.stats()["arena_huge_pages"] is (env == "1")
    finally:
        s.close()
    assert arena.map.closed


class _Room:
    """A room that shrinks by what the arena faulted in, as a memory cgroup's does."""

    def __init__(self, start: int | None):
        self.start, self.arena, self.looks = start, None, 0

    def __call__(self):
        self.looks += 1
        if self.start is None:
            return None, "available memory unknown"
        left = self.start - getattr(self.arena, "populated", 0)
        return left, f"the {left >> 20} MiB its memory cgroup /t leaves (limit 999 MiB)"


def _guarded(nslots: int, room: _Room, threads: int, capacity: int = 0) -> Arena:
    """An arena watched by `room` from before its threads start, faulted in."""
    class Watched(Arena):
        def __init__(self):
            room.arena = self
            super().__init__(nslots, threads=threads, room=room, capacity=capacity)

    a = Watched()
    a.ready()
    return a


@pytest.mark.parametrize("threads", [1, 2])
def test_the_guard_stops_the_faulting_in_short_of_memory_running_out(threads):
    """A budget above what is left (set by hand, or the machine filling up): the threads stop
    where the next slots would leave less than the reserve (a quarter of the room, at least
    RESERVE_MIN), and say why; a slot past the stop is never counted as usable."""
    room = _Room(200 << 20)
    a = _guarded(64, room, threads)            # 256 MiB asked, 200 MiB left
    try:
        reserve = max(arena_mod.RESERVE_MIN, min(arena_mod.RESERVE_MAX, (200 << 20) // 4))
        assert 0 < a.usable < 64
        assert a.usable * SEG <= (200 << 20) - reserve                   # the reserve is kept
        assert a.usable * SEG >= (200 << 20) - reserve - (threads + 2) * SEG   # and no more
        assert a.populated <= (a.usable + threads) * SEG                  # (one slot per thread in flight)
        assert a.short.startswith(f"faulted in {a.usable * SEG >> 20} of 256 MiB: the ")
        assert "memory cgroup /t leaves" in a.short and f"kept free: {reserve >> 20} MiB" in a.short
        assert room.looks >= a.usable          # under 1 GiB left it looks before every slot
    finally:
        a.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_with_room_enough_the_guard_looks_every_16_slots_and_never_stops(threads):
    room = _Room(64 << 30)
    a = _guarded(64, room, threads)
    try:
        assert a.usable == 64 and a.short is None and a.populated == 64 * SEG
        assert room.looks == 64 // arena_mod.LOOK_EVERY
    finally:
        a.close()


def test_where_the_room_is_unknown_or_not_looked_at_the_whole_arena_is_faulted_in():
    room = _Room(None)
    a = _guarded(8, room, 2)
    try:
        assert a.usable == 8 and a.short is None and a.populated == 8 * SEG and room.looks == 1
    finally:
        a.close()
    a = Arena(8)
    a.ready()
    try:
        assert a.usable == 8 and a.short is None and a.populated == 8 * SEG
    finally:
        a.close()


def test_a_tiny_room_faults_nothing_in_and_the_staging_spills_everything(tmp_path):
    room = _Room(90 << 20)       # less than the reserve's floor
    a = _guarded(16, room, 2)
    s = st.Staging(tmp_path, budget=16 * SEG, arena=a)
    try:
        s.ready()
        assert a.usable == 0 and s.arena_bytes == 0 and s.stats()["arena_short"] == a.short
    finally:
        s.close()


def test_the_staging_uses_only_the_slots_faulted_in_and_spills_the_rest(tmp_path):
    """What the guard left out is never staged into (it would fault in memory that is not
    there, inside the freeze): the staging holds at most the slots faulted in, spills the
    rest, and gives every byte back in order."""
    import random

    room = _Room(160 << 20)
    a = _guarded(64, room, 2)                  # 256 MiB asked, 160 MiB left
    s = st.Staging(tmp_path, budget=64 * SEG, arena=a)
    try:
        s.ready()
        usable = a.usable
        assert 0 < usable < 64 and s.arena_bytes == usable * SEG
        assert s.stats()["arena_short"] == a.short
        data = random.Random(3).randbytes((usable + 3) * SEG + 777)
        image = _stage(s, data, pages=True)
        assert s.peak_memory <= usable * SEG and s.spilled >= 3 * SEG + 777
        assert _ingest(s, image) == data
    finally:
        s.close()



def test_grow_to_faults_in_more_of_the_mapped_capacity_and_no_more():
    """A GPU job's device memory, known after the preflight: the arena grows in place, up to
    the slots mapped; threads that had finished are started again."""
    a = Arena(2, capacity=8)
    try:
        a.ready()
        assert a.nslots == 8 and a.usable == 2 and a.populated == 2 * SEG
        a.grow_to(5)
        a.ready()
        assert a.usable == 5 and a.populated == 5 * SEG
        addr = _addr(a)
        assert _resident(addr, 5 * SEG) == 5 * SEG
        a.grow_to(100)
        a.grow_to(3)                 # never shrinks
        a.ready()
        assert a.usable == 8 and a.populated == 8 * SEG
    finally:
        a.close()
    a.grow_to(10)                    # closed: nothing starts
    assert not _arena_threads()


def test_an_arena_the_guard_stopped_does_not_grow():
    room = _Room(150 << 20)
    a = _guarded(4, room, 2, capacity=64)      # 16 MiB: within the room
    try:
        assert a.usable == 4 and a.short is None and a.nslots == 64
        room.start = 100 << 20                   # memory taken meanwhile
        a.grow_to(40)
        a.ready()
        assert a.usable == 4 and a.short.startswith("faulted in 16 of 160 MiB")
        a.grow_to(64)
        a.ready()
        assert a.usable == 4
    finally:
        a.close()


@pytest.fixture()
def cuda_job():
    """A real process that looks like a CUDA job (the fake driver's libcuda.so.1 mapped) with
    64 MiB of anonymous memory of its own."""
    from plugin_helpers import libcuda_process

    with libcuda_process(anon_mb=64) as p:
        yield p


def test_the_gpu_memory_raises_the_default_budget_and_grows_the_arena(cuda_job):
    """What a CUDA checkpoint will bring into host memory (the preflight's GPU facts) counts
    as the job's: the default budget grows by it and so does the arena, in place, faulted in
    before CRIU runs; made again after a wait, the arena has it from the start."""
    from gpusnap.ops import dump_staging

    early = dump_staging.EarlyArena(dump_mod.DumpRequest(pid=cuda_job.pid, repo=Path("/nonexistent")))
    try:
        host = early.host
        assert host >= 64 << 20 and early.budget == host + st.JOB_MARGIN, early.choice
        assert early.arena.nslots > early.arena.usable      # mapped with room to grow
        early.add_gpu({"processes": [{"pid": cuda_job.pid, "memory_bytes": 256 << 20},
                                     {"pid": 1, "memory_bytes": None}]})
        assert early.gpu == 256 << 20
        assert early.budget == host + (256 << 20) + st.JOB_MARGIN
        assert "256 MiB of it GPU memory" in early.choice
        early.arena.ready()
        assert early.arena.usable == early.budget // SEG and early.arena.populated == early.arena.usable * SEG
        early.add_gpu(None)                   # (a later look without GPU facts changes nothing)
        assert early.gpu == 256 << 20
        early.release()
        early.again()
        early.arena.ready()
        assert early.arena.usable == early.budget // SEG
    finally:
        early.release(final=True)
    assert not _arena_threads()


def test_the_gpu_memory_grows_the_arena_within_a_budget_given(cuda_job):
    from gpusnap.ops import dump_staging

    early = dump_staging.EarlyArena(dump_mod.DumpRequest(pid=cuda_job.pid, repo=Path("/nonexistent"),
                                                         staging_budget=128 << 20))
    try:
        assert early.arena.usable == (early.host + st.JOB_MARGIN) // SEG
        early.add_gpu({"processes": [{"pid": cuda_job.pid, "memory_bytes": 1 << 30}]})
        assert early.budget == 128 << 20 and early.choice == "--staging-budget"
        early.arena.ready()
        assert early.arena.usable == 32 and early.arena.populated == 32 * SEG
    finally:
        early.release(final=True)


def test_a_job_that_touches_no_gpu_maps_no_more_than_its_arena(sample_job):
    """Address space counts where the kernel commits it strictly: only a tree that touches
    NVIDIA gets its arena mapped up to the largest budget."""
    from gpusnap.ops import dump_staging

    job = sample_job(mb=64, steps=100000)
    job.wait_steps(2)
    early = dump_staging.EarlyArena(dump_mod.DumpRequest(pid=job.pid, repo=Path("/nonexistent")))
    try:
        assert early.arena.nslots == early.arena.usable == (early.host + st.JOB_MARGIN) // SEG
    finally:
        early.release(final=True)


def test_growing_for_a_gpu_job_keeps_its_coming_growth_free():
    """The device memory the checkpoint will bring into the job's host memory stays free too:
    with 1.5 GiB left, growing by 1 GiB for a job with 1 GiB of GPU memory stops short."""
    room = _Room(1536 << 20)
    a = _guarded(4, room, 2, capacity=300)
    try:
        assert a.usable == 4 and a.short is None
        a.grow_to(4 + 256, keep=1 << 30)
        a.ready()
        assert a.short is not None and "kept free: 1280 MiB" in a.short, a.short   # (256 + 1024)
        assert (1536 << 20) - a.usable * SEG >= 1280 << 20
    finally:
        a.close()


def test_a_dump_on_a_terminal_says_when_memory_ran_short():
    """The summary a dump prints on a terminal names the guard's stop and what spilled (the
    freeze then waited for the disk); without a stop it says nothing of it."""
    import io

    from rich.console import Console

    from gpusnap.render import snapshots as render_snapshots
    from gpusnap.render.output import Output

    def shown(staging: dict) -> str:
        err = Console(file=io.StringIO(), force_terminal=True, width=300)
        out = Console(file=io.StringIO())
        r = dump_mod.DumpResult(snapshot="/r/snapshots/x", id="x", name="job", pid=1, pages_total=10,
                                pages_zero=0, pages_dedup=0, bytes_raw=40960, bytes_stored=40960, seconds=1.0,
                                job_running=True, staging=staging)
        render_snapshots.dump(r, Output(out=out, err=err))
        return err.file.getvalue()

    short = "faulted in 24 of 176 MiB: the 100 MiB its memory cgroup /a[1] leaves (limit 328 MiB) (kept free: 96 MiB)"
    text = shown({"arena_short": short, "spilled_bytes": 149 << 20})
    assert "memory ran short: the staging arena " + short in text
    assert "149.0 MiB spilled to disk while the job was frozen" in text, text
    assert "memory ran short" not in shown({"arena_short": None, "spilled_bytes": 0})
