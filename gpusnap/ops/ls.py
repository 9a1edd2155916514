"""`gpusnap ls` and `gpusnap schedule ls`: the rows to list, in their order.

`snapshots()` returns exactly what `ls --json` prints: the repository, one row per snapshot
(oldest first) with its unique and shared sizes and where it was copied (repo/copies.py: local
only, copied, not copied yet), the repository's totals, and its named jobs
(which PID carries each name now, forks). The usage of a
repository without snapshots is not computed (that would load numpy for nothing).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

EMPTY_TOTALS = {"snapshots": 0, "names": 0, "bytes_raw": 0, "bytes_stored": 0, "ratio": None}


def snapshots(root: Path, name: str | None = None) -> dict[str, Any]:
    """{repository, snapshots: [{dir, path, id, name, created, bytes_*}], totals} of the
    repository at `root` (already checked readable); only snapshots of `name` when given.
    The default location with nothing there yet is an empty listing; anywhere else no
    repository, a file, or a directory that is none is an error (Repository.open says which)."""
    from gpusnap.repo import copies as copy_records

    rows: list[dict[str, Any]] = []
    damaged: list[dict[str, str]] = []
    totals: dict[str, Any] = dict(EMPTY_TOTALS)
    from gpusnap.repo import locate

    if os.path.lexists(root) or not locate.is_default(root):
        from gpusnap.repo.maint import usage
        from gpusnap.repo.repository import Repository

        repository = Repository.open(root)
        by_dir = usage.repo_usage(repository) if _has_snapshots(root) else {}
        totals = usage.repo_totals(repository, by_dir)
        copies = copy_records.records(root)
        for dirname, row in by_dir.items():
            if name is None or row.get("name") == name:
                rows.append({"dir": dirname, "path": str(root / "snapshots" / dirname), **row,
                             "copies": copy_records.copy_state(copies.get(dirname, []))})
        rows.sort(key=lambda r: (r.get("created", 0), r["dir"]))
        if _entries(root) != len(by_dir):   # some entry is no readable snapshot: say which, and why
            damaged = [{"path": str(p), "reason": why} for p, why in sorted(repository.broken_snapshots().items())]
    return {"repository": str(root), "snapshots": rows, "totals": totals, "jobs": jobs(root, name), "damaged": damaged}


def _entries(root: Path) -> int:
    try:
        with os.scandir(root / "snapshots") as it:
            return sum(1 for e in it if not e.name.startswith("."))
    except FileNotFoundError:
        return 0


def jobs(root: Path, name: str | None = None) -> list[dict[str, Any]]:
    """The named jobs (gpusnap/ops/identity.py): which tree carries each name now, and forks."""
    from gpusnap.ops import identity

    out = []
    for job, up in identity.list_jobs(root):
        if name is None or name in (job.name, job.forked_from):
            out.append({"name": job.name, "pid": job.pid, "running": up, "kind": job.kind,
                        "forked_from": job.forked_from, "restores": job.restores,
                        "restored_from": job.restored_from, "dir": job.dir})
    return out


def _has_snapshots(root: Path) -> bool:
    try:
        with os.scandir(root / "snapshots") as it:
            return any(True for _ in it)
    except FileNotFoundError:
        return False


def schedules() -> list[dict[str, Any]]:
    """Every schedule with its state: last run, result, next run, whether its job is gone."""
    from gpusnap.ops import schedule

    return [schedule.status(s) for s in schedule.list_schedules()]
