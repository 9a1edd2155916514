"""A signal that reaches `dump` after its commit point, through the real CRIU: the snapshot
is committed, so dump says so (exit 28, the snapshot's directory named) instead of "no
snapshot was kept"; the snapshot is listed and a restore of it finishes with the result of
an uninterrupted run. The signal lands exactly there through the fault hook
(GPUSNAP_FAULT=POINT:SIG, gpusnap/system/faults.py, docs/faults.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import kill_pids, run_gpusnap, run_json
from gpusnap.errors import Interrupted, InterruptedAfterCommit
from restore_helpers import restore_and_finish

pytestmark = pytest.mark.criu

KW = dict(steps=200, mb=16, threads=2)


def _interrupted_dump(job, repo, point: str, sig: str, *extra):
    r = run_gpusnap("dump", job.pid, "--repo", repo, "--name", "victim", *extra,
                    env={"GPUSNAP_FAULT": f"{point}:{sig}"})
    assert "Traceback" not in r.stderr, r.stderr
    return r


def _listed(repo: Path) -> list[dict]:
    return run_json("ls", "--repo", repo)["snapshots"]


def test_term_at_the_commit_point_reports_the_kept_snapshot(sample_job, repo, reference):
    expected = reference(**KW)
    job = sample_job(**KW, step_ms=20)
    job.wait_steps(5)
    r = _interrupted_dump(job, repo, "commit:snapshot-renamed", "TERM")
    assert r.returncode == InterruptedAfterCommit.exit_code == 28, (r.stdout, r.stderr)
    [snap] = _listed(repo)
    assert snap["name"] == "victim"
    assert "interrupted after the commit" in r.stderr and "is kept" in r.stderr, r.stderr
    assert snap["path"] in r.stderr.replace("\n", "")   # the message names the kept directory
    assert "no snapshot was kept" not in r.stderr
    at = job.steps_done()
    job.wait_steps(at + 3)              # the job was left running, as a finished dump leaves it
    job.kill()
    restore_and_finish(job, "victim", repo, expected)


def test_int_after_the_commit_with_json_says_so_in_one_object(sample_job, repo, reference):
    expected = reference(**KW)
    job = sample_job(**KW, step_ms=20)
    job.wait_steps(5)
    r = _interrupted_dump(job, repo, "commit:done", "INT", "--json")
    assert r.returncode == 28, (r.stdout, r.stderr)
    [line] = [ln for ln in r.stdout.splitlines() if ln.strip()]
    obj = json.loads(line)
    assert obj["exit_code"] == 28 and obj["error"] == InterruptedAfterCommit.title
    assert "is kept" in obj["message"] and "victim-" in obj["message"]
    assert [s["name"] for s in _listed(repo)] == ["victim"]
    job.kill()
    restore_and_finish(job, "victim", repo, expected)


def test_hup_after_the_commit_with_exit_stops_the_job_and_keeps_the_snapshot(sample_job, repo, reference):
    expected = reference(**KW)
    job = sample_job(**KW, step_ms=20)
    job.wait_steps(5)
    r = _interrupted_dump(job, repo, "commit:done", "HUP", "--exit")
    assert r.returncode == 28, (r.stdout, r.stderr)
    assert "stopped, as --exit asked" in r.stderr, r.stderr
    job.popen.wait(timeout=30)          # the snapshot is safe, so --exit's stop was carried out
    assert not job.alive()
    assert [s["name"] for s in _listed(repo)] == ["victim"]
    job.kill()
    restore_and_finish(job, "victim", repo, expected)


def test_term_after_the_commit_says_retention_did_not_run(sample_job, repo):
    job = sample_job(**KW, step_ms=20)
    job.wait_steps(5)
    run_json("dump", job.pid, "--repo", repo, "--name", "victim")
    r = _interrupted_dump(job, repo, "commit:done", "TERM", "--keep-last", "1")
    assert r.returncode == 28, (r.stdout, r.stderr)
    assert "--keep-last retention did not run" in r.stderr, r.stderr
    assert len(_listed(repo)) == 2      # both kept: retention never started
    assert "gpusnap prune --keep-last 1 --name victim" in r.stderr


def test_term_before_the_commit_point_still_says_no_snapshot(sample_job, repo):
    job = sample_job(**KW, step_ms=20)
    job.wait_steps(5)
    r = _interrupted_dump(job, repo, "commit:manifest-written", "TERM")
    assert r.returncode == Interrupted.exit_code == 130, (r.stdout, r.stderr)
    assert "no snapshot was kept" in r.stderr
    assert _listed(repo) == []
    at = job.steps_done()
    job.wait_steps(at + 3)
