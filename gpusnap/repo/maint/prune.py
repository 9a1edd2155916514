"""gpusnap prune: the one lock policy of everything that deletes from a repository, and the
crash-safe execution of a PrunePlan (gpusnap/repo/maint/prune_plan.py decides; this applies).

Execution order (each step leaves a repository that verifies):
 1. rename doomed snapshot dirs to snapshots/.del-* (atomic; invisible to readers), delete them
 2. write rewritten packs (only the still-used pages of the packs the plan rewrites)
 3. write ONE new index file describing every kept blob, fsync
 3b. rewrite the locations file of every survivor that names a pack about to go (from the
    new index alone; atomic per file); with nothing to delete, write missing ones only
 4. delete every other index file
 5. delete the packs the plan deletes or rewrote (never one the new index names)
 6. delete the plan's leftovers: tmp/*, snapshots/.tmp-*, snapshots/.del-*, logs of gone snapshots
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from typing import Callable

from gpusnap.errors import CorruptSnapshot, RepositoryError, SnapshotNotFound
from gpusnap.repo import copies, fsutil, locations
from gpusnap.repo.codec import compress
from gpusnap.repo.format import CODEC_LZ4, CODEC_NONE, KIND_DATA, KIND_PAGES, PAGE_ID_LEN, PAGE_SIZE, FormatError
from gpusnap.repo.maint.prune_plan import (FAILED_LOGS_KEPT, MAX_UNUSED, SMALL_PACK, PackDecision,  # noqa: F401
                                           PrunePlan, Selection, doomed_logs, index_names, index_of, plan,
                                           plan_packs, plan_prune)
from gpusnap.repo.index import RepoIndex, write_index_file
from gpusnap.repo.pipeline.packwriter import PackWriter, packed_size
from gpusnap.repo.store import BlobReader, check_decoded, pack_path

Fault = Callable[[str], None]


# -- locks: the one policy ---------------------------------------------------------------------

@contextlib.contextmanager
def locked(repo, dry_run: bool = False, exclusive: bool = True, what: str = "prune"):
    """The locks of prune, `forget` and a dump's --keep-last retention, in this order:
    the writer lock, exclusive when data may be deleted (it waits for every writer, up to
    repo.lock_wait, repo/lockwait.py; a dump holding the shared one for its commit lets go
    of it first and takes it again after; a dry run skips the open-time recovery, which
    could change the repository, and takes it shared: it changes nothing), shared for a
    `forget` without --prune (removing a snapshot directory takes nothing from a writer);
    then the readers lock: exclusive when something may be deleted (a restore or verify
    reading makes it wait up to repo.lock_wait, then refuse with RepositoryLocked; the
    library alone waits 0 s), shared for a dry run (it waits for a running prune, and
    never blocks a restore)."""
    with repo.writer_lock(recover=not dry_run, exclusive=exclusive and not dry_run, what=what), \
            repo.readers_lock(exclusive=not dry_run):
        yield repo


# -- what a prune did ---------------------------------------------------------------------------

class PruneResult(dict):
    """What prune did (or, with dry_run, would do): a dict (the JSON), the plan under "plan"."""

    @classmethod
    def of_plan(cls, p: PrunePlan, dry_run: bool) -> "PruneResult":
        t = p.totals()
        res = cls({"dry_run": dry_run, "snapshots_deleted": list(p.remove), "snapshots_kept": list(p.keep),
                   "packs_deleted": t["packs_delete"], "packs_rewritten": t["packs_rewrite"], "packs_written": 0,
                   "bytes_freed": t["to_free"], "leftovers_removed": len(p.leftovers) if dry_run else 0,
                   "unreadable": list(p.unreadable), "plan": p.to_dict()})
        if p.data_kept:
            res["data_kept"] = p.data_kept
        return res

    def to_dict(self) -> dict:
        return dict(self)


# -- entry points ---------------------------------------------------------------------------------

def run(repo, keep_last: int | None = None, name: str | None = None, dry_run: bool = False,
        max_unused: float = MAX_UNUSED, keep=lambda: ()) -> PruneResult:
    """`gpusnap prune`: under the locks, delete all but the `keep_last` newest snapshots per
    name (or of `name`; none without keep_last), then free what no snapshot needs. `keep()`:
    ids never deleted (snapshots not yet copied to their next tier), read under the locks."""
    with locked(repo, dry_run):
        if not dry_run:     # what SIGKILLed dumps and restores left outside the repository
            from gpusnap.system import tmpdirs

            tmpdirs.sweep(repo.path)
        remove: list[str] = []
        if keep_last is not None:
            snaps = repo.snapshots()
            if name is not None and not any(s.name == name for s in snaps):
                raise SnapshotNotFound(f"no snapshot named {name!r} in repository {repo.path}",
                                       hint="list them with: gpusnap ls")
            kept = set(keep())
            remove = [i for i in plan_prune(snaps, keep_last=keep_last, name=name).delete if i not in kept]
        return apply(repo, remove, dry_run, max_unused)


def apply(repo, remove=(), dry_run: bool = False, max_unused: float = MAX_UNUSED,
          _fault: Fault | None = None) -> PruneResult:
    """Plan, then (unless dry_run) execute; the caller holds locked(repo, dry_run)."""
    p = plan(repo, remove, max_unused)
    if dry_run:
        measure_rewrite(repo, p)
    return PruneResult.of_plan(p, True) if dry_run else execute(repo, p, _fault)


def measure_rewrite(repo, p: PrunePlan) -> None:
    """A dry run: what the rewrite would write, blob by blob as the real one compresses it (a
    stored page run that is partly used shrinks, raw blobs get compressed), so the bytes it
    says are freed are the real prune's, not an estimate from the stored sizes."""
    if p.data_kept is None and p.by_action("rewrite"):
        p.rewrite_bytes = packed_size([len(b[4]) for b in _rewritten_blobs(repo.path, p)])


