"""A job's name follows the job (issue 30 item 2), real CRIU on real jobs: a `gpusnap run` job
crashed and restored is dumped again by its name and by its schedule's own command; a fork
restored beside the running original gets a name and files of its own, and both outputs stay
whole; a PID reused by another process never passes for the job; a name given to a plain
`dump --name N PID` follows its restore too. And the run job's init (item 9): one short line
in ps, pgrep -f and inspect, and nothing of its own in the job's stderr.log."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import PY, ROOT, checkout_bin, kill_pids, run_gpusnap, run_json
from gpusnap.system import proc

pytestmark = pytest.mark.criu

# Deterministic: STEPS numbered lines, a hash over them, the result. It waits for a go-file
# before its last part, so a test decides when it may finish.
JOB = r"""
import hashlib, os, sys, time
go, steps = sys.argv[1], int(sys.argv[2])
h = hashlib.sha256(b"job")
for i in range(steps):
    h.update(i.to_bytes(4, "little"))
    print(f"step {i}", flush=True)
    time.sleep(0.02)
while not os.path.exists(go):
    time.sleep(0.05)
for i in range(1000):
    h.update(h.digest())
print(f"result {h.hexdigest()[:16]}", flush=True)
"""


def _expected(tmp_path: Path, steps: int) -> str:
    go = tmp_path / "go-reference"
    go.touch()
    out = subprocess.run([sys.executable, "-c", JOB, str(go), str(steps)], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    return out


def _wait_for(path: Path, text: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    body = ""
    while time.monotonic() < deadline:
        body = path.read_text() if path.exists() else ""
        if text in body:
            return body
        time.sleep(0.05)
    raise AssertionError(f"{path}: {text!r} did not appear in {timeout} s; it holds {body[-500:]!r}")


def _run(repo: Path, name: str, go: Path, steps: int) -> dict:
    p = run_gpusnap("run", "--json", "--name", name, "--repo", repo, "--", PY, "-c", JOB, go, steps)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout)


def _crash(init: int) -> None:
    """The job crashes: its whole tree is killed at once."""
    tree = proc.tree(init)
    kill_pids(tree)
    assert proc.wait_gone(tree, 30) == []


def checkout_gpusnap(tmp_path: Path) -> str:
    """A PATH whose `gpusnap` (what a schedule's command line runs) is this checkout's."""
    return f"{checkout_bin(tmp_path)}:{os.environ['PATH']}"


def _sched_env(tmp_path: Path) -> dict:
    return {"GPUSNAP_CRON_DIR": str(tmp_path / "cron.d"), "GPUSNAP_LOG_DIR": str(tmp_path / "log"),
            "GPUSNAP_SCHEDULE_DIR": str(tmp_path / "schedules"), "GPUSNAP_SYSTEMD_DIR": str(tmp_path / "systemd"),
            "GPUSNAP_SCHEDULER": "cron", "PATH": checkout_gpusnap(tmp_path)}


def test_a_crashed_run_job_restored_is_dumped_by_name_and_by_its_schedule(tmp_path, repo):
    """The issue's scenario: run, schedule, dump, crash, restore, then `dump --name` (exit 5 on
    main: 'not running any more') and the schedule's own command (logged no-job) find the
    restored job; `schedule ls` and `ls` show it, and it finishes with the uninterrupted result."""
    expected = _expected(tmp_path, 20)
    go = tmp_path / "go"
    job = _run(repo, "fold", go, 20)
    env = _sched_env(tmp_path)
    restored: list[int] = []
    try:
        _wait_for(Path(job["stdout"]), "step 19")
        s = run_json("schedule", "add", "--name", "fold", "--every", "30m", "--repo", repo, env=env)
        run_json("dump", "--name", "fold", "--repo", repo)
        _crash(job["pid"])
        res = run_json("restore", "fold", "--repo", repo)
        restored = res["pids"]
        again = run_json("dump", "--name", "fold", "--repo", repo)
        assert again["pid"] == res["pid"] and again["job_running"]
        assert res["job"] == "fold" and res["fork_of"] is None and res["pid"] != job["pid"]
        # the command the cron line runs (this checkout's gpusnap, as the cron line's would be)
        p = subprocess.run(shlex.split(s["command"]), capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, **env))
        assert p.returncode == 0, p.stderr
        rec = [json.loads(ln) for ln in open(s["log"]).read().splitlines()][-1]
        assert rec["outcome"] == "ok" and rec["pid"] == res["pid"]
        st = run_json("schedule", "ls", env=env)["schedules"][0]
        assert st["job_pid"] == res["pid"] and not st["job_gone"] and st["result"] == "ok"
        jobs = {j["name"]: j for j in run_json("ls", "--repo", repo)["jobs"]}
        assert jobs["fold"]["pid"] == res["pid"] and jobs["fold"]["running"] and jobs["fold"]["restores"] == 1

        go.touch()
        assert _wait_for(Path(job["stdout"]), "result") == expected
        assert _wait_for(Path(job["dir"]) / "exit", "\n") == "0\n"
    finally:
        kill_pids(restored)
        kill_pids(proc.tree(job["pid"]) if proc.exists(job["pid"]) else [])


def test_a_fork_beside_the_running_original_keeps_both_outputs_whole(tmp_path, repo):
    """On main the fork cut the original's live stdout.log back to the snapshot's size and
    both appended to it. Now: the original's log is its own uninterrupted output; the fork,
    named fold-fork1, writes its own files (starting with the output up to the snapshot)."""
    steps = 150
    expected = _expected(tmp_path, steps)
    go = tmp_path / "go"
    go.touch()                     # both run straight through
    job = _run(repo, "fold", go, steps)
    fork: list[int] = []
    try:
        _wait_for(Path(job["stdout"]), "step 20")
        run_json("dump", "--name", "fold", "--repo", repo)
        res = run_json("restore", "fold", "--repo", repo)      # the original still runs
        fork = res["pids"]
        out = run_gpusnap("restore", "fold", "--repo", repo)   # a second fork: the next name
        assert out.returncode == 0, out.stderr
        fork += proc.tree(int(out.stdout.split()[0]))
        fdir = repo / "jobs" / "fold-fork1"
        assert _wait_for(Path(job["stdout"]), "result") == expected     # the original's own, whole
        assert res["job"] == "fold-fork1" and res["fork_of"] == "fold" and res["job_dir"] == str(fdir)
        assert "fold-fork2: a fork of fold" in out.stderr

        for d in (Path(job["dir"]), fdir, repo / "jobs" / "fold-fork2"):
            assert _wait_for(d / "stdout.log", "result") == expected, d
            assert _wait_for(d / "exit", "\n") == "0\n", d
            assert (d / "stderr.log").read_text() == ""
        # the name stayed with the original; each fork has its own record
        jobs = {j["name"]: j for j in run_json("ls", "--repo", repo)["jobs"]}
        assert jobs["fold"]["pid"] == job["pid"] and jobs["fold"]["forked_from"] is None
        assert jobs["fold-fork1"]["forked_from"] == "fold" and jobs["fold-fork1"]["pid"] == res["pid"]
        assert not list((repo / "jobs" / "fold").glob("*gpusnap-*-after"))   # nothing was set aside
        assert proc.wait_gone(fork + [job["pid"]], 30) == []
    finally:
        kill_pids(fork)
        kill_pids(proc.tree(job["pid"]) if proc.exists(job["pid"]) else [])


def _take_pid(pid: int, argv: list[str]) -> subprocess.Popen:
    """Start argv under PID `pid` (free now): the kernel's next PID is set just below it."""
    for _ in range(200):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p = subprocess.Popen(argv)
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    raise AssertionError(f"PID {pid} could not be taken again (other processes took it first)")


