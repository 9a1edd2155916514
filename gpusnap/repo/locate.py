"""Where the repository is (--repo, $GPUSNAP_REPO, /var/lib/gpusnap), when a missing one may
be made (only at the default location: a typo never becomes a new repository), and which
snapshot a user means (a snapshot directory, or a name, id or directory name inside a
repository)."""

from __future__ import annotations

import os
from pathlib import Path

from gpusnap.errors import SnapshotNotFound
from gpusnap import settings

DEFAULT_REPO = Path("/var/lib/gpusnap")


def repo_path(arg: str | os.PathLike | None = None) -> Path:
    if arg:
        return Path(arg).expanduser().absolute()
    env = settings.get("GPUSNAP_REPO")
    return Path(env).expanduser().absolute() if env else DEFAULT_REPO


def is_default(root: str | os.PathLike) -> bool:
    """Whether `root` is a default location: /var/lib/gpusnap, or $GPUSNAP_REPO when set
    (compared as written, never resolved)."""
    return Path(root).expanduser().absolute() in (DEFAULT_REPO, repo_path(None))


def open_repository(root: str | os.PathLike, create_at_default: bool = False):
    """The repository at `root`. A missing one is made only with `create_at_default` (the first
    dump, run or import) and only at the default location; anywhere else it is the one
    "no gpusnap repository" error (trust.no_repository), which names `gpusnap init`."""
    from gpusnap.repo.repository import Repository

    return Repository.open(root, create=create_at_default and is_default(root))


def _repo_of_snapshot_dir(path: Path) -> Path | None:
    """REPO/snapshots/<dir> -> REPO, when `path` looks like a snapshot directory."""
    if path.parent.name == "snapshots" and (path.parent.parent / "config").is_file():
        return path.parent.parent
    return None


def open_snapshot(ref: str, repo: str | os.PathLike | None = None):
    """Return (Repository, Snapshot) for `ref`: a snapshot directory path, or a reference
    (name, id prefix, directory name) inside the repository from `repo_path(repo)`."""
    from gpusnap.repo.repository import Repository

    candidate = Path(ref).expanduser().absolute()
    if candidate.is_dir():
        owner = _repo_of_snapshot_dir(candidate)
        if owner is None:
            raise SnapshotNotFound(f"{ref} is not a gpusnap snapshot directory",
                                   hint="point at REPO/snapshots/<snapshot>, or give a snapshot name; "
                                        "`gpusnap ls` lists them")
        repository = Repository.open(owner)     # checked as given: no link is followed first
        return repository, repository.snapshot(candidate.name)
    if "/" in ref:
        raise SnapshotNotFound(f"{ref}: no such snapshot directory",
                               hint="give the snapshot directory that `gpusnap dump` printed, or a snapshot name")
    root = repo_path(repo)
    if os.path.lexists(root) and not os.access(root, os.R_OK | os.X_OK):
        Repository.open(root)       # its own error (permissions, ownership), with a hint
    if not os.path.lexists(root) and is_default(root):    # (as `ls` there: nothing yet)
        raise SnapshotNotFound(f"no snapshot {ref!r}: there is no repository at {root} yet",
                               hint="give the snapshot directory that `gpusnap dump` printed, or --repo")
    repository = Repository.open(root)      # none there: the one "no gpusnap repository" error
    return repository, repository.snapshot(ref)
