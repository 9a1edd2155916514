"""A connection still being made (SYN_SENT: its SYN not answered yet) has no peer end to lose:
the restore brings it back as it was, and it connects once a listener answers. Restored closed
(as gpusnap did when it took the unanswered peer for gone) it never connects (zdtm's
socket-tcp-syn-sent then waited forever in accept())."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import kill_pids, run_json, wait_for
from gpusnap.criu import netlock

SERVER = r'''
import socket, sys
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", int(sys.argv[1])))
srv.listen(4)
open(sys.argv[2], "w").close()
while True:
    c, _ = srv.accept()
    c.sendall(b"pong")
    c.close()
'''

JOB = r'''
import os, select, socket, sys, time
out, port = sys.argv[1], int(sys.argv[2])
s = socket.socket()
s.setblocking(False)
try:
    s.connect(("127.0.0.1", port))
except BlockingIOError:
    pass
open(os.path.join(out, "started"), "w").close()
while not os.path.exists(os.path.join(out, "go")):
    time.sleep(0.02)
select.select([], [s], [], 60)
err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
if err:
    said = f"error {os.strerror(err)}"
else:
    s.setblocking(True)
    said = s.recv(100).decode()
with open(os.path.join(out, "results"), "w") as r:
    r.write(said)
'''


def test_syn_sent_peer_is_never_gone(monkeypatch):
    monkeypatch.setattr(netlock, "_live_connections", lambda: set())
    syn = {"local": "127.0.0.1:40000", "remote": "127.0.0.1:8880", "state": "SYN_SENT"}
    est = {"local": "127.0.0.1:40001", "remote": "127.0.0.1:8881", "state": "ESTABLISHED"}
    assert netlock.restore_tcp_close([syn], False) == (False, None)
    assert netlock.peers_gone([syn, est]) == [est]
    assert netlock.restore_tcp_close([syn], True) == (True, "--tcp-close")


def _drop(port: int, add: bool) -> None:
    subprocess.run(["iptables", "-w", "-t", "filter", "-A" if add else "-D", "INPUT", "-p", "tcp",
                    "--dport", str(port), "-j", "DROP"], check=add, capture_output=True)


@pytest.mark.criu
@pytest.mark.slow
def test_connect_in_progress_is_restored_and_connects(tmp_path, repo):
    if os.geteuid() != 0 or shutil.which("iptables") is None:
        pytest.skip("needs root and iptables")
    port = 8941
    (tmp_path / "server.py").write_text(SERVER)
    (tmp_path / "job.py").write_text(JOB)
    out = tmp_path / "job"
    out.mkdir()
    ready = tmp_path / "ready"
    server = subprocess.Popen([sys.executable, str(tmp_path / "server.py"), str(port), str(ready)],
                              stdin=subprocess.DEVNULL, start_new_session=True)
    job = restored = None
    _drop(port, True)      # the listener's SYN-ACK never comes: the job's connect stays in SYN_SENT
    try:
        wait_for(ready.exists, "the server")
        job = subprocess.Popen([sys.executable, str(tmp_path / "job.py"), str(out), str(port)],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
        wait_for((out / "started").exists, "the job's connect")
        ss = subprocess.run(["ss", "-tnH", "state", "syn-sent", "dport", f"= :{port}"], capture_output=True,
                            text=True).stdout
        assert ss.strip(), "the connect is not in SYN_SENT"
        snap = run_json("dump", job.pid, "--exit", "--repo", repo)["snapshot"]
        job.wait(timeout=30)
        r = run_json("restore", snap, "--repo", repo)
        restored = r["pid"]
        assert not r.get("tcp_closed"), r
        _drop(port, False)
        (out / "go").touch()
        wait_for((out / "results").exists, "the restored job's connect", timeout=120)
        assert (out / "results").read_text() == "pong"
    finally:
        _drop(port, False)
        kill_pids([p for p in (job.pid if job else None, restored) if p])
        server.kill()
        server.wait()
