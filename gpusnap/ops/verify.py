"""`gpusnap verify` as an operation: open the repository, run the check (repo.maint.verify),
and say with an error of the one hierarchy (CorruptSnapshot) whether the result is a failure.
The command prints the report and raises that error, so the exit code never comes from the
CLI's own judgement.
"""

from __future__ import annotations

from pathlib import Path

from gpusnap.errors import CorruptSnapshot, GpusnapError


def verify(snapshot: str | None, repo: Path | None, read_data: bool = True):
    """Check every checksum of the repository (or of one snapshot: a directory, name or id)."""
    from gpusnap.repo import locate
    from gpusnap.repo.maint import verify as verify_mod
    from gpusnap.system import access

    root = locate.repo_path(repo)
    if snapshot:
        access.check_snapshot_ref(snapshot, root)
        repository, snap = locate.open_snapshot(snapshot, repo)
        refs = [str(snap.path)]
    else:
        from gpusnap.repo.repository import Repository

        access.check_repo(root)
        repository, refs = Repository.open(root), None
    # a prune deleting snapshots while verify reads them must not look like damage: wait for it
    with repository.readers_lock():
        return verify_mod.verify(repository, refs, read_data=read_data)


def verify_failure(report) -> GpusnapError | None:
    """The error a damaged verify ends with; None when all holds."""
    if report.ok:
        return None
    return CorruptSnapshot(report.damage(), hint="restore from an intact snapshot; "
                                                        "`gpusnap forget` the damaged ones, then `gpusnap prune`")
