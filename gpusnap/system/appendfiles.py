"""Sizes of the files the job appends to, as of the freeze (CRIU records none for them).

CRIU stores no size for a regular file opened with O_APPEND and write access (the position
means nothing there), so a log opened `open(path, "a")` or with `>>` that grew after the dump
could not be brought back to the snapshot's point: the restored job appended again from its
own point and the log ended with those steps twice. Here:

- before CRIU starts, `scan` finds every (pid, fd) of the tree open O_APPEND with O_WRONLY
  or O_RDWR on a regular file (/proc/PID/fdinfo flags, /proc/PID/fd link);
- inside the freeze (the post-dump gate: CRIU has dumped everything, the job has not resumed),
  `Recorder.at_freeze` stats exactly those fds: a few syscalls each, counted in the freeze;
- the result goes into the manifest's `meta.append_files` (docs/format.md), and restore treats
  each like an output file with a known size (gpusnap/ops/restore_files.py).

A file is named by its path and identified by (st_dev, st_ino), so restore can tell a rotated
file from the one the job wrote. Files opened between the scan and the freeze are not
recorded (restore then behaves as without this: no check for them).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

O_ACCMODE = 0o3
O_APPEND = 0o2000
DELETED = " (deleted)"


@dataclass(frozen=True)
class AppendFd:
    pid: int
    fd: int
    dev: int
    ino: int


def _flags(pid: int, fd: int) -> int | None:
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"flags:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        return None
    return None


def _appending(flags: int | None) -> bool:
    return flags is not None and bool(flags & O_APPEND) and flags & O_ACCMODE in (os.O_WRONLY, os.O_RDWR)


def scan(pids: list[int]) -> list[AppendFd]:
    """Every fd of the tree open O_APPEND for writing on a regular file (before CRIU starts)."""
    out: list[AppendFd] = []
    for pid in pids:
        try:
            fds = [int(n) for n in os.listdir(f"/proc/{pid}/fd")]
        except (OSError, ValueError):
            continue
        for fd in fds:
            if not _appending(_flags(pid, fd)):
                continue
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                out.append(AppendFd(pid, fd, st.st_dev, st.st_ino))
    return out


class Recorder:
    """Stats the scanned fds once, at the freeze; `files` is None until then."""

    def __init__(self, found: list[AppendFd]):
        self.found = found
        self.files: list[dict] | None = None

    def at_freeze(self) -> None:
        if self.files is not None:
            return
        files: dict[tuple[int, int], dict] = {}
        for a in self.found:
            try:
                path = os.readlink(f"/proc/{a.pid}/fd/{a.fd}")
                st = os.stat(f"/proc/{a.pid}/fd/{a.fd}")
            except OSError:
                continue        # closed since the scan
            # the same open file still (not closed and another opened on that number), still
            # reachable by its name (a deleted file is CRIU's to restore), still appended to
            if (st.st_dev, st.st_ino) != (a.dev, a.ino) or not path.startswith("/") \
                    or path.endswith(DELETED) or st.st_nlink == 0 or not _appending(_flags(a.pid, a.fd)):
                continue
            files[(st.st_dev, st.st_ino)] = {"path": path, "size": st.st_size, "dev": st.st_dev, "ino": st.st_ino}
        self.files = sorted(files.values(), key=lambda f: f["path"])
