"""`gpusnap verify` and `gpusnap repair` as operations: open the repository, run the check
(repo.maint.verify / repo.maint.repair), and say with an error of the one hierarchy
(CorruptSnapshot, DamageRemains) whether the result is a failure. The command prints the
report and raises that error, so the exit code never comes from the CLI's own judgement.
"""

from __future__ import annotations

from pathlib import Path

from gpusnap.errors import CorruptSnapshot, DamageRemains, GpusnapError


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
    from gpusnap.render.maint import verify_summary

    return CorruptSnapshot(verify_summary(report), hint="restore from an intact snapshot; "
                                                        "`gpusnap forget` the damaged ones, then `gpusnap prune`")


def repair(repo: Path | None, dry_run: bool = False, read_data: bool = False):
    """Rebuild the index from the packs (repo.maint.repair)."""
    from gpusnap.repo import locate
    from gpusnap.repo.maint import repair as repair_mod
    from gpusnap.repo.repository import Repository

    return repair_mod.repair(Repository.open(locate.repo_path(repo)), dry_run=dry_run, read_data=read_data)


def repair_failure(report) -> GpusnapError | None:
    """The error a repair ends with while some snapshot still needs data that no pack holds."""
    if report.ok:
        return None
    return DamageRemains(f"snapshots still damaged: {', '.join(sorted(report.snapshots_damaged))}",
                         hint="their data is in no pack; restore another snapshot, or prune them")
