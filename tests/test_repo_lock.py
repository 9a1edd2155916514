import os
import subprocess
import sys

import pytest

from gpusnap.errors import RepositoryError, RepositoryLocked
from gpusnap.repo import Repository

HOLD = """
import sys, time
from gpusnap.repo import Repository
r = Repository.open(sys.argv[1])
with r.writer_lock(exclusive=sys.argv[2] == "exclusive"):
    print("locked", flush=True)
    time.sleep(60)
"""


def _holder(path, mode="exclusive"):
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(path), mode], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_a_prune_holding_it_refuses_a_writer_and_is_named(tmp_path):
    """The exclusive lock (prune, repair, forget --prune) keeps writers out and says who holds it."""
    repo = Repository.open(tmp_path / "r", create=True)
    p = _holder(repo.path)
    try:
        with pytest.raises(RepositoryLocked, match=f"pid {p.pid}"):
            with repo.writer_lock():
                pass
    finally:
        p.kill()
        p.wait()


def test_writers_share_it_and_keep_a_prune_out(tmp_path):
    """Writers (dump, import, copy) take it shared: another writer goes on at once, a prune
    is refused (here without waiting) naming the writer."""
    repo = Repository.open(tmp_path / "r", create=True)
    p = _holder(repo.path, "shared")
    try:
        with repo.writer_lock():
            assert repo.holds_lock() and not repo.holds_exclusive()
        with pytest.raises(RepositoryLocked, match=f"pid {p.pid}"):
            with repo.writer_lock(exclusive=True):
                pass
    finally:
        p.kill()
        p.wait()


def test_dead_holder_lock_is_free(tmp_path):
    repo = Repository.open(tmp_path / "r", create=True)
    p = _holder(repo.path)
    p.kill()
    p.wait()
    with repo.writer_lock(exclusive=True):
        with repo.writer_lock():          # re-entrant in one Repository object
            assert repo.holds_exclusive()
    assert not repo.holds_lock()
    assert [n for n in os.listdir(repo.path / "locks") if n.startswith("lock-")] == []


def test_two_objects_in_one_process_exclude(tmp_path):
    a = Repository.open(tmp_path / "r", create=True)
    b = Repository.open(tmp_path / "r")
    with a.writer_lock(exclusive=True):
        with pytest.raises(RepositoryLocked, match=f"pid {os.getpid()}"):
            with b.writer_lock():
                pass
    with a.writer_lock():
        with b.writer_lock():                       # two writers at once
            pass
        with pytest.raises(RepositoryLocked, match=f"pid {os.getpid()}"):
            with b.writer_lock(exclusive=True):
                pass
    with b.writer_lock(exclusive=True):
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
    import fcntl                # a reader of gpusnap before revision 1.6: its flock alone
    fd = os.open(repo.path / "locks" / "readers", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        with pytest.raises(RepositoryLocked, match="a restore is reading"):
            with Repository.open(tmp_path / "r").readers_lock(exclusive=True):
                pass
    finally:
        os.close(fd)


@pytest.mark.parametrize("change", ["mode 0666", "owned by nobody"])
def test_lock_file_another_user_could_swap_is_refused(tmp_path, change):
    """locks/writer writable by others or owned by another user: root would take (and truncate)
    a file someone else controls; the lock is refused and says which file."""
    repo = Repository.open(tmp_path / "r", create=True)
    with repo.writer_lock():
        pass
    lock = repo.path / "locks" / "writer"
    if change == "mode 0666":
        os.chmod(lock, 0o666)
    else:
        os.chown(lock, 65534, 65534)
    with pytest.raises(RepositoryError, match="locks/writer is (writable by|owned by uid 65534)"):
        with Repository.open(repo.path).writer_lock():
            pass


def test_hard_linked_lock_file_is_refused_and_its_other_name_untouched(tmp_path):
    """locks/writer a hard link to another file (the writer lock truncates its file)."""
    repo = Repository.open(tmp_path / "r", create=True)
    victim = tmp_path / "precious"
    victim.write_text("keep me")
    os.chmod(victim, 0o600)
    (repo.path / "locks").mkdir(exist_ok=True)
    (repo.path / "locks" / "writer").unlink(missing_ok=True)
    os.link(victim, repo.path / "locks" / "writer")
    with pytest.raises(RepositoryError, match="locks/writer has 2 hard links"):
        with Repository.open(repo.path).writer_lock():
            pass
    assert victim.read_text() == "keep me"


def test_flock_alone_keeps_a_prune_out_of_a_local_writer(tmp_path):
    """The fast path: a writer on this machine whose lock file is gone (removed by hand, or
    by a machine that took it for stale) still keeps a prune out through its flock."""
    repo = Repository.open(tmp_path / "r", create=True)
    p = _holder(repo.path, "shared")
    try:
        for n in os.listdir(repo.path / "locks"):
            if n.startswith("lock-"):
                os.unlink(repo.path / "locks" / n)
        with pytest.raises(RepositoryLocked):
            with repo.writer_lock(exclusive=True):
                pass
    finally:
        p.kill()
        p.wait()
