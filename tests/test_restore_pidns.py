"""A job that is the init of its own PID namespace restores side by side with the original
(real CRIU): its PIDs live in a new namespace, so nothing on the host collides, and both
finish with the uninterrupted result."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import kill_pids, run_json, wait_for

pytestmark = pytest.mark.criu

JOB = r'''
import hashlib, os, sys, time
out, steps, step_ms = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
h = hashlib.sha256(b"seed")
log = open(os.path.join(out, "job.log"), "a", buffering=1)
for i in range(1, steps + 1):
    h.update(i.to_bytes(4, "little"))
    log.write(f"step {i}\n")
    if step_ms:
        time.sleep(step_ms / 1000)
with open(os.path.join(out, "results"), "a") as r:     # one line per finished run
    r.write(h.hexdigest() + "\n")
'''


@pytest.mark.slow
@pytest.mark.parametrize("via", ["auto", "lazy"])
def test_pid_namespace_init_restores_while_the_original_runs(tmp_path, repo, via):
    """lazy: CRIU names the processes by their PIDs inside the namespace; gpusnap must find
    their memory by those and, should it fail, kill the restored tree by its host PIDs."""
    out = tmp_path / "job"
    out.mkdir()
    (out / "job.py").write_text(JOB)
    ref = tmp_path / "ref"
    ref.mkdir()
    subprocess.run([sys.executable, str(out / "job.py"), str(ref), "150", "0"], check=True, timeout=60)
    expected = (ref / "results").read_text().strip()

    # unshare's child is PID 1 of a new namespace; setsid makes it lead its own session there
    holder = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", sys.executable, str(out / "job.py"),
                               str(out), "150", "40"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, start_new_session=True)
    job = None
    restored = None
    try:
        deadline = time.monotonic() + 30
        while job is None:
            if holder.poll() is not None:   # a sandbox that forbids new PID namespaces
                pytest.skip(f"cannot make a PID namespace here: {holder.stderr.read().decode().strip()}")
            kids = Path(f"/proc/{holder.pid}/task/{holder.pid}/children").read_text().split()
            job = int(kids[0]) if kids else None
            assert time.monotonic() < deadline, "unshare did not start its child"
            time.sleep(0.02)
        wait_for(lambda: (out / "job.log").exists() and len((out / "job.log").read_text().splitlines()) >= 10,
              "the job's first steps")
        snap = run_json("dump", job, "--repo", repo)["snapshot"]
        r = run_json("restore", snap, "--repo", repo, "--via", via)        # the original still runs
        restored = r["pid"]
        if via == "lazy":
            assert r["via"] == "lazy" and r["lazy"]["bytes"] > 0
        assert restored != job and Path(f"/proc/{job}").exists()
        assert "NSpid:" in (s := Path(f"/proc/{restored}/status").read_text()) and \
            [ln for ln in s.splitlines() if ln.startswith("NSpid:")][0].split()[-1] == "1"
        wait_for(lambda: (out / "results").exists() and len((out / "results").read_text().split()) == 2,
              "both runs to finish", timeout=120)
        assert (out / "results").read_text().split() == [expected, expected]
    finally:
        kill_pids([p for p in (job, restored) if p])
        try:
            os.killpg(holder.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        holder.wait(timeout=30)
