"""Files the job appends to (`open(path, "a")`, `>>`), with the real CRIU.

CRIU records no size for them; gpusnap records it at the freeze (meta.append_files). A job
that keeps appending after the dump and then dies is restored with its log brought back to
the snapshot's point: every line exactly once, in order, and the bytes written after the
dump set aside next to the log. A log rotated after the dump (another file at that path) is
refused, naming it, and left untouched.
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
out, steps, step_ms = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
log = open(os.path.join(out, "job.log"), "a")     # O_WRONLY|O_APPEND, as gpusnap/samples/job.py
h = hashlib.sha256()
with open(os.path.join(out, "pid"), "w") as p:
    p.write(str(os.getpid()))
for i in range(1, steps + 1):
    h.update(i.to_bytes(4, "little"))
    log.write(f"step {i}/{steps} {h.hexdigest()[:16]}\n")
    log.flush()
    if step_ms:
        time.sleep(step_ms / 1000)
log.close()
with open(os.path.join(out, "result.tmp"), "w") as r:
    r.write(h.hexdigest())
os.rename(os.path.join(out, "result.tmp"), os.path.join(out, "result"))
'''


def _start(out: Path, steps: int, step_ms: float) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    script = out / "job.py"
    script.write_text(JOB)
    return subprocess.Popen([sys.executable, str(script), str(out), str(steps), str(step_ms)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _lines(out: Path) -> int:
    try:
        return len((out / "job.log").read_text().splitlines())
    except FileNotFoundError:
        return 0


def _dump_then_kill(job: subprocess.Popen, out: Path, repo: Path, more_lines: int) -> str:
    wait_for(lambda: _lines(out) >= 5, "the job's first lines")
    snap = run_json("dump", job.pid, "--repo", repo)["snapshot"]
    n = _lines(out)
    wait_for(lambda: _lines(out) >= n + more_lines, "the job to log on after the dump")
    os.kill(job.pid, signal.SIGKILL)
    job.wait(timeout=30)
    wait_for(lambda: not Path(f"/proc/{job.pid}").exists(), "the killed job's PID to be free")
    return snap


def _meta(repo: Path, snap: str) -> dict:
    return json.loads(run_gpusnap("inspect", snap, "--repo", repo, "--json").stdout).get("meta", {})


@pytest.mark.slow
def test_appended_log_that_grew_after_the_dump_has_every_line_once(tmp_path, repo):
    ref = tmp_path / "reference"
    assert _start(ref, 200, 0).wait(timeout=60) == 0
    expected = (ref / "job.log").read_bytes()
    assert len(expected.splitlines()) == 200
    out = tmp_path / "job"
    job = _start(out, 200, 30)
    try:
        snap = _dump_then_kill(job, out, repo, more_lines=10)
        log = out / "job.log"
        grown = log.read_bytes()
        r = run_gpusnap("restore", snap, "--repo", repo)
        assert r.returncode == 0, r.stdout + r.stderr
        notes = [ln for ln in r.stderr.splitlines() if "note:" in ln]
        assert len(notes) == 1 and str(log) in notes[0], r.stderr
        after = [p for p in out.iterdir() if p.name.startswith("job.log.gpusnap-") and p.name.endswith("-after")]
        assert len(after) == 1, sorted(p.name for p in out.iterdir())
        kept = after[0].read_bytes()
        # exactly the bytes written after the dump: the log at the freeze + these = the crashed run's log
        at_dump = len(grown) - len(kept)
        assert kept and grown.endswith(kept) and len(kept.splitlines()) >= 10
        assert grown[:at_dump] == expected[:at_dump] and kept == expected[at_dump:len(grown)]
        st = os.stat(log)
        assert _meta(repo, snap)["append_files"] == [
            {"path": str(log), "size": at_dump, "dev": st.st_dev, "ino": st.st_ino}]
        try:
            wait_for(lambda: (out / "result").exists(), "the restored job's result", timeout=120)
            assert (out / "result").read_text() == (ref / "result").read_text()
            # every step exactly once, in order: what an uninterrupted run writes
            assert log.read_bytes() == expected
        finally:
            kill_pids([job.pid])
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def test_appended_log_rotated_after_the_dump_is_refused_untouched(tmp_path, repo):
    out = tmp_path / "job"
    job = _start(out, 2000, 20)
    try:
        snap = _dump_then_kill(job, out, repo, more_lines=3)
        log = out / "job.log"
        # logrotate's default: the log is renamed away and a new one (here longer) takes its place
        os.rename(log, out / "job.log.1")
        log.write_bytes(b"x" * ((out / "job.log.1").stat().st_size + 4096))
        before = log.read_bytes()
        r = run_gpusnap("restore", snap, "--repo", repo, "--json")
        assert r.returncode == 25, r.stdout + r.stderr
        err = json.loads(r.stdout)
        assert str(log) in err["message"] and "rotated" in err["message"] and err["hint"]
        assert log.read_bytes() == before
        assert not Path(f"/proc/{job.pid}").exists()
        assert not [p for p in out.iterdir() if "gpusnap-" in p.name]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
