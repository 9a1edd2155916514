"""Scheduled work waits instead of failing (issue 31 item 6): a dump, prune, forget or import
that finds the repository's lock held against it (by a prune; writers no longer keep each
other out: tests/test_concurrent_writers.py) waits for it (bounded: --lock-wait SECONDS,
$GPUSNAP_LOCK_WAIT, default repo/lockwait.DEFAULT_WAIT), says "waiting for …", and only then
fails with exit 10; a dump's --keep-last retention waits the same way for a restore or verify
holding the readers lock, instead of exit 21. Two dumps into one repository started at the
same moment (two schedules firing in the same minute) both commit, round after round."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys

import pytest

from conftest import GPUSNAP, ROOT, run_gpusnap, run_json
from gpusnap.errors import RepositoryLocked
from gpusnap.ops.export import export_snapshot
from gpusnap.repo import Repository
from repo_helpers import PAGE, dump

HOLD = """
import sys
from gpusnap.repo import Repository
r = Repository.open(sys.argv[1])
with r.writer_lock(exclusive=True):      # as a prune holds it
    print("locked", flush=True)
    sys.stdin.read()          # held until the test closes our stdin
"""


class Holder:
    """Another process holding the repository's exclusive lock (a prune) until release():
    dumps, imports and forgets, which take it shared, wait for it as prunes do."""

    def __init__(self, path):
        self.p = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert self.p.stdout.readline().strip() == "locked"

    def release(self) -> None:
        self.p.stdin.close()
        assert self.p.wait(timeout=60) == 0


def _start(*args, env=None) -> subprocess.Popen:
    e = {k: v for k, v in os.environ.items() if k != "GPUSNAP_LOCK_WAIT"}
    e.update(env or {})
    return subprocess.Popen([*GPUSNAP, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=e)


def _wait_for_line(p: subprocess.Popen, text: str) -> str:
    """The first line of p's stderr that holds `text` (p must say it before it ends)."""
    for line in p.stderr:
        if text in line:
            return line
    raise AssertionError(f"never said {text!r}: exit {p.wait()}, stdout {p.stdout.read()!r}")


def _synthetic_repo(tmp_path, n=3):
    repo = Repository.open(tmp_path / "repo", create=True)
    snaps = [dump(repo, {"pages-1.img": os.urandom(PAGE * 4) + bytes([k + 1]) * PAGE}, name="job")[0]
             for k in range(n)]
    return repo, snaps


@pytest.mark.parametrize("command", ["prune", "forget", "import"])
def test_writers_wait_for_the_lock_say_so_then_succeed(tmp_path, command):
    repo, snaps = _synthetic_repo(tmp_path)
    export = tmp_path / "x.gsx"
    export_snapshot(snaps[0], str(export))
    target = Repository.open(tmp_path / "target", create=True) if command == "import" else repo
    args, expected = {"prune": (("prune", "--keep-last", "1"), snaps[2:]),
                      "forget": (("forget", snaps[0].id), snaps[1:]),
                      "import": (("import", export), snaps[:1])}[command]
    holder = Holder(target.path)
    p = _start(*args, "--repo", target.path, "--json")
    try:
        line = _wait_for_line(p, "waiting for")
        assert f"pid {holder.p.pid}" in line and str(target.path) in line
    finally:
        holder.release()
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, (out, err)
    # what is there now, by the id of the snapshot each came from (an import's is its source's)
    left = [(s.meta.get("imported_from") or {}).get("id", s.id) for s in Repository.open(target.path).snapshots()]
    assert left == [s.id for s in expected]


def test_a_short_wait_ends_with_exit_10_saying_who_holds_it(tmp_path):
    repo, snaps = _synthetic_repo(tmp_path)
    holder = Holder(repo.path)
    try:
        p = run_gpusnap("prune", "--keep-last", "1", "--repo", repo.path, "--lock-wait", "0.3")
        assert p.returncode == RepositoryLocked.exit_code, p.stderr
        assert f"locked by pid {holder.p.pid}" in p.stderr and "waited 0.3 s" in p.stderr
        assert "--lock-wait" in p.stderr                    # the hint says how to wait longer
        e = run_gpusnap("forget", snaps[0].id, "--repo", repo.path, env={"GPUSNAP_LOCK_WAIT": "0"})
        assert e.returncode == RepositoryLocked.exit_code and "waiting for" not in e.stderr
        bad = run_gpusnap("prune", "--repo", repo.path, env={"GPUSNAP_LOCK_WAIT": "soon"})
        assert bad.returncode == 2 and "GPUSNAP_LOCK_WAIT" in bad.stderr
    finally:
        holder.release()
    assert [s.id for s in Repository.open(repo.path).snapshots()] == [s.id for s in snaps]