def test_a_reused_pid_never_passes_for_the_job(tmp_path, repo):
    """After the job ended, another process that got its PID (and even looks like an init)
    is not the job: `dump --name` refuses (on main it dumped that process)."""
    job = _run(repo, "gone", tmp_path / "go", 1)
    _crash(job["pid"])
    impostor = _take_pid(job["pid"], [PY, "-c", "import time; time.sleep(600)", "gpusnap run init",
                                      "gpusnap-init gone"])
    try:
        p = run_gpusnap("dump", "--name", "gone", "--repo", repo, "--json")
        assert p.returncode == 5 and "not running" in json.loads(p.stdout)["message"], p.stdout
        assert not list((repo / "snapshots").iterdir())
        jobs = {j["name"]: j for j in run_json("ls", "--repo", repo)["jobs"]}
        assert jobs["gone"]["pid"] == impostor.pid and not jobs["gone"]["running"]
    finally:
        impostor.kill()
        impostor.wait()


def test_a_name_given_to_a_plain_dump_follows_its_restore(tmp_path, repo, sample_job):
    """`dump --name N PID` of a job not started by gpusnap: after a crash and a restore,
    `dump --name N` (no PID) and a schedule added by that name find the restored job."""
    job = sample_job(mb=8)
    job.wait_steps(5)
    pid = job.pid
    run_json("dump", str(pid), "--name", "plain", "--repo", repo)
    tree = proc.tree(pid)
    job.kill()
    assert proc.wait_gone(tree, 30) == []
    res = run_json("restore", "plain", "--repo", repo)
    try:
        again = run_json("dump", "--name", "plain", "--repo", repo)
        assert again["pid"] == pid
        assert res["job"] == "plain" and res["pid"] == pid      # its own PIDs again, a new process
        env = _sched_env(tmp_path)
        s = run_json("schedule", "add", "--name", "plain", "--every", "30m", "--repo", repo, env=env)
        assert s["match"] is None
        p = subprocess.run(shlex.split(s["command"]), capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, **env))
        assert p.returncode == 0, p.stderr
        assert [r["name"] for r in run_json("ls", "--repo", repo)["snapshots"]] == ["plain"] * 3
    finally:
        kill_pids(res["pids"])


