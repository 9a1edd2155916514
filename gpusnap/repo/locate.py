"""Where the repository is (--repo, $GPUSNAP_REPO, /var/lib/gpusnap) and which snapshot a
user means (a snapshot directory, or a name, id or directory name inside a repository)."""

from __future__ import annotations

import os
from pathlib import Path

from gpusnap.errors import SnapshotNotFound

DEFAULT_REPO = Path("/var/lib/gpusnap")


def repo_path(arg: str | os.PathLike | None = None) -> Path:
    if arg:
        return Path(arg).expanduser().absolute()
    env = os.environ.get("GPUSNAP_REPO")
    return Path(env).expanduser().absolute() if env else DEFAULT_REPO


def _repo_of_snapshot_dir(path: Path) -> Path | None:
    """REPO/snapshots/<dir> -> REPO, when `path` looks like a snapshot directory."""
    if path.parent.name == "snapshots" and (path.parent.parent / "config").is_file():
        return path.parent.parent
    return None


def open_snapshot(ref: str, repo: str | os.PathLike | None = None):
    """Return (Repository, Snapshot) for `ref`: a snapshot directory path, or a reference
    (name, id prefix, directory name) inside the repository from `repo_path(repo)`."""
    from gpusnap.repo.repository import Repository

    candidate = Path(ref).expanduser()
    if candidate.is_dir():
        owner = _repo_of_snapshot_dir(candidate.resolve())
        if owner is None:
            raise SnapshotNotFound(f"{ref} is not a gpusnap snapshot directory",
                                   hint="point at REPO/snapshots/<snapshot>, or give a snapshot name; "
                                        "`gpusnap ls` lists them")
        repository = Repository.open(owner)
        return repository, repository.snapshot(str(candidate.resolve()))
    root = repo_path(repo)
    if os.path.lexists(root) and not os.access(root, os.R_OK | os.X_OK):
        Repository.open(root)       # its own error (permissions, ownership), with a hint
    if not (root / "config").is_file():
        raise SnapshotNotFound(f"{ref} is neither a snapshot directory nor a snapshot in {root} "
                               "(no repository there)",
                               hint="give the snapshot directory that `gpusnap dump` printed, or --repo")
    repository = Repository.open(root)
    return repository, repository.snapshot(ref)
