"""Prune's plan: which snapshots go and, for every pack, keep / rewrite (with which blobs) /
delete, with byte counts; computed from the repository as it is, changing nothing on disk.

restic's prune is the model: decide everything first (what is used, what is not, which
packs are worth repacking), show it (`prune --dry-run` prints exactly this plan), then
apply it (gpusnap/repo/maint/prune.py executes a PrunePlan and nothing else).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from typing import Mapping

from gpusnap.errors import RepositoryError
from gpusnap.repo import fsutil
from gpusnap.repo.format import BLOB_HEADER, KIND_DATA
from gpusnap.repo.index import RepoIndex
from gpusnap.repo.pipeline.packwriter import DEFAULT_PACK_TARGET
from gpusnap.repo.store import list_packs, pack_sizes

SMALL_PACK = DEFAULT_PACK_TARGET // 4
MAX_UNUSED = 0.10


# -- which snapshots -------------------------------------------------------------------------

@dataclass
class Selection:
    """Snapshot ids to keep and to delete (the retention rule's answer)."""
    keep: list[str] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)

    @property
    def remove(self) -> list[str]:
        return self.delete

    def to_dict(self):
        return {"keep": self.keep, "delete": self.delete}


def _field(s, k):
    return s[k] if isinstance(s, Mapping) else getattr(s, k)


def plan_prune(snapshots_info, keep_last: int, name: str | None = None) -> Selection:
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
    sel = Selection()
    for gname in sorted(groups):
        items = sorted(groups[gname], key=lambda s: (s["created"], s["id"]))
        if name is not None and gname != name:
            sel.keep.extend(s["id"] for s in items)
            continue
        cut = len(items) - keep_last if keep_last < len(items) else 0
        sel.delete.extend(s["id"] for s in items[:cut])
        sel.keep.extend(s["id"] for s in items[cut:])
    return sel


# -- which packs -----------------------------------------------------------------------------

def plan_packs(sizes: Mapping[bytes, tuple[int, int]], max_unused: float = MAX_UNUSED,
               small: int = SMALL_PACK) -> tuple[list, list, list]:
    """Pure: (keep, rewrite, delete) pack lists from {pack: (bytes stored, bytes still used)}.

    A pack nobody uses goes; one whose unused share is above `max_unused` is rewritten with
    only what is used (restic's --max-unused, per pack); and small packs (under `small`
    bytes, e.g. one per incremental dump) are merged: when two or more would stay, all of
    them are rewritten together into as few packs as the target size allows."""
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


@dataclass
class PackDecision:
    """One pack's fate. `blobs` (rewrite only): (blob number in the plan's index, the page
    slots still used, or None for a whole data blob), in pack order."""
    pack: bytes
    action: str                  # "keep" | "rewrite" | "delete"
    why: str                     # "used", "unused", "orphan", "mostly unused", "small"
    size: int                    # bytes of the pack file (0: not there)
    used: int                    # bytes of its indexed blobs still needed (headers included)
    stored: int                  # bytes of its indexed blobs
    blobs: list = field(default_factory=list, repr=False)

    @property
    def unused(self) -> int:
        return self.stored - self.used

    def to_dict(self) -> dict:
        d = {"pack": self.pack.hex(), "action": self.action, "why": self.why, "size": self.size,
             "used": self.used, "unused": self.unused}
        if self.action == "rewrite":
            d["blobs_kept"] = len(self.blobs)
            d["pages_kept"] = sum(len(s) for _, s in self.blobs if s is not None)
        return d


@dataclass
class PrunePlan:
    """Everything a prune will do, decided before anything changes."""
    remove: list = field(default_factory=list)        # snapshot dir names to delete
    keep: list = field(default_factory=list)          # snapshot dir names that stay
    packs: list[PackDecision] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    data_kept: str | None = None        # why no data is deleted (a snapshot that cannot be read)
    leftovers: list[str] = field(default_factory=list)   # crash leftovers and logs that go
    index_files: list[str] = field(default_factory=list)  # what the plan was made from
    index: RepoIndex | None = field(default=None, repr=False, compare=False)
    rewrite_bytes: int | None = None    # a dry run: what the rewrite would write (prune.apply)

    def by_action(self, action: str) -> list[PackDecision]:
        return [d for d in self.packs if d.action == action]

    def totals(self) -> dict:
        rw, dl = self.by_action("rewrite"), self.by_action("delete")
        return {"packs_keep": len(self.by_action("keep")), "packs_rewrite": len(rw), "packs_delete": len(dl),
                "used": sum(d.used for d in self.packs), "unused": sum(d.unused for d in self.packs),
                "to_rewrite": sum(d.used for d in rw),
                # what goes: whole deleted packs, and what rewriting drops (exact when the dry
                # run computed the rewrite's output, else estimated before recompression)
                "to_free": sum(d.size for d in dl) + (sum(max(d.size - d.used, 0) for d in rw)
                                                      if self.rewrite_bytes is None
                                                      else sum(d.size for d in rw) - self.rewrite_bytes)}

    def to_dict(self) -> dict:
        return {"snapshots_remove": self.remove, "snapshots_keep": self.keep,
                "packs": [d.to_dict() for d in self.packs], "totals": self.totals(),
                "unreadable": self.unreadable, "data_kept": self.data_kept, "leftovers": self.leftovers}


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
        self._done()
        return int(self._count[bno]) if bno < len(self._count) else 0

    def slots(self, bno: int) -> list[int]:
        locs = self._done()
        lo, hi = self._np.searchsorted(locs, [bno << 8, (bno + 1) << 8])
        return (locs[lo:hi] & 0xFF).tolist()


