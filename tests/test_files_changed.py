"""Files the job had open that changed after the dump, with the real CRIU.

- `python job.py > train.log` kept logging after the dump, then died: the restore sets the
  extra bytes aside next to the log, brings the log back to the snapshot's size, says so in
  one line, and the restored job finishes with the uninterrupted result and log.
- an output file that shrank, and an input file that vanished: refused (exit 25) naming the
  file, nothing restored.
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
out, steps, step_ms, inp = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
f = open(inp, "rb") if inp else None            # kept open: an input file of the job
h = hashlib.sha256(f.read() if f else b"")
with open(os.path.join(out, "pid"), "w") as p:
    p.write(str(os.getpid()))
for i in range(1, steps + 1):
    h.update(i.to_bytes(4, "little"))
    print(f"step {i}/{steps} {h.hexdigest()[:16]}", flush=True)
    if step_ms:
        time.sleep(step_ms / 1000)
with open(os.path.join(out, "result.tmp"), "w") as r:
    r.write(h.hexdigest())
os.rename(os.path.join(out, "result.tmp"), os.path.join(out, "result"))
'''


def _start(out: Path, steps: int, step_ms: float, inp: str = "") -> subprocess.Popen:
    """Started as a user would: `python job.py > train.log` (the shell execs python, so the
    job leads its own session and its stdout is the log opened O_WRONLY|O_TRUNC)."""
    out.mkdir(parents=True, exist_ok=True)
    script = out / "job.py"
    script.write_text(JOB)
    return subprocess.Popen(["sh", "-c", 'exec "$0" "$@" > "$OUT/train.log" 2>&1', sys.executable, str(script),
                             str(out), str(steps), str(step_ms), inp],
                            env={**os.environ, "OUT": str(out)}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _lines(out: Path) -> int:
    try:
        return len((out / "train.log").read_text().splitlines())
    except FileNotFoundError:
        return 0


def _dump_then_kill(job: subprocess.Popen, out: Path, repo: Path, more_lines: int = 0) -> str:
    wait_for(lambda: _lines(out) >= 5, "the job's first lines")
    snap = run_json("dump", job.pid, "--repo", repo)["snapshot"]
    if more_lines:
        n = _lines(out)
        wait_for(lambda: _lines(out) >= n + more_lines, "the job to log on after the dump")
    os.kill(job.pid, signal.SIGKILL)
    job.wait(timeout=30)
    wait_for(lambda: not Path(f"/proc/{job.pid}").exists(), "the killed job's PID to be free")
    return snap


@pytest.mark.slow
def test_log_that_grew_after_the_dump_is_set_aside_and_the_job_finishes_identically(tmp_path, repo):
    ref = tmp_path / "reference"
    assert _start(ref, 200, 0).wait(timeout=60) == 0
    out = tmp_path / "job"
    job = _start(out, 200, 30)
    try:
        snap = _dump_then_kill(job, out, repo, more_lines=10)
        log = out / "train.log"
        grown = log.read_bytes()
        r = run_gpusnap("restore", snap, "--repo", repo)
        assert r.returncode == 0, r.stdout + r.stderr
        notes = [ln for ln in r.stderr.splitlines() if "note:" in ln]
        assert len(notes) == 1 and str(log) in notes[0] and "gpusnap-" in notes[0], r.stderr
        after = [p for p in out.iterdir() if p.name.startswith("train.log.gpusnap-") and p.name.endswith("-after")]
        assert len(after) == 1 and after[0].name in notes[0].replace("\n", "")
        kept = after[0].read_bytes()
        assert kept and grown.endswith(kept)
        at_dump = len(grown) - len(kept)
        try:
            wait_for(lambda: (out / "result").exists(), "the restored job's result", timeout=120)
            assert (out / "result").read_text() == (ref / "result").read_text()
            # the log is what an uninterrupted run writes; the crashed run's extra lines are kept aside
            assert log.read_bytes() == (ref / "train.log").read_bytes()
            assert log.read_bytes()[:at_dump] == grown[:at_dump]
        finally:
            kill_pids([job.pid])
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def test_output_file_that_shrank_is_refused_untouched(tmp_path, repo):
    out = tmp_path / "job"
    job = _start(out, 2000, 20)
    try:
        snap = _dump_then_kill(job, out, repo)
        log = out / "train.log"
        log.write_bytes(b"rotated\n")        # e.g. logrotate's copytruncate
        r = run_gpusnap("restore", snap, "--repo", repo, "--json")
        assert r.returncode == 25, r.stdout + r.stderr
        err = json.loads(r.stdout)
        assert str(log) in err["message"] and "shrank" in err["message"] and err["hint"]
        assert log.read_bytes() == b"rotated\n"
        assert not Path(f"/proc/{job.pid}").exists()
        assert not [p for p in out.iterdir() if "gpusnap-" in p.name]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def test_input_file_that_vanished_is_refused_naming_it(tmp_path, repo):
    data = tmp_path / "input.dat"
    data.write_bytes(os.urandom(5000))
    out = tmp_path / "job"
    job = _start(out, 2000, 20, str(data))
    try:
        snap = _dump_then_kill(job, out, repo)
        log_size = (out / "train.log").stat().st_size
        data.unlink()
        r = run_gpusnap("restore", snap, "--repo", repo)
        assert r.returncode == 25, r.stdout + r.stderr
        assert f"input file {data} is gone" in r.stderr and "hint:" in r.stderr
        assert not Path(f"/proc/{job.pid}").exists()
        # refused before anything changed: the log was not touched
        assert (out / "train.log").stat().st_size == log_size
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
