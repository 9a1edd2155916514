"""`gpusnap run`: a job in its own session and PID namespace, found by name, and restored as a
fork beside the still-running original (real CRIU): both finish with the result of an
uninterrupted run."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import kill_pids, run_gpusnap, run_json
from gpusnap.ops import run as run_op
from test_job_identity import checkout_gpusnap
from gpusnap.system import proc

pytestmark = pytest.mark.criu

# A deterministic job with a child process: it computes, waits for a go-file (so nothing it
# writes changes between the dump and the restore), computes on, and appends its result.
JOB = r"""
import hashlib, os, sys, time
go = sys.argv[1]
r, w = os.pipe()
kid = os.fork()
if kid == 0:
    os.close(r)
    h = hashlib.sha256(b"child")
    for i in range(20000):
        h.update(i.to_bytes(4, "little"))
    os.write(w, h.hexdigest().encode())
    os._exit(0)
os.close(w)
h = hashlib.sha256(b"parent")
state = [i * i for i in range(100000)]
h.update(repr(state).encode())
print(f"waiting pid={os.getpid()} kid={kid}", flush=True)
while not os.path.exists(go):
    time.sleep(0.05)
for i in range(200):
    h.update(h.digest())
child = os.read(r, 64).decode()
os.waitpid(kid, 0)
print(f"result {h.hexdigest()[:16]} {child[:16]} pid={os.getpid()}", flush=True)
"""


def _run_job(*args) -> dict:
    """`gpusnap run --json ARGS` (--json must come before the `--` that starts the command)."""
    res = run_gpusnap("run", "--json", *args)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)


def _wait_for(path: Path, text: str, count: int = 1, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = path.read_text() if path.exists() else ""
        if body.count(text) >= count:
            return body
        time.sleep(0.05)
    raise AssertionError(f"{path}: {text!r} x{count} did not appear in {timeout} s; it holds {body!r}")


def _expected(tmp_path: Path) -> str:
    go = tmp_path / "go-ref"
    go.touch()
    out = subprocess.run([sys.executable, "-c", JOB, str(go)], capture_output=True, text=True, check=True,
                         timeout=120).stdout
    line = [ln for ln in out.splitlines() if ln.startswith("result")][0]
    return line.rsplit(" ", 1)[0]  # without pid=..., which differs outside a namespace


def test_run_then_restore_beside_the_running_original(tmp_path, repo):
    expected = _expected(tmp_path)
    go = tmp_path / "go"
    started = _run_job("--name", "fork", "--repo", repo, "--", sys.executable, "-c", JOB, go)
    init = started["pid"]
    restored: list[int] = []
    try:
        stdout = Path(started["stdout"])
        assert stdout.parent == repo / "jobs" / "fork"
        body = _wait_for(stdout, "waiting")
        assert "pid=2 " in body  # the job is PID 2 of its own namespace (the init is PID 1)
        st = proc.read_stat(init)
        assert st.session == init and st.tty_nr == 0  # its own session, no terminal
        original = proc.tree(init)

        doctor = json.loads(run_gpusnap("doctor", init, "--json").stdout)
        assert doctor["ok"] and doctor["plan"]["dump_options"] == []  # no --shell-job needed
        snap = run_json("dump", "--name", "fork", "--repo", repo)  # no PID: found by name
        assert snap["pid"] == init and snap["job_running"]

        res = run_json("restore", "fork", "--repo", repo)  # while the original still runs
        restored = res["pids"]
        assert res["pid"] != init and not set(restored) & set(original)
        # all there (the finished child as a zombie, in both: CRIU restores zombies too)
        assert all(proc.read_stat(p) for p in original) and all(proc.read_stat(p) for p in restored)
        assert len(restored) == len(original)

        assert res["job"] == "fork-fork1" and res["fork_of"] == "fork"   # a name of its own
        go.touch()
        for d in (Path(started["dir"]), repo / "jobs" / "fork-fork1"):   # each in its own files
            body = _wait_for(d / "stdout.log", "result")
            results = [ln for ln in body.splitlines() if ln.startswith("result")]
            assert results == [f"{expected} pid=2"], body
            assert _wait_for(d / "exit", "0\n") == "0\n"
        assert proc.wait_gone(original + restored, 30) == []
    finally:
        kill_pids(restored)
        kill_pids(proc.tree(init) if proc.exists(init) else [])


def test_signals_reach_the_job_and_its_status_comes_back(tmp_path, repo):
    code = "import signal,sys,time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(7)); print('up', flush=True); time.sleep(120)"
    job = _run_job("--name", "sig", "--repo", repo, "--", sys.executable, "-c", code)
    _wait_for(Path(job["stdout"]), "up")
    os.kill(job["pid"], 15)  # to the init, which forwards it
    assert _wait_for(Path(job["dir"]) / "exit", "\n") == "7\n"
    assert proc.wait_gone([job["pid"]], 30) == []


def test_dump_by_an_unknown_job_name_says_how_jobs_are_named(repo):
    res = run_gpusnap("dump", "--name", "nosuch", "--repo", repo, "--json")
    assert res.returncode == 5 and "gpusnap run" in json.loads(res.stdout)["message"]


def test_dump_by_a_finished_job_name_says_it_is_not_running(repo):
    job = _run_job("--name", "brief", "--repo", repo, "--", "true")
    assert _wait_for(Path(job["dir"]) / "exit", "\n") == "0\n"
    proc.wait_gone([job["pid"]], 30)
    res = run_gpusnap("dump", "--name", "brief", "--repo", repo, "--json")
    assert res.returncode == 5 and "not running" in json.loads(res.stdout)["message"]


def test_a_running_name_is_not_reused(repo):
    job = _run_job("--name", "taken", "--repo", repo, "--", "sleep", "120")
    try:
        again = run_gpusnap("run", "--name", "taken", "--repo", repo, "--", "sleep", "1")
        assert again.returncode == 2 and "already running" in again.stderr
    finally:
        kill_pids(proc.tree(job["pid"])[::-1])


def test_schedule_finds_the_job_by_its_name(tmp_path, repo):
    job = _run_job("--name", "sched", "--repo", repo, "--", "sleep", "120")
    try:
        env = {"GPUSNAP_CRON_DIR": str(tmp_path / "cron.d"), "GPUSNAP_LOG_DIR": str(tmp_path / "log"),
               "GPUSNAP_SCHEDULE_DIR": str(tmp_path / "schedules"), "GPUSNAP_SYSTEMD_DIR": str(tmp_path / "systemd"),
               "GPUSNAP_SCHEDULER": "cron", "PATH": checkout_gpusnap(tmp_path)}
        s = run_json("schedule", "add", "--name", "sched", "--every", "30m", "--repo", repo, env=env)
        assert s["match"] is None and s["command"].endswith(f"schedule run sched --config-dir {tmp_path / 'schedules'}")
        # the command the cron line runs really dumps the job, found by its name
        subprocess.run(shlex.split(s["command"]), check=True, timeout=300, env=dict(os.environ, **env))
        listing = run_json("ls", "--repo", repo)
        assert [r["name"] for r in listing["snapshots"]] == ["sched"]
    finally:
        kill_pids(proc.tree(job["pid"])[::-1])
        assert run_op.list_jobs(repo)
