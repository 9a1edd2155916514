"""Tiered snapshots (`--copy-to`, ops/tiers.py, repo/copies.py): real jobs dumped by real CRIU
into a local repository and copied to a second one after the commit; `ls` says local only /
copied / not copied yet; a destination that is missing or an ssh:// one nobody answers leaves
the dump successful (exit 0) and its snapshot pending, and the next dump or `copy --pending`
catches up on every pending one; retention never deletes an uncopied snapshot (unless
--prune-uncopied) and --copy-keep-last prunes the destination; `restore --copy-to` restores
from the destination once the local snapshot is gone; a schedule with --copy-to run as cron
runs it copies and logs the copy."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

from conftest import kill_pids, run_gpusnap, run_json
from gpusnap.ops import prune as prune_op
from gpusnap.repo import Repository, copies
from gpusnap.repo.maint.verify import verify
from repo_helpers import dump as fake_dump
from restore_helpers import job_and_two_repos
from test_schedule import _run_as_cron, installed_gpusnap, sched_env  # noqa: F401 (fixtures)


def _init(*repos: Path) -> None:
    for r in repos:
        run_gpusnap("init", "--repo", r, check=True)


def _states(repo: Path) -> list[str]:
    return [r["copies"]["state"] for r in run_json("ls", "--repo", repo)["snapshots"]]


def _names(repo: Path) -> list[str]:
    return sorted(r["dir"] for r in run_json("ls", "--repo", repo)["snapshots"])


def _tiered(job, a: Path, to, *extra) -> dict:
    return run_json("dump", job.pid, "--repo", a, "--name", "train", "--copy-to", to, *extra)


@pytest.mark.criu
def test_tiered_dump_commits_then_copies_and_restores_from_the_destination(sample_job, tmp_path, reference):
    job, expected, a, b = job_and_two_repos(sample_job, tmp_path, reference)
    d = _tiered(job, a, b)
    c = d["copy"]
    assert c["status"] == "copied" and c["copied"] == [Path(d["snapshot"]).name] and c["error"] is None, c
    # the job waited for the local commit only: the copy started after it, and is no phase of the dump
    assert d["committed_at"] <= c["started_at"] and "copy" not in d["phases"]
    print(f"tiered dump: frozen {d['frozen_seconds']} s, dump {d['seconds']} s, copy {c['seconds']} s after it")
    row = run_json("ls", "--repo", a)["snapshots"][0]
    assert row["copies"]["state"] == "copied" and row["copies"]["copied_to"][0]["to"] == str(b)
    text = run_gpusnap("ls", "--repo", a).stdout
    assert f"copied:{b}" in "".join(text.split()), text      # (a long path is folded over lines)
    assert _names(b) == _names(a)
    assert run_gpusnap("verify", "--repo", b).returncode == 0
    job.kill()
    # the local snapshot is gone (a lost node's disk): restore finds the copy and verifies it
    run_gpusnap("forget", Path(d["snapshot"]).name, "--repo", a, check=True)
    restored = run_json("restore", "train", "--repo", a, "--copy-to", b)
    try:
        assert restored["pid"] == job.pid and restored["snapshot"].startswith(str(b))
        assert job.result() == expected
    finally:
        kill_pids(job.pids)


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.criu
def test_unreachable_destination_the_dump_succeeds_and_the_copy_catches_up(sample_job, tmp_path):
    job = sample_job(steps=2000, mb=8, threads=1, step_ms=20)
    job.wait_steps(3)
    a, b = tmp_path / "a", tmp_path / "b"             # b: no repository there yet
    _init(a)
    first = _tiered(job, a, b)
    assert first["copy"]["status"] == "pending" and "no gpusnap repository" in first["copy"]["error"]
    assert first["copy"]["pending"] == [Path(first["snapshot"]).name]
    assert first["committed_at"] <= first["copy"]["started_at"]
    human = run_gpusnap("dump", job.pid, "--repo", a, "--name", "train", "--copy-to", b)
    assert human.returncode == 0 and f"not copied to {b} yet" in human.stderr, human.stderr
    assert _states(a) == ["not-copied-yet"] * 2 and job.alive()
    text = run_gpusnap("ls", "--repo", a).stdout
    assert f"notcopiedyet:{b}" in "".join(text.split()), text
    # the destination comes back: `copy --pending` copies both, a second one has nothing to do
    _init(b)
    caught = run_json("copy", "--pending", "--to", b, "--repo", a)
    assert caught["copied"] == 2 and _states(a) == ["copied"] * 2
    assert run_json("copy", "--pending", "--to", b, "--repo", a)["snapshots"] == []
    # away again (renamed), two dumps wait; back, the next dump copies all three
    os.rename(b, tmp_path / "b.off")
    waiting = [_tiered(job, a, b)["snapshot"] for _ in range(2)]
    os.rename(tmp_path / "b.off", b)
    third = _tiered(job, a, b)
    assert sorted(third["copy"]["copied"]) == sorted(Path(p).name for p in [*waiting, third["snapshot"]])
    assert _states(a) == ["copied"] * 5 and _names(b) == _names(a)
    assert verify(Repository.open(b)).ok
    # an ssh:// destination nobody answers: the dump still succeeds, its snapshot waits for it
    ssh = run_gpusnap("dump", job.pid, "--repo", a, "--name", "train", "--copy-to",
                      f"ssh://127.0.0.1:{_closed_port()}/x", "--json",
                      env={"GPUSNAP_RSH": "ssh -o BatchMode=yes -o ConnectTimeout=5 -o StrictHostKeyChecking=no"})
    assert ssh.returncode == 0, ssh.stderr
    out = json.loads(ssh.stdout)
    assert out["copy"]["status"] == "pending" and out["copy"]["to"].startswith("ssh://"), out["copy"]
    assert _states(a)[-1] == "not-copied-yet" and job.alive()


@pytest.mark.criu
def test_retention_per_tier_never_deletes_an_uncopied_snapshot(sample_job, tmp_path):
    job = sample_job(steps=2000, mb=8, threads=1, step_ms=20)
    job.wait_steps(3)
    a, b = tmp_path / "a", tmp_path / "b"
    _init(a)
    for _ in range(3):          # the destination is missing: nothing is copied, nothing is pruned
        assert _tiered(job, a, b, "--keep-last", "1")["pruned"] == []
    assert _states(a) == ["not-copied-yet"] * 3
    assert run_json("prune", "--keep-last", "1", "--repo", a)["snapshots_deleted"] == []
    _init(b)
    last = _tiered(job, a, b, "--keep-last", "1", "--copy-keep-last", "2")
    assert len(last["copy"]["copied"]) == 4 and len(last["pruned"]) == 3, last
    assert _names(a) == [Path(last["snapshot"]).name] and _states(a) == ["copied"]
    assert len(_names(b)) == 2 and Path(last["snapshot"]).name in _names(b)
    assert len(last["copy"]["retention"]["deleted"]) == 2 and last["copy"]["retention"]["error"] is None
    assert verify(Repository.open(b)).ok and verify(Repository.open(a)).ok
    # asked to: --prune-uncopied lets --keep-last go
    os.rename(b, tmp_path / "b.off")
    _tiered(job, a, b)
    assert _states(a) == ["copied", "not-copied-yet"]
    gone = run_json("prune", "--keep-last", "1", "--prune-uncopied", "--repo", a)["snapshots_deleted"]
    assert len(gone) == 1 and _states(a) == ["not-copied-yet"]
    job.kill()


def test_pending_records_protect_from_retention_and_are_swept(tmp_path):
    """No CRIU: snapshots made by the repository's writer, marked pending as a tiered dump does."""
    repo = Repository.open(tmp_path / "a", create=True)
    snaps = [fake_dump(repo, {"pages-1.img": os.urandom(8 * 4096), "core-1.img": os.urandom(64)}, name="j")[0]
             for _ in range(3)]
    to = str(tmp_path / "b")
    for s in snaps[:2]:
        copies.mark_pending(repo.path, s, to)
    assert copies.pending(repo, to) == sorted(s.path.name for s in snaps[:2])
    deleted, _ = prune_op.retain(repo, "j", 1)
    assert deleted == [] and len(repo.snapshots()) == 3
    copies.write_record(repo.path, snaps[0].path.name, snaps[0].id, to, "copied")
    deleted, _ = prune_op.retain(repo, "j", 1)
    assert deleted == [snaps[0].id]
    assert [s.path.name for s in repo.snapshots()] == [s.path.name for s in snaps[1:]]
    copies.sweep(repo)
    assert set(copies.records(repo.path)) == {snaps[1].path.name}
    # a damaged record is skipped, never an error
    (repo.path / "copies" / "junk.0123456789abcdef").write_text("{not json")
    assert set(copies.records(repo.path)) == {snaps[1].path.name}


