"""CRIU's per-connection network-lock rules on this machine: which exist, and lifting them.

A `criu dump` of a job with established TCP connections (outside a network namespace of its
own) inserts, for each connection, two iptables rules that drop every packet of it not marked
by CRIU's own repair code (`-m mark ! --mark 0xc114 ... -j DROP`, INPUT and OUTPUT; ip6tables
for IPv6). CRIU lifts them itself when its dump fails or leaves the job running. They stay
when the dump leaves the tree stopped (`dump --exit`): the peer must get no reset until a
restore brings the connection back. If the job is then resumed instead (gpusnap's commit
failed, gpusnap was killed and its guardian resumed the job), nothing would ever lift them
and the job's connections would be blackholed for good: gpusnap lifts them there, on forget
and prune of the snapshot that held them, and `doctor` lists the ones no snapshot needs.

CRIU also leaves the tree's TCP sockets in repair mode after a stopped dump (it takes them
out only when it unlocks the network); a process resumed with its sockets in repair mode gets
EPERM on every send. repair_off() takes them out, through a copy of each socket descriptor
(pidfd_getfd), as CRIU would have.

The nftables method (used where iptables is missing) keeps its rules in a table named after
CRIU's run id, `inet CRIU-<uuid>`; lift_table() removes one when the run id is known.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import shutil
import socket
import subprocess
from typing import Any, Iterable

SOCCR_MARK = "0xc114"  # CRIU's libsoccr marks its own repair packets with this
CHAINS = ("INPUT", "OUTPUT")


def _exe(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}")
                                       if os.access(p, os.X_OK)), None)


def split(addr: str) -> tuple[str, int]:
    """'127.0.0.1:80' or '[::1]:80' → (ip, port); an IPv4-mapped IPv6 address as IPv4 (as CRIU
    writes its rule for it)."""
    host, port = addr.rsplit(":", 1)
    ip = ipaddress.ip_address(host.strip("[]").split("/")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return str(ip), int(port)


def key(conn: dict[str, Any]) -> tuple[tuple[str, int], tuple[str, int]] | None:
    """A connection ({local, remote}) as comparable addresses, or None when it does not parse."""
    try:
        return split(str(conn["local"])), split(str(conn["remote"]))
    except (KeyError, ValueError, TypeError):
        return None


def _fmt(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _run(cmd: list[str]) -> tuple[int, str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as e:
        return 1, str(e)
    return p.returncode, p.stdout


def parse_rules(text: str) -> list[tuple[str, str, int, str, int]]:
    """CRIU's lock rules in `iptables -S` output: [(chain, source, sport, destination, dport)]."""
    out = []
    for line in text.splitlines():
        t = line.split()
        if len(t) < 4 or t[0] != "-A" or t[1] not in CHAINS or t[-2:] != ["-j", "DROP"]:
            continue
        try:
            i = t.index("--mark")
        except ValueError:
            continue
        if t[i - 1] != "!" or t[i + 1].lower() != SOCCR_MARK:
            continue
        opts = {t[j]: t[j + 1] for j in range(2, len(t) - 1) if t[j] in ("-s", "-d", "--sport", "--dport")}
        try:
            out.append((t[1], opts["-s"].split("/")[0], int(opts["--sport"]),
                        opts["-d"].split("/")[0], int(opts["--dport"])))
        except (KeyError, ValueError):
            continue
    return out


def present() -> list[dict[str, str]]:
    """The connections CRIU's lock rules hold now ({local, remote}, as the job saw them: its
    OUTPUT rule's source is the job's end)."""
    seen: dict[tuple, dict[str, str]] = {}
    for name in ("iptables", "ip6tables"):
        exe = _exe(name)
        if not exe:
            continue
        for chain in CHAINS:
            rc, out = _run([exe, "-w", "-S", chain])
            if rc != 0:
                continue
            for ch, src, sport, dst, dport in parse_rules(out):
                local, remote = ((src, sport), (dst, dport)) if ch == "OUTPUT" else ((dst, dport), (src, sport))
                seen.setdefault((local, remote), {"local": _fmt(*local), "remote": _fmt(*remote)})
    return list(seen.values())


def lift(conns: Iterable[dict[str, Any]]) -> list[str]:
    """Remove the lock rules of these connections (a rule already gone is fine); the
    connections whose rules could not all be removed."""
    failed = []
    for c in conns:
        k = key(c)
        if k is None:
            continue
        (lip, lport), (rip, rport) = k
        exe = _exe("ip6tables" if ":" in lip else "iptables")
        if not exe:
            continue
        ok = True
        for chain, src, sport, dst, dport in (("INPUT", rip, rport, lip, lport), ("OUTPUT", lip, lport, rip, rport)):
            rule = [chain, "--protocol", "tcp", "-m", "mark", "!", "--mark", SOCCR_MARK, "--source", src,
                    "--sport", str(sport), "--destination", dst, "--dport", str(dport), "-j", "DROP"]
            # CRIU inserts one rule per lock; a connection locked twice (two dumps) has two
            for _ in range(8):
                if _run([exe, "-w", "-t", "filter", "-C", *rule])[0] != 0:
                    break
                if _run([exe, "-w", "-t", "filter", "-D", *rule])[0] != 0:
                    ok = False
                    break
        if not ok:
            failed.append(f"{_fmt(lip, lport)}→{_fmt(rip, rport)}")
    return failed


def lift_table(run_id: str | None) -> None:
    """The nftables lock of CRIU run `run_id` (its `inet CRIU-<run id>` table), if any."""
    nft = _exe("nft")
    if nft and run_id and all(ch.isalnum() or ch == "-" for ch in run_id):
        _run([nft, "delete", "table", "inet", f"CRIU-{run_id}"])


def run_id(criu_log: str | os.PathLike) -> str | None:
    """CRIU's run id, from the first lines of its log ("CRIU run id = <uuid>")."""
    try:
        with open(criu_log, errors="replace") as f:
            for _, line in zip(range(200), f):
                if "CRIU run id = " in line:
                    return line.rsplit("=", 1)[1].strip()
    except OSError:
        pass
    return None


SYS_PIDFD_GETFD = 438        # the same number on every architecture (Linux >= 5.6)
TCP_REPAIR = 19              # linux/tcp.h
TCP_REPAIR_OFF = 0           # leave repair mode and send a window probe (the peer resyncs)


def repair_off(pids: Iterable[int]) -> int:
    """Take every TCP socket of these (stopped, untraced) processes out of repair mode; how
    many were. Best effort: a process or descriptor that is gone is skipped."""
    libc = ctypes.CDLL(None, use_errno=True)
    done: set[int] = set()
    for pid in pids:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            for name in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{name}")
                except OSError:
                    continue
                if not target.startswith("socket:["):
                    continue
                inode = int(target[8:-1])
                if inode in done:
                    continue
                fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, int(name), 0)
                if fd < 0:
                    continue
                with socket.socket(fileno=fd) as sk:
                    try:
                        if (sk.family in (socket.AF_INET, socket.AF_INET6) and sk.type == socket.SOCK_STREAM
                                and sk.getsockopt(socket.IPPROTO_TCP, TCP_REPAIR) == 1):
                            sk.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, TCP_REPAIR_OFF)
                            done.add(inode)
                    except OSError:
                        pass
        finally:
            os.close(pidfd)
    return len(done)
