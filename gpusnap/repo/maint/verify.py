"""gpusnap verify: structure (manifests, page lists, index, packs) and data (every stored
byte read back and checked against its checksum)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import blake3

from gpusnap.errors import CorruptSnapshot, GpusnapError
from gpusnap.repo.codec import decompress
from gpusnap.repo.format import BLOB_HEADER, HEX64, KIND_PAGES, PACK_TRAILER, PAGE_ID_LEN, PAGE_SIZE, FormatError, pack_namer, parse_pack
from gpusnap.repo import locations
from gpusnap.repo.repository import Repository, Snapshot
from gpusnap.repo.store import RepoIndex, pack_path


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

    def to_dict(self) -> dict:
        return {"ok": self.ok, "read_data": self.read_data,
                "snapshots_checked": self.snapshots_checked,
                "affected_snapshots": self.affected_snapshots,
                "packs_checked": self.packs_checked, "bytes_read": self.bytes_read,
                "problems": [p.__dict__ for p in self.problems], "notes": self.notes}


def _check_blob(data, off, b) -> str | None:
    """Decompress one blob from a pack held in memory and check it against its ids."""
    end = off + BLOB_HEADER.size + b.stored_len
    if end > len(data):
        return f"blob at offset {off} runs past the end of the pack"
    try:
        from gpusnap.repo.format import parse_blob_header
        h = parse_blob_header(data, off)
        if (h.kind, h.codec, h.n_pages, h.raw_len, h.stored_len) != (b.kind, b.codec, b.n_pages, b.raw_len, b.stored_len):
            return f"blob header at offset {off} disagrees with the index"
        raw = decompress(memoryview(data)[off + BLOB_HEADER.size:end], b.codec, b.raw_len)
    except FormatError as e:
        return f"blob at offset {off}: {e}"
    if b.kind == KIND_PAGES:
        mv = memoryview(raw)
        for s in range(b.n_pages):
            if blake3.blake3(mv[s * PAGE_SIZE:(s + 1) * PAGE_SIZE]).digest(16) != b.ids[s * PAGE_ID_LEN:(s + 1) * PAGE_ID_LEN]:
                return f"page {s} of the blob at offset {off} fails its checksum"
    elif blake3.blake3(raw).digest() != b.ids:
        return f"data blob at offset {off} fails its checksum"
    return None


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
                if bh.kind == KIND_PAGES:
                    mv = memoryview(raw)
                    ids = b"".join(blake3.blake3(mv[s * PAGE_SIZE:(s + 1) * PAGE_SIZE]).digest(PAGE_ID_LEN)
                                   for s in range(bh.n_pages))
                else:
                    ids = blake3.blake3(raw).digest()
            h.update(data[off:off + BLOB_HEADER.size])
            h.update(ids)
        if ok:
            h.update(data[len(data) - PACK_TRAILER.size:])
            if h.digest() == ph:
                return True
    return blake3.blake3(data).digest() == ph      # a pack from before revision 1.2


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
        problem, note = locations.check(s, idx)
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
        present = set()
        pdir = root / "packs"
        for sub in sorted(os.listdir(pdir)):
            sp = pdir / sub
            if not sp.is_dir():
                rep.notes.append(f"unexpected file packs/{sub}")
                continue
            for f in os.listdir(sp):
                if HEX64.match(f) and f.startswith(sub):
                    present.add(bytes.fromhex(f))
                else:
                    rep.notes.append(f"unexpected file packs/{sub}/{f}")
        orphans = present - set(by_pack)
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
        need_end = max(idx.blobs[b].offset + BLOB_HEADER.size + idx.blobs[b].stored_len for b in bnos) + 16
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
