"""The terminals a snapshot's job had whose other end was outside the dumped tree (a tmux or
screen pane, an ssh session, the shell's terminal of a `&` job), read from CRIU's tty-info.img.

CRIU restores such a terminal (with --shell-job) by handing the job its own stdin in its place
(criu/tty.c: pty_open_unpaired_slave), and fails with "Don't have tty to inherit session from"
when that stdin is no terminal. A pty whose master the tree itself holds (a dumped tmux server)
is recreated whole and needs nothing. Read through criu/images.py.
"""

from __future__ import annotations

import os

from gpusnap.criu import images

IMAGE = "tty-info.img"
# images/tty.proto TtyType, and the fields of tty_info_entry read here
PTY, VT, SERIAL = 1, 3, 6
F_TYPE, F_PGRP, F_RDEV, F_PTY = 2, 7, 8, 12
PTMX = (5, 2)                       # /dev/ptmx: a pty's master
PTS_MAJORS = range(136, 144)        # UNIX98_PTY_SLAVE_MAJOR .. +7


def handed_over(snap) -> list[str]:
    """The terminals (e.g. ['/dev/pts/3'], as named at the dump) that a restore must replace
    with a terminal of its own; [] when there are none. Raises ValueError on a malformed image."""
    if not snap.has_image(IMAGE):
        return []
    masters: set[int] = set()
    slaves: dict[int, str] = {}
    others: list[str] = []
    for f in images.entries(images.read(snap, IMAGE), images.TTY_INFO_MAGIC):
        kind, rdev = f.get(F_TYPE), int(f.get(F_RDEV, 0))
        major, minor = os.major(rdev), os.minor(rdev)
        if kind == PTY:
            index = images.fields(f[F_PTY]).get(1) if isinstance(f.get(F_PTY), bytes) else None
            if (major, minor) == PTMX and index is not None:
                masters.add(int(index))
            elif major in PTS_MAJORS and index is not None:
                slaves[int(index)] = f"/dev/pts/{index}"
        elif kind in (VT, SERIAL):
            others.append(f"/dev/tty (device {major}:{minor})")
    return [name for i, name in sorted(slaves.items()) if i not in masters] + others


def job_had_foreground(snap) -> bool:
    """Whether a process group of the job was its terminal's foreground at the dump. If not
    (a shell's `&` job), the terminal's modes CRIU recorded were the shell's (readline's raw
    mode), not the job's."""
    groups = {p["pgid"] for p in images.pstree(images.read(snap, "pstree.img"))}
    for f in images.entries(images.read(snap, IMAGE), images.TTY_INFO_MAGIC) if snap.has_image(IMAGE) else []:
        if f.get(F_TYPE) == PTY and os.major(int(f.get(F_RDEV, 0))) in PTS_MAJORS and f.get(F_PGRP) in groups:
            return True
    return False
