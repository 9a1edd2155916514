"""`gpusnap doctor PID` and `gpusnap dump PID` agree, case by case, on real processes with the
real CRIU: where doctor says ready, the dump succeeds; where doctor fails, the dump refuses
with the same reason (before touching the job), and the CRIU options doctor predicts are the
ones the snapshot records."""

from __future__ import annotations

import json
import os
import pwd
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import kill_pids, run_gpusnap
from gpusnap.repo import locate
from gpusnap.ops import preflight
from gpusnap.system import filelocks, proc

pytestmark = pytest.mark.criu


def _doctor(pid: int) -> dict:
    res = run_gpusnap("doctor", pid, "--json")
    assert res.returncode in (0, 1), res.stderr
    return json.loads(res.stdout)


def _agree(pid: int, repo: Path) -> tuple[dict, subprocess.CompletedProcess]:
    """Doctor, then dump (left running); assert they agree and return both."""
    doc = _doctor(pid)
    fails = [c for c in doc["checks"] if c["status"] == "fail" and c["name"] not in
             ("GPU", "MIG", "MPS", "CUDA checkpoint API")]
    res = run_gpusnap("dump", pid, "--repo", repo, "--json")
    if not fails:
        assert res.returncode == 0, f"doctor said ready, dump failed:\n{res.stdout}\n{res.stderr}"
        assert json.loads(res.stdout)["criu_options"] == doc["plan"]["dump_options"]
        _, snap = locate.open_snapshot(json.loads(res.stdout)["snapshot"])
        assert snap.manifest["meta"]["restore_flags"] == doc["plan"]["restore_flags"]
    else:
        assert res.returncode != 0, f"doctor said {fails[0]}, dump succeeded"
        err = json.loads(res.stdout)
        assert err["message"] == fails[0]["detail"], (err, fails[0])
        assert err.get("hint") == fails[0]["fix"]
    return doc, res


def _names(doc: dict, status: str) -> set[str]:
    return {c["name"] for c in doc["checks"] if c["status"] == status}


def _start(code: str, **kw) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         text=True, start_new_session=True, **kw)
    assert p.stdout.readline().strip() == "ready"
    return p


def _stop(p: subprocess.Popen) -> None:
    kill_pids(proc.tree(p.pid)[::-1])
    p.wait(timeout=30)


def test_plain_job(repo):
    p = _start("import time; print('ready', flush=True); time.sleep(120)")
    try:
        doc, res = _agree(p.pid, repo)
        assert doc["ok"] and res.returncode == 0
        assert doc["plan"]["dump_options"] == []
    finally:
        _stop(p)


