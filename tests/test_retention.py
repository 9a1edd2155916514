"""Retention that cannot stop silently (issue 8 item 4): a failed `dump --keep-last` exits
21 with the snapshot committed and a line on stderr even with --quiet; an unreadable entry in
snapshots/ never blocks the retention of the others and is never deleted; prune merges small
packs and repacks mostly-garbage ones (new pack + index durable before old ones go); logs go
with their snapshots and failed-run logs are bounded."""

import fcntl
import json
import os

import pytest

from conftest import run_gpusnap, run_json
from gpusnap.repo import Repository
from gpusnap.repo.maint.prune import FAILED_LOGS_KEPT, execute_prune, plan_packs, plan_prune, prune_logs, snapshots_info
from gpusnap.repo.maint.verify import verify
from repo_helpers import PAGE, dump, read_all


def _dump(job, repo, name, *extra):
    return run_gpusnap("dump", job.pid, "--repo", repo, "--name", name, *extra)


@pytest.mark.criu
def test_failed_retention_exits_21_and_says_the_snapshot_is_committed(sample_job, repo):
    job = sample_job(steps=5000, mb=8, threads=1, step_ms=20)
    job.wait_steps(3)
    for _ in range(2):
        assert _dump(job, repo, "r", "--quiet").returncode == 0
    # a restore reading the repository holds the readers lock: retention cannot prune now
    fd = os.open(repo / "locks" / "readers", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        p = _dump(job, repo, "r", "--keep-last", "1", "--quiet", "--lock-wait", "0")   # (no wait: fails now)
        assert p.returncode == 21, (p.returncode, p.stderr)
        path = p.stdout.strip()
        assert path.startswith(str(repo / "snapshots")) and os.path.isdir(path)
        assert "is committed" in p.stderr and "retention failed" in p.stderr
        j = _dump(job, repo, "r", "--keep-last", "1", "--json", "--lock-wait", "0")
        assert j.returncode == 21
        obj = json.loads(j.stdout)            # exactly one JSON object
        assert obj["exit_code"] == 21 and obj["prune_error"] and os.path.isdir(obj["snapshot"])
    finally:
        os.close(fd)
    assert len(run_json("ls", "--repo", repo)["snapshots"]) == 4
    # the next run catches up
    assert _dump(job, repo, "r", "--keep-last", "1", "--quiet").returncode == 0
    assert len(run_json("ls", "--repo", repo)["snapshots"]) == 1
    assert job.alive() and run_gpusnap("verify", "--repo", repo).returncode == 0


@pytest.mark.criu
def test_unreadable_entries_never_block_retention(sample_job, repo, tmp_path):
    job = sample_job(steps=5000, mb=8, threads=1, step_ms=20)
    job.wait_steps(3)
    assert _dump(job, repo, "other", "--quiet").returncode == 0
    other = next((repo / "snapshots").iterdir())
    m = other / "manifest"
    data = bytearray(m.read_bytes())
    data[len(data) // 2] ^= 0x40                  # one flipped byte in a snapshot of another name
    m.write_bytes(bytes(data))
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, repo / "snapshots" / "zz-planted")
    for _ in range(4):
        p = _dump(job, repo, "r", "--keep-last", "2", "--quiet")
        assert p.returncode == 0, p.stderr
        assert "unreadable entry skipped" in p.stderr      # a cron log shows it
    names = [s["name"] for s in run_json("ls", "--repo", repo)["snapshots"]]
    assert names == ["r", "r"]
    assert m.exists() and (repo / "snapshots" / "zz-planted").is_symlink()     # reported, never deleted
    assert job.alive()


@pytest.mark.criu
def test_logs_go_with_their_snapshots(sample_job, repo):
    job = sample_job(steps=5000, mb=8, threads=1, step_ms=20)
    job.wait_steps(3)
    for _ in range(4):
        assert _dump(job, repo, "l", "--keep-last", "2", "--quiet").returncode == 0
    dirs = {s["dir"] for s in run_json("ls", "--repo", repo)["snapshots"]}
    logs = sorted(os.listdir(repo / "logs"))
    assert logs == sorted(f"{d}-dump.log" for d in dirs)


def test_failed_run_logs_are_bounded(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    logs = repo.path / "logs"
    logs.mkdir(mode=0o700)
    for i in range(FAILED_LOGS_KEPT + 5):
        f = logs / f"failed-dump-x-{i:03d}.log"
        f.write_text("x")
        os.utime(f, (1000 + i, 1000 + i))
    (logs / "gone-snapshot-dump.log").write_text("x")
    assert prune_logs(repo.path) == 6
    left = sorted(os.listdir(logs))
    assert left == [f"failed-dump-x-{i:03d}.log" for i in range(5, FAILED_LOGS_KEPT + 5)]


def test_plan_packs():
    MB = 1 << 20
    sizes = {b"a": (40 * MB, 40 * MB), b"b": (40 * MB, 0), b"c": (40 * MB, 10 * MB),
             b"d": (1 * MB, 1 * MB), b"e": (2 * MB, 2 * MB), b"f": (40 * MB, 39 * MB)}
    keep, rewrite, delete = plan_packs(sizes)
    assert delete == [b"b"] and keep == [b"a", b"f"] and rewrite == [b"c", b"d", b"e"]
    # one small pack alone is left as it is
    keep, rewrite, delete = plan_packs({b"a": (40 * MB, 40 * MB), b"d": (MB, MB)})
    assert keep == [b"a", b"d"] and not rewrite and not delete


def test_prune_merges_small_packs_and_repacks_garbage(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    imgs = []
    for k in range(10):                            # ten incremental dumps, one small pack each
        img = os.urandom(PAGE * 16) + bytes([k + 1]) * PAGE
        dump(repo, {"pages-1.img": img})
        imgs.append(img)
    packs = lambda: [p for p in (repo.path / "packs").rglob("*") if p.is_file()]
    assert len(packs()) >= 10
    res = execute_prune(repo, plan_prune(snapshots_info(repo), 3))
    assert res["packs_written"] >= 1
    assert len(packs()) == 1
    assert verify(repo).ok
    for s, img in zip(repo.snapshots(), imgs[-3:]):
        assert read_all(s, "pages-1.img") == img


@pytest.mark.criu
def test_retention_prune_and_forget_refuse_a_reader_the_same_way(sample_job, repo):
    """One lock policy (prune.locked): with a restore reading, a dump's --keep-last, `prune`
    and `forget --prune` all refuse with the same error, and delete nothing; a dry run of
    prune (the readers lock shared) goes on."""
    job = sample_job(steps=5000, mb=8, threads=1, step_ms=20)
    job.wait_steps(3)
    for _ in range(3):
        assert _dump(job, repo, "r", "--quiet").returncode == 0
    fd = os.open(repo / "locks" / "readers", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        d = _dump(job, repo, "r", "--keep-last", "1", "--json", "--lock-wait", "0")
        assert d.returncode == 21, d.stderr
        dumped = json.loads(d.stdout)
        refusals = [run_gpusnap(*cmd, "--repo", repo, "--json", "--lock-wait", "0")
                    for cmd in (("prune", "--keep-last", "1", "--name", "r"),
                                ("forget", "--keep-last", "1", "--name", "r", "--prune"))]
        for p in refusals:
            assert p.returncode == 10, (p.returncode, p.stderr)
            assert dumped["prune_error"] == json.loads(p.stdout)["message"]
        assert len(run_json("ls", "--repo", repo)["snapshots"]) == 4
        dry = run_json("prune", "--keep-last", "1", "--name", "r", "--dry-run", "--repo", repo)
    finally:
        os.close(fd)
    assert len(dry["snapshots_deleted"]) == 3
    assert _dump(job, repo, "r", "--keep-last", "1", "--quiet").returncode == 0
    assert len(run_json("ls", "--repo", repo)["snapshots"]) == 1
    assert job.alive() and run_gpusnap("verify", "--repo", repo).returncode == 0
