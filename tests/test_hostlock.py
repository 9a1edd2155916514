"""The machine-wide job locks (gpusnap/system/hostlock.py): one dump and one restore of a job
at a time, whichever repositories they use; the other waits (or, for a restore whose PIDs
are taken by the winner, exits 7), and the lock directory is private to root."""

import json
import os
import subprocess

import pytest

from conftest import GPUSNAP, ROOT, kill_pids, run_gpusnap, run_json
from flock_helpers import wait_until_blocked
from gpusnap.errors import AccessDenied
from gpusnap.system import hostlock


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
            wait_until_blocked(r, "restore")
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
            wait_until_blocked(d, "the dump")
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
