"""Kernel states of a process tree that CRIU cannot dump, or can only with an option gpusnap
then chooses, found from /proc before the job is frozen (the preflight's and doctor's checks;
CRIU itself finds them only once the tree is seized, and fails the dump).

- a thread with a pending SIGTRAP (a debugger's breakpoint or single step not yet taken):
  CRIU refuses it ("Can't dump the ... thread with a pending SIGTRAP");
- a process in another time namespace than the tree's root, or one that made a new time
  namespace for its children: CRIU dumps only the root's ("Can't dump nested time namespace");
- a UDP socket holding corked data (UDP_CORK, datagram not yet sent): CRIU cannot save the
  pending datagram ("Can't dump corked dgram socket");
- TCP connections waiting in a listening socket's accept queue (in flight: the job has not
  accepted them): CRIU dumps them only when told to drop them (--skip-in-flight); their
  clients see a reset and, as any client of a restarted server, connect again.

Each check returns findings as (name, status, detail, fix) and options for `criu dump`.
"""

from __future__ import annotations

import os
from pathlib import Path

from gpusnap.system import proc, sockets

SIGTRAP = 5


def _sig_pending(status: dict[str, str], sig: int) -> bool:
    bit = 1 << (sig - 1)
    return any(int(status.get(k, "0") or "0", 16) & bit for k in ("SigPnd", "ShdPnd"))


def pending_sigtrap(pids: list[int]) -> list[tuple[str, str, str, str]]:
    hit = [t for p in pids for t in proc.threads(p) if _sig_pending(proc.status(f"{p}/task/{t}"), SIGTRAP)]
    if not hit:
        return []
    return [("signals", "fail", f"thread(s) {', '.join(map(str, hit[:5]))} have a SIGTRAP pending (a "
             "debugger's breakpoint or single step not yet delivered): CRIU cannot dump such a thread",
             "let the job take the signal first (detach or continue the debugger), then dump")]


def _ns(pid: int, kind: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def nested_timens(pids: list[int]) -> list[tuple[str, str, str, str]]:
    if not pids or _ns(pids[0], "time") is None:
        return []           # a kernel without time namespaces
    root = _ns(pids[0], "time")
    odd = [p for p in pids if _ns(p, "time") not in (root, None) or _ns(p, "time_for_children") not in (root, None)]
    if not odd:
        return []
    return [("time namespace", "fail", f"process(es) {', '.join(map(str, odd[:5]))} use or made a time "
             "namespace other than the tree's root's: CRIU dumps only the root's (nested time namespaces "
             "are not supported)", "dump the process that made the time namespace's children instead, "
             "or start the job without unshare --time")]


def _udp_rows(pid: int) -> list[tuple[int, int]]:
    """(inode, bytes in the send queue) of each UDP socket in PID's network namespace."""
    out = []
    for name in ("udp", "udp6", "udplite", "udplite6"):
        try:
            text = (Path("/proc") / str(pid) / "net" / name).read_text()
        except OSError:
            continue
        for line in text.splitlines()[1:]:
            f = line.split()
            try:
                out.append((int(f[9]), int(f[4].split(":")[0], 16)))
            except (IndexError, ValueError):
                continue
    return out


def corked_udp(pids: list[int], inodes: set[int]) -> list[tuple[str, str, str, str]]:
    seen, corked = set(), []
    for p in pids:
        ns = sockets.netns(p)
        if ns in seen:
            continue
        seen.add(ns)
        corked += [ino for ino, tx in _udp_rows(p) if ino in inodes and tx > 0]
    if not corked:
        return []
    return [("UDP", "fail", f"{len(corked)} UDP socket(s) hold a datagram not yet sent (corked with "
             "UDP_CORK or MSG_MORE): CRIU cannot dump the pending data",
             "dump once the job has sent it (uncorked)")]


def tcp_in_flight(pids: list[int], listening: list[dict]) -> tuple[list[str], list[tuple[str, str, str, str]]]:
    """Connections not yet accepted on the tree's listening sockets: --skip-in-flight."""
    if not listening:
        return [], []
    ports = {s["local"].rsplit(":", 1)[1] for s in listening}
    seen, waiting = set(), []
    for p in pids:
        ns = sockets.netns(p)
        if ns in seen:
            continue
        seen.add(ns)
        # queued connections have no file yet (inode 0) and the listener's local port
        waiting += [r for r in sockets.tcp_sockets(p) if r["inode"] == 0 and r["state"] in ("ESTABLISHED", "SYN_RECV")
                    and r["local"].rsplit(":", 1)[1] in ports]
    if not waiting:
        return [], []
    return ["--skip-in-flight"], [
        ("TCP in flight", "info", f"{len(waiting)} connection(s) wait in the accept queue of "
         f"{', '.join(sorted({r['local'] for r in waiting}))}, not yet accepted by the job: they are not "
         "dumped (--skip-in-flight), and their clients see a reset", "the clients connect again")]
