"""CRIU's network lock never outlives what needs it (issue 36 item 3): a client holding a real
TCP connection to a local server, dumped with signals at each phase; a committed `--exit`
snapshot that is then forgotten; rules nobody needs, found and lifted by doctor. Each case
ends with the client talking to its server again over the same connection (no reset): with
a rule left, its next request would be dropped and it would hang."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from conftest import run_gpusnap, run_json
from gpusnap.criu import netlock_rules
from gpusnap.system import proc
from test_programs_sockets import _wait_file, scene  # noqa: F401 (a fixture)

pytestmark = pytest.mark.criu


def locked(port: int) -> list[dict]:
    return [c for c in netlock_rules.present() if c["remote"].endswith(f":{port}") or c["local"].endswith(f":{port}")]


def lock_lines(report: dict, port: int) -> list[dict]:
    """doctor's network-lock lines about this test's connection (LOCAL→SERVER; other rules
    may exist on the machine)."""
    return [c for c in report["checks"] if c["name"] == "network lock"
            and re.search(rf"→[^ ]*:{port}(?!\d)", c["detail"])]


def carries_on(scene, client) -> None:
    """The client finishes its ten round trips on its first connection."""
    (scene.tmp / "go").touch()
    out = _wait_file(scene.tmp / "out", timeout=60)
    assert out == "done 10 resets=0", out
    client.wait(timeout=30)


def wait_running(pid: int, timeout: float = 60) -> None:
    """Until the guardian has resumed the job (not stopped, not traced)."""
    deadline = time.monotonic() + timeout
    while True:
        st = proc.read_stat(pid)
        assert st is not None, f"{pid} is gone"
        if st.state not in ("T", "t") and not proc.tracer(pid):
            return
        assert time.monotonic() < deadline, f"{pid} still {st.state}"
        time.sleep(0.05)


@pytest.mark.parametrize("mode,fault,code", [
    ("--exit", "commit:start:KILL", -9),      # gpusnap dies: the guardian resumes the job
    ("--exit", "commit:start:TERM", 130),     # gpusnap gives the job back itself
    ("--exit", "dump:criu-running:KILL", -9),  # CRIU's stream breaks: CRIU unwinds
    ("--exit", "dump:criu-running:TERM", 130),
    ("--exit", "commit:snapshot-renamed:KILL", -9),  # committed, but the guardian never heard it
    ("", "dump:criu-running:KILL", -9),        # the default mode, killed while CRIU works
    ("", "dump:criu-running:INT", 130),
])
def test_a_dump_that_does_not_end_the_job_leaves_its_connections_unlocked(scene, repo, mode, fault, code):
    port = scene.server()
    client = scene.client(port)
    args = ["dump", client.pid, "--repo", repo, *([mode] if mode else [])]
    p = run_gpusnap(*args, env={"GPUSNAP_FAULT": fault})
    assert p.returncode == code, p.stderr
    wait_running(client.pid)
    deadline = time.monotonic() + 30
    while locked(port) and time.monotonic() < deadline:   # (the guardian lifts it, then resumes)
        time.sleep(0.1)
    assert locked(port) == [], netlock_rules.present()
    carries_on(scene, client)
    assert scene.connections() == 1


def test_forgetting_the_exit_snapshot_lifts_its_lock_and_doctor_says_whose_it_is(scene, repo, tmp_path):
    port = scene.server()
    client = scene.client(port)
    info = run_json("dump", client.pid, "--repo", repo, "--exit")
    client.wait(timeout=30)
    assert len(locked(port)) == 1                          # kept for the restore
    report = run_json("doctor", "--repo", repo)
    held = lock_lines(report, port)
    assert [c["status"] for c in held] == ["info"], held
    assert f":{port}" in held[0]["detail"] and info["name"] in held[0]["detail"]
    out = run_gpusnap("forget", info["snapshot"], "--repo", repo, check=True).stdout
    assert locked(port) == [], netlock_rules.present()
    assert "lifted CRIU's network lock on 1 connection" in out, out
    # the server's end is told at once: its next read sees the reset (no blackhole)
    assert lock_lines(run_json("doctor", "--repo", repo), port) == []


def test_doctor_finds_a_stale_lock_and_unlock_network_lifts_it(scene, repo):
    port = scene.server()
    client = scene.client(port)
    conn = next(c for c in _client_conns(client.pid) if c["remote"].endswith(f":{port}"))
    (lip, lport), (rip, rport) = netlock_rules.key(conn)
    # the two rules a CRIU dump leaves, as CRIU writes them (criu/netfilter.c)
    for chain, src, sport, dst, dport in (("INPUT", rip, rport, lip, lport), ("OUTPUT", lip, lport, rip, rport)):
        subprocess.run(["iptables", "-w", "-t", "filter", "-I", chain, "--protocol", "tcp", "-m", "mark", "!",
                        "--mark", "0xC114", "--source", src, "--sport", str(sport), "--destination", dst,
                        "--dport", str(dport), "-j", "DROP"], check=True)
    try:
        run_json("init", "--repo", repo)
        stale = lock_lines(run_json("doctor", "--repo", repo), port)
        assert [c["status"] for c in stale] == ["warn"], stale
        assert conn["local"] in stale[0]["detail"] and "--unlock-network" in stale[0]["fix"]
        report = run_json("doctor", "--repo", repo, "--unlock-network")
        lifted = [c for c in report["checks"] if c["name"] == "network lock" and "lifted" in c["detail"]]
        assert [c["status"] for c in lifted] == ["ok"], lifted
        assert lock_lines(report, port) == []
        assert locked(port) == []
        carries_on(scene, client)
    finally:
        netlock_rules.lift([conn])


def _client_conns(pid: int) -> list[dict]:
    from gpusnap.system import sockets

    return [c for c in sockets.tcp_sockets(pid, sockets.socket_inodes(pid)) if c["state"] == "ESTABLISHED"]
