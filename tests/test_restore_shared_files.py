"""A restore never touches a file that another live process uses, and `inspect` says beforehand
exactly what the restore then does (one function decides: restore_files.check).

- two jobs append to one log; one is snapshotted, crashes and is restored while the other still
  writes: the log is left as it is (restore says so in one line), every line of the other job
  stays, and the restored job finishes with the uninterrupted result;
- a `>` log (not appended) that another process holds open: refused, exit 25, naming the file
  and the process, nothing changed; once that process is gone, inspect and restore agree that
  the grown tail is set aside, and the job finishes;
- a `>` log that grew after the dump: inspect says it will be set aside (not that restore will
  fail), and the restore succeeds;
- a log whose mode changed: both say the restore fails, naming it (exit 25, not CRIU's exit 8).
Real CRIU, real processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import kill_pids, run_gpusnap, run_json, wait_for

pytestmark = pytest.mark.criu

JOB = r'''
import hashlib, os, sys, time
out, log, tag, steps, step_ms = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
f = open(log, "a") if log != "-" else sys.stdout        # appended to, or the `>` stdout
h = hashlib.sha256()
with open(os.path.join(out, "pid"), "w") as p:
    p.write(str(os.getpid()))
for i in range(1, steps + 1):
    h.update(i.to_bytes(4, "little"))
    f.write(f"{tag} {i}/{steps} {h.hexdigest()[:16]}\n")
    f.flush()
    if step_ms:
        time.sleep(step_ms / 1000)
with open(os.path.join(out, "result.tmp"), "w") as r:
    r.write(h.hexdigest())
os.rename(os.path.join(out, "result.tmp"), os.path.join(out, "result"))
'''


def _start(out: Path, log: str, tag: str, steps: int, step_ms: float, stdout: Path | None = None) -> subprocess.Popen:
    """log "-": the job writes to its stdout, `> stdout` (O_WRONLY|O_TRUNC, as a shell does)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.py").write_text(JOB)
    argv = [sys.executable, str(out / "job.py"), str(out), log, tag, str(steps), str(step_ms)]
    if stdout is not None:
        argv = ["sh", "-c", 'exec "$@" > "$LOG"', "sh", *argv]
    return subprocess.Popen(argv, env={**os.environ, "LOG": str(stdout)}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _lines(path: Path, tag: str) -> int:
    try:
        return sum(1 for ln in path.read_text().splitlines() if ln.startswith(tag + " "))
    except FileNotFoundError:
        return 0


def _dump_then_kill(job: subprocess.Popen, log: Path, tag: str, repo: Path) -> str:
    wait_for(lambda: _lines(log, tag) >= 5, "the job's first lines")
    snap = run_json("dump", job.pid, "--repo", repo)["snapshot"]
    n = _lines(log, tag)
    wait_for(lambda: _lines(log, tag) >= n + 10, "the job to log on after the dump")
    os.kill(job.pid, signal.SIGKILL)
    job.wait(timeout=30)
    wait_for(lambda: not Path(f"/proc/{job.pid}").exists(), "the killed job's PID to be free")
    return snap


def _reference(tmp_path: Path, steps: int) -> str:
    ref = tmp_path / "reference"
    assert _start(ref, str(tmp_path / "reference.log"), "R", steps, 0).wait(timeout=60) == 0
    return (ref / "result").read_text()


def _inspect(repo: Path, snap: str) -> tuple[dict, dict, str]:
    rep = run_json("inspect", snap, "--repo", repo)
    text = run_gpusnap("inspect", snap, "--repo", repo, env={"COLUMNS": "400"}, check=True).stdout
    return rep, {c["path"]: c for c in rep.get("file_checks", [])}, " ".join(text.split())


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_shared_append_log_keeps_the_other_jobs_lines_when_one_job_is_restored(tmp_path, repo):
    expected = _reference(tmp_path, 150)
    log = tmp_path / "shared.log"
    other = _start(tmp_path / "b", str(log), "B", 600, 30)
    job = _start(tmp_path / "a", str(log), "A", 150, 30)
    try:
        wait_for(lambda: _lines(log, "B") >= 5, "the other job's first lines")
        snap = _dump_then_kill(job, log, "A", repo)
        assert other.poll() is None, "the other job must still be writing during the restore"
        rep, checks, text = _inspect(repo, snap)
        assert rep["files_changed"] == [] and "restore will fail" not in text
        assert checks[str(log)]["verdict"] == "left" and f"process {other.pid} " in checks[str(log)]["detail"]
        assert f"left as it is" in text
        r = run_gpusnap("restore", snap, "--repo", repo)
        assert r.returncode == 0, r.stdout + r.stderr
        notes = [ln for ln in r.stderr.splitlines() if "note:" in ln]
        assert len(notes) == 1 and str(log) in notes[0] and "left as it is" in notes[0], r.stderr
        try:
            wait_for(lambda: (tmp_path / "a" / "result").exists(), "the restored job's result", timeout=120)
            assert other.wait(timeout=120) == 0
        finally:
            kill_pids([job.pid])
        assert (tmp_path / "a" / "result").read_text() == expected
        lines = log.read_text().splitlines()
        # the other job's lines: every one, once, in order
        assert [ln.split()[1] for ln in lines if ln.startswith("B ")] == [f"{i}/600" for i in range(1, 601)]
        # the restored job's: every step (those after the dump twice: the crashed run's stay too)
        assert {ln.split()[1] for ln in lines if ln.startswith("A ")} == {f"{i}/150" for i in range(1, 151)}
        assert not list(tmp_path.glob("shared.log.gpusnap-*"))
    finally:
        _stop(job, other)


def test_grown_log_another_process_holds_open_is_refused_naming_it_until_it_is_closed(tmp_path, repo):
    expected = _reference(tmp_path, 150)
    log = tmp_path / "train.log"
    job = _start(tmp_path / "a", "-", "A", 150, 30, stdout=log)
    holder = None
    try:
        snap = _dump_then_kill(job, log, "A", repo)
        with open(log, "r+b") as f:      # another program keeps the log open for writing
            holder = subprocess.Popen(["sleep", "600"], stdout=f, stdin=subprocess.DEVNULL, start_new_session=True)
        before = log.read_bytes()
        rep, checks, text = _inspect(repo, snap)
        assert rep["files_changed"] == [str(log)] and "restore will fail until these files" in text
        assert checks[str(log)]["verdict"] == "refused" and f"process {holder.pid} (sleep)" in text
        r = run_gpusnap("restore", snap, "--repo", repo, "--json")
        assert r.returncode == 25, r.stdout + r.stderr
        err = json.loads(r.stdout)
        assert str(log) in err["message"] and f"process {holder.pid} (sleep)" in err["message"] and err["hint"]
        assert log.read_bytes() == before and not list(tmp_path.glob("train.log.gpusnap-*"))
        assert not Path(f"/proc/{job.pid}").exists()
        _stop(holder)
        # nobody else uses it now: inspect and restore agree that the tail is set aside
        rep, checks, text = _inspect(repo, snap)
        assert rep["files_changed"] == [] and checks[str(log)]["verdict"] == "set-aside"
        assert "restore will fail" not in text
        r = run_gpusnap("restore", snap, "--repo", repo)
        assert r.returncode == 0, r.stdout + r.stderr
        try:
            wait_for(lambda: (tmp_path / "a" / "result").exists(), "the restored job's result", timeout=120)
        finally:
            kill_pids([job.pid])
        assert (tmp_path / "a" / "result").read_text() == expected
        assert len(list(tmp_path.glob("train.log.gpusnap-*-after"))) == 1
    finally:
        _stop(job, *([holder] if holder else []))


def test_inspect_of_a_grown_log_says_it_is_set_aside_and_the_restore_succeeds(tmp_path, repo):
    log = tmp_path / "train.log"
    job = _start(tmp_path / "a", "-", "A", 2000, 20, stdout=log)
    try:
        snap = _dump_then_kill(job, log, "A", repo)
        rep, checks, text = _inspect(repo, snap)
        assert rep["files_changed"] == [] and "restore will fail" not in text
        assert checks[str(log)]["verdict"] == "set-aside" and "restore: " in text and "sets them aside" in text
        r = run_gpusnap("restore", snap, "--repo", repo, "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        kill_pids(json.loads(r.stdout)["pids"])
    finally:
        _stop(job)


def test_a_file_whose_mode_changed_is_refused_by_inspect_and_restore_alike(tmp_path, repo):
    log = tmp_path / "train.log"
    job = _start(tmp_path / "a", "-", "A", 2000, 20, stdout=log)
    try:
        snap = _dump_then_kill(job, log, "A", repo)
        os.chmod(log, 0o600)        # CRIU refuses a file whose mode changed
        rep, checks, text = _inspect(repo, snap)
        assert rep["files_changed"] == [str(log)] and "chmod it back" in checks[str(log)]["detail"]
        assert "restore will fail until these files" in text
        before = log.read_bytes()
        r = run_gpusnap("restore", snap, "--repo", repo, "--json")
        assert r.returncode == 25, r.stdout + r.stderr
        assert str(log) in json.loads(r.stdout)["message"] and "mode" in json.loads(r.stdout)["message"]
        assert log.read_bytes() == before and not Path(f"/proc/{job.pid}").exists()
    finally:
        _stop(job)
