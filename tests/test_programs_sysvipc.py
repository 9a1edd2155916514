"""Jobs using SysV IPC, with the real CRIU: a `gpusnap run` job (an IPC namespace of its own)
whose child counts in a SysV shared-memory segment dumps and restores in both modes and
counts to the end (a fork restored beside the running original counts in a segment of its
own); the same job in the host's IPC namespace is refused before it is touched, with the hint
to use `gpusnap run`, and goes on to the right count; a message queue there is a warning."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import kill_pids, run_gpusnap, run_json
from gpusnap.system import proc, sysvipc

pytestmark = pytest.mark.criu

N = 300

# the child adds 1 to a counter in the segment N times; the parent waits for it and writes what
# the segment holds: N only when the segment (and its contents) came through the restore
SHM_JOB = r"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
out, n = sys.argv[1], int(sys.argv[2])
shmid = libc.shmget(0, 4096, 0o1600)            # IPC_PRIVATE, IPC_CREAT | 0600
assert shmid >= 0, ctypes.get_errno()
c = ctypes.c_long.from_address(libc.shmat(shmid, None, 0))
libc.shmctl(shmid, 0, None)                      # IPC_RMID: goes when the last user detaches
child = os.fork()
if child == 0:
    for i in range(n):
        c.value += 1
        if i == 20:
            open(out + ".ready", "w").close()
        time.sleep(0.02)
    os._exit(0)
os.waitpid(child, 0)
with open(out, "a") as f:
    f.write(f"count {c.value}\n")
"""


def _wait(cond, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _counts(out: Path) -> list[str]:
    return out.read_text().splitlines() if out.exists() else []


@pytest.mark.parametrize("mode", ["running", "exit"])
def test_run_job_with_shm_counter_restores(tmp_path, repo, mode):
    out = tmp_path / "out"
    started = run_gpusnap("run", "--json", "--name", "shm", "--repo", repo, "--", sys.executable, "-c", SHM_JOB,
                          str(out), str(N), check=True)
    job = json.loads(started.stdout)
    init, restored = job["pid"], []
    try:
        _wait(lambda: Path(str(out) + ".ready").exists(), "the job did not start counting")
        assert sysvipc.ipc_ns(init) != sysvipc.ipc_ns("self")     # `gpusnap run` gave it its own
        info = run_json("dump", "--name", "shm", "--repo", repo, *(["--exit"] if mode == "exit" else []))
        assert not [o for o in info["criu_options"] if "ipc" in o]   # nothing to ask: CRIU dumps the namespace
        if mode == "exit":
            assert proc.wait_gone([init], 30) == []
        # running: the fork comes back beside the original, in an IPC namespace (and segment) of its own
        res = run_json("restore", "shm", "--repo", repo)
        restored = res["pids"]
        assert sysvipc.ipc_ns(res["pid"]) not in (sysvipc.ipc_ns("self"), sysvipc.ipc_ns(init))
        want = 1 if mode == "exit" else 2
        _wait(lambda: len(_counts(out)) >= want, f"no result: {_counts(out)}")
        time.sleep(0.2)
        assert _counts(out) == [f"count {N}"] * want        # as uninterrupted, each its own count
    finally:
        kill_pids(restored)
        kill_pids(proc.tree(init)[::-1] if proc.exists(init) else [])


def test_host_namespace_shm_is_refused_untouched(tmp_path, repo):
    out = tmp_path / "out"
    job = subprocess.Popen([sys.executable, "-c", SHM_JOB, str(out), str(N)], stdin=subprocess.DEVNULL,
                           start_new_session=True)
    try:
        _wait(lambda: Path(str(out) + ".ready").exists(), "the job did not start counting")
        doc = json.loads(run_gpusnap("doctor", job.pid, "--json").stdout)
        fails = [c for c in doc["checks"] if c["status"] == "fail" and c["name"] == "SysV IPC"]
        assert fails and "gpusnap run" in fails[0]["fix"], doc["checks"]
        res = run_gpusnap("dump", job.pid, "--repo", repo, "--json")
        assert res.returncode == 16, res.stdout + res.stderr
        err = json.loads(res.stdout)
        assert err["message"] == fails[0]["detail"] and err["hint"] == fails[0]["fix"]
        assert "shared-memory" in err["message"] and "host's IPC namespace" in err["message"]
        assert proc.read_stat(job.pid).state in ("S", "R")              # untouched: goes on counting
        job.wait(timeout=60)
        assert _counts(out) == [f"count {N}"]
    finally:
        if job.poll() is None:
            job.kill()
        job.wait()


MSG_JOB = r"""
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
q = libc.msgget(0, 0o1600)
buf = ctypes.create_string_buffer(b"\x01\x00\x00\x00\x00\x00\x00\x00hello")
assert libc.msgsnd(q, buf, 5, 0) == 0, ctypes.get_errno()
print(q, flush=True)
time.sleep(120)
"""


def test_host_namespace_message_queue_is_a_warning(tmp_path, repo):
    job = subprocess.Popen([sys.executable, "-c", MSG_JOB], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           text=True, start_new_session=True)
    q = int(job.stdout.readline())
    try:
        doc = json.loads(run_gpusnap("doctor", job.pid, "--json").stdout)
        warn = [c for c in doc["checks"] if c["name"] == "SysV IPC"]
        assert warn and warn[0]["status"] == "warn" and f"message queue {q}" in warn[0]["detail"], doc["checks"]
        info = run_json("dump", job.pid, "--repo", repo)        # plain CRIU dumps it too
        assert info["job_running"]
    finally:
        job.kill()
        job.wait()
        subprocess.run(["ipcrm", "-q", str(q)], capture_output=True)