def index_of(repo) -> RepoIndex:
    """The repository's whole index, read afresh from index/ (store's public loader; never a
    cached copy a dump may have loaded with check_packs, which leaves records out)."""
    return RepoIndex.load(repo.path)


def index_names(root) -> list[str]:
    """The index files there are now (names are content hashes: equal lists, equal index)."""
    return sorted(n for n in os.listdir(root / "index") if not n.startswith("."))


def present_packs(root) -> set[bytes]:
    """Names of the pack files under packs/ (store.list_packs: the one listing)."""
    return set(list_packs(root)[0])


def _leftovers(root, gone: set[str]) -> list[str]:
    """Crash leftovers (tmp/*, snapshots/.tmp-*, .del-*) and the logs that go (doomed_logs)."""
    from gpusnap.repo import fsutil

    out = []
    for sub in ("tmp", "snapshots"):
        dfd = fsutil.open_dir(root / sub)       # never listed through a planted symlink
        try:
            names = sorted(os.listdir(dfd))
        finally:
            os.close(dfd)
        out += [f"{sub}/{n}" for n in names if sub == "tmp" or n.startswith((".tmp-", ".del-"))]
    return out + [f"logs/{n}" for n in doomed_logs(root, gone)]


FAILED_LOGS_KEPT = 20
_LOG_OF_SNAPSHOT = re.compile(r"(?P<dir>.+)-(dump|restore)(-[0-9]+)?\.log")


def doomed_logs(root, gone: set[str] = frozenset()) -> list[str]:
    """The logs in REPO/logs/ that go: those of a snapshot whose directory is gone (or in
    `gone`), and the logs of failed runs (failed-*) beyond the newest FAILED_LOGS_KEPT."""
    try:
        dfd = fsutil.open_dir(root / "logs")
    except (FileNotFoundError, NotADirectoryError):
        return []
    try:
        present = set(os.listdir(root / "snapshots")) - set(gone)
        failed = []
        doomed = []
        for name in sorted(os.listdir(dfd)):
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
        return doomed + [n for _, n in failed[FAILED_LOGS_KEPT:]]
    finally:
        os.close(dfd)


def plan(repo, remove=(), max_unused: float = MAX_UNUSED) -> PrunePlan:
    """The plan for deleting the snapshots `remove` (Snapshot objects, ids, or anything with
    the `path` of a snapshot directory) and freeing every byte no remaining snapshot needs.
    Reads only. Raises RepositoryError, before anything changes, when data cannot be judged
    safely (a damaged index file, a snapshot needing pages no index holds)."""
    root = repo.path
    snaps = repo.snapshots()
    want = {r if isinstance(r, str) else r.path.name for r in remove}
    doomed = [s for s in snaps if s.id in want or s.path.name in want]
    foreign = repo.unusable_entries()
    broken = {q: why for q, why in repo.broken_snapshots().items() if q not in foreign}
    # an unreadable snapshot directory named explicitly (forget DIR) goes; it then needs nothing
    gone = [q.name for q in broken if q.name in want] + [s.path.name for s in doomed]
    broken = {q: why for q, why in broken.items() if q.name not in gone}
    survivors = [s for s in snaps if s.path.name not in gone]
    p = PrunePlan(remove=gone, keep=[s.path.name for s in survivors])
    # An unreadable entry never blocks the retention of the others: it is reported and left
    # alone. A damaged snapshot directory may still need data nobody can list, so then no data
    # is deleted; entries that are not snapshot directories at all need none.
    p.unreadable = list(foreign.values()) + list(broken.values())
    p.leftovers = _leftovers(root, set(gone))
    if broken:
        p.data_kept = "no data deleted while a snapshot is unreadable: " + ", ".join(q.name for q in broken)
        return p
    names = index_names(root)
    idx = index_of(repo)
    if idx.bad_files:
        raise RepositoryError(f"prune refuses to delete data while index files are damaged: "
                              f"{', '.join(sorted(idx.bad_files))}", "run gpusnap verify")
    p.index, p.index_files = idx, names
    used_slots, used_data = _usage(idx, survivors)
    p.packs = _decide(root, idx, used_slots, used_data, max_unused)
    return p


def _usage(idx: RepoIndex, survivors) -> tuple[_UsedSlots, set[int]]:
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
    return used_slots, used_data


def _decide(root, idx: RepoIndex, used_slots: _UsedSlots, used_data: set[int], max_unused: float) -> list:
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
    keep, rewrite, delete = plan_packs(sizes, max_unused)
    orphans = present_packs(root) - set(by_pack)
    on_disk = pack_sizes(root, set(by_pack) | orphans)
    out = []
    small = set(rewrite) - {ph for ph in rewrite if sizes[ph][0] - sizes[ph][1] > max_unused * sizes[ph][0]}
    for action, phs in (("keep", keep), ("rewrite", rewrite), ("delete", delete)):
        for ph in phs:
            total, used = sizes[ph]
            why = {"keep": "used", "delete": "unused"}.get(action) or ("small" if ph in small else "mostly unused")
            d = PackDecision(ph, action, why, on_disk.get(ph) or 0, used, total)
            if action == "rewrite":
                for bno in by_pack[ph]:
                    if idx.blobs[bno].kind == KIND_DATA:
                        if bno in used_data:
                            d.blobs.append((bno, None))
                    else:
                        slots = used_slots.slots(bno)
                        if slots:
                            d.blobs.append((bno, slots))
            out.append(d)
    for ph in sorted(orphans):
        sz = on_disk.get(ph) or 0
        out.append(PackDecision(ph, "delete", "orphan", sz, 0, sz))
    out.sort(key=lambda d: d.pack)
    return out