def test_the_run_init_is_one_short_line_and_keeps_out_of_the_jobs_stderr(tmp_path, repo):
    """ps, pgrep -f and inspect show `gpusnap-init NAME` (on main: a 35-line script); a kill -9
    of the init leaves nothing in the job's stderr.log (on main: unshare's complaint)."""
    job = _run(repo, "tidy", tmp_path / "go", 5)
    init = job["pid"]
    try:
        ps = subprocess.run(["ps", "-o", "args=", "-p", str(init)], capture_output=True, text=True).stdout
        assert ps.strip() == "gpusnap-init tidy"
        assert subprocess.run(["ps", "-o", "comm=", "-p", str(init)], capture_output=True,
                              text=True).stdout.strip() == "gpusnap-init"
        hits = subprocess.run(["pgrep", "-f", "gpusnap-init tidy"], capture_output=True, text=True).stdout.split()
        assert hits == [str(init)]
        _wait_for(Path(job["stdout"]), "step 4")
        snap = run_json("dump", "--name", "tidy", "--repo", repo)
        info = run_json("inspect", snap["snapshot"], "--repo", repo)
        root = [p for p in info["processes"] if p["ppid"] == 0][0]
        assert root["cmdline"] == ["gpusnap-init tidy"]
        assert "GPUSNAP_RUN_INIT" not in open(f"/proc/{proc.children(init)[0]}/environ").read()
        os.kill(init, signal.SIGKILL)
        assert proc.wait_gone([init], 30) == []
        assert (Path(job["dir"]) / "stderr.log").read_text() == ""
    finally:
        kill_pids(proc.tree(init) if proc.exists(init) else [])
