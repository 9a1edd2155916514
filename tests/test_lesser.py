"""Issue 8's lesser items, each as a user meets it: a kernel thread, a repository that is a
file, verify during a prune, two restores of one snapshot at once, a damaged or deleted index
file whose snapshots still restore."""

import os
import subprocess
import time

import pytest

from conftest import GPUSNAP, ROOT, kill_pids, run_gpusnap, run_json
from gpusnap.repo import Repository
from gpusnap.repo.maint.prune import execute_prune, plan_prune, snapshots_info
from gpusnap.repo.maint.verify import verify
from gpusnap.render.maint import verify_summary
from repo_helpers import PAGE, dump, read_all


@pytest.mark.criu
def test_kernel_thread_is_named_as_such():
    p = run_gpusnap("dump", "2", "--repo", "/nonexistent-gpusnap-repo")
    assert p.returncode == 16 and "kernel thread" in p.stderr and "session leader" not in p.stderr, p.stderr


@pytest.mark.criu
def test_dump_into_a_file_is_a_clean_error(sample_job, tmp_path):
    job = sample_job(steps=5000, mb=8, threads=1, step_ms=20)
    job.wait_steps(2)
    f = tmp_path / "file"
    f.write_text("x")
    p = run_gpusnap("dump", job.pid, "--repo", f)
    assert p.returncode == 14 and "Traceback" not in p.stderr and "not a gpusnap repository" in p.stderr, p.stderr
    assert job.alive() and f.read_text() == "x"


def _blocked_on_flock(pid: int) -> bool:
    """/proc/locks lists a process waiting for a lock with '->'."""
    for line in open("/proc/locks"):
        f = line.split()
        if "->" in f and f[f.index("->") + 1] == "FLOCK" and int(f[f.index("->") + 4]) == pid:
            return True
    return False


def test_verify_while_prune_runs_waits_instead_of_reporting_damage(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    for k in range(4):
        dump(repo, {"pages-1.img": os.urandom(PAGE * 8) + bytes([k + 1]) * PAGE})
    with repo.writer_lock(), repo.readers_lock(exclusive=True):     # what `gpusnap prune` holds
        v = subprocess.Popen([*GPUSNAP, "verify", "--repo", str(repo.path)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=ROOT)
        deadline = time.monotonic() + 120                            # (a safety net, not a measure)
        while not _blocked_on_flock(v.pid):                          # verify is waiting for the prune
            assert v.poll() is None, v.communicate()
            assert time.monotonic() < deadline, "verify never waited for the lock"
            time.sleep(0.01)
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


@pytest.mark.criu
def test_two_restores_of_one_snapshot_the_loser_exits_7(sample_job, repo):
    job = sample_job(steps=5000, mb=8, threads=1, step_ms=20)
    job.wait_steps(3)
    snap = run_json("dump", job.pid, "--repo", repo, "--name", "twice")["snapshot"]
    job.kill()
    procs = [subprocess.Popen([*GPUSNAP, "restore", snap, "--repo", str(repo), "--json"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT) for _ in range(2)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    try:
        codes = sorted(r[0] for r in results)
        assert codes == [0, 7], results
    finally:
        kill_pids(job.pids or [job.pid])
