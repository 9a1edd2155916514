"""A signal (INT, TERM, HUP) at each phase of a restore, through the real CRIU: the exit status
says whether the job runs. Exit 130 only when nothing was restored (before CRIU, or CRIU
stopped by the cut image stream) and the files restore had set aside are back; once the job
runs, the restore finishes reporting: its PID on stdout, exit 0, a note that the interrupt came
too late. So a script that retries on failure never starts a second copy. The signal lands
exactly in its phase through the fault hook (GPUSNAP_FAULT=POINT:SIG, docs/faults.md)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from conftest import kill_pids, run_gpusnap, run_json
from gpusnap.errors import Interrupted
from gpusnap.system import proc

pytestmark = pytest.mark.criu

KW = dict(steps=200, mb=16, threads=2)

# (via, fault point, signal, whether the job runs afterwards)
BEFORE = [("stream", "restore:checked", "INT"), ("stream", "restore:checked", "TERM"),
          ("files", "restore:images-written", "HUP"), ("stream", "restore:criu-started", "INT"),
          ("stream", "restore:criu-started", "TERM"), ("stream", "restore:criu-started", "HUP")]
AFTER = [("stream", "restore:criu-exited", "INT"), ("stream", "restore:criu-exited", "TERM"),
         ("stream", "restore:job-running", "HUP"), ("stream", "restore:report", "INT"),
         ("files", "restore:criu-started", "TERM"), ("files", "restore:criu-exited", "INT"),
         ("lazy", "restore:criu-started", "INT")]


def _dumped_and_crashed(sample_job, repo):
    job = sample_job(**KW, step_ms=60)   # runs on for ~10 s after the restore: the retry finds it
    job.wait_steps(5)
    run_gpusnap("dump", job.pid, "--repo", repo, "--name", "victim", check=True)
    job.wait_steps(job.steps_done() + 3)    # the job's log grows after the dump: restore sets it aside
    job.kill()
    return job


def _restore(repo, via, point, sig, *extra):
    r = run_gpusnap("restore", "victim", "--repo", repo, "--via", via, *extra,
                    env={"GPUSNAP_FAULT": f"{point}:{sig}"})
    assert "Traceback" not in r.stderr, r.stderr
    return r


@pytest.mark.parametrize("via,point,sig", BEFORE, ids=lambda x: x)
def test_a_signal_before_the_job_runs_restores_nothing(sample_job, repo, reference, via, point, sig):
    expected = reference(**KW)
    job = _dumped_and_crashed(sample_job, repo)
    log = (job.out / "job.log").read_bytes()
    r = _restore(repo, via, point, sig)
    assert r.returncode == Interrupted.exit_code == 130, (r.stdout, r.stderr)
    assert r.stdout == ""                                   # no PID: nothing was restored
    assert "nothing was restored" in r.stderr, r.stderr
    assert proc.wait_gone(job.pids, 10) == []               # and nothing of the job runs
    assert (job.out / "job.log").read_bytes() == log        # the grown log is as it was
    assert not list(job.out.glob("job.log.gpusnap-*"))      # nothing set aside is left behind
    # the retry a script makes after a failure brings exactly one job back
    again = run_json("restore", "victim", "--repo", repo, "--via", via)
    try:
        assert again["pid"] == job.pid and again["interrupted"] is None, again
        assert job.result() == expected
    finally:
        kill_pids(job.pids)


@pytest.mark.parametrize("via,point,sig", AFTER, ids=lambda x: x)
def test_a_signal_once_the_job_runs_lets_the_restore_report_it(sample_job, repo, reference, via, point, sig):
    expected = reference(**KW)
    job = _dumped_and_crashed(sample_job, repo)
    r = _restore(repo, via, point, sig)
    try:
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert r.stdout.split() == [str(job.pid)]            # the PID, as an uninterrupted restore prints it
        assert f"interrupted (SIG{sig})" in r.stderr and f"runs as PID {job.pid}" in r.stderr, r.stderr
        assert proc.exists(job.pid)
        # a retry (of a script that did not trust the 0) finds the job's PIDs taken: no second copy
        again = run_gpusnap("restore", "victim", "--repo", repo, "--via", via)
        assert again.returncode == 7, (again.stdout, again.stderr)
        assert job.result() == expected
    finally:
        kill_pids(job.pids)


def test_json_says_the_job_runs_after_a_late_signal(sample_job, repo):
    job = _dumped_and_crashed(sample_job, repo)
    r = _restore(repo, "stream", "restore:criu-exited", "TERM", "--json")
    try:
        assert r.returncode == 0, (r.stdout, r.stderr)
        obj = json.loads(r.stdout)
        assert obj["pid"] == job.pid and obj["interrupted"] == "SIGTERM"
        assert any("too late to stop it" in n for n in obj["notes"]), obj["notes"]
    finally:
        kill_pids(job.pids)


# A job in a PID namespace of its own (`gpusnap run`) restores beside anything: there a
# restore that ran but said it failed made a retrying script start a second copy.
FOREVER = "import sys, time\nprint('up', flush=True)\nwhile True: time.sleep(0.2)\n"


def _copies(marker: str) -> list[int]:
    """PIDs of live processes running FOREVER with this marker (the init of a `run` job is not one)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        st = proc.read_stat(int(p.name))
        if argv[1:4] == [b"-c", FOREVER.encode(), marker.encode()] and st and st.state not in "ZX":
            out.append(int(p.name))
    return out


@pytest.mark.parametrize("point,sig", [("restore:checked", "INT"), ("restore:criu-started", "TERM"),
                                       ("restore:criu-exited", "INT"), ("restore:job-running", "HUP"),
                                       ("restore:report", "TERM")])
def test_a_script_that_retries_until_success_runs_one_copy(tmp_path, repo, point, sig):
    marker = f"twin-{point}-{tmp_path.name}-{os.getpid()}"      # this run's copies only
    res = run_gpusnap("run", "--json", "--name", "twin", "--repo", repo, "--", sys.executable, "-c", FOREVER,
                      marker)
    assert res.returncode == 0, res.stderr
    init = json.loads(res.stdout)["pid"]
    restored: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not _copies(marker):
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.05)
        run_gpusnap("dump", "--name", "twin", "--repo", repo, check=True)
        kill_pids(proc.tree(init))                              # the crash
        deadline = time.monotonic() + 30                        # (a zombie left to be reaped is no copy)
        while _copies(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _copies(marker) == []
        codes = []
        env = {"GPUSNAP_FAULT": f"{point}:{sig}"}
        while not codes or codes[-1] != 0:                      # what a cron job's `until` loop does
            assert len(codes) < 3, codes
            r = run_gpusnap("restore", "twin", "--repo", repo, "--json", env=env)
            env = None
            codes.append(r.returncode)
            if r.returncode == 0:
                restored = proc.tree(json.loads(r.stdout)["pid"])
        assert codes == ([130, 0] if point in ("restore:checked", "restore:criu-started") else [0]), codes
        assert len(_copies(marker)) == 1
    finally:
        kill_pids(restored)
        kill_pids(proc.tree(init) if proc.exists(init) else [])
        for pid in _copies(marker):       # a copy nothing reported (what the test is about) goes too
            st = proc.read_stat(pid)
            kill_pids([pid, *(proc.tree(st.ppid) if st and st.ppid > 1 else [])])