@pytest.mark.criu
def test_a_dump_waits_for_a_held_lock_then_commits(sample_job, repo):
    job = sample_job(steps=5000, mb=8, threads=1, step_ms=20)
    job.wait_steps(3)
    Repository.open(repo, create=True)
    holder = Holder(repo)
    d = _start("dump", job.pid, "--repo", repo, "--name", "w", "--json")
    try:
        line = _wait_for_line(d, "waiting for")
        assert f"pid {holder.p.pid}" in line
    finally:
        holder.release()
    out, err = d.communicate(timeout=300)
    assert d.returncode == 0, (out, err)
    snap = json.loads(out)["snapshot"]
    assert [s["dir"] for s in run_json("ls", "--repo", repo)["snapshots"]] == [os.path.basename(snap)]
    assert job.alive()


@pytest.mark.criu
def test_a_dump_with_a_short_wait_exits_10_and_the_job_runs_on(sample_job, repo):
    job = sample_job(steps=5000, mb=8, threads=1, step_ms=20)
    job.wait_steps(3)
    Repository.open(repo, create=True)
    holder = Holder(repo)
    try:
        p = run_gpusnap("dump", job.pid, "--repo", repo, "--name", "w", "--lock-wait", "0.5")
        assert p.returncode == RepositoryLocked.exit_code, p.stderr
        assert f"locked by pid {holder.p.pid}" in p.stderr and "waited 0.5 s" in p.stderr
    finally:
        holder.release()
    assert run_json("ls", "--repo", repo)["snapshots"] == []
    s = job.steps_done()
    job.wait_steps(s + 2)                       # unfrozen, running


@pytest.mark.criu
def test_retention_waits_for_a_verify_instead_of_failing(sample_job, repo):
    job = sample_job(steps=5000, mb=8, threads=1, step_ms=20)
    job.wait_steps(3)
    for _ in range(2):
        assert run_gpusnap("dump", job.pid, "--repo", repo, "--name", "r", "--quiet").returncode == 0
    # a verify (or restore) reading: the readers lock held shared by another open file
    fd = os.open(repo / "locks" / "readers", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        d = _start("dump", job.pid, "--repo", repo, "--name", "r", "--keep-last", "1", "--json")
        _wait_for_line(d, "waiting for a restore or verify")
    finally:
        os.close(fd)
    out, err = d.communicate(timeout=300)
    assert d.returncode == 0, (out, err)
    res = json.loads(out)
    assert res["prune_error"] is None and len(res["pruned"]) == 2
    assert [s["dir"] for s in run_json("ls", "--repo", repo)["snapshots"]] == [os.path.basename(res["snapshot"])]


ROUNDS = 6


@pytest.mark.criu
def test_two_dumps_started_together_both_commit_every_round(sample_job, repo):
    """As two schedules firing in the same minute run them: `dump --keep-last` of two jobs
    into one repository, started at the same moment, ROUNDS times: every snapshot is taken."""
    jobs = [sample_job(f"job{k}", steps=100000, mb=8, threads=1, step_ms=20, seed=k + 1) for k in range(2)]
    for j in jobs:
        j.wait_steps(2)
    Repository.open(repo, create=True)
    taken = []
    for _ in range(ROUNDS):
        ps = [_start("dump", j.pid, "--repo", repo, "--name", f"s{k}", "--keep-last", "2", "--json")
              for k, j in enumerate(jobs)]
        for p in ps:
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, (p.returncode, err)
            res = json.loads(out)
            assert res["prune_error"] is None
            taken.append(res["snapshot"])
    assert len(set(taken)) == 2 * ROUNDS
    left = sorted(s["dir"] for s in run_json("ls", "--repo", repo)["snapshots"])
    assert left == sorted(os.path.basename(t) for t in taken[-4:])
    assert all(j.alive() for j in jobs)
    assert run_gpusnap("verify", "--repo", repo).returncode == 0


CREATE = """
import sys
from gpusnap.repo import Repository
print("ready", flush=True)
sys.stdin.readline()
print(Repository.open(sys.argv[1], create=True).config["id"], flush=True)
"""


def test_gpusnaps_creating_one_repository_at_once_all_succeed(tmp_path):
    """Two schedules' first run in the same minute: both create the repository. The second
    used to find it half made ("exists, is not empty", exit 14); now they take turns."""
    for k in range(8):
        path = tmp_path / f"r{k}"
        ps = [subprocess.Popen([sys.executable, "-c", CREATE, str(path)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
              for _ in range(3)]
        for p in ps:
            assert p.stdout.readline().strip() == "ready"
        for p in ps:                   # go, all at once
            p.stdin.write("go\n")
            p.stdin.flush()
        ids = set()
        for p in ps:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            ids.add(out.strip())
        assert ids == {Repository.open(path).config["id"]}
