"""gpusnap verify: structure (manifests, page lists, index, packs) and data (every stored
byte read back and checked against its checksum)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import blake3

from gpusnap.errors import CorruptSnapshot, GpusnapError
from gpusnap.repo import locations
from gpusnap.repo.codec import decompress
from gpusnap.repo.format import BLOB_HEADER, KIND_DATA, KIND_PAGES, PACK_TRAILER, PAGE_ID_LEN, FormatError, pack_namer, parse_pack
from gpusnap.repo.format.locations import Locations, LocationsInvalid, image_digests
from gpusnap.repo.index import RepoIndex
from gpusnap.repo.repository import Repository, Snapshot
from gpusnap.repo.store import check_decoded, decode_blob, decoded_ids, list_packs, pack_path


@dataclass
class Problem:
    scope: str        # "repository" | "snapshot" | "pack" | "index"
    name: str         # snapshot dir name, pack hash, index file name
    message: str

    def __str__(self):
        return f"{self.scope} {self.name}: {self.message}"


@dataclass
class VerifyReport:
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)          # harmless: orphan packs, leftovers
    snapshots_checked: list[str] = field(default_factory=list)
    affected_snapshots: list[str] = field(default_factory=list)
    packs_checked: int = 0
    bytes_read: int = 0
    read_data: bool = True

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, scope, name, message):
        self.problems.append(Problem(scope, str(name), message))

    def damage(self) -> str:
        """One sentence on what is wrong (a damaged report): how many problems, which snapshots
        they affect (the message `verify` fails with; render/maint.py shows it too)."""
        if not self.affected_snapshots and all(p.scope == "index" for p in self.problems):
            return (f"{len(self.problems)} problem(s): the repository index is damaged; no snapshot is "
                    "affected (each still restores); `gpusnap repair` rebuilds the index")
        aff = ", ".join(self.affected_snapshots) or "none (damage is in data no snapshot needs)"
        return f"{len(self.problems)} problem(s); affected snapshots: {aff}"

    def to_dict(self) -> dict:
        return {"ok": self.ok, "read_data": self.read_data,
                "snapshots_checked": self.snapshots_checked,
                "affected_snapshots": self.affected_snapshots,
                "packs_checked": self.packs_checked, "bytes_read": self.bytes_read,
                "problems": [p.__dict__ for p in self.problems], "notes": self.notes}


def _check_blob(data, off, b) -> str | None:
    """Decode one blob of a pack held in memory (store.decode_blob, as every reader does) and
    check it against its ids: -> what is wrong, or None."""
    try:
        raw = decode_blob(data, off, off, b.kind, b.codec, b.n_pages, b.raw_len, b.stored_len)
    except FormatError as e:
        return str(e) if str(e).startswith("blob") else f"blob at offset {off}: {e}"
    return check_decoded(raw, b)


def _name_matches(data, walked, ph: bytes, recs) -> bool:
    """Is `ph` the name of the pack `data` (docs/format.md §3)? The name is the blake3 of the
    pack's descriptor: its header, each blob header with the blob's ids, its trailer. The
    ids come from the index records (each indexed blob is checked against them separately,
    _check_blob); a blob no index record describes gets its ids from its decompressed
    content. Packs written before format revision 1.2 are named by the blake3 of the whole
    file: accepted too."""
    if walked is not None:
        ids_at = {r.offset: r.ids for r in recs}
        h = pack_namer()
        ok = True
        for off, bh in walked:
            ids = ids_at.get(off)
            if ids is None:
                try:
                    raw = decompress(memoryview(data)[off + BLOB_HEADER.size:off + BLOB_HEADER.size + bh.stored_len],
                                     bh.codec, bh.raw_len)
                except FormatError:
                    ok = False
                    break
                ids = decoded_ids(bh.kind, bh.n_pages, raw)     # one native batch scan for pages
            h.update(data[off:off + BLOB_HEADER.size])
            h.update(ids)
        if ok:
            h.update(data[len(data) - PACK_TRAILER.size:])
            if h.digest() == ph:
                return True
    return blake3.blake3(data).digest() == ph      # a pack from before revision 1.2


def check_locations(snap, idx) -> tuple[str | None, str | None]:
    """For verify: -> (problem, note). problem: the locations file is usable but disagrees
    with the index (a restore would fail); note: missing/unusable/stale (a restore uses
    the index instead)."""
    try:
        loc = Locations.open(snap.path, image_digests(snap.manifest))
    except LocationsInvalid as e:
        return None, f"snapshot {snap.path.name}: locations file not used ({e}); restore reads through locations built from the index"
    try:
        try:
            locations.check_packs(loc, snap.repo.path)
        except LocationsInvalid as e:
            return None, f"snapshot {snap.path.name}: locations file not used ({e}); restore reads through locations built from the index"
        where = {(b.pack, b.offset): b for b in idx.blobs}
        for i, im in enumerate(snap.manifest["images"]):
            runs = loc.iter_runs(i)
            if im["type"] == "blob":
                want = [("data", bytes.fromhex(b)) for b in im["blobs"]]
            else:
                want = snap.iter_page_refs(im["name"])
            pend = b""
            for rec in want:
                if rec[0] == "zero":
                    continue
                if rec[0] in ("data", "tail"):
                    bid = rec[1] if rec[0] == "data" else rec[2]
                    r = next(runs, None)
                    b = where.get((loc.pack(r[0])[0], r[1])) if r else None
                    if b is None or b.kind != KIND_DATA or b.ids != bid:
                        return f"locations file disagrees with the index for {im['name']}", None
                    continue
                ids = rec[1]
                while ids:
                    if not pend:
                        r = next(runs, None)
                        b = where.get((loc.pack(r[0])[0], r[1])) if r else None
                        if b is None or r[2] != KIND_PAGES or (b.kind, b.codec, b.stored_len) != (r[2], r[3], r[6]):
                            return f"locations file disagrees with the index for {im['name']}", None
                        pend = b.ids[r[7] * PAGE_ID_LEN:(r[7] + r[8]) * PAGE_ID_LEN]
                    k = min(len(pend), len(ids))
                    if pend[:k] != ids[:k]:
                        return f"locations file disagrees with the page list of {im['name']}", None
                    pend, ids = pend[k:], ids[k:]
            if pend or next(runs, None) is not None:
                return f"locations file disagrees with the page list of {im['name']}", None
    except LocationsInvalid as e:
        return f"locations file damaged: {e}", None
    except CorruptSnapshot as e:
        return str(e), None
    finally:
        loc.close()
    return None, None


def verify(repo: Repository, snapshot_refs=None, read_data: bool = True) -> VerifyReport:
    rep = VerifyReport(read_data=read_data)
    root = repo.path
    idx = RepoIndex.load(root)
    for name, why in sorted(idx.bad_files.items()):
        rep.add("index", name, why)

    # -- snapshots -------------------------------------------------------------------
    snaps: list[Snapshot] = []
    if snapshot_refs is None:
        for p, why in sorted(repo.broken_snapshots().items()):
            rep.add("snapshot", p.name, why)
            rep.affected_snapshots.append(p.name)
        snaps = repo.snapshots()
    else:
        for ref in snapshot_refs:
            try:
                snaps.append(repo.snapshot(ref))
            except GpusnapError as e:
                rep.add("snapshot", str(ref), str(e))
                rep.affected_snapshots.append(str(ref))
    import numpy as np
    table = idx.page_table()
    blob_users: dict[int, set[str]] = {}
    for s in snaps:
        rep.snapshots_checked.append(s.path.name)
        try:
            pages, data = s.referenced_page_bytes()
        except CorruptSnapshot as e:
            rep.add("snapshot", s.path.name, str(e))
            rep.affected_snapshots.append(s.path.name)
            continue
        # page ids in bulk (numpy + the index's page table), not one Python object per page
        ids = np.unique(np.frombuffer(pages, dtype="V16"))
        locs = np.frombuffer(table.get_many(ids.tobytes()), dtype=np.int64) if len(ids) else np.zeros(0, np.int64)
        missing = int((locs < 0).sum())
        for bno in np.unique(locs[locs >= 0] >> 8).tolist():
            blob_users.setdefault(bno, set()).add(s.path.name)
        for bid in data:
            bno = idx.data_loc.get(bid)
            if bno is None:
                missing += 1
            else:
                blob_users.setdefault(bno, set()).add(s.path.name)
        if missing and s.locations() is not None:
            # the snapshot's own locations file (checked: packs present, long enough) still
            # finds every page, and restore reads through it: the index is what is damaged
            msg = (f"{missing} pages/blobs of snapshot {s.path.name} are not in the index; the snapshot "
                   "restores through its locations file; `gpusnap repair` rebuilds the index from the packs")
            if idx.bad_files:                   # (each damaged file is a problem of its own above)
                rep.notes.append(msg)
            else:
                rep.add("index", "index", msg + " (an index file is missing)")
            continue
        if missing:
            rep.add("snapshot", s.path.name, f"{missing} pages/blobs it needs are not in the index"
                    + (" (damaged index files: " + ", ".join(sorted(idx.bad_files)) + ")" if idx.bad_files else ""))
            rep.affected_snapshots.append(s.path.name)
            continue
        problem, note = check_locations(s, idx)
        if problem:
            rep.add("snapshot", s.path.name, problem + " (a restore would fail; prune rewrites the file)")
            rep.affected_snapshots.append(s.path.name)
        elif note:
            rep.notes.append(note)

    # -- packs -----------------------------------------------------------------------
    by_pack: dict[bytes, list[int]] = {}
    for bno, b in enumerate(idx.blobs):
        by_pack.setdefault(b.pack, []).append(bno)
    if snapshot_refs is not None:
        needed = {idx.blobs[bno].pack for bno in blob_users}
        by_pack = {k: v for k, v in by_pack.items() if k in needed}
    else:
        present, other = list_packs(root)
        rep.notes.extend(f"unexpected file {p}" for p in other)
        orphans = set(present) - set(by_pack)
        if orphans:
            rep.notes.append(f"{len(orphans)} pack(s) not referenced by the index (left by an interrupted dump; prune removes them)")
        for d in ("tmp",):
            left = os.listdir(root / d)
            if left:
                rep.notes.append(f"{len(left)} leftover temporary file(s) in {d}/ (prune removes them)")
        left = [p for p in os.listdir(root / "snapshots") if p.startswith(".")]
        if left:
            rep.notes.append(f"{len(left)} unfinished snapshot dir(s) in snapshots/ (prune removes them)")

    def affect(bnos, msg, ph):
        users = set()
        for bno in bnos:
            users |= blob_users.get(bno, set())
        for u in sorted(users):
            rep.add("snapshot", u, f"needs damaged data: {msg} (pack {ph.hex()})")
            rep.affected_snapshots.append(u)

    for ph, bnos in sorted(by_pack.items()):
        rep.packs_checked += 1
        pp = pack_path(root, ph)
        need_end = max(idx.blobs[b].end for b in bnos)
        try:
            size = os.stat(pp).st_size
        except FileNotFoundError:
            rep.add("pack", ph.hex(), "missing")
            affect(bnos, "pack missing", ph)
            continue
        if size < need_end:
            rep.add("pack", ph.hex(), f"truncated: {size} bytes, index needs at least {need_end}")
        if not read_data:
            if size < need_end:
                affect(bnos, "pack truncated", ph)
            continue
        try:
            with open(pp, "rb") as f:
                data = f.read()
        except OSError as e:
            rep.add("pack", ph.hex(), f"unreadable: {e}")
            affect(bnos, "pack unreadable", ph)
            continue
        rep.bytes_read += len(data)
        try:
            walked = parse_pack(data)
        except FormatError as e:
            walked = None
            rep.add("pack", ph.hex(), f"malformed: {e}")
        if not _name_matches(data, walked, ph, [idx.blobs[b] for b in bnos]):
            rep.add("pack", ph.hex(), "contents do not match the pack's name (checksum)")
        bad = []
        for bno in bnos:
            b = idx.blobs[bno]
            why = _check_blob(data, b.offset, b)
            if why:
                bad.append(bno)
                rep.add("pack", ph.hex(), why)
        if bad:
            affect(bad, f"{len(bad)} damaged blob(s)", ph)
        elif size < need_end:
            affect(bnos, "pack truncated", ph)
    rep.affected_snapshots = sorted(set(rep.affected_snapshots))
    return rep
