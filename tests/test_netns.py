"""A job in a named network namespace (`ip netns add`) is restored into that namespace again
(CRIU's --join-ns), where a server outside the job still answers it; with the namespace gone
the restore refuses (exit 35) and nothing runs. Real CRIU, real namespaces."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import kill_pids, run_gpusnap, run_json, wait_for
from gpusnap.system import netns

pytestmark = pytest.mark.criu

# setns() into /run/netns/NAME, as the zdtm netns_lock tests do (not `ip netns exec`, which
# also gives the process a mount namespace of its own)
ENTER = r'''
import ctypes, os, sys
def enter(name):
    fd = os.open("/run/netns/" + name, os.O_RDONLY)
    if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:
        raise OSError(ctypes.get_errno(), "setns")
    os.close(fd)
'''

SERVER = ENTER + r'''
import socket
enter(sys.argv[1])
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", int(sys.argv[2])))
srv.listen(4)
open(sys.argv[3], "w").close()
while True:
    c, _ = srv.accept()
    c.sendall(b"pong " + sys.argv[1].encode())
    c.close()
'''

JOB = ENTER + r'''
import hashlib, socket, time
enter(sys.argv[1])
out, port = sys.argv[2], int(sys.argv[3])
h = hashlib.sha256(b"seed")
log = open(os.path.join(out, "job.log"), "a", buffering=1)
for i in range(1, 201):
    h.update(i.to_bytes(4, "little"))
    log.write(f"step {i}\n")
    time.sleep(0.02)
try:
    c = socket.create_connection(("127.0.0.1", port), timeout=10)
    said = c.recv(100).decode()
except OSError as e:
    said = f"error {e}"
with open(os.path.join(out, "results"), "a") as r:
    r.write(h.hexdigest() + " " + said.replace(" ", "_") + "\n")
'''


def _expected() -> str:
    h = __import__("hashlib").sha256(b"seed")
    for i in range(1, 201):
        h.update(i.to_bytes(4, "little"))
    return h.hexdigest()


@pytest.fixture
def named_netns():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2's ip")
    name = f"gpusnap-t{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {r.stderr.strip()}")
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def _start(tmp_path: Path, name: str, port: int):
    (tmp_path / "server.py").write_text(SERVER)
    (tmp_path / "job.py").write_text(JOB)
    out = tmp_path / "job"
    out.mkdir()
    ready = tmp_path / "server.ready"
    server = subprocess.Popen([sys.executable, str(tmp_path / "server.py"), name, str(port), str(ready)],
                              stdin=subprocess.DEVNULL, start_new_session=True)
    wait_for(ready.exists, "the server in the namespace")
    job = subprocess.Popen([sys.executable, str(tmp_path / "job.py"), name, str(out), str(port)],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    wait_for(lambda: (out / "job.log").exists() and len((out / "job.log").read_text().splitlines()) >= 10,
             "the job's first steps")
    return server, job, out


@pytest.mark.slow
def test_job_in_named_netns_is_restored_into_it(tmp_path, repo, named_netns):
    server, job, out = _start(tmp_path, named_netns, 8931)
    restored = None
    try:
        checks = {c["name"]: c for c in run_json("doctor", job.pid)["checks"]}
        ns = checks["network namespace"]
        assert ns["status"] == "ok" and f"/run/netns/{named_netns}" in ns["detail"], ns
        snap = run_json("dump", job.pid, "--exit", "--repo", repo)["snapshot"]
        job.wait(timeout=30)
        from gpusnap.repo import locate

        _, opened = locate.open_snapshot(snap, repo)
        assert opened.manifest["meta"]["netns"]["path"] == f"/run/netns/{named_netns}"
        seen = run_json("inspect", snap, "--repo", repo)["netns"]
        assert seen["path"] == f"/run/netns/{named_netns}" and seen["status"] == "same", seen
        info = run_json("restore", snap, "--repo", repo)
        restored = info["pid"]
        assert not any("made again" in n for n in info["notes"]), info["notes"]
        # the job's namespace is the named one, not a new one made from the images
        assert netns.inode(restored) == netns.mounted_at(f"/run/netns/{named_netns}")
        wait_for(lambda: (out / "results").exists(), "the restored job to finish", timeout=120)
        # the server outside the job answered it: the restored job is in the same namespace
        assert (out / "results").read_text().split() == [_expected(), f"pong_{named_netns}"]
    finally:
        kill_pids([p for p in (job.pid, restored) if p])
        server.kill()
        server.wait()


@pytest.mark.slow
def test_restore_refuses_when_the_named_netns_is_gone(tmp_path, repo, named_netns):
    server, job, out = _start(tmp_path, named_netns, 8932)
    try:
        snap = run_json("dump", job.pid, "--exit", "--repo", repo)["snapshot"]
        job.wait(timeout=30)
    finally:
        server.kill()
        server.wait()
    subprocess.run(["ip", "netns", "delete", named_netns], check=True)
    assert run_json("inspect", snap, "--repo", repo)["netns"]["status"] == "missing"
    r = run_gpusnap("restore", snap, "--repo", repo, "--json")
    assert r.returncode == 35, (r.returncode, r.stdout, r.stderr)
    err = __import__("json").loads(r.stdout)
    assert err["error"] == "network namespace missing" and f"/run/netns/{named_netns}" in err["message"]
    assert f"ip netns add {named_netns}" in err["hint"]
    time.sleep(0.5)
    assert not (out / "results").exists()
    # made again (empty, but a network namespace at that path): the restore joins it
    subprocess.run(["ip", "netns", "add", named_netns], check=True)
    subprocess.run(["ip", "-n", named_netns, "link", "set", "lo", "up"], check=True)
    human = run_gpusnap("inspect", snap, "--repo", repo)
    assert "(made again)" in human.stdout + human.stderr, human.stdout + human.stderr
    info = run_json("restore", snap, "--repo", repo)
    restored = info["pid"]
    try:
        assert netns.inode(restored) == netns.mounted_at(f"/run/netns/{named_netns}")
        # joined, and said: the namespace of that name is not the one the job ran in
        assert any(f"{named_netns} was made again" in n for n in info["notes"]), info["notes"]
        wait_for(lambda: (out / "results").exists(), "the restored job to finish", timeout=120)
        assert (out / "results").read_text().split()[0] == _expected()   # no server there now
    finally:
        kill_pids([restored])


def test_mountinfo_names_net_namespaces():
    """nsfs bind mounts of net namespaces, escaped mount points unescaped; other nsfs and
    other filesystems are not network namespaces."""
    info = ("46 45 0:4 net:[4026532304] /run/netns/a\\040b rw shared:2 - nsfs nsfs rw\n"
            "47 45 0:4 net:[4026532304] /tmp/keep rw - nsfs nsfs rw\n"
            "48 45 0:4 mnt:[4026532305] /run/mntns/x rw - nsfs nsfs rw\n"
            "49 1 0:5 / /run rw - tmpfs tmpfs rw\n")
    assert netns.mounts(info) == {"/run/netns/a b": 4026532304, "/tmp/keep": 4026532304}
    assert netns.mounted_at("/run/netns/a b", info) == 4026532304
    assert netns.mounted_at("/run/netns/gone", info) is None


def test_own_netns_is_not_foreign():
    assert netns.foreign(os.getpid()) is None
