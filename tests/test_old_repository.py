"""A repository made by gpusnap before format revision 1.6 (tests/data/repo-rev1.5: three
snapshots dumped through the library by branch `copy`'s code, locks/writer and no lock files)
keeps working with no migration: read, written, verified and pruned as it is; and its flock
files are the same locks, so an older gpusnap holding locks/writer keeps a new writer out."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil

import pytest

from conftest import ROOT
from gpusnap.errors import RepositoryLocked
from gpusnap.repo import Repository
from gpusnap.repo.maint import prune, verify
from repo_helpers import PAGE, dump, read_all

DATA = ROOT / "tests" / "data" / "repo-rev1.5"
# sha256 of each snapshot's pages-1.img, oldest first, as the old code stored them
DIGESTS = ["268f723f07935796075ce0541e72fd57369b173a28dc28879d6c56da7cd2059f",
           "33649518f177232426039bebd2f4971a601d3a3adfef04b01d8229acf8e4ef51",
           "7950397a8b504cf024aff5273cdcf5b3df0d8bfa988e9f9fe84de994a6aac06c"]


@pytest.fixture
def old_repo(tmp_path):
    path = tmp_path / "old"
    shutil.copytree(DATA, path)
    for d, _, files in os.walk(path):          # (git keeps neither the modes nor empty dirs)
        os.chmod(d, 0o700)
        for f in files:
            os.chmod(os.path.join(d, f), 0o600)
    return path


def test_an_old_repository_is_read_written_verified_and_pruned(old_repo):
    repo = Repository.open(old_repo)
    snaps = repo.snapshots()
    assert [hashlib.sha256(read_all(s, "pages-1.img")).hexdigest() for s in snaps] == DIGESTS
    new = os.urandom(PAGE * 4) + read_all(snaps[-1], "pages-1.img")
    snap, _ = dump(repo, {"pages-1.img": new}, name="old")
    assert read_all(snap, "pages-1.img") == new
    assert verify.verify(Repository.open(old_repo), read_data=True).ok
    repo = Repository.open(old_repo)
    res = prune.run(repo, keep_last=2, name="old")
    assert len(res["snapshots_deleted"]) == 2
    left = Repository.open(old_repo).snapshots()
    assert read_all(left[-1], "pages-1.img") == new
    assert hashlib.sha256(read_all(left[0], "pages-1.img")).hexdigest() == DIGESTS[-1]
    assert verify.verify(Repository.open(old_repo), read_data=True).ok
    assert not [n for n in os.listdir(old_repo / "locks") if n.startswith("lock-")]


def test_an_older_gpusnap_holding_the_writer_flock_keeps_new_writers_and_prunes_out(old_repo):
    """Before revision 1.6 every writer took locks/writer LOCK_EX: held so, a new writer
    (shared) and a new prune (exclusive) are refused, naming the holder it wrote there."""
    fd = os.open(old_repo / "locks" / "writer", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.pwrite(fd, b'{"pid": 4711, "host": "oldnode", "what": "writer", "since": "then"}', 0)
    try:
        for exclusive in (False, True):
            with pytest.raises(RepositoryLocked, match="pid 4711 on oldnode"):
                with Repository.open(old_repo).writer_lock(exclusive=exclusive):
                    pass
    finally:
        os.close(fd)
    with Repository.open(old_repo).writer_lock():
        pass