def test_job_started_from_a_shell(repo):
    p = subprocess.Popen(["sh", "-c", "sleep 120 & echo $!; wait"], stdout=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    child = int(p.stdout.readline())
    try:
        doc, res = _agree(child, repo)
        assert res.returncode == 0 and "--shell-job" in doc["plan"]["dump_options"]
        assert "shell job" in _names(doc, "info")
    finally:
        _stop(p)


def test_missing_process(repo):
    doc, res = _agree(2 ** 22 + 11, repo)
    assert res.returncode == 5 and "process" in _names(doc, "fail")


def test_own_parent(repo):
    doc, res = _agree(os.getpid(), repo)  # the test runner is the gpusnap commands' parent
    assert res.returncode == 2 and "self" in _names(doc, "fail")


def test_kernel_thread(repo):
    kthreadd = 2
    if not ((st := proc.read_stat(kthreadd)) and st.flags & proc.PF_KTHREAD):
        pytest.skip("no kernel thread visible in this PID namespace")
    doc, res = _agree(kthreadd, repo)
    assert res.returncode == 16 and "kernel thread" in json.loads(res.stdout)["message"]


def test_session_leader_outside_the_pid_namespace(repo):
    holder = subprocess.Popen(["unshare", "--pid", "--fork", "sleep", "600"], stdin=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
    target = None
    try:
        deadline = time.monotonic() + 10
        while not proc.children(holder.pid):
            if holder.poll() is not None:
                pytest.skip(f"cannot make a PID namespace here: {holder.stderr.read().decode().strip()}")
            assert time.monotonic() < deadline
            time.sleep(0.02)
        target = proc.children(holder.pid)[0]
        doc, res = _agree(target, repo)
        assert res.returncode == 16 and "session" in _names(doc, "fail")
    finally:
        if target:
            kill_pids([target])
        holder.kill()
        holder.wait()


def test_traced_process(repo):
    # the child asks to be traced by its parent (this test) and then waits; CRIU cannot seize it
    code = ("import ctypes,os,time; ctypes.CDLL(None).ptrace(0,0,0,0); print('ready',flush=True); "
            "time.sleep(120)")
    p = _start(code)
    try:
        doc, res = _agree(p.pid, repo)
        assert res.returncode == 16 and "ptrace" in _names(doc, "fail")
    finally:
        _stop(p)


def test_other_uid(repo):
    try:
        nobody = pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("no user nobody")
    p = subprocess.Popen(["sleep", "120"], user=nobody, stdin=subprocess.DEVNULL, start_new_session=True)
    try:                      # (Popen returns once `sleep` is exec'd: nothing to wait for)
        doc, res = _agree(p.pid, repo)
        if preflight.has_cap(preflight.CAP_SYS_RESOURCE):
            assert res.returncode == 0
        else:
            assert res.returncode == 16 and "uid" in _names(doc, "fail")
    finally:
        p.kill()
        p.wait()


def test_established_tcp_connection(repo):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    p = _start(f"import socket,time; s=socket.create_connection(('127.0.0.1',{port})); "
               "print('ready',flush=True); time.sleep(120)")
    conn, _ = srv.accept()
    try:
        doc, res = _agree(p.pid, repo)
        assert res.returncode == 0 and "--tcp-established" in doc["plan"]["dump_options"]
        assert "TCP" in _names(doc, "info")
        # the job kept its connection through the dump
        conn.sendall(b"x")
        assert proc.exists(p.pid)
    finally:
        conn.close()
        _stop(p)
        srv.close()


def test_listening_socket(repo):
    p = _start("import socket,time; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(); "
               "print('ready',flush=True); time.sleep(120)")
    try:
        doc, res = _agree(p.pid, repo)
        assert res.returncode == 0 and "TCP listen" in _names(doc, "ok")
    finally:
        _stop(p)


def test_unix_socket_to_a_process_outside(repo, tmp_path):
    path = str(tmp_path / "ext.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen()
    p = _start(f"import socket,time; s=socket.socket(socket.AF_UNIX); s.connect({path!r}); "
               "print('ready',flush=True); time.sleep(120)")
    conn, _ = srv.accept()
    try:
        doc, res = _agree(p.pid, repo)
        assert res.returncode == 16 and "unix sockets" in _names(doc, "fail")
        assert f"pid {os.getpid()}" in json.loads(res.stdout)["message"]  # names the peer
        assert proc.read_stat(p.pid).state in ("S", "R")  # untouched
    finally:
        conn.close()
        _stop(p)
        srv.close()


def test_file_lock(repo, tmp_path):
    target = tmp_path / "locked"
    target.write_text("x")
    p = _start(f"import fcntl,time; f=open({str(target)!r},'r+'); fcntl.flock(f, fcntl.LOCK_EX); "
               "print('ready',flush=True); time.sleep(120)")
    try:
        doc, res = _agree(p.pid, repo)
        assert res.returncode == 0 and "--file-locks" in doc["plan"]["dump_options"]
        locks = [c for c in doc["checks"] if c["name"] == "file locks"]
        assert locks and "FLOCK" in locks[0]["detail"] and str(target) in locks[0]["detail"]
    finally:
        _stop(p)


def test_lock_parser_sees_posix_and_ofd_locks(tmp_path):
    target = tmp_path / "f"
    target.write_text("data")
    code = (f"import fcntl,os,struct,time; fd=os.open({str(target)!r}, os.O_RDWR); "
            "fcntl.lockf(fd, fcntl.LOCK_EX, 1, 0); "
            f"fd2=os.open({str(target)!r}, os.O_RDWR); "
            "fcntl.fcntl(fd2, 37, struct.pack('hhqqi', fcntl.F_WRLCK, 0, 2, 1, 0)); "  # F_OFD_SETLK
            "print('ready',flush=True); time.sleep(120)")
    p = _start(code)
    try:
        kinds = {lk["kind"] for lk in filelocks.file_locks([p.pid])}
        assert {"POSIX", "OFDLCK"} <= kinds, kinds
    finally:
        _stop(p)
