"""What restore and verify print for a person: restore ends with a summary line on a terminal, as
dump does (the snapshot, its size, the time, the path CRIU took, the PID), and verify counts
the bytes it read back in the same binary units as every other figure."""

from __future__ import annotations

import re
import subprocess

import pytest

from conftest import GPUSNAP, ROOT, kill_pids, run_gpusnap, run_json

pytestmark = pytest.mark.criu


def test_restore_prints_a_summary_line_on_a_terminal(sample_job, repo):
    job = sample_job(steps=300, mb=16, threads=2, step_ms=20)
    job.wait_steps(5)
    snap = run_json("dump", job.pid, "--repo", repo, "--name", "summary")
    job.kill()
    cmd = " ".join([*GPUSNAP, "restore", "summary", "--repo", str(repo)])
    r = subprocess.run(["script", "-qec", cmd, "/dev/null"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    try:
        assert r.returncode == 0, r.stdout
        text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", r.stdout).replace("\r", "")
        line = [ln for ln in text.splitlines() if ln.startswith("restored ")]
        assert len(line) == 1, text
        assert re.fullmatch(rf"restored {re.escape(snap['snapshot'])}: \d+\.\d (MiB|KiB) from CRIU, \d+\.\d\d s "
                            rf"via stream; job running as PID {job.pid}", line[0]), line
        assert str(job.pid) in text.split()
    finally:
        kill_pids(job.pids)
    # verify counts what it read back in binary units, not raw bytes
    piped = run_gpusnap("verify", "--repo", repo)
    assert piped.returncode == 0, piped.stderr
    out = piped.stdout + piped.stderr
    assert re.search(r"\d+\.\d MiB read back: all good", out), out
    assert not re.search(r"\d{5,} bytes", out), out
