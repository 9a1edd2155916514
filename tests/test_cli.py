"""The command line as scripts use it: help, --json on every read command, PID selection."""

import json

import pytest

from conftest import kill_pids, run_gpusnap, run_json
from gpusnap.errors import ProcessNotFound, UsageError


def test_help_lists_every_command():
    proc = run_gpusnap("--help", check=True)
    for cmd in ("dump", "restore", "ls", "inspect", "verify", "prune", "schedule", "doctor", "ps"):
        assert cmd in proc.stdout


def test_doctor_json_reports_criu():
    data = run_json("doctor")
    checks = {c["name"]: c for c in data["checks"]}
    assert checks["criu"]["status"] == "ok" and "4." in checks["criu"]["detail"]
    assert "NVIDIA driver" in checks


def test_ps_json_without_a_driver():
    data = run_json("ps")
    assert data["processes"] == []
    assert data["driver"]["available"] is False


def test_pid_selection_is_exclusive(tmp_path):
    proc = run_gpusnap("dump", "1", "--match", "x", "--repo", tmp_path / "r")
    assert proc.returncode == UsageError.exit_code
    proc = run_gpusnap("dump", "--repo", tmp_path / "r")
    assert proc.returncode == UsageError.exit_code
    proc = run_gpusnap("dump", "--match", "no-such-job-anywhere-xyz", "--repo", tmp_path / "r")
    assert proc.returncode == ProcessNotFound.exit_code


def test_bad_snapshot_name_is_refused(tmp_path):
    proc = run_gpusnap("dump", "1", "--name", "../evil", "--repo", tmp_path / "r")
    assert proc.returncode == UsageError.exit_code
    assert "not allowed" in proc.stderr


@pytest.mark.criu
def test_match_pidfile_and_inspect(sample_job, repo):
    job = sample_job(steps=300, mb=8, threads=2, step_ms=20)
    job.wait_steps(3)
    by_match = run_json("dump", "--match", f"gpusnap.samples.job {job.out}", "--repo", repo, "--name", "m")
    assert by_match["pid"] == job.pid
    by_file = run_json("dump", "--pidfile", job.out / "pid", "--repo", repo, "--name", "p")
    assert by_file["pid"] == job.pid
    report = run_json("inspect", by_file["snapshot"])
    procs = {p["pid"]: p for p in report["processes"]}
    assert set(procs) == set(job.pids)
    assert procs[job.pid]["threads"] == 3  # main thread + 2 workers
    assert procs[job.pid]["memory_bytes"] >= 8 << 20
    ls = run_json("ls", "--repo", repo)
    assert [s["name"] for s in ls["snapshots"]] == ["m", "p"]
    assert run_json("verify", "--repo", repo)["ok"] is True
    pr = run_json("prune", "--keep-last", "0", "--name", "m", "--all", "--repo", repo)
    assert len(pr["snapshots_deleted"]) == 1
    assert [s["name"] for s in run_json("ls", "--repo", repo)["snapshots"]] == ["p"]
