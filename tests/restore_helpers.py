"""The check every restore test ends with: restore a snapshot of a killed job, and the
restored job finishes with exactly the result of an uninterrupted run; and the set-up of the
tests that move a real job's snapshot between two repositories (export/import, copy, tiers)."""

from __future__ import annotations

from conftest import kill_pids, run_gpusnap, run_json


def restore_and_finish(job, snapshot, repo, expected: str) -> dict:
    """Restore `snapshot` (a name or a path) of `job` (already killed) from `repo`: it comes
    back under its own PID and ends with `expected`. Returns restore's --json object."""
    restored = run_json("restore", snapshot, "--repo", repo)
    try:
        assert restored["pid"] == job.pid
        assert job.result() == expected
    finally:
        kill_pids(job.pids)
    return restored


def job_and_two_repos(sample_job, tmp_path, reference):
    """A running sample job (10 steps in), its uninterrupted result, and two new repositories."""
    kw = dict(steps=300, mb=32, threads=2)
    expected = reference(**kw)
    job = sample_job(**kw, step_ms=20)
    job.wait_steps(10)
    a, b = tmp_path / "a", tmp_path / "b"
    for r in (a, b):
        run_gpusnap("init", "--repo", r, check=True)
    return job, expected, a, b