@pytest.mark.criu
def test_a_schedule_with_copy_to_copies_and_logs_it(sched_env, installed_gpusnap, sample_job, tmp_path):  # noqa: F811
    job = sample_job(steps=2000, mb=8, threads=1, step_ms=20)
    job.wait_steps(3)
    a, b = tmp_path / "a", tmp_path / "b"
    _init(a)
    marker = f"gpusnap.samples.job {job.out}"
    p = run_gpusnap("schedule", "add", "--match", marker, "--name", "tiered", "--every", "5m", "--keep-last", "1",
                    "--repo", a, "--copy-to", b, "--copy-keep-last", "2", "--json", env=sched_env)
    assert p.returncode == 0, p.stderr
    from gpusnap.ops import schedule

    s = schedule.load("tiered")
    assert s.copy_to == str(b) and s.copy_keep_last == 2
    r = _run_as_cron(s.path)                  # b is missing: the run succeeds, the copy waits
    assert r.returncode == 0, r.stderr
    _init(b)
    for _ in range(2):
        r = _run_as_cron(s.path)
        assert r.returncode == 0, r.stderr
    recs = [json.loads(ln) for ln in open(s.log).read().splitlines()]
    assert [x["outcome"] for x in recs] == ["ok"] * 3
    assert [x["copy"]["status"] for x in recs] == ["pending", "copied", "copied"], recs
    assert "no gpusnap repository" in recs[0]["copy"]["error"]
    assert [x["copy"]["copied"] for x in recs[1:]] == [2, 1] and recs[2]["copy"]["pruned_there"] == 1
    assert _states(a) == ["copied"] and len(_names(b)) == 2 and recs[-1]["snapshot"].startswith(str(a))
    st = run_json("schedule", "ls", env=sched_env)["schedules"][0]
    assert st["copy_to"] == str(b) and st["last_copy"]["status"] == "copied"
    assert verify(Repository.open(b)).ok and job.alive()
    job.kill()


def test_copy_to_is_checked_before_anything_runs(tmp_path):
    p = run_gpusnap("dump", "1", "--repo", tmp_path, "--copy-to", "ssh://bad host/x")
    assert p.returncode == 2 and "not a repository path" in p.stderr, p.stderr
    p = run_gpusnap("dump", "1", "--repo", tmp_path, "--copy-keep-last", "2")
    assert p.returncode == 2 and "--copy-to" in p.stderr, p.stderr
    p = run_gpusnap("restore", "x", "--repo", tmp_path, "--copy-to", "ssh://bad host/x")
    assert p.returncode == 2 and "not a repository path" in p.stderr, p.stderr
    assert sys.executable
