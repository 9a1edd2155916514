"""End to end through the real CRIU, as root: dump a running job, kill it, restore it, and
check it finishes with exactly the result of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from conftest import kill_pids, run_gpusnap, run_json
from gpusnap.system import proc
from restore_helpers import restore_and_finish

pytestmark = pytest.mark.criu


def _restore_and_finish(job, snapshot, repo, expected):
    """restore_and_finish, and restore's phases add up."""
    restored = restore_and_finish(job, snapshot, repo, expected)
    ph = restored["phases"]
    assert list(ph) == (["preflight", "criu"] if restored["via"] == "stream" else ["preflight", "materialize", "criu"])
    assert ph["criu"] > 0 and sum(ph.values()) <= restored["seconds"] + 0.01


def test_dump_keeps_job_running_then_restore_finishes_identically(sample_job, repo, reference):
    kw = dict(steps=300, mb=256, threads=3)
    expected = reference(**kw)
    job = sample_job(**kw, step_ms=20)
    job.wait_steps(10)

    info = run_json("dump", job.pid, "--repo", repo, "--name", "e2e")
    snap = Path(info["snapshot"])
    assert snap.is_dir() and snap.parent.name == "snapshots"
    for key in ("snapshot", "id", "name", "pid", "pages_total", "pages_zero", "pages_dedup",
                "bytes_raw", "bytes_stored", "seconds"):
        assert key in info, key
    assert info["name"] == "e2e" and info["pid"] == job.pid
    assert info["bytes_raw"] > 256 << 20  # all of the job's memory went through the stream
    ph = info["phases"]                    # where the time went, in order, adding up
    assert list(ph) == ["preflight", "staging", "criu", "storing", "commit"] and min(ph.values()) >= 0
    assert 0 < info["frozen_seconds"] <= ph["criu"]    # CRIU's own figure, inside its run
    assert ph["criu"] > 0 and sum(ph.values()) <= info["seconds"] + 0.01
    assert info["pages_zero"] >= (256 << 20) // 4 // 4096 * 0.9  # the zeroed quarter

    # the job keeps running and making progress after the dump
    at = job.steps_done()
    job.wait_steps(at + 5)
    assert job.alive()
    assert not (job.out / "result").exists(), "the job finished too early for this test"

    job.kill()
    _restore_and_finish(job, snap, repo, expected)
    # the log kept growing after the dump and was appended to again after the restore
    steps = [int(ln.split()[1].split("/")[0]) for ln in (job.out / "job.log").read_text().splitlines()]
    assert steps[-1] == 300


@pytest.mark.slow
def test_exit_stops_the_job_after_storing(sample_job, repo, reference):
    kw = dict(steps=200, mb=32, threads=2)
    expected = reference(**kw)
    job = sample_job(**kw, step_ms=20)
    job.wait_steps(5)
    info = run_json("dump", job.pid, "--repo", repo, "--exit")
    assert info["job_running"] is False
    job.popen.wait(timeout=30)
    assert not job.alive()
    job.kill()  # reap, and wait for the child's PID to be free
    _restore_and_finish(job, info["snapshot"], repo, expected)


@pytest.mark.slow
def test_job_started_from_a_shell_without_setsid(sample_job, repo, reference):
    """A job started from a shell (`job &`) is in the shell's session and process group, both
    outside the dumped tree: that needs --shell-job, and gpusnap works it out itself."""
    kw = dict(steps=200, mb=16, threads=2)
    expected = reference(**kw)
    job = sample_job(**kw, step_ms=20, from_shell=True)
    job.wait_steps(5)
    st = proc.read_stat(job.pid)
    assert st.session == job.popen.pid and st.pgrp == job.popen.pid  # the shell leads both
    info = run_json("dump", job.pid, "--repo", repo)
    job.kill()
    _restore_and_finish(job, info["snapshot"], repo, expected)


def test_session_leader_outside_the_pid_namespace_is_refused_untouched(repo, tmp_path):
    """CRIU cannot dump a task whose session leader is outside its PID namespace (its session
    id there is 0; CI runners and container inits start jobs like that). gpusnap says so before
    touching the job: its own exit code, the job keeps running, no snapshot appears."""
    holder = subprocess.Popen(["unshare", "--pid", "--fork", "sleep", "600"], stdin=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
    target = None
    try:
        deadline = time.monotonic() + 10
        while not proc.children(holder.pid):
            if holder.poll() is not None:   # a sandbox that forbids new PID namespaces
                pytest.skip(f"cannot make a PID namespace here: {holder.stderr.read().decode().strip()}")
            assert time.monotonic() < deadline, "unshare did not start its child"
            time.sleep(0.02)
        target = proc.children(holder.pid)[0]
        assert proc.session_outside_namespace(target)
        res = run_gpusnap("dump", target, "--repo", repo, "--json")
        assert res.returncode == 16, res.stdout + res.stderr
        err = json.loads(res.stdout)
        assert err["error"] == "cannot snapshot this process"
        assert "outside its PID namespace" in err["message"] and "setsid" in err["hint"]
        assert proc.read_stat(target).state in ("S", "R")  # running, not left stopped
        assert not repo.exists()            # refused before the repository was even made
    finally:
        if target:
            kill_pids([target])  # the namespace's init: unshare's death would not end it
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)


@pytest.mark.slow
def test_restore_by_name_from_repo_and_ls(sample_job, repo, reference):
    kw = dict(steps=200, mb=16, threads=1)
    expected = reference(**kw)
    job = sample_job(**kw, step_ms=20)
    job.wait_steps(5)
    run_json("dump", job.pid, "--repo", repo, "--name", "first")
    second = run_json("dump", job.pid, "--repo", repo, "--name", "later")
    listing = run_json("ls", "--repo", repo)
    assert [s["name"] for s in listing["snapshots"]] == ["first", "later"]
    job.kill()
    restored = run_json("restore", "later", "--repo", repo)
    assert restored["pid"] == job.pid
    try:
        assert job.result() == expected
    finally:
        kill_pids(job.pids)
    assert second["bytes_stored"] < second["bytes_raw"] * 0.2  # the second dump is incremental


def test_repository_is_private(sample_job, repo):
    job = sample_job(steps=5000, mb=8, threads=1, step_ms=20)   # (still running when dumped, however busy the machine)
    job.wait_steps(3)
    run_json("dump", job.pid, "--repo", repo)
    for dirpath, dirnames, filenames in os.walk(repo):
        mode = stat.S_IMODE(os.stat(dirpath).st_mode)
        assert mode & 0o077 == 0, f"{dirpath} is {oct(mode)}"
        for f in filenames:
            p = os.path.join(dirpath, f)
            assert stat.S_IMODE(os.stat(p).st_mode) & 0o077 == 0, f"{p} is readable by others"


@pytest.mark.slow
def test_human_output_prints_the_snapshot_dir_and_pid(sample_job, repo, reference):
    kw = dict(steps=150, mb=8, threads=1)
    expected = reference(**kw)
    job = sample_job(**kw, step_ms=20)
    job.wait_steps(3)
    proc = run_gpusnap("dump", job.pid, "--repo", repo, check=True)
    snapdir = proc.stdout.strip()
    assert Path(snapdir).is_dir()
    job.kill()
    proc = run_gpusnap("restore", snapdir, check=True)  # the directory alone names the repository
    assert int(proc.stdout.strip()) == job.pid
    try:
        assert job.result() == expected
    finally:
        kill_pids(job.pids)
