"""The staging arena (gpusnap/staging/arena.py): faulted in by a thread of its own,
every page resident once ready() returns, and gone (thread and mapping) once closed, also
when a dump that began one is refused."""

from __future__ import annotations

import ctypes
import subprocess
import threading
import time

import pytest

from gpusnap.errors import GpusnapError
from gpusnap.ops import dump as dump_mod
from gpusnap import staging as st
from gpusnap.staging import arena as arena_mod
from gpusnap.staging.arena import SEG, Arena


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

    def recording_init(self, nslots):
        init(self, nslots)
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
