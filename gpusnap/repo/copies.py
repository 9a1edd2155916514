"""REPO/copies/ (docs/format.md §14): per snapshot and destination, whether a tiered dump's
copy is pending or done (ops/tiers.py decides when; `ls` shows it; retention keeps what is
pending). One small JSON file per (snapshot directory, destination), replaced atomically, so
a crash leaves the old record or the new one; records of snapshots that are gone are ignored
and swept."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from gpusnap.errors import GpusnapError
from gpusnap.repo import fsutil

COPIES = "copies"
RECORD_VERSION = 1
RECORD_MAX = 64 << 10


def _key(to: str) -> str:
    return hashlib.blake2b(to.encode(), digest_size=8).hexdigest()


def _record_name(snap_dir: str, to: str) -> str:
    return f"{snap_dir}.{_key(to)}"


def write_record(root: Path, snap_dir: str, snap_id: str, to: str, state: str, **extra) -> dict:
    """REPO/copies/<snapshot dir>.<key>, replaced atomically (temporary file, fsync, rename)."""
    rec = {"version": RECORD_VERSION, "snapshot": snap_dir, "id": snap_id, "to": to, "state": state,
           "time": round(time.time(), 3), **extra}
    os.close(fsutil.private_dirs(Path(root), COPIES))     # 0700, reached without a link, never another's
    fsutil.write_atomic(Path(root) / COPIES / _record_name(snap_dir, to),
                        json.dumps(rec, sort_keys=True) + "\n")
    return rec


def mark_pending(root: Path, snap, to: str) -> None:
    """Right after a tiered dump's commit: this snapshot is to reach `to`. A failure to write
    the record never fails the committed dump: the copy that follows names the snapshot itself."""
    try:
        write_record(root, Path(snap.path).name, snap.id, to, "pending", since=round(time.time(), 3))
    except (OSError, GpusnapError):
        pass


def records(root: Path) -> dict[str, list[dict]]:
    """Every readable record, by snapshot directory. A damaged or foreign entry is skipped (it
    is rewritten by the next copy); none of them is ever followed through a link."""
    out: dict[str, list[dict]] = {}
    d = Path(root) / COPIES
    try:
        names = sorted(os.listdir(d))
    except (FileNotFoundError, NotADirectoryError):
        return out
    for n in names:
        if n.startswith("."):
            continue
        try:
            fd = os.open(d / n, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                if fsutil.untrusted_reason(os.fstat(f.fileno()), want_dir=False):
                    continue
                rec = json.loads(f.read(RECORD_MAX))
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and rec.get("snapshot") and n == _record_name(str(rec["snapshot"]), str(rec.get("to"))):
            out.setdefault(rec["snapshot"], []).append(rec)
    return out


def copy_state(recs: list[dict]) -> dict:
    """What `ls` shows of one snapshot: local only, copied (to where), or not copied yet."""
    copied = [r for r in recs if r.get("state") == "copied"]
    pending = [r for r in recs if r.get("state") == "pending"]
    state = "not-copied-yet" if pending else "copied" if copied else "local-only"
    return {"state": state, "copied_to": [{"to": r["to"], "time": r.get("time"), "snapshot": r.get("dest_snapshot")}
                                          for r in copied],
            "pending_to": [{"to": r["to"], "since": r.get("since"), "error": r.get("error")} for r in pending]}


def pending(repo, to: str) -> list[str]:
    """The directories of this repository's snapshots still to be copied to `to`."""
    have = {s.path.name for s in repo.snapshots()}
    return sorted(d for d, recs in records(repo.path).items()
                  if d in have and any(r.get("to") == to and r.get("state") == "pending" for r in recs))


def uncopied_ids(root: Path) -> set[str]:
    """The ids of snapshots with a copy still pending: what retention keeps unless asked."""
    return {str(r.get("id")) for recs in records(root).values() for r in recs if r.get("state") == "pending"}


def sweep(repo) -> None:
    """The records of snapshots that are gone (deleted by prune or forget) go too. Under prune's
    locks (maint/prune.py execute runs it; taken here when not held): the writer lock exclusive,
    so no writer is between its commit and its pending record, and the readers lock exclusive,
    so no copy is recording. The records are read before the snapshots, so a record is only
    ever removed for a snapshot that was gone after the record was there."""
    if repo.holds_exclusive():
        _sweep(repo)
        return
    with repo.writer_lock(recover=False, exclusive=True, what="prune"), repo.readers_lock(exclusive=True):
        _sweep(repo)


def _sweep(repo) -> None:
    recs = records(repo.path)
    have = {s.path.name for s in repo.snapshots()} | {Path(p).name for p in repo.broken_snapshots()}
    for d, rs in recs.items():
        if d not in have:
            for r in rs:
                try:
                    fsutil.unlink_quiet(Path(repo.path) / COPIES / _record_name(d, r["to"]))
                except OSError:     # ignored meanwhile (records()), removed by the next prune
                    pass


def note_copied(root: Path, done: list[dict], to: str) -> None:
    """`gpusnap copy` (tiered or not): each snapshot committed (or found) at `to` is recorded."""
    for d in done:
        try:
            write_record(root, Path(d["source"]).name, d["source_id"], to, "copied",
                         dest_snapshot=d.get("snapshot"), dest_id=d.get("id"))
        except (OSError, GpusnapError):     # it stays pending: the next copy finds it there, sends nothing
            pass
