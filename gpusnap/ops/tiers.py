"""Tiered snapshots (`--copy-to REPO` on dump, schedule add and slurm-run): a snapshot commits
in the repository the job dumps into (a node-local one on fast disk or tmpfs), and is then
copied to a second one (shared: NFS, Lustre, or another machine through ssh), by the same
process, after the job runs again: the job waits for the local commit only.

What was asked and what was done is kept per snapshot and destination in REPO/copies/
(docs/format.md §14): a "pending" record is written right after the commit, replaced by a
"copied" one once the destination has committed the snapshot. A destination that cannot be
reached leaves the record pending; the dump still succeeds (exit 0, with a warning), and the
next tiered dump, schedule run or `gpusnap copy --pending --to REPO` copies every pending
snapshot. Retention never deletes a pending snapshot unless asked (--prune-uncopied; the rule
is in ops/prune.py), and a destination's own --copy-keep-last runs there after the copy.

Restores (`restore NAME --copy-to REPO`, `slurm-run` after a requeue) look in both
repositories and take the newest snapshot of the name that verifies, wherever it is; a path
destination is read directly, an ssh:// one is listed through ssh and the snapshot chosen there
is pulled into this repository first (ops/tier_pull.py).
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path

from gpusnap.errors import GpusnapError, Interrupted, InterruptedAfterCommit, UsageError
from gpusnap.repo import copies

REMOTE_PRUNE_TIMEOUT_S = 3600


@dataclass
class Tier:
    """Where new snapshots go next, and how many of each name that side keeps."""
    to: str                                 # a repository path, or ssh://[user@]host[:port]/path
    keep_last: int | None = None            # --copy-keep-last: retention at the destination
    remote_gpusnap: str | None = None

    def destination(self) -> str:
        return destination(self.to)


def destination(to: str) -> str:
    """The destination as it is recorded and compared: a local path made absolute (a relative
    one names the same repository from anywhere), an ssh:// one as given, checked."""
    from gpusnap.ops.copy_peer import serve_command

    if not to:
        raise UsageError("--copy-to needs a repository path or ssh://[user@]host[:port]/path")
    _, local = serve_command(to, None, None)       # raises UsageError for a malformed ssh:// one
    return local if local is not None else to


# -- copying -------------------------------------------------------------------------------

def catch_up(root: Path, tier: Tier, lock_wait: float | None = None, progress=None, also: tuple = ()) -> dict:
    """Copy every snapshot pending for tier.to, oldest first. -> the report: status "copied"
    (nothing pending any more) or "pending" (the destination failed: `error` says why; the
    records stay pending for the next run). Only an interruption raises."""
    from gpusnap.ops.copy import CopyRequest, copy
    from gpusnap.repo import locate

    t0, started = time.monotonic(), time.time()
    to = destination(tier.to)
    repo = locate.open_repository(root)
    todo = sorted(set(copies.pending(repo, to)) | set(also))
    out: dict = {"to": to, "status": "copied", "started_at": round(started, 3), "copied": [],
                 "already_there": [], "pending": [], "bytes_sent": 0, "error": None}
    if todo:
        req = CopyRequest(refs=todo, repo=Path(root), to=to, remote_gpusnap=tier.remote_gpusnap, lock_wait=lock_wait)
        try:
            out["bytes_sent"] = copy(req, progress=progress)["bytes_sent"]
        except Interrupted:
            raise
        except (GpusnapError, OSError) as e:
            out["status"], out["error"] = "pending", getattr(e, "message", None) or str(e)
            for d in set(todo) - {Path(x["source"]).name for x in req.done}:
                _still_pending(root, repo, d, to, out["error"])
        out["copied"] = [Path(x["source"]).name for x in req.done if not x["already_present"]]
        out["already_there"] = [Path(x["source"]).name for x in req.done if x["already_present"]]
        out["pending"] = copies.pending(repo, to)
    if out["status"] == "copied" and tier.keep_last:
        out["retention"] = remote_retention(tier, to, repo, lock_wait)
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out


