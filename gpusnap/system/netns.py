"""A job's network namespace when it is not gpusnap's own, and the name it can be found by.

`ip netns add NAME` makes a network namespace and keeps it alive with a bind mount of its nsfs
file on /run/netns/NAME; a job started with `ip netns exec NAME ...` (or one that setns()'d into
it) runs there beside processes outside the job (a server, a router) that stay in it. CRIU
dumps the job's namespace because it differs from CRIU's own, and by default its restore makes
a new namespace from the images: the processes outside the job are not in it. Restoring into
the same namespace is CRIU's `--join-ns net:PATH`. The preflight records the path of a bind
mount of the job's namespace (`meta.netns`, docs/format.md); the restore joins it when a net
namespace is still mounted there, and refuses (NetnsMissing) when none is.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

NETNS_DIR = "/run/netns"        # where `ip netns` binds them (/var/run is a link to /run)
_ROOT = re.compile(r"net:\[(\d+)\]$")


@dataclass(frozen=True)
class Netns:
    inode: int                  # the namespace's inode (as /proc/PID/ns/net reads net:[INODE])
    path: str | None            # a bind mount of it (prefer /run/netns/NAME); None: no name found

    @property
    def name(self) -> str | None:
        return os.path.basename(self.path) if self.path else None

    def to_meta(self) -> dict:
        return {"path": self.path, "inode": self.inode}


def inode(pid: int | str) -> int | None:
    """The inode of PID's network namespace (None: the process is gone)."""
    try:
        m = _ROOT.match(os.readlink(f"/proc/{pid}/ns/net"))
    except OSError:
        return None
    return int(m.group(1)) if m else None


def _unescape(s: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def mounts(mountinfo: str | None = None) -> dict[str, int]:
    """{mount point: net namespace inode} for every nsfs bind mount of a network namespace in
    gpusnap's mount namespace (/proc/self/mountinfo)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return {}
    out: dict[str, int] = {}
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if not sep or len(f) < 5 or not r or r[0] != "nsfs":
            continue
        m = _ROOT.match(f[3])
        if m:
            out[_unescape(f[4])] = int(m.group(1))
    return out


def foreign(pid: int, mountinfo: str | None = None) -> Netns | None:
    """PID's network namespace when it is not gpusnap's own (None: the same, or PID is gone),
    with the path of a bind mount of it: one under /run/netns first, else any other."""
    ino, mine = inode(pid), inode("self")
    if ino is None or ino == mine:
        return None
    paths = sorted((p for p, i in mounts(mountinfo).items() if i == ino),
                   key=lambda p: (not p.startswith(NETNS_DIR + "/"), len(p), p))
    return Netns(ino, paths[0] if paths else None)


def mounted_at(path: str, mountinfo: str | None = None) -> int | None:
    """The inode of the network namespace bound at `path` now (None: none is)."""
    found = mounts(mountinfo)
    if path in found:
        return found[path]
    real = os.path.realpath(path)   # /var/run/netns/NAME is /run/netns/NAME
    return found.get(real)
