"""Temporary directories gpusnap makes outside the repository, and the one sweep that removes
what a killed gpusnap left of them.

A dump's work directory (CRIU's log, the capture socket, the gate: up to 680 KB), a restore's
(CRIU's pidfile and sockets) and a restore's image directory (/dev/shm, REPO/tmp, or $TMPDIR
for a read-only repository) are
named `<prefix><pid>-<start>-<random>`: the owning gpusnap's PID and its start time (clock
ticks after boot, /proc/PID/stat), which together name one process for good, PID reuse
included. A SIGKILLed gpusnap cleans nothing; every later dump, restore and prune calls
sweep(), which removes each such directory whose owner is gone. Only directories this user
owns are touched (never a link: /tmp is everyone's), through shutil.rmtree, which works
relative to directory descriptors and never follows a link inside.

Names from gpusnap before this one: `<prefix><pid>-<random>` (restores: the PID alone
decides) and `gpusnap-dump-<random>` (no owner in the name: removed once a day old, which no
dump lasts).
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

from gpusnap.system import proc

DUMP = "gpusnap-dump-"          # $TMPDIR: a dump's work directory
RESTORE = "gpusnap-restore-"    # $TMPDIR: a restore's work directory (criu restore -W)
IMAGES = "gpusnap-images-"      # /dev/shm or REPO/tmp: `restore --via files|lazy` image files
SHM = Path("/dev/shm")
LEGACY_AGE = 86400.0

_tag: list[str] = []


def owner_tag() -> str:
    """`<pid>-<start>` of this process (computed once per process: a fork gets its own)."""
    pid = os.getpid()
    if not _tag or not _tag[0].startswith(f"{pid}-"):
        st = proc.read_stat(pid)
        _tag[:] = [f"{pid}-{st.starttime if st else 0}"]
    return _tag[0]


def make(prefix: str, parent: Path | str | None = None) -> Path:
    """A new private directory (0700, created exclusively) named after this process."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{owner_tag()}-", dir=parent))


def _owner_gone(prefix: str, rest: str, mtime: float) -> bool:
    parts = rest.split("-")
    if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit():
        pid, start = int(parts[0]), int(parts[1])
        if f"{pid}-{start}" == owner_tag():
            return False
        return not proc.alive_since(pid, start)
    if len(parts) == 2 and parts[0].isdigit():              # <pid>-<random>: the PID alone
        return int(parts[0]) != os.getpid() and not proc.exists(int(parts[0]))
    if len(parts) == 1 and prefix == DUMP:                  # gpusnap-dump-<random>: by age
        return time.time() - mtime > LEGACY_AGE
    return False


def remove_dead(parent: Path | str, prefix: str) -> list[str]:
    """Remove `parent/<prefix>…` directories of gpusnap processes that no longer exist.
    -> the paths removed."""
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    out = []
    for n in names:
        if not n.startswith(prefix):
            continue
        p = os.path.join(parent, n)
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        if _owner_gone(prefix, n[len(prefix):], st.st_mtime):
            shutil.rmtree(p, ignore_errors=True)
            if not os.path.lexists(p):
                out.append(p)
    return out


def sweep(repo_path: Path | str | None = None) -> list[str]:
    """Every place gpusnap leaves temporary directories: $TMPDIR, /dev/shm, and REPO/tmp of
    `repo_path` (nothing happens there on a read-only repository). -> the paths removed."""
    tmp = tempfile.gettempdir()
    out = remove_dead(tmp, DUMP) + remove_dead(tmp, RESTORE) + remove_dead(tmp, IMAGES) + remove_dead(SHM, IMAGES)
    if repo_path is not None:
        out += remove_dead(Path(repo_path) / "tmp", IMAGES)
    return out
