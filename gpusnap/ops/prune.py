"""`gpusnap prune` and the retention rules it shares with `forget` and `dump --keep-last`:
delete what a retention rule gives up (gpusnap/repo/maint/prune.py does the repository's
part), then lift the network locks only the deleted snapshots needed
(gpusnap/ops/netlock_sweep.py), and remove the kept logs of snapshots that are gone.
"""

from __future__ import annotations

from gpusnap.errors import GpusnapError, UsageError


def check_retention(keep_last: int | None, name: str | None, all_: bool, what: str) -> None:
    """The guard shared by prune and forget: a retention that keeps nothing must say so."""
    if keep_last is None:
        return
    if keep_last < 0:
        raise UsageError(f"{what} --keep-last must be 0 or more")
    if keep_last == 0 and name is None:
        raise UsageError(f"{what} --keep-last 0 without --name would delete every snapshot in the repository",
                         hint="name the snapshots to go (`gpusnap forget SNAP...`), or give --name NAME --all")
    if keep_last == 0 and not all_:
        raise UsageError(f"{what} --keep-last 0 --name {name} deletes every snapshot of {name!r}",
                         hint="add --all if that is what you want")


def check_args(keep_last: int | None, name: str | None, all_: bool) -> int | None:
    """`gpusnap prune`'s retention arguments checked (check_retention): the --keep-last to
    apply, which --all makes 0."""
    check_retention(keep_last, name, all_, "prune")
    if all_ and keep_last not in (None, 0):
        raise UsageError("--all goes with --keep-last 0 (or without --keep-last): it deletes every snapshot of --name")
    if all_ and keep_last is None:
        keep_last = 0
        check_retention(keep_last, name, all_, "prune")
    return keep_last


def uncopied(repo, prune_uncopied: bool):
    """What retention keeps whatever its count: the snapshots still to be copied to their next
    tier (repo/copies.py), unless --prune-uncopied. A callable, read under prune's locks."""
    from gpusnap.repo import copies

    return (lambda: ()) if prune_uncopied else (lambda: copies.uncopied_ids(repo.path))


def retain_after_commit(repo, name: str, keep_last: int | None,
                        prune_uncopied: bool = False) -> tuple[list[str], list[str], str | None]:
    """A dump's --keep-last right after its commit: (ids deleted, warnings, the failure's
    message or None). A failure never undoes the snapshot: the dump reports it (exit 30)."""
    if not keep_last:
        return [], [], None
    try:
        deleted, warnings = retain(repo, name, keep_last, prune_uncopied)
    except GpusnapError as e:
        return [], [], e.message
    except OSError as e:
        return [], [], f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
    return deleted, warnings, None


def retain(repo, name: str, keep_last: int, prune_uncopied: bool = False) -> tuple[list[str], list[str]]:
    """A dump's --keep-last (gpusnap/repo/maint/prune.py retain), never a snapshot not yet
    copied (unless prune_uncopied), then the network locks only the deleted snapshots needed:
    (snapshot ids deleted, warnings and notes)."""
    from gpusnap.ops import netlock_sweep
    from gpusnap.repo.maint import prune as prune_mod

    before = repo.snapshots()
    deleted, warnings = prune_mod.retain(repo, name, keep_last, uncopied(repo, prune_uncopied))
    if deleted:
        warnings += netlock_sweep.after_removal(before, repo.snapshots())
    return deleted, warnings


def prune(repo, keep_last: int | None = None, name: str | None = None, dry_run: bool = False,
          prune_uncopied: bool = False):
    """`gpusnap prune` (gpusnap/repo/maint/prune.py; --keep-last keeps the snapshots not yet
    copied unless prune_uncopied), then the network locks that only the deleted snapshots
    needed (gpusnap/ops/netlock_sweep.py): a PruneResult, with "notes"."""
    from gpusnap.ops import netlock_sweep
    from gpusnap.repo.maint import prune as prune_mod

    before = repo.snapshots() if not dry_run else []
    result = prune_mod.run(repo, keep_last=keep_last, name=name, dry_run=dry_run,
                           keep=uncopied(repo, prune_uncopied))
    if not dry_run:
        notes = netlock_sweep.after_removal(before, repo.snapshots())
        if notes:
            result["notes"] = notes
    return result


def sweep_logs(repo) -> int:
    """Remove the kept logs of snapshots that are gone (prune's rule, gpusnap/repo/maint/prune.py):
    whoever deleted the snapshot, its logs go with it."""
    from gpusnap.repo.maint import prune as prune_mod

    return prune_mod.prune_logs(repo.path)