def _still_pending(root: Path, repo, snap_dir: str, to: str, error: str) -> None:
    """A pending record that says why the last attempt failed, and since when it waits."""
    old = next((r for r in copies.records(root).get(snap_dir, []) if r.get("to") == to), {})
    try:
        snap = repo.snapshot(snap_dir)
    except GpusnapError:
        return
    copies.write_record(root, snap_dir, snap.id, to, "pending", since=old.get("since", round(time.time(), 3)),
                 attempts=int(old.get("attempts", 0) or 0) + 1, error=error[:500])


def remote_retention(tier: Tier, to: str, repo, lock_wait: float | None) -> dict:
    """--copy-keep-last at the destination: `gpusnap prune --keep-last N --name NAME` run there
    (through ssh for an ssh:// one) for each name this repository copies, after the copy."""
    from gpusnap.ops.copy_peer import remote_command

    out: dict = {"keep_last": tier.keep_last, "deleted": [], "error": None}
    names = sorted({s.name for s in repo.snapshots()})
    for name in names:
        tail = ["prune", "--keep-last", str(tier.keep_last), "--name", name, "--json"]
        if lock_wait is not None:
            tail += ["--lock-wait", str(lock_wait)]
        try:
            p = subprocess.run(remote_command(to, tier.remote_gpusnap, tail), capture_output=True, text=True,
                               timeout=REMOTE_PRUNE_TIMEOUT_S, stdin=subprocess.DEVNULL)
            res = json.loads(p.stdout.strip().splitlines()[-1]) if p.stdout.strip() else {}
        except (OSError, subprocess.SubprocessError, ValueError) as e:
            p, res = None, {"message": str(e)}
        if p is not None and p.returncode == 0:
            out["deleted"] += res.get("snapshots_deleted", [])
        elif not (p is not None and res.get("exit_code") == 4):       # 4: no snapshot of that name there
            out["error"] = f"{name}: {res.get('message') or (p.stderr.strip()[-300:] if p else '')}"
    return out


# -- a tiered dump -------------------------------------------------------------------------

def dump(req, tier: Tier, progress=None):
    """`dump --copy-to`: the dump commits (marking its snapshot pending), the job runs again,
    then every pending snapshot is copied, then local retention (which keeps what is still
    pending) and the destination's. -> the DumpResult with `copy` filled in."""
    from gpusnap.ops import prune
    from gpusnap.ops.dump import dump as do_dump

    to = destination(tier.to)
    result = do_dump(replace(req, keep_last=None, copy_to=to), progress)
    root = Path(result.snapshot).parent.parent
    try:
        result.copy = catch_up(root, replace(tier, to=to), req.lock_wait, also=(Path(result.snapshot).name,))
        if req.keep_last:
            from gpusnap.repo import locate, lockwait

            # retention deletes: the writer lock exclusive (docs/format.md §6), waited for as the
            # dump's own was (every other writer finishes first); the dump's shared lock is long
            # gone. Its prune also sweeps the records of snapshots that are gone (repo/copies.py).
            repo = locate.open_repository(root).wait_for_locks(lockwait.seconds(req.lock_wait))
            result.pruned, result.prune_warnings, result.prune_error = prune.retain_after_commit(
                repo, result.name, req.keep_last, req.prune_uncopied)
    except (KeyboardInterrupt, Interrupted):
        raise InterruptedAfterCommit(
            f"dump interrupted after the commit, while copying to {to}: snapshot {result.snapshot} is kept "
            "(listed and restorable), not copied yet", snapshot=result.snapshot,
            hint=f"`gpusnap copy --pending --to {to}` (or the next dump with --copy-to) copies it") from None
    return result


# -- restoring from either tier --------------------------------------------------------------

