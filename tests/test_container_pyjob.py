"""A Python job in a Podman container (issue 36): snapshotted through `dump --container`, a second
dump storing only what changed, the container killed, and the restore carrying on to exactly
the digest an uninterrupted run prints (tests/container_job.py builds the job's image from the
host's own Python, cached)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

import container_job
from conftest import run_gpusnap, run_json, wait_for

STEPS, DELAY = 500, 0.02            # about 10 s uninterrupted: long enough to dump twice mid-run
PODMAN_RUN = ["--runtime", "runc", "--network", "none", "--ulimit", "nofile=4096:4096",
              "--ulimit", "nproc=4096:4096"]


def _podman(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)


def progress(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/root/tmp/progress").read_text() or 0)
    except (OSError, ValueError):
        return 0


def done_digest(logs: str) -> str | None:
    return next((ln.split()[1] for ln in logs.splitlines() if ln.startswith("done ")), None)


@pytest.fixture
def pyctr():
    assert shutil.which("podman") and shutil.which("runc"), "scripts/test-deps.sh installs podman and runc"
    image = container_job.ensure_image(["podman"])
    name = f"gpusnap-py-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    r = _podman("run", "-d", "--name", name, *PODMAN_RUN, image, *container_job.command(STEPS, DELAY))
    if r.returncode != 0:
        pytest.skip(f"podman cannot start a container on this machine: {r.stderr.strip()[-300:]}")
    try:
        yield name
    finally:
        _podman("rm", "-f", "-t", "0", name)


def test_a_python_job_in_a_podman_container_restored_ends_with_the_uninterrupted_digest(pyctr, tmp_path):
    name = pyctr
    pid = int(_podman("inspect", "-f", "{{.State.Pid}}", name).stdout.strip())
    wait_for(lambda: progress(pid) >= 20, "the Python job to make progress")
    repo = tmp_path / "repo"
    run_gpusnap("init", "--repo", repo, check=True)
    one = run_json("dump", "--container", name, "--repo", repo)
    two = run_json("dump", "--container", name, "--repo", repo)
    at = progress(pid)
    # the job's 16 MiB, stored by the first dump, are found stored again by the second
    assert one["pages_total"] >= container_job.PAGES and two["pages_dedup"] >= container_job.PAGES // 2, (one, two)
    assert two["bytes_stored"] < one["bytes_stored"] // 4, (one, two)
    assert _podman("rm", "-f", "-t", "0", name).returncode == 0          # the crash
    r = run_json("restore", two["snapshot"], "--repo", repo)
    assert r["via"] == "podman" and r["job"] == name, r
    assert _podman("wait", name, timeout=120).returncode == 0
    logs = _podman("logs", name).stdout
    assert done_digest(logs) == container_job.run(STEPS, 0), logs
    assert at < STEPS, "the job ended before the second dump: nothing was restored mid-run"
    print(f"podman, Python job: dump {one['seconds']} s then {two['seconds']} s, "
          f"stored {one['bytes_stored']} then {two['bytes_stored']} bytes, restore {r['seconds']} s")
