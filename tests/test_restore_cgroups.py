"""`gpusnap restore --cgroups MODE` is CRIU's --manage-cgroups: by default (CRIU's soft mode) a
job that moved itself into a cgroup of its own comes back in it; with `ignore` it comes back in
the cgroups of the restoring gpusnap. Real CRIU, a real cgroup (v1 pids controller, or v2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import kill_pids, run_gpusnap, run_json, wait_for

JOB = r'''
import hashlib, os, sys, time
out = sys.argv[1]
h = hashlib.sha256(b"seed")
log = open(os.path.join(out, "job.log"), "a", buffering=1)
for i in range(1, 301):
    h.update(i.to_bytes(4, "little"))
    log.write(f"step {i}\n")
    time.sleep(0.02)
with open(os.path.join(out, "results"), "a") as r:
    r.write(h.hexdigest() + "\n")
'''


def _expected() -> str:
    import hashlib

    h = hashlib.sha256(b"seed")
    for i in range(1, 301):
        h.update(i.to_bytes(4, "little"))
    return h.hexdigest()


def _controller() -> tuple[Path, str] | None:
    """(a cgroup hierarchy we may make a child in, its /proc/PID/cgroup key)."""
    for d, key in ((Path("/sys/fs/cgroup/pids"), "pids"), (Path("/sys/fs/cgroup/unified"), "")):
        if (d / "cgroup.procs").exists():
            return d, key
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return Path("/sys/fs/cgroup"), ""
    return None


def _cgroup_of(pid: int | str, key: str) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, ctrl, path = line.split(":", 2)
        if ctrl == key or (key == "" and ctrl == ""):
            return path
    raise AssertionError(f"no {key or 'v2'} line in /proc/{pid}/cgroup")


def test_bad_cgroups_mode_is_a_usage_error(tmp_path):
    r = run_gpusnap("restore", "nothing", "--repo", tmp_path / "repo", "--cgroups", "most", "--json")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "--cgroups must be one of none, props, soft, full, strict, ignore" in r.stdout


@pytest.mark.criu
@pytest.mark.slow
def test_cgroups_ignore_restores_into_the_restorers_cgroup(tmp_path, repo):
    found = _controller()
    if os.geteuid() != 0 or found is None:
        pytest.skip("needs root and a writable cgroup hierarchy")
    root, key = found
    cg = root / f"gpusnap-t{os.getpid()}"
    cg.mkdir()
    out = tmp_path / "job"
    out.mkdir()
    (tmp_path / "job.py").write_text(JOB)
    job = subprocess.Popen([sys.executable, str(tmp_path / "job.py"), str(out)], stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    pids: list[int] = [job.pid]
    try:
        (cg / "cgroup.procs").write_text(str(job.pid))
        mine, its = _cgroup_of("self", key), _cgroup_of(job.pid, key)
        assert its == f"/{cg.name}" and its != mine
        wait_for(lambda: (out / "job.log").exists() and len((out / "job.log").read_text().splitlines()) >= 10,
                 "the job's first steps")
        snap = run_json("dump", job.pid, "--exit", "--repo", repo)["snapshot"]
        job.wait(timeout=30)
        pid = run_json("restore", snap, "--repo", repo)["pid"]        # default: CRIU's soft mode
        pids.append(pid)
        assert _cgroup_of(pid, key) == its
        snap = run_json("dump", pid, "--exit", "--repo", repo)["snapshot"]
        wait_for(lambda: not Path(f"/proc/{pid}").exists(), "the dumped job to go")
        pid = run_json("restore", snap, "--repo", repo, "--cgroups", "ignore")["pid"]
        pids.append(pid)
        assert _cgroup_of(pid, key) == mine     # not the job's own: CRIU left its cgroups alone
        wait_for(lambda: (out / "results").exists(), "the restored job to finish", timeout=120)
        assert (out / "results").read_text().split() == [_expected()]
    finally:
        kill_pids(pids)
        wait_for(lambda: not (cg / "cgroup.procs").read_text().split(), "the cgroup to empty", timeout=30)
        cg.rmdir()