def retain(repo, name: str, keep_last: int, keep=lambda: ()) -> tuple[list[str], list[str]]:
    """A dump's --keep-last: keep the newest `keep_last` snapshots of `name`, and those whose
    id `keep()` gives (snapshots not yet copied to their next tier). -> (snapshot ids deleted,
    warnings). Raises on failure. A first look (under the dump's shared lock, or none) decides
    whether anything is to go; only then is the writer lock taken exclusive (a dump lets go of
    its shared one first, docs/format.md §6), and the plan and `keep()` that count are made
    again under it: another writer may have committed, or marked a snapshot pending, meanwhile."""
    def doomed() -> list[str]:
        kept = set(keep())
        return [i for i in plan_prune(repo.snapshots(), keep_last=keep_last, name=name).delete if i not in kept]

    warnings = [f"unreadable entry skipped: {w}" for w in repo.broken_snapshots().values()]
    delete = doomed()
    if delete:
        with locked(repo):
            delete = doomed()
            res = apply(repo, delete) if delete else {}
        if res.get("data_kept"):
            warnings.append(res["data_kept"])
    return delete, warnings


def execute_prune(repo, selection: Selection, dry_run: bool = False, repack_threshold: float = MAX_UNUSED,
                  _fault: Fault | None = None) -> PruneResult:
    """Plan and apply the deletion of `selection` under the writer lock alone: the entry the
    step-by-step tests drive (they hold, or deliberately skip, the readers lock); commands
    use run() / apply() inside locked()."""
    with repo.writer_lock(recover=not dry_run, exclusive=not dry_run, what="prune"):
        return apply(repo, selection.delete, dry_run, repack_threshold, _fault)


def snapshots_info(repo) -> list[dict]:
    return [{"id": s.id, "name": s.name, "created": s.created, "dir": s.path.name} for s in repo.snapshots()]


# -- execution --------------------------------------------------------------------------------------

