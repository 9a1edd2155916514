"""Private (0700/0600), fsynced, atomic file operations."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def mkdir_private(path: Path) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return
    os.chmod(path, 0o700)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_tmp(tmpdir: Path, prefix: str) -> tuple[Path, int]:
    p = tmpdir / f"{prefix}{secrets.token_hex(8)}.tmp"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)
    return p, fd


def write_file_atomic(tmpdir: Path, dest: Path, data: bytes) -> None:
    tmp, fd = create_tmp(tmpdir, "w-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, dest)
    except BaseException:
        unlink_quiet(tmp)
        raise
    fsync_dir(dest.parent)


def write_private(path: Path, data: bytes) -> None:
    """Create (exclusively) a private file, write, fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
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
