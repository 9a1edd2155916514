"""The sockets a process tree holds, read from /proc: socket inodes of its descriptors, its
network namespace, the TCP tables (/proc/PID/net/tcp{,6}), `ss -x` unix rows, and which
process holds a socket. Used by the preflight, doctor and CRIU's network lock."""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Any

from gpusnap.system import proc

PROC = Path("/proc")
TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1",
              "05": "FIN_WAIT2", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT",
              "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING"}


def _read(path: Path | str) -> str | None:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None


def socket_inodes(pid: int) -> set[int]:
    out = set()
    for t in proc.fd_targets(pid).values():
        m = re.match(r"socket:\[(\d+)\]$", t)
        if m:
            out.add(int(m.group(1)))
    return out


def netns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def decode_addr(hexaddr: str) -> str:
    """'0100007F:1F90' → '127.0.0.1:8080' (/proc/net/tcp{,6} notation)."""
    ip_hex, port_hex = hexaddr.split(":")
    raw = bytes.fromhex(ip_hex)
    # the kernel prints each 32-bit word in host (little-endian) order
    b = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(b)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    port = int(port_hex, 16)
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def parse_proc_net_tcp(text: str) -> list[dict[str, Any]]:
    """Rows of /proc/PID/net/tcp or tcp6: [{local, remote, state, inode}]."""
    out = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 10:
            continue
        try:
            out.append({"local": decode_addr(f[1]), "remote": decode_addr(f[2]),
                        "state": TCP_STATES.get(f[3].upper(), f[3]), "inode": int(f[9])})
        except ValueError:
            continue
    return out


def host_tcp() -> list[dict[str, Any]]:
    """Rows of this network namespace's /proc/net/tcp and tcp6 (every TCP socket here)."""
    rows: list[dict[str, Any]] = []
    for name in ("tcp", "tcp6"):
        rows += parse_proc_net_tcp(_read(PROC / "net" / name) or "")
    return rows


def tcp_sockets(pid: int, inodes: set[int] | None = None) -> list[dict[str, Any]]:
    """TCP sockets (among `inodes`, or all) in PID's network namespace."""
    out = []
    for name in ("tcp", "tcp6"):
        for row in parse_proc_net_tcp(_read(PROC / str(pid) / "net" / name) or ""):
            if inodes is None or row["inode"] in inodes:
                out.append(row)
    return out


def parse_ss_unix(text: str) -> list[dict[str, Any]]:
    """`ss -xaH` lines → [{type, state, path, inode, peer}] (peer inode, 0 = none)."""
    out = []
    for line in text.splitlines():
        f = line.split()
        if len(f) < 8:
            continue
        try:
            inode, peer = int(f[-3]), int(f[-1])
        except ValueError:
            continue
        path = " ".join(f[4:-3])
        out.append({"type": f[0], "state": f[1], "path": "" if path == "*" else path,
                    "inode": inode, "peer": peer})
    return out


def who_holds(inodes: set[int]) -> dict[int, tuple[int, str]]:
    """socket inode → (pid, comm) of some process holding it."""
    found: dict[int, tuple[int, str]] = {}
    want = set(inodes)
    for n in os.listdir(PROC):
        if not want:
            break
        if not n.isdigit():
            continue
        for ino in socket_inodes(int(n)) & want:
            comm = (_read(PROC / n / "comm") or "?").strip()
            found[ino] = (int(n), comm)
            want.discard(ino)
    return found


# /proc/PID/net tables of the socket kinds CRIU before 4.2 fails on, and their inode column
_NET_TABLES = {"tcp": ("TCP", 9), "tcp6": ("TCP/IPv6", 9), "udp": ("UDP", 9), "udp6": ("UDP/IPv6", 9),
               "udplite": ("UDP-Lite", 9), "udplite6": ("UDP-Lite/IPv6", 9), "raw": ("raw IP", 9),
               "raw6": ("raw IPv6", 9), "packet": ("packet", 8)}


def network_sockets(pids: list[int]) -> dict[int, str]:
    """socket inode -> kind ("TCP", "UDP/IPv6", "packet", ...) for every AF_INET, AF_INET6 and
    AF_PACKET socket the processes hold open (unix and netlink sockets are not in the tables)."""
    held: dict[str, set[int]] = {}  # network namespace -> socket inodes held there
    first_pid: dict[str, int] = {}
    for pid in pids:
        ns = netns(pid)
        if ns is None:
            continue
        first_pid.setdefault(ns, pid)
        held.setdefault(ns, set()).update(socket_inodes(pid))
    found: dict[int, str] = {}
    for ns, inodes in held.items():
        for table, (kind, col) in _NET_TABLES.items():
            for row in (_read(PROC / str(first_pid[ns]) / "net" / table) or "").splitlines()[1:]:
                f = row.split()
                if len(f) > col and f[col].isdigit() and int(f[col]) in inodes:
                    found[int(f[col])] = kind
    return found
