"""Acting on a user's files as that user, through file descriptors (docs/faults.md, "acting on
users' files").

gpusnap runs as root on shared machines. A file outside the repository that it changes (the
tail of a grown log set aside at restore, and put back when the restore fails) lies in a
directory its owner can write, so every name there may be swapped for a link to a root file
between two system calls. Two rules close that:

- the change runs with the owner's identity: `as_owner` forks a helper that drops to the
  file owner's uid, gid and groups (setresuid: the whole process, every thread, and its
  supplementary groups, which setfsuid would leave as root's; a failure in it can never leave
  gpusnap itself with a changed identity). Whatever a link points at, the helper can reach only
  what the owner could reach anyway. A file that root owns is changed by gpusnap itself;
- every step goes through descriptors: the directory is opened once, the file relative to it
  with O_NOFOLLOW, `fstat` checks it is the file that was checked (device and inode), files are
  created with O_EXCL|O_NOFOLLOW and given their mode with fchmod, whatever the umask.

The helper reports back through a pipe as JSON (a result, or an errno with its message); an
OSError in it is raised again in the caller.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pwd
import signal
import stat
from typing import Any, Callable

NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
STOPS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT}
CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _groups(uid: int, gid: int) -> list[int]:
    try:
        return os.getgrouplist(pwd.getpwuid(uid).pw_name, gid)
    except (KeyError, OSError):
        return [gid]            # a uid with no passwd entry: its own group only


@contextlib.contextmanager
def uninterrupted():
    """INT, TERM, HUP and QUIT held back for the block (a change and its record in one piece);
    one that came meanwhile is delivered at its end."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def as_owner(uid: int, gid: int, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) with identity uid/gid (in a forked helper unless uid is root's). fn's result
    must be JSON data; an OSError it raises is raised here."""
    if uid == 0 or uid == os.geteuid() and os.geteuid() != 0:
        return fn(*args)
    groups = _groups(uid, gid)          # (NSS in the parent: the child does system calls only)
    r, w = os.pipe()
    # the helper runs to its end (a few system calls): an interrupt is the caller's to handle,
    # after it, never halfway through a move the helper could then not report
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    try:
        pid = os.fork()
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        os.close(r)
        os.close(w)
        raise
    if pid == 0:                                    # the helper (signals stay blocked)
        code = 0
        try:
            os.close(r)
            os.setgroups(groups)
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            os.umask(0o077)
            try:
                out = {"ok": fn(*args)}
            except OSError as e:
                out = {"errno": e.errno or errno.EIO, "msg": e.strerror or str(e), "file": e.filename}
            os.write(w, json.dumps(out).encode())
        except BaseException:                       # noqa: BLE001 - a helper never returns into gpusnap
            code = 1
        os._exit(code)
    signal.pthread_sigmask(signal.SIG_SETMASK, held)
    os.close(w)
    chunks = []
    try:
        while b := os.read(r, 1 << 16):
            chunks.append(b)
    finally:
        os.close(r)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    try:
        out = json.loads(b"".join(chunks))
    except ValueError:
        raise OSError(errno.EIO, f"the helper acting as uid {uid} failed") from None
    if "errno" in out:
        raise OSError(out["errno"], out["msg"], out.get("file"))
    return out["ok"]


# -- descriptor steps (run inside as_owner) ----------------------------------------------------

def open_parent(path: str) -> tuple[int, str]:
    """(fd of the directory holding the absolute `path`, the file's name in it), walked from /
    one component at a time with O_NOFOLLOW: a link anywhere in the path is refused (ELOOP or
    ENOTDIR), as the paths CRIU and gpusnap record are resolved ones."""
    d, name = os.path.split(path)
    if not path.startswith("/") or not name or name in (".", ".."):
        raise OSError(errno.EINVAL, "not an absolute file name", path)
    fd = os.open("/", NOFOLLOW_DIR)
    try:
        for part in [p for p in d.split("/") if p]:
            if part in (".", ".."):
                raise OSError(errno.EINVAL, "not a resolved path", path)
            try:
                nfd = os.open(part, NOFOLLOW_DIR, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise OSError(errno.ELOOP, f"{part} in the path is a symbolic link or no directory", path) from None
                raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd, name


def open_checked(dfd: int, name: str, flags: int, dev: int, ino: int) -> tuple[int, os.stat_result]:
    """Open dfd/name without following a link and check it is the regular file (dev, ino)
    that was checked before; ESTALE names one that is not."""
    fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (dev, ino):
        os.close(fd)
        raise OSError(errno.ESTALE, "another file is at that name now (not the one checked)", name)
    return fd, st


def create_exclusive(dfd: int, name: str, mode: int) -> int:
    """A new file dfd/name (O_EXCL: never an existing file or a link) with exactly `mode`."""
    fd = os.open(name, CREATE, mode & 0o777, dir_fd=dfd)
    os.fchmod(fd, mode & 0o777)      # the umask narrowed what open gave
    return fd


def create_numbered(dfd: int, base: str, mode: int) -> tuple[int, str]:
    """create_exclusive at `base`, or `base.1`, `base.2`, ... when the name is taken."""
    name, n = base, 0
    while True:
        try:
            return create_exclusive(dfd, name, mode), name
        except FileExistsError:
            n += 1
            name = f"{base}.{n}"


def unlink_if_same(dfd: int, name: str, dev: int, ino: int) -> bool:
    """Remove dfd/name if it is still the file (dev, ino)."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if (st.st_dev, st.st_ino) != (dev, ino):
        return False
    os.unlink(name, dir_fd=dfd)
    return True
