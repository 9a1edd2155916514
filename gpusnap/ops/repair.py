"""`gpusnap repair` as an operation: rebuild the index from the packs (repo.maint.repair), and
say with an error of the one hierarchy (DamageRemains) whether some snapshot is still damaged.
"""

from __future__ import annotations

from pathlib import Path

from gpusnap.errors import DamageRemains, GpusnapError


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
