"""Issue 8's lesser items, each as a user meets it: a kernel thread, a repository that is a
file, verify during a prune, two restores of one snapshot at once, a damaged or deleted index
file whose snapshots still restore."""

import json
import os
import subprocess
import time

import pytest

from conftest import GPUSNAP, ROOT, kill_pids, run_gpusnap, run_json
from gpusnap.errors import AccessDenied
from gpusnap.repo import Repository
from gpusnap.system import hostlock
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
def test_a_restore_waits_while_another_restore_of_the_job_holds_it(sample_job, repo):
    """The lock that keeps two restores of one job apart: while it is held, a restore neither
    touches the job's files nor starts CRIU; once released, it restores."""
    job = sample_job(steps=5000, mb=8, threads=1, step_ms=20)
    job.wait_steps(3)
    snap = run_json("dump", job.pid, "--repo", repo, "--name", "held")["snapshot"]
    job.wait_steps(job.steps_done() + 3)                 # the log grows past the snapshot's size
    job.kill()
    log = job.out / "job.log"
    size = log.stat().st_size
    try:
        with hostlock.held(f"restore-pid-{job.pid}"):
            r = subprocess.Popen([*GPUSNAP, "restore", snap, "--repo", str(repo), "--json"], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, cwd=ROOT)
            deadline = time.monotonic() + 120                # (a safety net, not a measure)
            while not _blocked_on_flock(r.pid):
                assert r.poll() is None, r.communicate()
                assert time.monotonic() < deadline, "restore never waited for the lock"
                time.sleep(0.01)
            assert log.stat().st_size == size and not list(job.out.glob("job.log.gpusnap-*"))
            assert not os.path.exists(f"/proc/{job.pid}")
        out, err = r.communicate(timeout=300)
        assert r.returncode == 0, (out, err)
        assert list(job.out.glob("job.log.gpusnap-*-after")) and log.stat().st_size < size
    finally:
        kill_pids(job.pids or [job.pid])


@pytest.mark.criu
def test_a_dump_waits_while_another_dump_of_the_job_holds_it(sample_job, repo):
    """While another gpusnap dumps the job (the lock held), a dump starts no CRIU; once
    released, it dumps the job as it is then."""
    job = sample_job(steps=5000, mb=8, threads=1, step_ms=20)
    job.wait_steps(3)
    try:
        with hostlock.held(f"dump-pid-{job.pid}"):
            d = subprocess.Popen([*GPUSNAP, "dump", str(job.pid), "--repo", str(repo), "--json"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
            deadline = time.monotonic() + 120                # (a safety net, not a measure)
            while not _blocked_on_flock(d.pid):
                assert d.poll() is None, d.communicate()
                assert time.monotonic() < deadline, "the dump never waited for the lock"
                time.sleep(0.01)
            at = job.steps_done()
            job.wait_steps(at + 3)                          # not frozen meanwhile
            assert not (repo / "snapshots").exists() or not list((repo / "snapshots").iterdir())
        out, err = d.communicate(timeout=300)
        assert d.returncode == 0, (out, err)
        assert job.alive()
    finally:
        kill_pids(job.pids or [job.pid])


@pytest.mark.criu
def test_two_dumps_of_one_job_at_once_both_succeed_and_restore(sample_job, tmp_path, reference):
    """Two schedules into two repositories firing together: one waits for the other."""
    kw = dict(steps=200, mb=16, threads=2)
    expected = reference(**kw)
    job = sample_job(**kw, step_ms=20)
    job.wait_steps(5)
    repos = [tmp_path / "r1", tmp_path / "r2"]
    for r in repos:
        run_gpusnap("init", "--repo", r, check=True)
    dumps = [subprocess.Popen([*GPUSNAP, "dump", str(job.pid), "--repo", str(r), "--json"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT) for r in repos]
    results = [(d.wait(timeout=300), *d.communicate()) for d in dumps]
    try:
        assert [r[0] for r in results] == [0, 0], results
        at = job.steps_done()
        job.wait_steps(at + 3)
        job.kill()
        snap = json.loads(results[1][1])["snapshot"]
        restored = run_json("restore", snap, "--repo", repos[1])
        assert restored["pid"] == job.pid
        assert job.result() == expected
    finally:
        kill_pids(job.pids or [job.pid])


def test_lock_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "locks"
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)                                    # (mkdir's mode is masked by the umask)
    monkeypatch.setenv("GPUSNAP_LOCK_DIR", str(d))
    with pytest.raises(AccessDenied, match="not a directory private"):
        with hostlock.held("restore-pid-1"):
            pass
    os.chmod(d, 0o700)
    with hostlock.held("restore-pid-1"):
        assert (d / "restore-pid-1.lock").exists()


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
