"""gpusnap prune: a pure planning function, then a crash-safe execution.

Execution order (each step leaves a repository that verifies):
 1. rename doomed snapshot dirs to snapshots/.del-* (atomic; invisible to readers), delete them
 2. write rewritten packs (only the still-used pages of partly used packs)
 3. write ONE new index file describing every kept blob, fsync
 3b. rewrite the locations file of every survivor that names a pack about to go (from the
    new index alone; atomic per file); with nothing to delete, write missing ones only
 4. delete every other index file
 5. delete packs no index names (deleted, rewritten, orphans of interrupted dumps)
 6. delete leftovers: tmp/*, snapshots/.tmp-*, snapshots/.del-*
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
from dataclasses import dataclass, field
from typing import Callable, Mapping

from gpusnap.errors import CorruptSnapshot, RepositoryError
from gpusnap.repo import fsutil, locations
from gpusnap.repo.codec import compress
from gpusnap.repo.format import BLOB_HEADER, CODEC_LZ4, CODEC_NONE, HEX64, KIND_DATA, KIND_PAGES, PAGE_ID_LEN, PAGE_SIZE, FormatError
from gpusnap.repo.repository import Repository
from gpusnap.repo.store import DEFAULT_PACK_TARGET, PendingBlob, BlobReader, PackWriter, RepoIndex, pack_path, write_index_file

import blake3


@dataclass
class PrunePlan:
    keep: list[str] = field(default_factory=list)      # snapshot ids
    delete: list[str] = field(default_factory=list)

    @property
    def remove(self) -> list[str]:
        return self.delete

    def to_dict(self):
        return {"keep": self.keep, "delete": self.delete}


class PruneResult(dict):
    """What prune did (or, with dry_run, would do). A dict, plus to_dict()/lines() for the CLI."""

    def to_dict(self) -> dict:
        return dict(self)


def _field(s, k):
    return s[k] if isinstance(s, Mapping) else getattr(s, k)


def plan_prune(snapshots_info, keep_last: int, name: str | None = None) -> PrunePlan:
    """Pure. snapshots_info: iterable of mappings with "id", "name", "created" (or objects
    with those attributes, e.g. Snapshot).
    Per snapshot name (or only `name` when given) keep the `keep_last` newest, delete the
    rest. Snapshots of other names are kept. Ties on `created` are broken by id."""
    if type(keep_last) is not int or keep_last < 0:
        raise ValueError("keep_last must be a non-negative integer")
    groups: dict[str, list] = {}
    for s in snapshots_info:
        s = {"id": _field(s, "id"), "name": _field(s, "name"), "created": _field(s, "created")}
        groups.setdefault(s["name"], []).append(s)
    plan = PrunePlan()
    for gname in sorted(groups):
        items = sorted(groups[gname], key=lambda s: (s["created"], s["id"]))
        if name is not None and gname != name:
            plan.keep.extend(s["id"] for s in items)
            continue
        cut = len(items) - keep_last if keep_last < len(items) else 0
        plan.delete.extend(s["id"] for s in items[:cut])
        plan.keep.extend(s["id"] for s in items[cut:])
    return plan


SMALL_PACK = DEFAULT_PACK_TARGET // 4


def plan_packs(sizes: Mapping[bytes, tuple[int, int]], max_unused: float = 0.10,
               small: int = SMALL_PACK) -> tuple[list, list, list]:
    """Pure: (keep, rewrite, delete) pack lists from {pack: (bytes stored, bytes still used)}.

    A pack nobody uses goes; one whose unused share is above `max_unused` is rewritten with
    only what is used (restic's --max-unused, per pack); and small packs (under `small`
    bytes, e.g. one per incremental dump) are merged: when two or more would stay, all of
    them are rewritten together into as few packs as the target size allows. Execution
    writes the new packs and index durably before deleting any old one."""
    keep, rewrite, delete = [], [], []
    for ph in sorted(sizes):
        total, used = sizes[ph]
        if used == 0:
            delete.append(ph)
        elif total - used > max_unused * total:
            rewrite.append(ph)
        else:
            keep.append(ph)
    smalls = [ph for ph in keep if sizes[ph][0] < small]
    small_rewrites = [ph for ph in rewrite if sizes[ph][1] < small]
    if len(smalls) + len(small_rewrites) >= 2 and smalls:
        keep = [ph for ph in keep if ph not in set(smalls)]
        rewrite = sorted(rewrite + smalls)
    return keep, rewrite, delete


class _UsedSlots:
    """The blob slots (blob_no << 8 | slot) the surviving snapshots need, as one sorted numpy
    array: page ids are looked up in the index's page table in bulk, never one by one."""

    def __init__(self, idx: RepoIndex):
        import numpy as np
        self._np = np
        self._table = idx.page_table()
        self._parts: list = []
        self._locs = None
        self._count = None

    def add(self, page_ids: bytes) -> bool:
        """Mark the pages `page_ids` (16 bytes each) as needed; False if one is not indexed."""
        np = self._np
        ids = np.unique(np.frombuffer(page_ids, dtype="V16"))
        if not len(ids):
            return True
        locs = np.frombuffer(self._table.get_many(ids.tobytes()), dtype=np.int64)
        if (locs < 0).any():
            return False
        self._parts.append(locs)
        self._locs = None
        return True

    def _done(self):
        if self._locs is None:
            np = self._np
            self._locs = np.unique(np.concatenate(self._parts)) if self._parts else np.zeros(0, np.int64)
            self._count = np.bincount(self._locs >> 8) if len(self._locs) else np.zeros(0, np.int64)
        return self._locs

    def count(self, bno: int) -> int:
        """How many slots of blob `bno` are needed."""
        self._done()
        return int(self._count[bno]) if bno < len(self._count) else 0

    def slots(self, bno: int) -> list[int]:
        """The needed slots of blob `bno`, ascending."""
        locs = self._done()
        lo, hi = self._np.searchsorted(locs, [bno << 8, (bno + 1) << 8])
        return (locs[lo:hi] & 0xFF).tolist()


