"""A repository's path, checked as given, one component at a time, before anything is
resolved (docs/format.md §1). Resolving first (realpath) would follow a link that another
user planted (/tmp/x -> root's repository) and then check the link's target, which is
trusted: root would act on a repository it never named.

The walk goes down from `/` with directory descriptors: each component is opened with
`O_NOFOLLOW|O_DIRECTORY` relative to the one above and its owner and mode read with fstat
from what was opened. A symbolic link is followed only when it is owned by root (or by the
user running gpusnap) and lies in a directory only they can write (`/var/run -> /run`); its
target is then walked the same way. Anything else that is a link is refused (exit 14)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from gpusnap.errors import RepositoryError
from gpusnap.repo import fsutil

MAX_LINKS = 40          # as the kernel's ELOOP limit


class Missing(Exception):
    """A component of the path does not exist (and creating it was not asked for)."""


class NotADir(Exception):
    """A component of the path is not a directory (nor a link to one)."""


def _above_reason(st: os.stat_result) -> str | None:
    """Why a directory above the repository cannot be trusted: its owner could swap what
    lies below it. Writable by others is allowed with the sticky bit (as /tmp)."""
    if st.st_uid not in fsutil.trusted_uids():
        return f"(above the repository) is owned by uid {st.st_uid}, neither you nor root"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return f"(above the repository) is writable by others (mode {st.st_mode & 0o7777:04o})"
    return None


def _link_reason(link: os.stat_result, holder: os.stat_result) -> str | None:
    """Why a symbolic link in the path is not followed, or None (a system link)."""
    if link.st_uid not in fsutil.trusted_uids():
        return f"is a symbolic link owned by uid {link.st_uid} (only root's links are followed)"
    if holder.st_uid not in fsutil.trusted_uids() or holder.st_mode & 0o022:
        return ("is a symbolic link in a directory others can write "
                f"(mode {holder.st_mode & 0o7777:04o}; only links in directories only root can write are followed)")
    return None


def _split(path: str) -> list[str]:
    return [p for p in path.split("/") if p and p != "."]


def walk(path: Path, create: bool = False) -> Path:
    """Check every directory on the way to `path` (absolute); -> the path without links
    (what realpath would give, computed only from components that were checked).

    Every directory above the last component must be trusted (_above_reason); the last one
    is left to trust.check_tree. Raises RepositoryError (exit 14) for an untrusted
    component or link, Missing when a component does not exist (with `create`, missing
    directories are made instead: 0755 above, 0700 the last), NotADir for a file."""
    todo = _split(str(path))
    done: list[str] = []            # the components walked so far, links replaced
    fd = os.open("/", fsutil.NOFOLLOW_DIR)
    links = 0
    try:
        st = os.fstat(fd)
        while todo:
            name = todo.pop(0)
            if name == "..":        # the parent of a checked directory was checked on the way down
                nfd = os.open("..", fsutil.NOFOLLOW_DIR, dir_fd=fd)
                os.close(fd)
                fd, st = nfd, os.fstat(nfd)
                if done:
                    done.pop()
                continue
            here = "/" + "/".join([*done, name])
            bad = _above_reason(st)
            if bad:
                raise fsutil.untrusted("/" + "/".join(done), bad)
            try:
                nfd = os.open(name, fsutil.NOFOLLOW_DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise Missing(here) from None
                with contextlib.suppress(FileExistsError):      # (another gpusnap made it meanwhile)
                    os.mkdir(name, 0o755 if todo else 0o700, dir_fd=fd)
                todo.insert(0, name)        # then open what is there, by the same rules
                continue
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                lst = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISLNK(lst.st_mode):
                    raise NotADir(here) from None
                bad = _link_reason(lst, st)
                if bad:
                    raise RepositoryError(
                        f"refusing to use repository: {here} {bad}",
                        "another user could point it at any repository (or change where it points while "
                        "gpusnap works) and have root act on that one; give the repository's own path, "
                        "after checking where the link points") from None
                links += 1
                if links > MAX_LINKS:
                    raise fsutil.untrusted(here, "is one link too many (a loop?)") from None
                target = os.readlink(name, dir_fd=fd)
                todo[:0] = _split(target)
                if target.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", fsutil.NOFOLLOW_DIR)
                    st, done = os.fstat(fd), []
                continue
            os.close(fd)
            fd, st = nfd, os.fstat(nfd)
            done.append(name)
        return Path("/" + "/".join(done))
    finally:
        os.close(fd)
