"""The check every restore test ends with: restore a snapshot of a killed job, and the
restored job finishes with exactly the result of an uninterrupted run."""

from __future__ import annotations

from conftest import kill_pids, run_json


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