def snapshots_info(repo: Repository) -> list[dict]:
    return [{"id": s.id, "name": s.name, "created": s.created, "dir": s.path.name} for s in repo.snapshots()]


def execute_prune(repo: Repository, plan: PrunePlan, dry_run: bool = False, repack_threshold: float = 0.10,
                  _fault: Callable[[str], None] | None = None) -> PruneResult:
    fault = _fault or (lambda step: None)
    root = repo.path
    res = PruneResult({"dry_run": dry_run, "snapshots_deleted": [], "snapshots_kept": [], "packs_deleted": 0,
           "packs_rewritten": 0, "packs_written": 0, "bytes_freed": 0, "leftovers_removed": 0})
    with repo.writer_lock():
        # An unreadable entry never blocks the retention of the others: it is reported and
        # left alone (never deleted: it may be repairable). A damaged snapshot directory may
        # still need data nobody can list, so then no data is deleted; entries that are not
        # snapshot directories at all (a symlink, a file) need none.
        foreign = repo.unusable_entries()
        broken = {p: why for p, why in repo.broken_snapshots().items() if p not in foreign}
        res["unreadable"] = [why for why in foreign.values()] + [why for why in broken.values()]
        keep_data = bool(broken)
        if keep_data:
            res["data_kept"] = ("no data deleted while a snapshot is unreadable: "
                                + ", ".join(p.name for p in broken))
        snaps = repo.snapshots()
        doomed_ids = set(plan.delete)
        doomed = [s for s in snaps if s.id in doomed_ids]
        survivors = [s for s in snaps if s.id not in doomed_ids]
        res["snapshots_deleted"] = [s.path.name for s in doomed]
        res["snapshots_kept"] = [s.path.name for s in survivors]

        # 1. snapshots
        if not dry_run:
            sd = root / "snapshots"
            for s in doomed:
                tomb = sd / f".del-{s.path.name}"
                os.rename(s.path, tomb)
                fsutil.fsync_dir(sd)
                fault("snapshot-renamed")
                shutil.rmtree(tomb)
            fault("snapshots-deleted")

        if keep_data:
            res["leftovers_removed"] = _clear_leftovers(root)
            repo._index = None
            return res

        # what is still needed
        idx = RepoIndex.load(root)
        if idx.bad_files:
            raise RepositoryError(f"prune refuses to delete data while index files are damaged: "
                                  f"{', '.join(sorted(idx.bad_files))}", "run gpusnap verify")
        used_slots = _UsedSlots(idx)
        used_data: set[int] = set()
        for s in survivors:
            pages, data = s.referenced_page_bytes()
            if not used_slots.add(pages):
                raise RepositoryError(f"snapshot {s.path.name} needs pages missing from the index; prune stops",
                                      "run gpusnap verify")
            for bid in data:
                bno = idx.data_loc.get(bid)
                if bno is None:
                    raise RepositoryError(f"snapshot {s.path.name} needs blobs missing from the index; prune stops",
                                          "run gpusnap verify")
                used_data.add(bno)

        by_pack: dict[bytes, list[int]] = {}
        for bno, b in enumerate(idx.blobs):
            by_pack.setdefault(b.pack, []).append(bno)
        sizes: dict[bytes, tuple[int, int]] = {}
        for ph, bnos in by_pack.items():
            total = used = 0
            for bno in bnos:
                b = idx.blobs[bno]
                sz = BLOB_HEADER.size + b.stored_len
                total += sz
                if b.kind == KIND_DATA:
                    used += sz if bno in used_data else 0
                else:
                    used += sz * used_slots.count(bno) // b.n_pages
            sizes[ph] = (total, used)
        keep_packs, rewrite_packs, delete_packs = plan_packs(sizes, repack_threshold)
        present = _present_packs(root)
        orphans = present - set(by_pack)

        def psize(ph):
            try:
                return os.stat(pack_path(root, ph)).st_size
            except OSError:
                return 0

        freed = sum(psize(p) for p in delete_packs + rewrite_packs) + sum(psize(p) for p in orphans)
        res["packs_deleted"] = len(delete_packs) + len(orphans)
        res["packs_rewritten"] = len(rewrite_packs)
        if dry_run:
            res["bytes_freed"] = freed
            return res

        # 2. rewrite partly used packs
        writer = PackWriter(root)
        reader = BlobReader(root, idx, cache_blobs=2)
        try:
            for ph in rewrite_packs:
                for bno in by_pack[ph]:
                    b = idx.blobs[bno]
                    if b.kind == KIND_DATA:
                        if bno not in used_data:
                            continue
                        raw = _read_checked(reader, idx, bno)
                        codec, payload = compress(raw, b.codec if b.codec != CODEC_NONE else CODEC_LZ4)
                        writer.add(KIND_DATA, codec, 0, len(raw), payload, b.ids)
                        continue
                    slots = used_slots.slots(bno)
                    if not slots:
                        continue
                    raw = _read_checked(reader, idx, bno)
                    pages = b"".join(raw[s * PAGE_SIZE:(s + 1) * PAGE_SIZE] for s in slots)
                    ids = b"".join(b.ids[s * PAGE_ID_LEN:(s + 1) * PAGE_ID_LEN] for s in slots)
                    codec, payload = compress(pages, b.codec if b.codec != CODEC_NONE else CODEC_LZ4)
                    writer.add(KIND_PAGES, codec, len(slots), len(pages), payload, ids)
            new_packs = writer.finish()
        except BaseException:
            writer.abort()
            raise
        finally:
            reader.close()
        res["packs_written"] = len(new_packs)
        freed -= writer.bytes_written
        fault("packs-rewritten")

        # 3. one new index for everything kept
        changed = bool(delete_packs or rewrite_packs or new_packs)
        if changed:
            kept = []
            for ph in sorted(keep_packs):
                recs = []
                for bno in by_pack[ph]:
                    b = idx.blobs[bno]
                    recs.append(_Rec(b.offset, b.kind, b.codec, b.n_pages, b.raw_len, b.stored_len, b.ids))
                kept.append((ph, recs))
            res_idx = write_index_file(root, kept + list(new_packs))
            fault("index-written")
            # 3b. locations files of the survivors that name a pack about to go (docs/format.md §5.4)
            live = set(keep_packs) | {ph for ph, _ in new_packs}
            new_only = RepoIndex.load(root, [res_idx[0].name]) if res_idx else RepoIndex()
            res["locations_written"] = locations.refresh(repo, survivors, new_only, live, fault)
            fault("locations-written")
            # 4. old index files
            new_name = res_idx[0].name if res_idx else None
            for n in os.listdir(root / "index"):
                if n != new_name:
                    fsutil.unlink_quiet(root / "index" / n)
                    fault("index-deleted-one")
            fsutil.fsync_dir(root / "index")
        else:
            # nothing moves: only write missing/unusable locations files (older snapshots)
            res["locations_written"] = locations.refresh(repo, survivors, idx, None, fault)
        fault("index-replaced")

        # 5. packs nobody indexes any more
        final = RepoIndex.load(root)
        if final.bad_files:
            raise RepositoryError("index became unreadable during prune: " + ", ".join(final.bad_files))
        live = {b.pack for b in final.blobs}
        for ph in sorted(_present_packs(root) - live):
            fsutil.unlink_quiet(pack_path(root, ph))
            fault("pack-deleted")
        # 6. leftovers
        res["leftovers_removed"] = _clear_leftovers(root)
        res["bytes_freed"] = max(freed, 0)
        repo._index = None
        return res


