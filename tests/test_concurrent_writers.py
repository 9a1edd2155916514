"""Many writers at once (issue 35 item 1, docs/format.md §6): dumps of different jobs into one
repository run together and all commit (no exit 10), verify is clean, and each snapshot
restores to the uninterrupted result; a writer killed or interrupted at every fault point
while another commits leaves the other's snapshot intact and nothing of its own visible; a
prune waits for the writers, and writers started during a prune wait for it; lock files of
dead processes and of other machines that stopped refreshing them are taken over, and one
that is refreshed keeps others out. Real dumps, real CRIU, real signals, real lock files."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import GPUSNAP, ROOT, run_gpusnap, run_json
from gpusnap.errors import RepositoryLocked
from gpusnap.repo import Repository
from gpusnap.system.proc import boot_id
from restore_helpers import restore_and_finish
from test_faults import _stopped, wait_criu_gone

JOB = dict(steps=400, mb=8, threads=1)


def _start(*args, env=None) -> subprocess.Popen:
    e = {k: v for k, v in os.environ.items() if k not in ("GPUSNAP_LOCK_WAIT", "GPUSNAP_FAULT")}
    e.update(env or {})
    return subprocess.Popen([*GPUSNAP, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=e)


def _lock_files(repo: Path) -> list[str]:
    return sorted(n for n in os.listdir(repo / "locks") if n.startswith("lock-"))


def _jobs(sample_job, n: int, **kw):
    jobs = [sample_job(f"job{k}", step_ms=20, seed=k + 1, **{**JOB, **kw}) for k in range(n)]
    for j in jobs:
        j.wait_steps(2)
    return jobs


@pytest.mark.criu
def test_concurrent_dumps_all_commit_verify_and_restore(sample_job, repo, reference):
    n = 4
    jobs = _jobs(sample_job, n)
    Repository.open(repo, create=True)
    taken: dict[int, list[str]] = {k: [] for k in range(n)}
    for _ in range(2):
        ps = [_start("dump", j.pid, "--repo", repo, "--name", f"w{k}", "--json", "--lock-wait", "0")
              for k, j in enumerate(jobs)]
        for k, p in enumerate(ps):
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, (k, p.returncode, err)      # never 10: nobody waits for anybody
            taken[k].append(json.loads(out)["snapshot"])
    listed = {s["dir"] for s in run_json("ls", "--repo", repo)["snapshots"]}
    assert listed == {os.path.basename(t) for v in taken.values() for t in v}
    v = run_json("verify", "--repo", repo)
    assert v["ok"], v
    assert _lock_files(repo) == []
    for k, j in enumerate(jobs):
        j.kill()
        restore_and_finish(j, taken[k][-1], repo, reference(seed=k + 1, **JOB))


POINTS = ["writer:open", "pack:opened", "commit:start", "pack:renamed", "commit:packs-durable",
          "commit:index-renamed", "commit:locations-written", "commit:manifest-written",
          "commit:snapshot-renamed", "commit:done"]
COMMITTED_AT = {"commit:snapshot-renamed", "commit:done"}


@pytest.mark.criu
@pytest.mark.parametrize("sig", ["KILL", "TERM"])
def test_a_writer_signalled_at_every_point_while_another_commits(sample_job, repo, sig):
    """The victim is held at the point (SIGSTOP through the hook), the other dump runs start
    to end meanwhile, then the victim gets the signal: the other's snapshot is there and
    verifies, the victim's is there only if the point is past its commit."""
    victim, other = _jobs(sample_job, 2, steps=100000)
    Repository.open(repo, create=True)
    good = []
    for point in POINTS:
        before = {s["dir"] for s in run_json("ls", "--repo", repo)["snapshots"]}
        v = _start("dump", victim.pid, "--repo", repo, "--name", "victim", env={"GPUSNAP_FAULT": f"{point}:STOP"})
        _stopped(v)
        info = run_json("dump", other.pid, "--repo", repo, "--name", "other", "--lock-wait", "0")
        good.append(info["snapshot"])
        os.kill(v.pid, getattr(signal, f"SIG{sig}"))
        os.kill(v.pid, signal.SIGCONT)
        _, err = v.communicate(timeout=300)
        assert "Traceback" not in err, (point, err)
        wait_criu_gone(victim.pid)
        after = {s["dir"] for s in run_json("ls", "--repo", repo)["snapshots"]}
        new = after - before - {os.path.basename(info["snapshot"])}
        assert len(new) == (1 if point in COMMITTED_AT else 0), (point, new)
        assert os.path.basename(info["snapshot"]) in after
        rep = run_json("verify", "--repo", repo)
        assert rep["ok"], (point, rep)
        for j in (victim, other):
            assert j.alive() or sig == "KILL", point
        time.sleep(0.1)
    assert run_gpusnap("prune", "--repo", repo).returncode == 0     # what the victims left
    assert run_json("verify", "--repo", repo)["ok"]
    other.kill()
    r = run_json("restore", good[-1], "--repo", repo)
    assert r["pid"] == other.pid
    s = other.steps_done()
    deadline = time.monotonic() + 60
    while other.steps_done() < s + 3:          # the restored job runs on
        assert time.monotonic() < deadline, "the restored job does not run"
        time.sleep(0.05)
    os.kill(other.pid, signal.SIGKILL)


