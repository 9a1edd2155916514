"""`gpusnap verify` as a user meets it: during a prune it waits for the prune instead of
reporting the data being deleted as damage, and a damaged or deleted index file is reported
as an index problem, not a snapshot one (each snapshot still restores)."""

import os
import subprocess

import pytest

from conftest import GPUSNAP, ROOT
from flock_helpers import wait_until_blocked
from gpusnap.repo import Repository
from gpusnap.repo.maint.prune import execute_prune, plan_prune, snapshots_info
from gpusnap.repo.maint.verify import verify
from gpusnap.render.maint import verify_summary
from repo_helpers import PAGE, dump, read_all


def test_verify_while_prune_runs_waits_instead_of_reporting_damage(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    for k in range(4):
        dump(repo, {"pages-1.img": os.urandom(PAGE * 8) + bytes([k + 1]) * PAGE})
    with repo.writer_lock(), repo.readers_lock(exclusive=True):     # what `gpusnap prune` holds
        v = subprocess.Popen([*GPUSNAP, "verify", "--repo", str(repo.path)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=ROOT)
        wait_until_blocked(v, "verify")
        execute_prune(repo, plan_prune(snapshots_info(repo), 1))
    out, err = v.communicate(timeout=120)
    assert v.returncode == 0, (out, err)
    assert "verified 1 snapshot" in out


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_damaged_index_file_is_an_index_problem_not_a_snapshot_one(tmp_path, damage):
    repo = Repository.open(tmp_path / "repo", create=True)
    imgs = []
    for k in range(2):
        img = os.urandom(PAGE * 8) + bytes([k + 1]) * PAGE
        dump(repo, {"pages-1.img": img})
        imgs.append(img)
    idx = sorted((repo.path / "index").iterdir())[-1]
    if damage == "flip":
        data = bytearray(idx.read_bytes())
        data[len(data) // 2] ^= 1
        idx.write_bytes(bytes(data))
    else:
        idx.unlink()
    repo = Repository.open(repo.path)
    rep = verify(repo)
    assert not rep.ok and rep.affected_snapshots == []
    assert {p.scope for p in rep.problems} == {"index"}
    assert "index is damaged" in verify_summary(rep) and "no snapshot is affected" in verify_summary(rep)
    for s, img in zip(repo.snapshots(), imgs):                       # and each one does restore
        assert read_all(s, "pages-1.img") == img
