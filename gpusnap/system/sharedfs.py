"""Whether a repository lives on a filesystem other machines share, and whether its locks hold there.

The repository's locks are flock(2) locks and, since format revision 1.6, lock files under
REPO/locks/ (docs/format.md §6). On a local filesystem the kernel enforces the flocks. On NFS,
Linux maps flock to byte-range locks the server enforces across clients, unless the mount
keeps locks local to this client (`nolock`, `local_lock=flock|all`): then the lock files
alone keep a prune from running under another node's writers, which needs the nodes' clocks
in step and every node on gpusnap >= the revision 1.6 (an older one only flocks). Other
network filesystems differ per mount option; doctor names them so the user checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

NFS = ("nfs", "nfs4")
OTHER_SHARED = ("cifs", "smb3", "lustre", "beegfs", "gpfs", "glusterfs", "ceph", "9p", "afs", "ocfs2", "gfs2")


@dataclass
class Mount:
    point: str
    fstype: str
    options: set[str]


def _unescape(s: str) -> str:
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def mount_of(path: Path, mountinfo: str | None = None) -> Mount | None:
    """The mount holding `path` (the nearest existing ancestor), from /proc/self/mountinfo."""
    p = Path(path).absolute()
    rest: list[str] = []
    while not p.exists() and p != p.parent:  # the repository may not exist yet
        rest.insert(0, p.name)
        p = p.parent
    p = p.resolve().joinpath(*rest)
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    best: Mount | None = None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if not sep or len(f) < 6 or len(r) < 3:
            continue
        point = _unescape(f[4])
        if p != Path(point) and not str(p).startswith(point.rstrip("/") + "/"):
            continue
        if best is None or len(point) >= len(best.point):  # later mounts on the same point win
            best = Mount(point, r[0], set(f[5].split(",")) | set(r[2].split(",")))
    return best


def check(path: Path, mountinfo: str | None = None) -> tuple[str, str, str | None]:
    """(status, detail, fix) for doctor: ok for a local filesystem or NFS with server-side locks."""
    m = mount_of(path, mountinfo)
    if m is None:
        return "info", f"cannot tell which filesystem holds {path}", None
    where = f"{path} is on {m.fstype} ({m.point})"
    if m.fstype in NFS:
        local = {o for o in m.options if o in ("nolock", "local_lock=flock", "local_lock=all")}
        if local:
            return ("warn", f"{where}, mounted with {', '.join(sorted(local))}: flock is local to this "
                            "machine, so only gpusnap's lock files (REPO/locks/lock-*) keep a prune on one node "
                            "from running under another node's dumps",
                    "keep the nodes' clocks in sync (the files go stale after $GPUSNAP_LOCK_STALE s) and every "
                    "node on this gpusnap version (an older one only flocks); or mount without nolock/local_lock")
        return "ok", f"{where}: locks are enforced by the server, so nodes can share it", None
    if m.fstype in OTHER_SHARED or m.fstype.startswith("fuse."):
        return ("warn", f"{where}: shared with other machines? gpusnap's lock files hold there, its flock(2) "
                        "fast path only if the filesystem enforces flock across nodes",
                "see docs/slurm.md, 'A shared repository'")
    return "ok", f"{where} (local)", None
