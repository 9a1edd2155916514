"""Which live processes have a file open or mapped, by device and inode (/proc/*/fd and
/proc/*/maps), so that a restore never cuts back a file another process is using
(gpusnap/ops/restore_files.py).

A file is named by (st_dev, st_ino), not by path: a link or another name of the same file is
the same file. Mappings are matched on the inode in /proc/PID/maps and confirmed with a stat of
/proc/PID/map_files/RANGE (the device numbers maps prints are not st_dev on every filesystem).
Processes that cannot be read (gone meanwhile) are skipped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class User:
    pid: int
    comm: str
    how: str            # "open" or "mapped"

    def __str__(self) -> str:
        return f"process {self.pid} ({self.comm})"


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() or "?"
    except OSError:
        return "?"


def _fds(pid: int, files: set[tuple[int, int]]) -> set[tuple[int, int]]:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    return _among((f"/proc/{pid}/fd/{fd}" for fd in fds), files)


def _among(paths, files: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """The (dev, ino) of `files` that the /proc links `paths` lead to."""
    found = set()
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in files:
            found.add((st.st_dev, st.st_ino))
    return found


def _maps(pid: int, files: set[tuple[int, int]], inodes: set[int]) -> set[tuple[int, int]]:
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    rows = (ln.split(None, 5) for ln in lines)
    return _among((f"/proc/{pid}/map_files/{p[0].decode()}" for p in rows
                   if len(p) >= 5 and p[4].isdigit() and int(p[4]) in inodes), files)


def users(files: set[tuple[int, int]], exclude: set[int] = frozenset()) -> dict[tuple[int, int], list[User]]:
    """For each (dev, ino) of `files`, the live processes (but this one and `exclude`) that
    have it open or mapped."""
    out: dict[tuple[int, int], list[User]] = {f: [] for f in files}
    if not files:
        return out
    inodes = {ino for _, ino in files}
    skip = set(exclude) | {os.getpid()}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        pid = int(name)
        opened = _fds(pid, files)
        mapped = _maps(pid, files, inodes) - opened
        if opened or mapped:
            comm = _comm(pid)
            for f in opened:
                out[f].append(User(pid, comm, "open"))
            for f in mapped:
                out[f].append(User(pid, comm, "mapped"))
    return out
