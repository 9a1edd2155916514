"""TCP connections across a dump and a restore: CRIU's network lock, and whether a restored
connection can be re-established or must come back closed (--tcp-close).

While CRIU dumps established connections it drops their packets (the network lock: `iptables`
rules, or an nftables table) so the peer sees nothing. After `dump --exit` the rules stay until
a restore re-establishes the connections and lifts them. A restore with --tcp-close brings the
sockets back closed and CRIU leaves the rules in place; gpusnap removes them, so the peer's
end gets the reset it is owed the next time it sends.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
from typing import Any

from gpusnap.errors import GpusnapError



def _exe(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}")
                                       if os.access(p, os.X_OK)), None)


def network_lock() -> tuple[list[str] | None, str]:
    """CRIU's network lock for --tcp-established: (extra dump options, method), or (None, why
    not). CRIU's default method runs `iptables`; without it, nftables when this CRIU was built
    with libnftables (`criu check --feature nftables`)."""
    if _exe("iptables"):
        return [], "iptables"
    from gpusnap.criu import config, runner

    try:
        criu = runner.criu_info().path
    except GpusnapError:
        return None, "CRIU is missing"
    try:
        rc = subprocess.run(config.argv(criu, "check", "--feature", "nftables"), env=config.environ(), capture_output=True,
                            timeout=30).returncode
    except (OSError, subprocess.SubprocessError):
        rc = 1
    if rc == 0:
        return ["--network-lock", "nftables"], "nftables"
    return None, "neither iptables nor CRIU's nftables support is available"


def _split(addr: str) -> tuple[str, int]:
    host, port = addr.rsplit(":", 1)
    return host.strip("[]"), int(port)


def _is_local_ip(ip: str) -> bool:
    """True when `ip` is an address of this machine (binding to it works)."""
    try:
        a = ipaddress.ip_address(ip)
    except ValueError:
        return False
    if a.is_loopback:
        return True
    fam = socket.AF_INET6 if a.version == 6 else socket.AF_INET
    try:
        with socket.socket(fam, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


def _live_connections() -> set[tuple[str, str]]:
    from gpusnap.system import sockets

    rows = sockets.host_tcp()
    # a peer that died leaves an orphan (inode 0) in FIN_WAIT or TIME_WAIT: that end is gone;
    # one that only shut down its half (CLOSE_WAIT, FIN_WAIT2, LAST_ACK, CLOSING) still holds it
    return {(r["local"], r["remote"]) for r in rows
            if r["state"] not in ("LISTEN", "TIME_WAIT", "CLOSE") and r["inode"]}


def peers_gone(conns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Connections whose peer was on this machine and no longer holds its end. Peers on other
    machines cannot be seen from here: they count as alive (a dead one answers with a reset).
    A connection still in SYN_SENT has no peer end yet (its SYN was not answered: dropped by a
    firewall, or the listener is slow): restored as it was, it connects when a listener answers,
    and fails as it would have when none does; restored closed, it never connects."""
    ours = {c["local"] for c in conns}
    live = _live_connections()
    gone = []
    for c in conns:
        if c["remote"] in ours:  # both ends are in the snapshot: restored together
            continue
        if c.get("state") == "SYN_SENT":   # a connect in progress: no peer end to lose yet; the
            continue                      # restored socket sends its SYN again, a listener answers it
        if _is_local_ip(_split(c["remote"])[0]) and (c["remote"], c["local"]) not in live:
            gone.append(c)
    return gone


def restore_tcp_close(conns: list[dict[str, Any]], requested: bool) -> tuple[bool, str | None]:
    """Restore the snapshot's connections closed? (decision, why)."""
    if not conns:
        return False, None
    if requested:
        return True, "--tcp-close"
    # a connection already reset (CLOSE) has no peer to lose: CRIU restores it as it was, and
    # refuses it under --tcp-close ("Connected TCP socket in image")
    conns = [c for c in conns if c.get("state") != "CLOSE"]
    live = _live_connections()
    held = [c for c in conns if (c["local"], c["remote"]) in live]
    if held:  # the original job still runs with it (a restore beside it, as a fork)
        return True, f"the running original still holds {held[0]['local']}→{held[0]['remote']}"
    gone = peers_gone(conns)
    if gone:
        return True, (f"the peer of {gone[0]['local']}→{gone[0]['remote']} is gone"
                      + (f" (and {len(gone) - 1} more)" if len(gone) > 1 else ""))
    return False, None


def unlock_closed(conns: list[dict[str, Any]]) -> None:
    """Remove the lock rules CRIU's dump left for connections restored closed (best effort:
    a rule already gone is fine)."""
    from gpusnap.criu import netlock_rules

    netlock_rules.lift(conns)
