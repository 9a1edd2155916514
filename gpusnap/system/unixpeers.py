"""Unix sockets of a tree connected to a process outside it, sorted by what CRIU can do with them.

CRIU dumps one end of a unix connection only when told to (`--ext-unix-sk`), and then only
for a datagram socket whose peer has a name (a bound path: syslog's /dev/log, journald's
socket, a daemon's own; an abstract name too): at restore it binds the job's end as before and connects it to that
path again, so the daemon must be listening there then. A stream or seqpacket connection has
state on both ends that CRIU cannot recreate on one side, and a nameless peer cannot be found
again; those stay refused, with CRIU's reason. The rows come from `ss -xaH` (parse_ss_unix).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpusnap.system import sockets

EXT_OPTION = "--ext-unix-sk"  # dump and restore both need it
_KIND = {"u_dgr": "datagram", "u_str": "stream", "u_seq": "seqpacket"}


@dataclass
class External:
    row: dict[str, Any]        # the tree's socket (parse_ss_unix row)
    peer_path: str             # the outside peer's bound path, "" for none
    holder: str                # who holds the peer, in words
    reason: str | None         # why CRIU cannot dump it; None: --ext-unix-sk does

    @property
    def kind(self) -> str:
        return _KIND.get(self.row["type"], self.row["type"])

    def describe(self) -> str:
        own = self.row["path"] or "(unnamed)"
        return f"{self.kind} {own} → {self.peer_path or '(unnamed peer)'} of {self.holder}"


def external(rows: list[dict[str, Any]], inodes: set[int]) -> list[External]:
    """The tree's sockets (inodes) whose peer is outside the tree, each with CRIU's verdict.
    rows: every unix socket `ss -xaH` lists (the peers' names are read from them too)."""
    by_inode = {r["inode"]: r for r in rows}
    ext = [r for r in rows if r["inode"] in inodes and r["peer"] and r["peer"] not in inodes]
    holders = sockets.who_holds({r["peer"] for r in ext}) if ext else {}
    out = []
    for r in ext:
        peer = by_inode.get(r["peer"], {})
        name = peer.get("path", "")
        h = holders.get(r["peer"])
        who = f"{h[1]} (pid {h[0]})" if h else "a process outside the tree"
        if r["type"] != "u_dgr":
            why = (f"CRIU cannot dump one half of a {_KIND.get(r['type'], r['type'])} connection "
                   "(the other end's state is not in the snapshot)")
        elif not name:
            why = "CRIU can reconnect a datagram socket only to a peer that has a name, and this one has none"
        else:
            why = None
        out.append(External(r, name, who, why))
    return out
