"""Jobs that hold network sockets, through the real CRIU, as root.

A `python3 -m http.server` on 127.0.0.1 is dumped while it runs, killed, restored, and must
answer HTTP requests again. Under a CRIU known to fail on such sockets with this kernel (before
4.2 on Linux >= 6.16), gpusnap refuses the dump before CRIU runs and says how to get a CRIU that
works. The "old" CRIU is the real one behind a wrapper that only claims 4.1.1 to `--version` and
records every other call, so the test sees whether CRIU was ever asked to dump.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT, kill_pids, run_gpusnap, run_json
from gpusnap.criu import runner
from gpusnap.errors import CriuUnavailable
from gpusnap.system import sockets

pytestmark = pytest.mark.criu

PAGE = b"gpusnap socket test: this page is served by the restored server\n"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, timeout: float = 5) -> tuple[int, bytes]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/page.txt", timeout=timeout) as r:
        return r.status, r.read()


def wait_answering(port: int, pid: int, timeout: float = 60) -> tuple[int, bytes]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return get(port)
        except OSError as e:
            alive = Path(f"/proc/{pid}").exists()
            if not alive or time.monotonic() > deadline:
                raise AssertionError(f"no HTTP answer on port {port} (pid {pid} alive: {alive}): {e}") from None
            time.sleep(0.05)


class HttpServer:
    """`python3 -m http.server` on 127.0.0.1 in a session of its own (as with setsid)."""

    def __init__(self, tmp: Path):
        self.www = tmp / "www"
        self.www.mkdir()
        (self.www / "page.txt").write_bytes(PAGE)
        self.port = free_port()
        self.log = open(tmp / "server.log", "ab")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "http.server", str(self.port), "--bind", "127.0.0.1",
             "--directory", str(self.www)],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, cwd=tmp, start_new_session=True)
        self.pid = self.popen.pid
        assert wait_answering(self.port, self.pid) == (200, PAGE)

    def kill(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=30)

    def close(self) -> None:
        kill_pids([self.pid])
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()


@pytest.fixture
def http_server(tmp_path):
    server = HttpServer(tmp_path)
    yield server
    server.close()


@pytest.fixture
def criu_claiming_4_1(tmp_path):
    """A wrapper around the real CRIU that answers `--version` with 4.1.1 (the Debian 13 CRIU
    that fails on network sockets from Linux 6.16 on) and logs every other call before running
    the real CRIU with it. Returns (wrapper path, call log path)."""
    real = runner.criu_path()
    assert real and os.access(real, os.X_OK), "no CRIU to wrap"
    calls = tmp_path / "criu-calls.log"
    wrapper = tmp_path / "criu-4.1.1"
    wrapper.write_text("#!/bin/sh\n"
                       'if [ "$1" = --version ]; then printf "Version: 4.1.1\\n"; exit 0; fi\n'
                       f'echo "$*" >> "{calls}"\n'
                       f'exec "{real}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return wrapper, calls


def snapshots_in(repo: Path) -> list[str]:
    d = repo / "snapshots"
    return sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) if d.exists() else []


def test_http_server_is_dumped_killed_restored_and_answers_again(http_server, repo):
    """The issue's proof: a listening TCP socket survives dump, kill and restore."""
    info = run_json("dump", http_server.pid, "--repo", repo)
    assert wait_answering(http_server.port, http_server.pid) == (200, PAGE)   # left running
    http_server.kill()
    with pytest.raises(OSError):      # nothing listens any more
        get(http_server.port, timeout=2)
    restored = run_json("restore", info["snapshot"], "--repo", repo)
    try:
        assert restored["pid"] == http_server.pid
        assert wait_answering(http_server.port, restored["pid"]) == (200, PAGE)
        assert get(http_server.port) == (200, PAGE)   # and again: it serves, not just once
    finally:
        kill_pids([restored["pid"]])