def candidates(name: str, roots: list[Path]) -> list[tuple[Path, str, float]]:
    """Snapshots of `name` in any of `roots` (a missing one has none), newest first: (repository,
    snapshot directory, created); the same snapshot in both, the first repository's first."""
    from gpusnap.repo.repository import Repository

    out = []
    for rank, root in enumerate(roots):
        if not (Path(root) / "config").exists():
            continue
        for s in Repository.open(root).snapshots():
            if s.name == name:
                out.append((Path(root), str(s.path), s.created, rank))
    out.sort(key=lambda c: (-c[2], c[3]))
    return [c[:3] for c in out]


def restore_roots(repo: Path, copy_to: str) -> list[Path]:
    """The repositories a restore reads directly: this one, and the destination when it is a
    path (an ssh:// one is listed and pulled from instead: ops/tier_pull.py)."""
    to = destination(copy_to)
    return [Path(repo)] if "://" in to else [Path(repo), Path(to)]


def choose(ref: str, repo: Path, copy_to: str, remote_gpusnap: str | None = None,
           lock_wait: float | None = None) -> tuple[Path, str, list[dict]]:
    """`restore NAME --copy-to REPO`: the newest snapshot of NAME that verifies, in this repository
    or the destination. -> (its repository, its directory, the newer ones skipped and why). A ref
    that is no name (a directory, an id) is looked up here, then there. From an ssh:// destination
    the chosen snapshot is pulled into this repository first (only what is missing travels, every
    page checked on arrival), and restored from here."""
    from gpusnap.errors import SnapshotNotFound
    from gpusnap.ops.verify import verify

    to = destination(copy_to)
    roots = restore_roots(repo, copy_to)
    skipped: list[dict] = []
    found = candidates(ref, roots) + remote(ref, repo, to, remote_gpusnap, skipped)
    found.sort(key=lambda c: -c[2])         # stable: the same time here before there
    if not found:
        found = _by_ref(ref, roots)
    for root, path, _ in found:
        try:
            if root is None:                # an ssh:// tier's: pulled here first
                from gpusnap.ops import tier_pull

                path = f"{to} {path}"
                root, path = Path(repo), tier_pull.pull(Path(repo), to, remote_gpusnap, path.rsplit(" ", 1)[1],
                                                        lock_wait)
            report = verify(path, root)
        except GpusnapError as e:
            skipped.append({"snapshot": path, "reason": e.message})
            continue
        if report.ok:
            return root, path, skipped
        skipped.append({"snapshot": path, "reason": report.damage()})
    where = [str(r) for r in roots] + ([to] if "://" in to else [])
    raise SnapshotNotFound(f"no snapshot {ref!r} that verifies in {' or '.join(where)}"
                           + (f" ({len(skipped)} damaged)" if skipped else ""),
                           hint="`gpusnap ls --repo REPO` and `gpusnap verify` in each say more")


def _by_ref(ref: str, roots: list[Path]) -> list:
    from gpusnap.repo import locate

    for root in roots:
        try:
            _, snap = locate.open_snapshot(ref, root)
            return [(root, str(snap.path), snap.created)]
        except (GpusnapError, OSError):
            continue
    return []


def remote(name: str, repo: Path, to: str, remote_gpusnap: str | None, skipped: list) -> list:
    """An ssh:// tier's snapshots of `name` not here already (same directory name: a copy keeps
    it), as (None, directory, created). A tier that cannot be listed is left out (and said in
    `skipped`): this repository's snapshots still count."""
    if "://" not in to:
        return []
    from gpusnap.ops import tier_pull

    try:
        theirs = tier_pull.remote_candidates(to, remote_gpusnap, name)
    except GpusnapError as e:
        skipped.append({"snapshot": to, "reason": e.message})
        return []
    here = {Path(p).name for _, p, _ in candidates(name, [Path(repo)])}
    return [(None, d, created) for d, created in theirs if d not in here]

