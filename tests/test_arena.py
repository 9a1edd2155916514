"""The staging arena (gpusnap/repo/pipeline/arena.py): faulted in by a thread of its own,
every page resident once ready() returns, and gone (thread and mapping) once closed, also
when a dump that began one is refused."""

from __future__ import annotations

import ctypes
import subprocess
import threading

import pytest

from gpusnap.errors import GpusnapError
from gpusnap.ops import dump as dump_mod
from gpusnap.repo.pipeline import staging as st
from gpusnap.repo.pipeline.arena import SEG, Arena


def _addr(arena: Arena) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(arena.map))


def _rss_kib(addr: int) -> int | None:
    """Rss of the mapping starting at addr, from /proc/self/smaps; None if not mapped."""
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{addr:x}":
            for follow in lines[i + 1:]:
                if follow.startswith("Rss:"):
                    return int(follow.split()[1])
    return None


def _arena_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gpusnap-arena"]


def test_every_page_is_resident_once_ready():
    arena = Arena(6)
    addr = _addr(arena)
    arena.ready()
    assert not _arena_threads()
    assert _rss_kib(addr) == 6 * SEG // 1024
    arena.close()
    assert _rss_kib(addr) is None
    arena.close()       # idempotent


def test_close_while_faulting_in_waits_then_unmaps():
    arena = Arena(64)    # 256 MiB: closed at once, most likely while the thread still runs
    addr = _addr(arena)
    arena.close()
    assert not _arena_threads()
    assert _rss_kib(addr) is None


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
    addr = _addr(arena)
    s = st.Staging(tmp_path, budget=2 * SEG, arena=arena)
    s.ready()
    assert s.arena_bytes == 2 * SEG      # the budget, not the arena, bounds what staging holds
    s.close()
    assert _rss_kib(addr) is None


def test_a_refused_dump_leaves_no_arena_behind(tmp_path, monkeypatch):
    """The arena is begun before the preflight; a dump refused after that (here: the
    repository path is a file) must not leave its thread or its memory behind."""
    made: list[int] = []
    init = Arena.__init__

    def recording_init(self, nslots):
        init(self, nslots)
        made.append(_addr(self))

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
        assert all(_rss_kib(addr) is None for addr in made)
        assert job.poll() is None        # and the job runs on
    finally:
        job.kill()
        job.wait()
