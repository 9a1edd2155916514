"""Programs with TCP connections, dumped with the real CRIU and restored: a client whose
connection is re-established (peer alive), restored closed on request (--tcp-close) or by
default when its peer is gone (it sees a reset and reconnects), and redis-server with 100k
keys dumped while a client talks to it."""

from __future__ import annotations

import json
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import kill_pids, run_gpusnap, run_json
from gpusnap.system import proc

pytestmark = pytest.mark.criu

SERVER = r"""
import socket, sys, threading
port_file, log = sys.argv[1], sys.argv[2]
port = int(sys.argv[3]) if len(sys.argv) > 3 else 0
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port)); srv.listen()
open(port_file + ".tmp", "w").write(str(srv.getsockname()[1])); __import__("os").rename(port_file + ".tmp", port_file)
def serve(c, addr):
    with open(log, "a") as f:
        f.write(f"conn {addr[1]}\n")
    r = c.makefile("rb")
    for line in r:
        c.sendall(line.replace(b"ping", b"pong"))
while True:
    c, addr = srv.accept()
    threading.Thread(target=serve, args=(c, addr), daemon=True).start()
"""

CLIENT = r"""
import os, socket, sys, time
port, go, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
def connect():
    s = socket.create_connection(("127.0.0.1", port))
    return s, s.makefile("rb")
s, r = connect()
resets, i = 0, 0
while i < 10:
    if i == 5:
        print("waiting", flush=True)
        while not os.path.exists(go):
            time.sleep(0.05)
    try:
        s.sendall(f"ping {i}\n".encode())
        line = r.readline()
        if not line:
            raise ConnectionResetError("EOF")
        assert line == f"pong {i}\n".encode(), line
        i += 1
    except OSError as e:
        resets += 1
        print(f"reset: {e!r}", flush=True)
        s, r = connect()
open(out, "a").write(f"done {i} resets={resets}\n")
"""


def _wait_file(path: Path, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.05)
    raise AssertionError(f"{path} did not appear in {timeout} s")


