"""Whether this user may use a repository (or a file a command reads or writes), checked by
gpusnap before anything else, so that a repository of another user (usually root's, 0700)
gives one clear error with a hint instead of an OSError deep inside a command."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

from gpusnap.errors import AccessDenied, RepositoryError


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _denied(root: Path, what: str, owner: int | None) -> AccessDenied:
    me = _user(os.geteuid())
    if what == "create":
        where = f" ({_user(owner)}'s directory)" if owner is not None else ""
        return AccessDenied(f"{me} cannot create repository {root} there{where}",
                            hint="use --repo with a directory you can write to, or run gpusnap as root")
    if owner is not None and owner != os.geteuid():
        who = _user(owner)
        hint = (f"run gpusnap as {who} (`sudo gpusnap ...` for root's repository), or use a repository of "
                f"your own with --repo DIR")
        msg = f"repository {root} belongs to {who}; {me} cannot {what} it"
    else:
        hint = "check the permissions of the repository and of the directories above it"
        msg = f"{me} cannot {what} repository {root}"
    return AccessDenied(msg + " (repositories are private: snapshots hold whole process memory)", hint=hint)


def _owner(path: Path) -> int | None:
    """The owner of `path`, or of the nearest ancestor this user can stat."""
    p = path
    while True:
        try:
            return os.stat(p).st_uid
        except PermissionError:
            pass
        except FileNotFoundError:
            pass
        if p.parent == p:
            return None
        p = p.parent


def check_repo(root: Path, write: bool = False, create: bool = False) -> bool:
    """Raise AccessDenied when this user cannot read (or, with `write`, change; with `create`,
    make where it is missing) the repository at `root`. Returns whether a repository (its
    config) is there. A missing one that will not be made is the opener's error to give."""
    root = Path(root)
    what = "change" if write else "read"
    try:
        os.stat(root)
    except PermissionError:
        raise _denied(root, what, _owner(root.parent)) from None
    except (FileNotFoundError, NotADirectoryError):
        if create:  # it would be created: the nearest existing directory above must be writable
            p = root.parent
            while not p.exists() and p.parent != p:
                p = p.parent
            if not os.access(p, os.W_OK | os.X_OK):
                raise _denied(root, "create", _owner(p))
        return False
    except OSError:         # a link loop, a name too long: the opener says what is wrong
        return False
    try:
        st = os.stat(root / "config")
    except PermissionError:
        raise _denied(root, what, os.stat(root).st_uid) from None
    except (FileNotFoundError, NotADirectoryError):
        return False
    mode = os.R_OK | os.X_OK | (os.W_OK if write else 0)
    if write and read_only_fs(root):
        raise read_only_error(root, "read-only filesystem")
    if not os.access(root, mode) or not os.access(root / "config", os.R_OK):
        raise _denied(root, what, st.st_uid)
    if write:
        for sub in ("snapshots", "packs", "index", "locks", "tmp"):
            p = root / sub
            if p.exists() and not os.access(p, os.R_OK | os.W_OK | os.X_OK):
                raise _denied(root, what, os.stat(p).st_uid)
    return True


def check_readable_file(path: Path, what: str) -> None:
    """A file a command reads (e.g. an export file): a clear error rather than an OSError."""
    try:
        with open(path, "rb"):
            pass
    except FileNotFoundError:
        from gpusnap.errors import UsageError
        raise UsageError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        from gpusnap.errors import UsageError
        raise UsageError(f"{what} {path} is a directory") from None
    except PermissionError:
        raise AccessDenied(f"{_user(os.geteuid())} cannot read {what} {path}",
                           hint="check its permissions, or run as its owner") from None


def check_snapshot_ref(ref: str, repo_root: Path) -> None:
    """Before locating snapshot `ref`: the repository it would come from must be readable. A
    path (REPO/snapshots/DIR) is checked against its own repository, a name against
    `repo_root`."""
    if "/" in ref:
        p = Path(ref).expanduser().absolute()
        if p.parent.name == "snapshots":
            check_repo(p.parent.parent)
            return
        try:
            os.stat(p)
        except PermissionError:
            raise _denied(p, "read", _owner(p.parent)) from None
        except OSError:
            pass
        return
    check_repo(repo_root)


def read_only_fs(path) -> bool:
    """Whether `path` is on a filesystem mounted read-only (a read-only bind mount included)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def read_only_reason(path) -> str | None:
    """Why this process cannot change the repository at `path` although it can read it: a
    read-only filesystem, or no write permission on it (a copy it may only read); None if it can."""
    import stat as stat_
    if read_only_fs(path):
        return "read-only filesystem"
    try:
        locks = os.path.join(path, "locks")
        if stat_.S_ISDIR(os.lstat(locks).st_mode) and not os.access(locks, os.W_OK | os.X_OK):
            return "no write permission on its locks/ directory"
    except OSError:
        return None
    return None


def read_only_error(path, why: str) -> RepositoryError:
    """The one error of a command that would change a repository it can only read."""
    return RepositoryError(f"repository {path} is read-only ({why}): it cannot be changed",
                           "ls, inspect, verify, export and restore work on it; dump, import, prune, forget "
                           "and repair need a writable repository (copy it, or remount it read-write)")