def execute(repo, p: PrunePlan, _fault: Fault | None = None) -> PruneResult:
    """Apply `p` and nothing else. The caller holds the writer lock (and the readers lock
    exclusively: locked()); `p` must have been planned under the same writer lock."""
    fault = _fault or (lambda step: None)
    if not repo.holds_exclusive():
        raise RepositoryError("prune's execution needs the repository's exclusive lock (use prune.locked())")
    _check_current(repo, p)
    root = repo.path
    res = PruneResult.of_plan(p, dry_run=False)
    _remove_snapshots(root, p.remove, fault)
    if p.data_kept is None:
        new_packs, written = _rewrite(root, p, fault)
        p.rewrite_bytes = written          # the plan as run: its bytes freed are exact, as a dry run's
        res["plan"] = p.to_dict()
        res["packs_written"] = len(new_packs)
        res["locations_written"] = _replace_index(repo, p, new_packs, fault)
        freed = _delete_packs(repo, p, fault) - written
        res["bytes_freed"] = max(freed, 0)
    res["leftovers_removed"] = _remove_leftovers(root, p.leftovers)
    copies.sweep(repo)      # the copy records (docs/format.md §14) of snapshots that are gone
    return res


def _check_current(repo, p: PrunePlan) -> None:
    """The plan still describes the repository (nothing else writes under the exclusive
    lock; this catches a plan made before the lock was taken)."""
    sd = repo.path / "snapshots"
    for n in p.remove:
        try:
            st = os.lstat(sd / n)
        except FileNotFoundError:
            st = None
        if st is None or not stat.S_ISDIR(st.st_mode):
            raise RepositoryError(f"the repository changed since prune's plan: snapshot {n} is gone",
                                  "run prune again")
    if p.index is not None and index_names(repo.path) != p.index_files:
        raise RepositoryError("the repository changed since prune's plan: index files differ", "run prune again")


def _remove_snapshots(root, names: list[str], fault: Fault) -> None:
    sd = root / "snapshots"
    for n in names:
        tomb = sd / f".del-{n}"
        shutil.rmtree(tomb, ignore_errors=True)   # left by a crash while an earlier namesake went
        os.rename(sd / n, tomb)
        fsutil.fsync_dir(sd)
        fault("snapshot-renamed")
        shutil.rmtree(tomb)
    fault("snapshots-deleted")


def _rewrite(root, p: PrunePlan, fault: Fault) -> tuple[list, int]:
    """Step 2: the still-used blobs (pages) of the packs the plan rewrites, into new packs.
    -> (new packs with their records, bytes written)."""
    writer = PackWriter(root)
    try:
        for blob in _rewritten_blobs(root, p):
            writer.add(*blob)
        new_packs = writer.finish()
    except BaseException:
        writer.abort()
        raise
    fault("packs-rewritten")
    return new_packs, writer.bytes_written


def _rewritten_blobs(root, p: PrunePlan):
    """The blobs the rewrite writes, in order: (kind, codec, n_pages, raw_len, payload, ids)."""
    idx = p.index
    reader = BlobReader(root)
    try:
        for d in p.by_action("rewrite"):
            for bno, slots in d.blobs:
                b = idx.blobs[bno]
                raw = _read_checked(reader, idx, bno)
                codec = b.codec if b.codec != CODEC_NONE else CODEC_LZ4
                if slots is None:
                    c, payload = compress(raw, codec)
                    yield KIND_DATA, c, 0, len(raw), payload, b.ids
                    continue
                pages = b"".join(raw[s * PAGE_SIZE:(s + 1) * PAGE_SIZE] for s in slots)
                ids = b"".join(b.ids[s * PAGE_ID_LEN:(s + 1) * PAGE_ID_LEN] for s in slots)
                c, payload = compress(pages, codec)
                yield KIND_PAGES, c, len(slots), len(pages), payload, ids
    finally:
        reader.close()