def _clear_leftovers(root) -> int:
    """tmp/*, snapshots/.tmp-*, snapshots/.del-*, and logs of snapshots that are gone.
    Never through a symlink: tmp/ and snapshots/ are opened O_NOFOLLOW and entries removed
    relative to them (shutil.rmtree is fd-based and refuses a symlink)."""
    n = fsutil.clear_dir(root / "tmp")
    dfd = fsutil.open_dir(root / "snapshots")
    try:
        for name in os.listdir(dfd):
            if name.startswith((".tmp-", ".del-")):
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        shutil.rmtree(name, dir_fd=dfd)
                    else:
                        os.unlink(name, dir_fd=dfd)
                    n += 1
                except OSError:
                    pass
    finally:
        os.close(dfd)
    n += prune_logs(root)
    return n


FAILED_LOGS_KEPT = 20
_LOG_OF_SNAPSHOT = re.compile(r"(?P<dir>.+)-(dump|restore)(-[0-9]+)?\.log")


def prune_logs(root) -> int:
    """REPO/logs/ goes with the snapshots: a snapshot's logs (<dir>-dump.log, <dir>-restore*.log)
    are removed once its directory is gone, and of the logs of failed runs (failed-*) only the
    newest FAILED_LOGS_KEPT stay. Returns how many files went."""
    logs = root / "logs"
    try:
        dfd = fsutil.open_dir(logs)
    except (FileNotFoundError, NotADirectoryError):
        return 0
    try:
        present = {n for n in os.listdir(root / "snapshots")}
        failed = []
        doomed = []
        for name in os.listdir(dfd):
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode) and not stat.S_ISLNK(st.st_mode):
                continue
            if name.startswith("failed-"):
                failed.append((st.st_mtime, name))
                continue
            m = _LOG_OF_SNAPSHOT.fullmatch(name)
            if m and m.group("dir") not in present:
                doomed.append(name)
        failed.sort(reverse=True)
        doomed += [n for _, n in failed[FAILED_LOGS_KEPT:]]
        for name in doomed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dfd)
        return len(doomed)
    finally:
        os.close(dfd)


