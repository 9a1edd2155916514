import os
import subprocess
import sys

import pytest

from gpusnap.errors import RepositoryLocked
from gpusnap.repo import Repository

HOLD = """
import sys, time
from gpusnap.repo import Repository
r = Repository.open(sys.argv[1])
with r.writer_lock():
    print("locked", flush=True)
    time.sleep(60)
"""


def _holder(path):
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_second_writer_is_refused_and_named(tmp_path):
    repo = Repository.open(tmp_path / "r", create=True)
    p = _holder(repo.path)
    try:
        with pytest.raises(RepositoryLocked, match=f"pid {p.pid}"):
            with repo.writer_lock():
                pass
    finally:
        p.kill()
        p.wait()


def test_dead_holder_lock_is_free(tmp_path):
    repo = Repository.open(tmp_path / "r", create=True)
    p = _holder(repo.path)
    p.kill()
    p.wait()
    with repo.writer_lock():
        with repo.writer_lock():          # re-entrant in one Repository object
            assert repo.holds_lock()
    assert not repo.holds_lock()


def test_two_objects_in_one_process_exclude(tmp_path):
    a = Repository.open(tmp_path / "r", create=True)
    b = Repository.open(tmp_path / "r")
    with a.writer_lock():
        with pytest.raises(RepositoryLocked, match=f"pid {os.getpid()}"):
            with b.writer_lock():
                pass
    with b.writer_lock():
        pass


def test_prune_waits_for_no_reader(tmp_path):
    """A restore reads under a shared lock; prune needs it exclusive and says who is in the way."""
    repo = Repository.open(tmp_path / "r", create=True)
    other = Repository.open(tmp_path / "r")
    with repo.readers_lock(), other.readers_lock():       # two restores at once are fine
        with pytest.raises(RepositoryLocked, match="a restore is reading"):
            with Repository.open(tmp_path / "r").readers_lock(exclusive=True):
                pass
    with repo.readers_lock(exclusive=True):                 # free again once they are done
        pass
