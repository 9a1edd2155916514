"""Machine-wide locks for work that contends for this host's own resources, not a repository's.

Two restores of one job started at the same moment would both find its PIDs free and both set
aside what its output files gained since the snapshot; two dumps of one job (into two
repositories) would race to seize it, and one CRIU would fail. One dump and one restore at a
time per job keeps each one's checks true while it works. The locks are flock(2) on files in a
root-only directory under /run (tmpfs, emptied at boot); the kernel drops a lock when its
holder dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
import tempfile
from typing import Callable, Iterator

from gpusnap.errors import AccessDenied
from gpusnap import settings

LOCK_DIR = "/run/gpusnap"


def _lock_dir() -> str:
    d = settings.get("GPUSNAP_LOCK_DIR")                 # (set by tests)
    if not d:
        d = LOCK_DIR
        if os.geteuid() != 0 or not os.path.isdir(os.path.dirname(d)):
            # CRIU's non-root mode (capabilities) cannot write /run; nor can anyone where it is missing
            base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
            d = os.path.join(base, f"gpusnap-{os.geteuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(d, 0o700)
    st = os.lstat(d)
    # another user's directory (or a link) could let them hold our locks or swap the files
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise AccessDenied(f"{d} (gpusnap's lock directory) is not a directory private to uid {os.geteuid()}",
                           hint=f"remove it (`rm -rf {d}`); gpusnap makes it again, mode 0700")
    return d


@contextlib.contextmanager
def held(name: str, waiting: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold the machine-wide lock `name` (letters, digits, '-', '.'), waiting while another
    process holds it (`waiting` is called once before such a wait). The lock file is removed
    on release, so /run/gpusnap holds only the locks in use: it is unlinked while still
    locked, and a taker whose flock lands on a file that was meanwhile unlinked (or replaced)
    lets go and opens the path again, so that no two processes ever hold the lock on two
    different files."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.-]{0,100}", name):
        raise ValueError(f"bad lock name {name!r}")
    d = _lock_dir()
    path = os.path.join(d, name + ".lock")
    told = False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if waiting is not None and not told:
                    told = True
                    waiting()
                fcntl.flock(fd, fcntl.LOCK_EX)
            if _is_linked(fd, path):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)          # its holder removed it after we opened it: take the new one
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)   # still ours: we hold the lock on the file this path names
        os.close(fd)          # the only fd: closing it releases the lock
    _sweep_free(d)


def _is_linked(fd: int, path: str) -> bool:
    """Whether `path` still names the file open on `fd`."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _sweep_free(d: str) -> None:
    """Remove lock files nobody holds (left by a gpusnap killed between its unlink and its
    exit, or by one from before lock files were removed), the same safe way."""
    try:
        names = [n for n in os.listdir(d) if n.endswith(".lock")]
    except OSError:
        return
    for n in names:
        path = os.path.join(d, n)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _is_linked(fd, path) and stat.S_ISREG(os.fstat(fd).st_mode):
                os.unlink(path)
        except OSError:
            pass              # held: in use
        finally:
            os.close(fd)