HOLD = """
import sys
from gpusnap.repo import Repository
r = Repository.open(sys.argv[1])
with r.writer_lock(exclusive=sys.argv[2] == "exclusive"):
    print("locked", flush=True)
    sys.stdin.read()
"""


class Holder:
    def __init__(self, path, mode):
        self.p = subprocess.Popen([sys.executable, "-c", HOLD, str(path), mode], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert self.p.stdout.readline().strip() == "locked"

    def release(self) -> None:
        self.p.stdin.close()
        assert self.p.wait(timeout=60) == 0


def _import_args(tmp_path) -> tuple:
    """`gpusnap import` of a new snapshot (one the repository does not hold yet) each call."""
    from repo_helpers import PAGE, dump
    from gpusnap.ops.export import export_snapshot
    src = Repository.open(tmp_path / "src", create=True)
    snap = dump(src, {"pages-1.img": os.urandom(PAGE * 8)}, name="x")[0]
    out = tmp_path / f"{snap.id}.gsx"
    export_snapshot(snap, str(out))
    return ("import", out)


def test_prune_waits_for_writers_and_writers_wait_for_prune(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    imp = _import_args(tmp_path)
    writers = [Holder(repo.path, "shared") for _ in range(2)]
    r = run_gpusnap(*imp, "--repo", repo.path, "--lock-wait", "0")   # a third writer: at once
    assert r.returncode == 0, r.stderr
    p = _start("prune", "--repo", repo.path, "--lock-wait", "120")
    line = next(ln for ln in p.stderr if "waiting for" in ln)
    assert any(f"pid {w.p.pid}" in line for w in writers), line
    for w in writers:
        assert p.poll() is None
        w.release()
    assert p.wait(timeout=120) == 0
    prune = Holder(repo.path, "exclusive")
    try:
        r = run_gpusnap(*_import_args(tmp_path), "--repo", repo.path, "--lock-wait", "0.5")
        assert r.returncode == RepositoryLocked.exit_code and f"pid {prune.p.pid}" in r.stderr, r.stderr
        w = _start(*_import_args(tmp_path), "--repo", repo.path, "--lock-wait", "120")
        next(ln for ln in w.stderr if "waiting for" in ln)
    finally:
        prune.release()
    assert w.wait(timeout=120) == 0
    assert _lock_files(repo.path) == []


def _write_lock(repo: Path, name: str, **fields) -> Path:
    body = {"format": "gpusnap-lock", "version": 1, "exclusive": False, "what": "dump",
            "host": socket.gethostname(), "pid": 1, "start": 0, "boot": boot_id(),
            "created": time.time(), "refreshed": time.time(), **fields}
    path = repo / "locks" / f"lock-{name}"
    path.write_text(json.dumps(body))
    os.chmod(path, 0o600)
    return path


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_stale_lock_files_are_taken_over(tmp_path):
    """A lock file of a dead process on this machine, one of a process that reused nothing
    (its start time differs), and one from another machine not refreshed for longer than the
    staleness timeout: a prune (exclusive) takes over at once and removes them."""
    repo = Repository.open(tmp_path / "repo", create=True)
    me = Path(f"/proc/{os.getpid()}/stat").read_text()
    start = int(me[me.rindex(")") + 2:].split()[19])
    dead = _write_lock(repo.path, "a" * 32, pid=_dead_pid())
    reused = _write_lock(repo.path, "b" * 32, pid=os.getpid(), start=start + 1, exclusive=True)
    old = _write_lock(repo.path, "c" * 32, host="node-gone.example", boot="x", pid=os.getpid(),
                      created=time.time() - 3600, refreshed=time.time() - 3600)
    r = run_gpusnap("prune", "--repo", repo.path, "--lock-wait", "0")
    assert r.returncode == 0, r.stderr
    assert not dead.exists() and not reused.exists() and not old.exists()


def test_a_refreshed_lock_file_keeps_others_out_until_it_stops(tmp_path):
    """Another machine's writer, its lock file refreshed (here by a thread, as its holder's
    would): a prune is refused naming it; once the refreshing stops, the file is stale after
    GPUSNAP_LOCK_STALE seconds and a waiting prune takes over."""
    repo = Repository.open(tmp_path / "repo", create=True)
    path = _write_lock(repo.path, "d" * 32, host="node7.example", boot="y", pid=4242)
    stop = threading.Event()

    def refresh():
        while not stop.wait(0.3):
            _write_lock(repo.path, "d" * 32, host="node7.example", boot="y", pid=4242)
    t = threading.Thread(target=refresh)
    t.start()
    try:
        env = {"GPUSNAP_LOCK_STALE": "2"}
        r = run_gpusnap("prune", "--repo", repo.path, "--lock-wait", "4", env=env)
        assert r.returncode == RepositoryLocked.exit_code, r.stderr
        assert "pid 4242 on node7.example" in r.stderr
        ex = _write_lock(repo.path, "e" * 32, host="node8.example", boot="z", pid=77, exclusive=True, what="prune")
        w = run_gpusnap(*_import_args(tmp_path), "--repo", repo.path, "--lock-wait", "1", env=env)
        assert w.returncode == RepositoryLocked.exit_code and "pid 77 on node8.example" in w.stderr, w.stderr
        ex.unlink()
    finally:
        stop.set()
        t.join()
    t0 = time.monotonic()
    r = run_gpusnap("prune", "--repo", repo.path, "--lock-wait", "30", env={"GPUSNAP_LOCK_STALE": "2"})
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 < 20 and not path.exists()


def test_a_holder_refreshes_its_lock_file(tmp_path):
    """A long writer's file is rewritten while held (refreshed moves on), so other machines
    never take it for stale; it is gone once released."""
    repo = Repository.open(tmp_path / "repo", create=True)
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(repo.path), "shared"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, cwd=ROOT,
                         env={**os.environ, "GPUSNAP_LOCK_STALE": "1"})
    assert p.stdout.readline().strip() == "locked"
    (name,) = _lock_files(repo.path)
    first = json.loads((repo.path / "locks" / name).read_text())
    assert first["pid"] == p.pid and first["host"] == socket.gethostname() and not first["exclusive"]
    time.sleep(1.0)
    later = json.loads((repo.path / "locks" / name).read_text())
    assert later["refreshed"] > first["refreshed"] and later["created"] == first["created"]
    p.stdin.close()
    assert p.wait(timeout=60) == 0
    assert _lock_files(repo.path) == []