def test_criu_before_4_2_refuses_a_job_with_sockets_before_running_criu(http_server, repo, criu_claiming_4_1):
    wrapper, calls = criu_claiming_4_1
    env = {"GPUSNAP_CRIU": str(wrapper)}
    res = run_gpusnap("dump", http_server.pid, "--repo", repo, "--json", env=env)
    if runner.kernel_version() < runner.SOCKETS_BROKEN_FROM_KERNEL:
        # an older kernel: CRIU 4.1 dumps sockets fine, so gpusnap lets it
        assert res.returncode == 0, res.stdout + res.stderr
        assert "dump" in calls.read_text()
        return
    assert res.returncode == CriuUnavailable.exit_code, res.stdout + res.stderr
    err = json.loads(res.stdout)
    assert "CRIU 4.1.1" in err["message"] and "network socket" in err["message"] and "TCP" in err["message"]
    assert "make setup" in err["hint"] and "GPUSNAP_CRIU" in err["hint"]
    assert not calls.exists(), f"CRIU ran: {calls.read_text()}"   # refused before CRIU was called
    assert snapshots_in(repo) == []
    assert get(http_server.port) == (200, PAGE)   # the job was not touched
    # the human form: one line saying what, one hint line
    res = run_gpusnap("dump", http_server.pid, "--repo", repo, env=env)
    assert res.returncode == CriuUnavailable.exit_code
    assert "cannot dump this job" in res.stderr and "make setup" in res.stderr
    assert not calls.exists()


def test_criu_before_4_2_still_dumps_a_job_without_network_sockets(sample_job, repo, criu_claiming_4_1):
    """The refusal is about sockets: a job without any is dumped by that CRIU as before."""
    wrapper, calls = criu_claiming_4_1
    job = sample_job(steps=200, mb=4, threads=1, step_ms=20)
    job.wait_steps(2)
    assert sockets.network_sockets(job.pids) == {}
    info = run_json("dump", job.pid, "--repo", repo, env={"GPUSNAP_CRIU": str(wrapper)})
    assert snapshots_in(repo) == [Path(info["snapshot"]).name]
    assert calls.read_text().startswith("dump ")
    assert job.alive()


def test_doctor_flags_criu_before_4_2_for_a_job_with_sockets(http_server, criu_claiming_4_1):
    wrapper, _ = criu_claiming_4_1
    res = run_gpusnap("doctor", http_server.pid, "--json", env={"GPUSNAP_CRIU": str(wrapper)})
    checks = json.loads(res.stdout)["checks"]
    criu = next(c for c in checks if c["name"] == "criu")
    assert criu["detail"] == f"CRIU 4.1.1 ({wrapper})"
    flagged = [c for c in checks if c["name"] == "criu sockets"]
    if runner.kernel_version() < runner.SOCKETS_BROKEN_FROM_KERNEL:
        assert flagged == []
        return
    assert [c["status"] for c in flagged] == ["warn", "fail"]   # the machine, then this job
    assert all("make setup" in c["fix"] for c in flagged)
    assert "TCP" in flagged[1]["detail"] and res.returncode == 1
    # the CRIU make setup installs: nothing to flag, the listening port is simply restored
    res = run_gpusnap("doctor", http_server.pid, "--json")
    checks = json.loads(res.stdout)["checks"]
    assert not [c for c in checks if c["name"] == "criu sockets"]
    assert any(c["name"] == "TCP listen" and f":{http_server.port}" in c["detail"] for c in checks)


def test_network_sockets_finds_the_tcp_and_udp_sockets_a_process_holds(tmp_path):
    """The detection itself, on a real process holding a TCP listener, a UDP socket and a unix
    socket pair (which CRIU 4.1 dumps fine, so it is not reported)."""
    code = ("import socket, sys, time\n"
            "t = socket.socket(); t.bind(('127.0.0.1', 0)); t.listen()\n"
            "u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(('127.0.0.1', 0))\n"
            "a, b = socket.socketpair()\n"
            "print('ready', flush=True); time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                         start_new_session=True, cwd=ROOT)
    try:
        assert p.stdout.readline() == b"ready\n"
        found = sockets.network_sockets([p.pid])
        assert sorted(found.values()) == ["TCP", "UDP"]
    finally:
        p.kill()
        p.wait(timeout=30)


def test_socket_policy_by_version_and_kernel():
    assert runner.sockets_broken((4, 1, 1), (6, 16))
    assert runner.sockets_broken((4, 0), (6, 18))
    assert not runner.sockets_broken((4, 2), (6, 18))
    assert not runner.sockets_broken((4, 2, 1), (7, 0))
    assert not runner.sockets_broken((4, 1, 1), (6, 15))
    assert runner.kernel_version("6.18.44-fc-v657") == (6, 18)
    assert runner.kernel_version("6.1.0-27-amd64") == (6, 1)