_Rec = PendingBlob  # a blob header read back from a pack: the same fields


def _read_checked(reader: BlobReader, idx: RepoIndex, bno: int) -> bytes:
    b = idx.blobs[bno]
    try:
        raw = reader.read_raw(b)
    except (OSError, FormatError) as e:
        raise CorruptSnapshot(f"prune stopped: blob in pack {b.pack.hex()} unreadable: {e}",
                              "run gpusnap verify") from None
    if b.kind == KIND_PAGES:
        for s in range(b.n_pages):
            if blake3.blake3(raw[s * PAGE_SIZE:(s + 1) * PAGE_SIZE]).digest(16) != b.ids[s * PAGE_ID_LEN:(s + 1) * PAGE_ID_LEN]:
                raise CorruptSnapshot(f"prune stopped: damaged page in pack {b.pack.hex()}", "run gpusnap verify")
    elif blake3.blake3(raw).digest() != b.ids:
        raise CorruptSnapshot(f"prune stopped: damaged blob in pack {b.pack.hex()}", "run gpusnap verify")
    return raw


def _present_packs(root) -> set[bytes]:
    out = set()
    pdir = root / "packs"
    for sub in os.listdir(pdir):
        sp = pdir / sub
        if len(sub) != 2 or not sp.is_dir():
            continue
        for f in os.listdir(sp):
            if HEX64.match(f) and f.startswith(sub):
                out.add(bytes.fromhex(f))
    return out
