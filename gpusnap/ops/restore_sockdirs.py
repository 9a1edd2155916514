"""The directories of the job's bound unix sockets, made again before a restore when gone.

CRIU restores a bound unix socket by binding it to its path again, which fails ("Can't bind
... No such file or directory") when the directory is gone. Programs put such sockets in a
private temporary directory they remove on exit: Python multiprocessing's `forkserver` listens
on /tmp/pymp-XXXX/listener-XXXX and removes /tmp/pymp-XXXX when the program ends, so a job
dumped while it ran and restored after it finished could not come back. Before CRIU runs,
`make` creates each missing directory of a bound path socket in the snapshot's files.img
(mode 0700, as mkdtemp makes them, owned like the socket); a failed restore removes them
again (`Made.undo`), a successful one leaves them to the job, which removes them as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gpusnap.criu import images


def bound_dirs(snap) -> list[tuple[str, int, int]]:
    """(directory, uid, gid) of every absolute-path unix socket the snapshot binds."""
    try:
        socks = images.unix_sockets(snap)
    except ValueError:
        socks = []      # unreadable: CRIU says so in its own words
    out: dict[str, tuple[str, int, int]] = {}
    for u in socks:
        if u["deleted"]:
            continue        # already unlinked when dumped: CRIU restores it so, and the job
                            # may check that its directory stays gone
        name = u["name"].rstrip(b"\0")
        if not name.startswith(b"/") or b"\0" in name:
            continue        # abstract, unnamed or relative (CRIU resolves those itself)
        d = os.path.dirname(os.fsdecode(name))
        out.setdefault(d, (d, u["uid"], u["gid"]))
    return sorted(out.values())


@dataclass
class Made:
    dirs: list[str] = field(default_factory=list)   # made here, outermost first

    def undo(self) -> None:
        for d in reversed(self.dirs):
            try:
                os.rmdir(d)             # only if still empty
            except OSError:
                pass
        self.dirs.clear()


def make(snap) -> Made:
    made = Made()
    for d, uid, gid in bound_dirs(snap):
        missing = []
        p = d
        while p and p != "/" and not os.path.lexists(p):
            missing.append(p)
            p = os.path.dirname(p)
        for m in reversed(missing):
            try:
                os.mkdir(m, 0o700)
            except OSError:
                break           # CRIU then fails and names the path
            made.dirs.append(m)
            try:
                os.chown(m, uid, gid)
            except OSError:
                pass
    return made
