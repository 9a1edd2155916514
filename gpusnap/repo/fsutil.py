"""Private (0700/0600), fsynced, atomic file operations."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def mkdir_private(path: Path) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return
    fd = open_dir(path)      # (umask may have narrowed it; never chmod through a symlink)
    try:
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_tmp(tmpdir: Path, prefix: str) -> tuple[Path, int]:
    """A new private file in `tmpdir`, created exclusively (O_EXCL) in the directory itself,
    never through a symlink put in its place (O_NOFOLLOW on the directory)."""
    name = f"{prefix}{os.urandom(8).hex()}.tmp"   # = secrets.token_hex(8), without loading OpenSSL (~5 ms)
    return tmpdir / name, open_in(tmpdir, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)


def open_in(dir_path, name: str, flags: int) -> int:
    """`name` opened (flags | O_NOFOLLOW) in the directory itself, which is opened O_NOFOLLOW:
    never through a symlink at either; the file private (0600)."""
    dfd = open_dir(dir_path)
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    finally:
        os.close(dfd)
    os.fchmod(fd, 0o600)
    return fd


def write_file_atomic(tmpdir: Path, dest: Path, data: bytes) -> None:
    write_atomic(dest, data, tmpdir=tmpdir)


def write_atomic(dest: Path, data: bytes | str, mode: int = 0o600, tmpdir: Path | None = None) -> None:
    """`dest` replaced by `data` all at once: a temporary file made by create_tmp (exclusive,
    never through a link) in `tmpdir` (default: dest's own directory, as a hidden name),
    written, given `mode`, fsynced, renamed over `dest`, the directory fsynced. On any failure
    the temporary file goes and `dest` is as it was."""
    tmp, fd = create_tmp(dest.parent if tmpdir is None else tmpdir, f".{dest.name}." if tmpdir is None else "w-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if mode != 0o600:
                os.fchmod(f.fileno(), mode)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, dest)
    except BaseException:
        unlink_quiet(tmp)
        raise
    fsync_dir(dest.parent)


def close_all(fds: dict) -> None:
    """Close every descriptor that is a value of `fds` (errors ignored), and empty it."""
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def write_private(path: Path, data: bytes) -> None:
    """Create (exclusively) a private file, write, fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def unlink_quiet(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# -- trusting no one (docs/format.md §1: who may own what) -----------------------------
# A repository is used by root; anything in it that another user could write or replace
# would hand that user root's hands (a planted symlink truncated or deleted as root). So
# every directory of a repository must be owned by the caller or root and writable by
# nobody else, and nothing inside it is reached through a symlink.

NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def trusted_uids() -> tuple[int, int]:
    return (os.geteuid(), 0)


def untrusted_reason(st: os.stat_result, *, want_dir: bool | None = None) -> str | None:
    """Why an lstat() result must not be trusted, or None."""
    import stat as _stat
    if _stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if want_dir is True and not _stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if want_dir is False and not _stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid not in trusted_uids():
        return f"is owned by uid {st.st_uid}, neither you nor root"
    if st.st_mode & 0o022:
        return f"is writable by {'group and others' if st.st_mode & 0o022 == 0o022 else ('group' if st.st_mode & 0o020 else 'others')} (mode {st.st_mode & 0o7777:04o})"
    return None


def untrusted(p, why: str):
    from gpusnap.errors import RepositoryError
    return RepositoryError(
        f"refusing to use repository: {p} {why}",
        "a repository must be owned by you or root and writable by nobody else, with no symbolic "
        "links inside (another user could otherwise make gpusnap, as root, overwrite or delete any "
        "file); check who changed it, then e.g. chown -R root: and chmod -R go-w it")


def _is_link(path, dir_fd) -> bool:
    import stat as _stat
    try:
        return _stat.S_ISLNK(os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def open_dir(path, dir_fd: int | None = None) -> int:
    """A directory fd that never went through a symlink at its last component (O_NOFOLLOW);
    a symlink there is refused as planted (RepositoryError)."""
    try:
        return os.open(path, NOFOLLOW_DIR, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(path, dir_fd):
            raise untrusted(path, "is a symbolic link") from None
        raise


def open_nofollow(name, flags: int, dir_fd: int | None = None, mode: int = 0o600) -> int:
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise untrusted(name, "is a symbolic link") from None
        raise


def open_lock_file(dir_path, name: str, create: bool = True) -> int:
    """Open (creating) a lock file in `dir_path` without following a symlink anywhere in
    the last two components, and refuse anything but a private regular file with one link
    (a hard link to another file would be truncated by the lock's owner otherwise).
    create=False: open an existing one read-only (flock needs no more; a read-only repository)."""
    import stat as _stat
    dfd = open_dir(dir_path)
    try:
        flags = (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise untrusted(f"{dir_path}/{name}", "is a symbolic link") from None
        raise
    finally:
        os.close(dfd)
    st = os.fstat(fd)
    bad = untrusted_reason(st, want_dir=False)
    if bad is None and st.st_nlink != 1:
        bad = f"has {st.st_nlink} hard links"
    if bad is None and not _stat.S_ISREG(st.st_mode):
        bad = "is not a regular file"
    if bad:
        os.close(fd)
        raise untrusted(f"{dir_path}/{name}", bad)
    return fd


def copy_into(src, dir_path, name: str) -> None:
    """Copy `src` to dir_path/name as a private file, never through a symlink: the directory
    is opened O_NOFOLLOW and the file created relative to it with O_NOFOLLOW."""
    fd = open_in(dir_path, name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        with open(src, "rb") as f:
            while True:
                b = f.read(1 << 20)
                if not b:
                    break
                os.write(fd, b)
    finally:
        os.close(fd)


# -- files gpusnap makes for itself outside the store (REPO/jobs/, docs/faults.md): always
# relative to a checked directory fd, never through a link, with explicit modes whatever the
# umask (a umask 000 once made REPO/jobs 0777, where any user could plant links).

def private_dir_at(parent_fd: int, name: str, shown) -> int:
    """The fd of parent/name, a private (0700) directory: made so (mkdir, then fchmod: the
    umask is not trusted) or, when it exists, checked like the repository's own directories
    (a link, another owner, or group/other write is refused as untrusted). `shown`: its path,
    for messages."""
    made = True
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    except FileExistsError:
        made = False
    fd = open_dir(name, dir_fd=parent_fd)
    try:
        if made:
            os.fchmod(fd, 0o700)
        bad = untrusted_reason(os.fstat(fd), want_dir=True)
        if bad:
            raise untrusted(shown, bad)
    except BaseException:
        os.close(fd)
        raise
    return fd


def private_dirs(root: Path, *names: str) -> int:
    """The fd of root/names[0]/names[1]/..., each a private directory (private_dir_at), reached
    from root's fd (root itself never through a link at its last component)."""
    fd = open_dir(root)
    shown = Path(root)
    try:
        for n in names:
            shown = shown / n
            nfd = private_dir_at(fd, n, shown)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_private_at(dfd: int, name: str, flags: int, shown) -> int:
    """parent/name opened with `flags` (for writing), created exclusively as 0600 when missing;
    an existing one must be a private regular file of the caller or root with one link (never a
    link, nor a hard link to some other file)."""
    try:
        fd = os.open(name, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        os.fchmod(fd, 0o600)
        return fd
    except FileExistsError:
        pass
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise untrusted(shown, "is a symbolic link") from None
        raise
    st = os.fstat(fd)
    bad = untrusted_reason(st, want_dir=False) or (f"has {st.st_nlink} hard links" if st.st_nlink != 1 else None)
    if bad:
        os.close(fd)
        raise untrusted(shown, bad)
    os.set_blocking(fd, True)
    return fd
