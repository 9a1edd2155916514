"""Trusting a repository before reading it: every directory in it owned by the caller or root
and writable by nobody else, none a symlink (the path above it: repo/pathcheck.py); and
quarantine/, where recovery and repair set aside index files they replaced (docs/format.md §10)."""

from __future__ import annotations

import os
from pathlib import Path

from gpusnap.errors import RepositoryError
from gpusnap.repo import fsutil

SUBDIRS = ("packs", "index", "snapshots", "locks", "tmp")
QUARANTINE = "quarantine"      # index files set aside by recovery or repair (docs/format.md §10)
MADE_ON_OPEN = ("tmp", "locks")     # recreated when missing; the others missing = damaged
OPTIONAL = ("logs", "quarantine")  # checked when present
CONFIG_TMP = "w-"    # the config's temporary file in tmp/ while it is written (fsutil.write_file_atomic)


def untrusted(p, why: str) -> RepositoryError:
    return fsutil.untrusted(p, why)


def no_repository(path) -> RepositoryError:
    """The one error for a repository path where nothing is (a typo): every command says the
    same. Only `gpusnap init` and a first dump at the default location create one."""
    return RepositoryError(f"no gpusnap repository at {path}",
                           f"`gpusnap init --repo {path}` creates one there; or check the path "
                           "(--repo, $GPUSNAP_REPO)")


def half_made(path: Path) -> bool:
    """Whether `path` holds only what a creation killed before its config was written leaves
    (SIGKILL, the OOM killer, a power cut): the subdirectories, real and trusted, empty but for
    the config's temporary files in tmp/. Such a directory counts as new: the next creation
    finishes it, where it would otherwise refuse a directory that is not empty."""
    try:
        names = os.listdir(path)
        if not names or not set(names) <= set(SUBDIRS):
            return False
        for n in names:
            if fsutil.untrusted_reason(os.lstat(path / n), want_dir=True):
                return False
            inside = os.listdir(path / n)
            if inside and (n != "tmp" or not all(x.startswith(CONFIG_TMP) for x in inside)):
                return False
    except OSError:
        return False
    return True


def check_tree(path: Path) -> None:
    """The repository directory, its subdirectories and packs/xx/: real directories (not
    symlinks), owned by the caller or root, writable by nobody else. Missing tmp/ and locks/
    are recreated (never through a symlink: relative to the checked directory's fd)."""
    rfd = fsutil.open_dir(path)
    try:
        bad = fsutil.untrusted_reason(os.fstat(rfd), want_dir=True)
        if bad:
            raise untrusted(path, bad)
        for d in SUBDIRS + OPTIONAL:
            try:
                st = os.stat(d, dir_fd=rfd, follow_symlinks=False)
            except FileNotFoundError:
                if d in MADE_ON_OPEN:
                    os.mkdir(d, 0o700, dir_fd=rfd)
                    continue
                if d in OPTIONAL:
                    continue
                if not os.path.lexists(path / "config"):
                    raise
                raise RepositoryError(f"{path} is damaged: directory {d}/ is missing") from None
            bad = fsutil.untrusted_reason(st, want_dir=True)
            if bad:
                raise untrusted(path / d, bad)
        pfd = fsutil.open_dir("packs", dir_fd=rfd)
        try:
            for sub in os.listdir(pfd):
                st = os.stat(sub, dir_fd=pfd, follow_symlinks=False)
                bad = fsutil.untrusted_reason(st, want_dir=True)
                if bad:
                    raise untrusted(path / "packs" / sub, bad)
        finally:
            os.close(pfd)
    finally:
        os.close(rfd)


def quarantine_file(root: Path, path: Path) -> Path:
    """Move `path` (an index file) into REPO/quarantine/ (atomic rename, both directories
    fsynced): kept for inspection, never read. -> its new path."""
    q = root / QUARANTINE
    fsutil.mkdir_private(q)
    dest = q / f"{path.parent.name}-{path.name}"
    k = 1
    while os.path.lexists(dest):
        k += 1
        dest = q / f"{path.parent.name}-{path.name}.{k}"
    os.rename(path, dest)
    fsutil.fsync_dir(q)
    fsutil.fsync_dir(path.parent)
    return dest