def _replace_index(repo, p: PrunePlan, new_packs: list, fault: Fault) -> int:
    """Steps 3, 3b, 4: one index file for every kept blob, the survivors' locations files,
    then the old index files. -> number of locations files written."""
    root, idx = repo.path, p.index
    survivors = [s for s in repo.snapshots() if s.path.name in set(p.keep)]
    indexed_going = [d for d in p.packs if d.action != "keep" and d.why != "orphan"]
    if not (indexed_going or new_packs):
        # nothing moves: only write missing/unusable locations files (older snapshots)
        n = locations.refresh(repo, survivors, idx, None, fault)
        fault("index-replaced")
        return n
    keep = {d.pack for d in p.by_action("keep")}
    recs: dict[bytes, list] = {}
    for b in idx.blobs:
        if b.pack in keep:
            recs.setdefault(b.pack, []).append(b)
    written = write_index_file(root, sorted(recs.items()) + list(new_packs))
    fault("index-written")
    # the survivors' locations files that name a pack about to go (docs/format.md §5.4)
    live = keep | {ph for ph, _ in new_packs}
    new_only = RepoIndex.load(root, [written[0].name]) if written else RepoIndex()
    n = locations.refresh(repo, survivors, new_only, live, fault)
    fault("locations-written")
    new_name = written[0].name if written else None
    for name in os.listdir(root / "index"):
        if name != new_name:
            fsutil.unlink_quiet(root / "index" / name)
            fault("index-deleted-one")
    fsutil.fsync_dir(root / "index")
    fault("index-replaced")
    return n


def _delete_packs(repo, p: PrunePlan, fault: Fault) -> int:
    """Step 5: the packs the plan deletes or rewrote, never one the index now names.
    -> bytes freed."""
    final = index_of(repo)
    if final.bad_files:
        raise RepositoryError("index became unreadable during prune: " + ", ".join(final.bad_files))
    live = {b.pack for b in final.blobs}
    freed = 0
    for d in p.packs:
        if d.action == "keep" or d.pack in live:
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pack_path(repo.path, d.pack))
            freed += d.size
        fault("pack-deleted")
    return freed


def _read_checked(reader: BlobReader, idx: RepoIndex, bno: int) -> bytes:
    """A blob to copy, checked against its ids (store.check_decoded)."""
    b = idx.blobs[bno]
    try:
        raw = reader.read_raw(b)
    except (OSError, FormatError) as e:
        raise CorruptSnapshot(f"prune stopped: blob in pack {b.pack.hex()} unreadable: {e}",
                              "run gpusnap verify") from None
    why = check_decoded(raw, b)
    if why is not None:
        raise CorruptSnapshot(f"prune stopped: damaged blob in pack {b.pack.hex()}: {why}", "run gpusnap verify")
    return raw


# -- leftovers and logs -------------------------------------------------------------------------------

def _remove_leftovers(root, leftovers: list[str]) -> int:
    """Step 6: the plan's leftovers ("tmp/x", "snapshots/.del-x", "logs/x"), each removed
    relative to its directory opened O_NOFOLLOW (never through a symlink; shutil.rmtree is
    fd-based and refuses one)."""
    by_dir: dict[str, list[str]] = {}
    for rel in leftovers:
        sub, _, name = rel.partition("/")
        by_dir.setdefault(sub, []).append(name)
    n = 0
    for sub, names in by_dir.items():
        try:
            dfd = fsutil.open_dir(root / sub)
        except FileNotFoundError:
            continue
        try:
            for name in names:
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        shutil.rmtree(name, dir_fd=dfd)
                    else:
                        os.unlink(name, dir_fd=dfd)
                    n += 1
                except FileNotFoundError:
                    pass
        finally:
            os.close(dfd)
    return n


def prune_logs(root) -> int:
    """Remove the logs doomed_logs() names (whoever deleted the snapshot, its logs go with
    it). Returns how many files went."""
    return _remove_leftovers(root, [f"logs/{n}" for n in doomed_logs(root)])
