"""gpusnap forget: which snapshots to drop (named ones, or a retention rule per name), and
dropping them through the repository's snapshot-removal primitive. The data they alone
needed stays until prune frees it (`forget --prune` does both).

Deleting every snapshot of a name is never a side effect of a number: a retention that keeps
none needs `--name` and an explicit `--all`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpusnap.errors import CorruptSnapshot, SnapshotNotFound, UsageError
from gpusnap.ops.prune import check_retention, sweep_logs


@dataclass
class Unreadable:
    """A snapshot directory whose manifest cannot be read: forget may still drop it when it
    is named explicitly (its directory name or path), which is how a user gets rid of it."""
    path: object
    id: str | None = None
    name: str | None = None
    created: float | None = None


@dataclass
class ForgetResult:
    dry_run: bool
    forgotten: list[dict] = field(default_factory=list)   # {"dir", "id", "name", "created"}
    kept: list[str] = field(default_factory=list)          # snapshot directory names
    prune: dict | None = None                              # prune's result with --prune
    notes: list[str] = field(default_factory=list)         # network locks lifted (netlock_sweep.py)

    def to_dict(self) -> dict:
        return {"dry_run": self.dry_run, "snapshots_forgotten": self.forgotten,
                "snapshots_kept": self.kept, "prune": self.prune, "notes": self.notes}


def _resolve(repo, ref: str):
    """One snapshot for `ref` (directory name or path, id prefix, or a name that has exactly
    one snapshot). A name with several snapshots is refused: forget never guesses."""
    snaps = repo.snapshots()
    byname = [s for s in snaps if s.name == ref]
    if len(byname) > 1 and not (repo.path / "snapshots" / ref).is_dir():
        raise UsageError(f"{ref!r} names {len(byname)} snapshots; forget needs one",
                         hint=f"give a snapshot directory or id (`gpusnap ls --name {ref}`), or use "
                              f"--name {ref} --keep-last N")
    return repo.snapshot(ref)


def _snapshot_dir(repo, ref: str):
    """REPO/snapshots/<dir> for a directory name or path inside this repository, else None."""
    from pathlib import Path

    from gpusnap.repo import pathcheck

    sd = repo.path / "snapshots"
    p = Path(ref)
    cand = p if ("/" in ref or p.is_absolute()) else sd / ref
    try:        # checked as given, as the repository's path (a planted link: exit 14)
        if pathcheck.walk(cand.absolute().parent) != sd:
            return None
    except (pathcheck.Missing, pathcheck.NotADir):
        return None
    # only a snapshot directory gpusnap trusts (not a symlink, not another user's) whose
    # manifest cannot be read: broken_snapshots() less the entries that are no snapshot at all
    unreadable = set(repo.broken_snapshots()) - set(repo.unusable_entries())
    return sd / cand.name if sd / cand.name in unreadable else None


def select(repo, refs: list[str], name: str | None = None, keep_last: int | None = None,
           all_: bool = False) -> tuple[list, list]:
    """(snapshots to forget, snapshots kept), both oldest first."""
    from gpusnap.repo.maint import prune as prune_mod

    snaps = repo.snapshots()
    if refs:
        if keep_last is not None or all_ or name is not None:
            raise UsageError("give snapshots, or --name/--keep-last/--all, not both")
        doomed_paths: dict = {}
        for ref in refs:
            try:
                s = _resolve(repo, ref)
            except CorruptSnapshot:
                p = _snapshot_dir(repo, ref)
                if p is None:
                    raise
                s = Unreadable(p)
            doomed_paths.setdefault(s.path.name, s)
        doomed = sorted(doomed_paths.values(), key=lambda s: (s.created or 0, s.path.name))
        return doomed, [s for s in snaps if s.path.name not in doomed_paths]
    else:
        if all_ and keep_last is None:
            keep_last = 0
        if keep_last is None:
            raise UsageError("say what to forget: SNAP..., or --keep-last N [--name NAME]",
                             hint="`gpusnap ls` lists the snapshots")
        check_retention(keep_last, name, all_, "forget")
        if name is not None and not any(s.name == name for s in snaps):
            raise SnapshotNotFound(f"no snapshot named {name!r} in repository {repo.path}",
                                   hint="list them with: gpusnap ls")
        doomed_ids = set(prune_mod.plan_prune(snaps, keep_last=keep_last, name=name).delete)
    doomed = [s for s in snaps if s.id in doomed_ids]
    kept = [s for s in snaps if s.id not in doomed_ids]
    return doomed, kept


def forget(repo, refs: list[str], name: str | None = None, keep_last: int | None = None,
           all_: bool = False, dry_run: bool = False, prune: bool = False) -> ForgetResult:
    """Select, then remove under prune's locks (a restore may be reading a snapshot about to
    go; the writer lock shared, as a dump's: removing a directory takes nothing from a
    writer); with `prune`, the removal is part of one prune plan that also frees the data
    nothing needs, under the exclusive lock (with dry_run: exactly what it would do)."""
    from gpusnap.repo.maint import prune as prune_mod

    with prune_mod.locked(repo, dry_run, exclusive=prune, what="forget"):
        doomed, kept = select(repo, refs, name=name, keep_last=keep_last, all_=all_)
        res = ForgetResult(dry_run=dry_run, kept=[s.path.name for s in kept],
                           forgotten=[{"dir": s.path.name, "id": s.id, "name": s.name, "created": s.created}
                                      for s in doomed])
        if prune:
            res.prune = prune_mod.apply(repo, doomed, dry_run=dry_run).to_dict()
        elif not dry_run:
            for s in doomed:
                repo.remove_snapshot(s)
            sweep_logs(repo)
        if not dry_run:   # CRIU's network lock held only for a forgotten `--exit` snapshot
            from gpusnap.ops import netlock_sweep

            res.notes = netlock_sweep.after_removal([*doomed, *kept], kept)
    return res