class Scene:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        self.restored: list[int] = []

    def server(self, port: int = 0) -> int:
        pf = self.tmp / f"port-{len(self.procs)}"
        p = subprocess.Popen([sys.executable, "-c", SERVER, str(pf), str(self.tmp / "server.log"), str(port)],
                             stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(p)
        return int(_wait_file(pf))

    def client(self, port: int) -> subprocess.Popen:
        log = open(self.tmp / "client.log", "w")
        p = subprocess.Popen([sys.executable, "-c", CLIENT, str(port), str(self.tmp / "go"), str(self.tmp / "out")],
                             stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        self.procs.append(p)
        deadline = time.monotonic() + 30
        while "waiting" not in (self.tmp / "client.log").read_text():
            assert time.monotonic() < deadline and p.poll() is None, (self.tmp / "client.log").read_text()
            time.sleep(0.05)
        return p

    def connections(self) -> int:
        return (self.tmp / "server.log").read_text().count("conn ")

    def close(self) -> None:
        kill_pids(self.restored)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.fixture
def scene(tmp_path):
    s = Scene(tmp_path)
    yield s
    s.close()


def _dump_exit_restore(scene: Scene, client: subprocess.Popen, repo: Path, *restore_args) -> dict:
    info = run_json("dump", client.pid, "--repo", repo, "--exit")
    client.wait(timeout=30)
    assert proc.wait_gone([client.pid], 30) == []
    res = run_json("restore", info["snapshot"], "--repo", repo, *restore_args)
    scene.restored = res["pids"]
    return res


def test_connection_is_re_established_when_the_peer_is_alive(scene, repo):
    port = scene.server()
    client = scene.client(port)
    res = _dump_exit_restore(scene, client, repo)
    assert res["tcp_closed"] is None
    (scene.tmp / "go").touch()
    assert _wait_file(scene.tmp / "out") == "done 10 resets=0"
    assert scene.connections() == 1  # the same connection carried on


def test_tcp_close_restores_the_connection_closed(scene, repo):
    port = scene.server()
    client = scene.client(port)
    res = _dump_exit_restore(scene, client, repo, "--tcp-close")
    assert res["tcp_closed"] == "--tcp-close"
    (scene.tmp / "go").touch()
    assert _wait_file(scene.tmp / "out") == "done 10 resets=1"
    assert "reset" in (scene.tmp / "client.log").read_text()
    assert scene.connections() == 2  # it reconnected
    rules = subprocess.run(["iptables", "-S"], capture_output=True, text=True).stdout if shutil.which(
        "iptables") else ""
    assert f"--dport {port}" not in rules and f"--sport {port}" not in rules, rules  # lock lifted


@pytest.mark.parametrize("mode", ["running", "exit"])
def test_dump_tcp_close_leaves_the_connection_out(scene, repo, mode):
    """`dump --tcp-close`: CRIU saves no connection state and locks nothing, so a job left running
    keeps talking on its connection; the restore (no flag needed) has it closed: it reconnects."""
    port = scene.server()
    client = scene.client(port)
    info = run_json("dump", client.pid, "--repo", repo, "--tcp-close", *(["--exit"] if mode == "exit" else []))
    assert "--tcp-close" in info["criu_options"] and "--tcp-established" not in info["criu_options"]
    if mode == "running":
        (scene.tmp / "go").touch()       # the original goes on, on its connection, undisturbed
        assert _wait_file(scene.tmp / "out") == "done 10 resets=0"
    client.wait(timeout=30)
    assert proc.wait_gone([client.pid], 30) == []
    res = run_json("restore", info["snapshot"], "--repo", repo)
    scene.restored = res["pids"]
    assert res["tcp_closed"] == "dumped with --tcp-close"
    (scene.tmp / "go").touch()
    deadline = time.monotonic() + 60
    while "resets=1" not in (scene.tmp / "out").read_text() if (scene.tmp / "out").exists() else True:
        assert time.monotonic() < deadline, (scene.tmp / "client.log").read_text()
        time.sleep(0.05)
    assert (scene.tmp / "out").read_text().splitlines()[-1] == "done 10 resets=1"
    assert scene.connections() == 2      # the restored job reconnected
    rules = subprocess.run(["iptables", "-S"], capture_output=True, text=True).stdout if shutil.which(
        "iptables") else ""
    assert f"--dport {port}" not in rules and f"--sport {port}" not in rules, rules


def test_connection_is_closed_by_default_when_the_peer_is_gone(scene, repo):
    port = scene.server()
    client = scene.client(port)
    info = run_json("dump", client.pid, "--repo", repo, "--exit")
    client.wait(timeout=30)
    # the server dies and comes back on the same port: the old connection's other end is gone
    old = scene.procs[0]
    old.kill()
    old.wait()
    scene.server(port)
    res = run_json("restore", info["snapshot"], "--repo", repo)
    scene.restored = res["pids"]
    assert res["tcp_closed"] and "gone" in res["tcp_closed"]
    (scene.tmp / "go").touch()
    assert _wait_file(scene.tmp / "out") == "done 10 resets=1"


def test_fork_beside_the_running_original_gets_its_connection_closed(scene, repo):
    """A `gpusnap run` job restored while it still runs: the original keeps its connection, the
    fork's copy comes back closed (the original holds that address pair) and reconnects."""
    port = scene.server()
    res = run_gpusnap("run", "--json", "--name", "client", "--repo", repo, "--", sys.executable, "-c", CLIENT,
                      str(port), str(scene.tmp / "go"), str(scene.tmp / "out"))
    assert res.returncode == 0, res.stderr
    job = json.loads(res.stdout)
    init = job["pid"]
    try:
        deadline = time.monotonic() + 30
        while "waiting" not in Path(job["stdout"]).read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        info = run_json("dump", "--name", "client", "--repo", repo)
        assert info["job_running"]
        restored = run_json("restore", "client", "--repo", repo)
        scene.restored = restored["pids"]
        assert "running original" in restored["tcp_closed"]
        (scene.tmp / "go").touch()
        deadline = time.monotonic() + 60
        while (scene.tmp / "out").read_text().count("done") < 2 if (scene.tmp / "out").exists() else True:
            assert time.monotonic() < deadline, Path(job["stdout"]).read_text()
            time.sleep(0.05)
        assert sorted((scene.tmp / "out").read_text().split("\n")[:2]) == ["done 10 resets=0",
                                                                          "done 10 resets=1"]
        assert scene.connections() == 2
    finally:
        kill_pids(proc.tree(init)[::-1] if proc.exists(init) else [])


# ---------------------------------------------------------------- redis

def _resp(*args: str) -> bytes:
    out = [f"*{len(args)}\r\n".encode()]
    for a in args:
        b = a.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class Redis:
    def __init__(self, port: int):
        self.s = socket.create_connection(("127.0.0.1", port))
        self.r = self.s.makefile("rb")

    def reply(self):
        line = self.r.readline()
        kind, rest = line[:1], line[1:-2]
        if kind in (b"+", b"-"):
            return rest.decode()
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.r.read(n + 2)[:-2]
            return data.decode()
        raise AssertionError(f"unexpected reply {line!r}")

    def cmd(self, *args: str):
        self.s.sendall(_resp(*args))
        return self.reply()

    def pipeline(self, cmds: list[tuple[str, ...]]) -> list:
        self.s.sendall(b"".join(_resp(*c) for c in cmds))
        return [self.reply() for _ in cmds]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not shutil.which("redis-server"), reason="redis-server is not installed (apt-get install redis-server)")
def test_redis_with_100k_keys_dumped_while_serving(tmp_path, repo):
    port = _free_port()
    log = open(tmp_path / "redis.log", "w")
    # no persistence: everything the restored server knows came through the snapshot
    p = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path),
                          "--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "no"],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, cwd=tmp_path)
    restored: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                client = Redis(port)
                break
            except OSError:
                assert time.monotonic() < deadline and p.poll() is None, (tmp_path / "redis.log").read_text()
                time.sleep(0.05)
        rnd = random.Random(7)
        values = {f"key:{i}": f"{i}-{rnd.getrandbits(64):x}" for i in range(100_000)}
        items = list(values.items())
        for k in range(0, len(items), 5000):
            assert set(client.pipeline([("SET", a, b) for a, b in items[k:k + 5000]])) == {"OK"}
        assert client.cmd("DBSIZE") == 100_000
        assert client.cmd("INCR", "counter") == 1
        # `client` stays connected through the dump: redis holds an established connection
        info = run_json("dump", p.pid, "--repo", repo, "--exit")
        p.wait(timeout=30)
        assert proc.wait_gone([p.pid], 30) == []
        res = run_json("restore", info["snapshot"], "--repo", repo)
        restored = res["pids"]
        assert res["tcp_closed"] is None
        # the connection made before the dump carries on
        assert client.cmd("INCR", "counter") == 2
        fresh = Redis(port)
        assert fresh.cmd("DBSIZE") == 100_001
        sample = rnd.sample(items, 500)
        assert fresh.pipeline([("GET", a) for a, _ in sample]) == [b for _, b in sample]
        assert fresh.cmd("SET", "after", "restore") == "OK" and fresh.cmd("GET", "after") == "restore"
    finally:
        kill_pids(restored)
        if p.poll() is None:
            p.kill()
        p.wait()
        log.close()
