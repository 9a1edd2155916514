"""A job logging to a daemon through a unix datagram socket (syslog/journald style), dumped with
the real CRIU (left running, and with --exit) and restored: the daemon outside the tree
receives the job's numbered messages again from where the snapshot left off, and the job
finishes with the result of an uninterrupted run. A stream connection to an outside process
stays refused, before the job is touched."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import kill_pids, run_gpusnap, run_json
from gpusnap.system import proc

pytestmark = pytest.mark.criu

N = 300

DAEMON = r"""
import os, socket, sys
path, log = sys.argv[1], sys.argv[2]
d = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
d.bind(path)
f = open(log, "a", buffering=1)
open(path + ".ready", "w").close()
while True:
    f.write(d.recv(64).decode() + "\n")
"""

JOB = r"""
import socket, sys, time
path, out, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.connect(path)
total = 0
for i in range(1, n + 1):
    s.send(str(i).encode())
    total += i
    time.sleep(0.02)
open(out, "w").write(f"done {i} total={total}\n")
"""


def _wait(cond, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


class Daemon:
    def __init__(self, tmp: Path):
        self.path, self.log = tmp / "daemon.sock", tmp / "daemon.log"
        self.p = subprocess.Popen([sys.executable, "-c", DAEMON, str(self.path), str(self.log)],
                                  stdin=subprocess.DEVNULL, start_new_session=True)
        _wait(lambda: Path(str(self.path) + ".ready").exists(), "the daemon did not start")

    def received(self) -> list[int]:
        return [int(x) for x in self.log.read_text().split()] if self.log.exists() else []

    def close(self) -> None:
        self.p.kill()
        self.p.wait()


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path)
    yield d
    d.close()


@pytest.mark.parametrize("mode", ["running", "exit"])
def test_daemon_receives_again_after_restore(daemon, tmp_path, repo, mode):
    out = tmp_path / "out"
    job = subprocess.Popen([sys.executable, "-c", JOB, str(daemon.path), str(out), str(N)],
                           stdin=subprocess.DEVNULL, start_new_session=True)
    restored: list[int] = []
    try:
        _wait(lambda: len(daemon.received()) >= 40, "the job sent nothing")
        doc = json.loads(run_gpusnap("doctor", job.pid, "--json").stdout)
        unix = [c for c in doc["checks"] if c["name"] == "unix sockets"]
        assert unix and unix[0]["status"] == "info" and str(daemon.path) in unix[0]["detail"], unix
        info = run_json("dump", job.pid, "--repo", repo, *(["--exit"] if mode == "exit" else []))
        assert "--ext-unix-sk" in info["criu_options"]
        if mode == "running":
            assert info["job_running"]
            seen = len(daemon.received())
            _wait(lambda: len(daemon.received()) >= seen + 20, "the job stopped sending after the dump")
            job.kill()
        job.wait(timeout=30)
        assert proc.wait_gone([job.pid], 30) == []
        before = daemon.received()
        assert not out.exists()
        res = run_json("restore", info["snapshot"], "--repo", repo)
        restored = res["pids"]
        _wait(lambda: out.exists() and out.read_text(), "the restored job did not finish")
        assert out.read_text() == f"done {N} total={N * (N + 1) // 2}\n"   # as uninterrupted
        got = daemon.received()
        assert got[:len(before)] == before == list(range(1, len(before) + 1))
        again = got[len(before):]
        # the restored job goes on from its snapshot's counter, to the end, no gap, no repeat
        assert again == list(range(again[0], N + 1)), again[:10]
        if mode == "exit":
            assert again[0] == len(before) + 1      # frozen at the dump: nothing sent twice
        else:
            assert 40 < again[0] <= len(before) - 19  # what it sent after the dump comes again
    finally:
        kill_pids(restored)
        if job.poll() is None:
            job.kill()
        job.wait()


def test_stream_to_a_daemon_is_refused_untouched(tmp_path, repo):
    path = str(tmp_path / "stream.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen()
    job = subprocess.Popen([sys.executable, "-c", f"import socket,time; s=socket.socket(socket.AF_UNIX); "
                            f"s.connect({path!r}); print('ready', flush=True); time.sleep(120)"],
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, start_new_session=True)
    conn = None
    try:
        assert job.stdout.readline().strip() == "ready"
        conn, _ = srv.accept()
        res = run_gpusnap("dump", job.pid, "--repo", repo, "--json")
        assert res.returncode == 16, res.stdout + res.stderr
        err = json.loads(res.stdout)
        assert "stream" in err["message"] and "one half" in err["message"]
        assert proc.read_stat(job.pid).state in ("S", "R")
    finally:
        if conn:
            conn.close()
        job.kill()
        job.wait()
        srv.close()


def test_restore_without_the_daemon_names_its_address(tmp_path, repo):
    """The daemon is gone at restore: CRIU cannot reconnect; the hint says to start the daemon
    and names its address; once it listens there again, the restore works and it receives."""
    d = Daemon(tmp_path)
    out = tmp_path / "out"
    job = subprocess.Popen([sys.executable, "-c", JOB, str(d.path), str(out), str(N)],
                           stdin=subprocess.DEVNULL, start_new_session=True)
    restored: list[int] = []
    try:
        _wait(lambda: len(d.received()) >= 20, "the job sent nothing")
        info = run_json("dump", job.pid, "--repo", repo, "--exit")
        job.wait(timeout=30)
        d.close()
        d.path.unlink()
        res = run_gpusnap("restore", info["snapshot"], "--repo", repo, "--json")
        assert res.returncode != 0, res.stdout
        err = json.loads(res.stdout)
        assert "daemon" in err["hint"] and str(d.path) in err["hint"], err
        d.log.rename(tmp_path / "before.log")
        d = Daemon(tmp_path)
        restored = run_json("restore", info["snapshot"], "--repo", repo)["pids"]
        _wait(lambda: out.exists() and out.read_text(), "the restored job did not finish")
        assert out.read_text() == f"done {N} total={N * (N + 1) // 2}\n"
        before = [int(x) for x in (tmp_path / "before.log").read_text().split()]
        assert before + d.received() == list(range(1, N + 1))
    finally:
        kill_pids(restored)
        if job.poll() is None:
            job.kill()
        job.wait()
        d.close()
