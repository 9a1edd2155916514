"""gpusnap repair: rebuild the repository index from what the packs say about themselves.

The model is restic's `repair index`: the packs are the truth, an index is only a cache of
them. Every pack is walked from its header to its trailer (blobs are self-describing,
docs/format.md §3). A pack's name is the blake3 of its descriptor (headers plus the ids of
its blobs), so the ids an index file claims for a pack are confirmed, without reading a
payload, when the descriptor built from them hashes to the pack's name. Otherwise (no
index names the pack, the claims disagree, a pack from before format revision 1.2, or
--read-data) every blob is decompressed and its ids are computed from its content; a blob
that does not decompress, or whose content no longer matches its name-confirmed ids, is
damaged and left out.

What changes (nothing with dry_run; nothing at all when the index already agrees with the
packs): ONE new index file for every good blob of every pack (temp, fsync, rename); then
every old index file goes: deleted when each of its records is in the new one, moved to
quarantine/ when it is damaged or names data the packs do not hold. No pack is ever
deleted or modified here, and a crash at any point leaves the old and new files side by side
(duplicates are legal). The report names every snapshot that still needs data no pack holds.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import ClassVar

import blake3

from gpusnap.repo import fsutil
from gpusnap.repo.codec import decompress
from gpusnap.repo.format import BLOB_HEADER, HEX64, PACK_HEADER, PACK_TRAILER, PACK_TRAILER_MAGIC, Blob, FormatError, IndexFile, pack_namer, parse_blob_header, parse_index, parse_pack_header
from gpusnap.repo.index import RepoIndex, encode_index_file, write_index_file
from gpusnap.repo.repository import QUARANTINE, Repository
from gpusnap.repo.store import decoded_ids, list_packs, pack_path
from gpusnap.repo.trust import quarantine_file


@dataclass
class RepairReport:
    QUARANTINE: ClassVar[str] = QUARANTINE   # where damaged index files go (render/maint.py says so)
    dry_run: bool = False
    read_data: bool = False
    packs_scanned: int = 0
    packs_confirmed: int = 0        # ids confirmed by the pack's name, no payload read
    packs_rehashed: int = 0         # ids computed from the decompressed content
    blobs_indexed: int = 0
    blobs_recovered: int = 0        # good blobs no valid index file listed
    blobs_damaged: int = 0
    records_dropped: int = 0        # index records naming data that is not in the packs
    problems: list[str] = field(default_factory=list)       # damaged packs, stray files
    index_written: str | None = None
    index_removed: list[str] = field(default_factory=list)      # superseded, all records confirmed
    index_quarantined: list[str] = field(default_factory=list)  # damaged, or naming missing data
    snapshots_damaged: dict[str, str] = field(default_factory=dict)   # still damaged after repair
    changed: bool = False

    @property
    def ok(self) -> bool:
        return not self.snapshots_damaged

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["ok"] = self.ok
        return d

# (pack, offset, kind, codec, n_pages, raw_len, stored_len, ids): one index record, as a key
def _key(ph, r) -> tuple:
    return (ph, r.offset, r.kind, r.codec, r.n_pages, r.raw_len, r.stored_len, bytes(r.ids))


def repair(repo: Repository, dry_run: bool = False, read_data: bool = False) -> RepairReport:
    """Rebuild the index from the packs (module docstring). Holds the writer lock, and (to
    change anything) the readers lock exclusively, as prune does."""
    rep = RepairReport(dry_run=dry_run, read_data=read_data)
    with repo.writer_lock(recover=not dry_run, exclusive=not dry_run, what="repair"), \
            (contextlib.nullcontext() if dry_run else repo.readers_lock(exclusive=True)):
        root = repo.path
        idir = root / "index"
        # 1. what the index files claim
        good_files: dict[str, list[tuple]] = {}     # name -> its record keys
        bad_files: list[str] = []
        claims: dict[bytes, dict[int, set]] = {}    # pack -> offset -> {(fields, ids)}
        for n in sorted(os.listdir(idir)):
            if n.startswith("."):
                continue
            try:
                if not HEX64.match(n):
                    raise FormatError("not an index file name")
                with open(idir / n, "rb") as f:
                    data = f.read()
                if data[-32:].hex() != n:
                    raise FormatError("file name is not its checksum")
                parsed = parse_index(data)
            except (OSError, FormatError) as e:
                bad_files.append(n)
                rep.problems.append(f"index file {n}: {e}")
                continue
            keys = []
            for b in parsed.blobs:
                k = _key(b.pack, b)
                keys.append(k)
                claims.setdefault(b.pack, {}).setdefault(b.offset, set()).add(k[2:])
            good_files[n] = keys
        # 2. what the packs hold
        new: dict[bytes, list[Blob]] = {}
        for ph in _pack_files(root, rep):
            rep.packs_scanned += 1
            recs = _scan_pack(root, ph, claims.get(ph, {}), read_data, rep)
            if recs:
                new[ph] = recs
        new_keys = {_key(ph, r) for ph, recs in new.items() for r in recs}
        old_keys = {k for keys in good_files.values() for k in keys}
        rep.blobs_indexed = len(new_keys)
        rep.blobs_recovered = len(new_keys - old_keys)
        rep.records_dropped = len(old_keys - new_keys)
        stale = [n for n, keys in good_files.items() if not set(keys) <= new_keys]
        rep.changed = bool(bad_files or stale or rep.blobs_recovered)
        if rep.changed:
            packs = [(ph, sorted(new[ph], key=lambda r: r.offset)) for ph in sorted(new)]
            name = encode_index_file(packs)[-32:].hex() if packs else None
            rep.index_written = name
            rep.index_quarantined = sorted(bad_files + stale)
            rep.index_removed = sorted(n for n in good_files if n not in stale and n != name)
            if not dry_run:
                if packs:
                    write_index_file(root, packs)
                for n in rep.index_quarantined:
                    quarantine_file(root, idir / n)
                for n in rep.index_removed:
                    fsutil.unlink_quiet(idir / n)
                fsutil.fsync_dir(idir)
                repo._index = None
        # 3. what is still lost
        if dry_run:
            idx = RepoIndex()
            for ph, recs in new.items():
                idx.add_file(ph.hex(), IndexFile([ph], recs))
        else:
            idx = repo.index(check_packs=True)
        rep.snapshots_damaged = repo.snapshots_missing_data(idx)
    return rep


def _pack_files(root, rep: RepairReport) -> list[bytes]:
    """Every pack file in packs/ab/; other entries are reported and left alone."""
    present, other = list_packs(root)
    rep.problems.extend(f"unexpected entry {p} (left alone)" for p in other)
    return present


def _walk(fd: int, size: int) -> tuple[list, str | None]:
    """[(offset, BlobHeader, header bytes)] of the blobs from the pack's header on, by their headers only
    (16-byte reads), and the first thing wrong with the pack's structure (None: well formed).
    A damaged header ends the walk: what comes before it is still usable."""
    try:
        parse_pack_header(os.pread(fd, PACK_HEADER.size, 0))
    except FormatError as e:
        return [], str(e)
    problem = None
    end = size - PACK_TRAILER.size
    n_blobs = None
    tr = os.pread(fd, PACK_TRAILER.size, end) if end >= PACK_HEADER.size else b""
    if len(tr) == PACK_TRAILER.size:
        magic, n, reserved = PACK_TRAILER.unpack(tr)
        if magic == PACK_TRAILER_MAGIC and not reserved:
            n_blobs = n
    if n_blobs is None:
        problem = "no pack trailer (truncated?)"
        end = size
    out = []
    pos = PACK_HEADER.size
    while pos < end:
        raw = os.pread(fd, BLOB_HEADER.size, pos)
        try:
            h = parse_blob_header(raw)
        except FormatError as e:
            return out, problem or f"blob header at offset {pos}: {e}"
        nxt = pos + BLOB_HEADER.size + h.stored_len
        if nxt > end:
            return out, problem or f"blob at offset {pos} runs past the end of the pack"
        out.append((pos, h, raw))
        pos = nxt
    if problem is None and n_blobs != len(out):
        problem = f"pack trailer says {n_blobs} blobs, found {len(out)}"
    return out, problem


def _scan_pack(root, ph: bytes, claimed: dict, read_data: bool, rep: RepairReport) -> list[Blob]:
    """The good blobs of one pack, with their ids (module docstring)."""
    name = ph.hex()
    try:
        fd = os.open(pack_path(root, ph), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as e:
        rep.problems.append(f"pack {name}: unreadable: {e}")
        return []
    try:
        size = os.fstat(fd).st_size
        walked, problem = _walk(fd, size)
        fields = [(h.kind, h.codec, h.n_pages, h.raw_len, h.stored_len) for _, h, _ in walked]
        # the ids the index files claim, where they agree and match the header
        claim_ids = []
        for (off, _h, _), f in zip(walked, fields):
            c = {k[5] for k in claimed.get(off, ()) if k[:5] == f}
            claim_ids.append(c.pop() if len(c) == 1 else None)
        confirmed = bool(problem is None and walked and all(i is not None for i in claim_ids)
                         and _descriptor(fd, size, walked, claim_ids) == ph)
        if confirmed and not read_data:
            rep.packs_confirmed += 1
            return [Blob(ph, off, h.kind, h.codec, h.n_pages, h.raw_len, h.stored_len, ids)
                    for (off, h, _), ids in zip(walked, claim_ids)]
        rep.packs_rehashed += 1
        out = []
        damaged = 0
        all_ids = []
        for (off, h, _), cid in zip(walked, claim_ids):
            payload = os.pread(fd, h.stored_len, off + BLOB_HEADER.size)
            try:
                raw = decompress(payload, h.codec, h.raw_len)
            except FormatError:
                damaged += 1
                all_ids.append(None)
                continue
            ids = decoded_ids(h.kind, h.n_pages, raw)
            all_ids.append(ids)
            if confirmed and ids != cid:
                damaged += 1          # the name commits to other content: this payload is damaged
                continue
            out.append(Blob(ph, off, h.kind, h.codec, h.n_pages, h.raw_len, h.stored_len, ids))
        rep.blobs_damaged += damaged
        if problem is None and not confirmed and walked and None not in all_ids:
            if _descriptor(fd, size, walked, all_ids) != ph and not _whole_file_name(fd, ph):
                problem = "contents do not match the pack's name"
        if problem or damaged:
            rep.problems.append(f"pack {name}: {problem or 'damaged'}"
                                + (f"; {damaged} damaged blob(s) left out" if damaged else "")
                                + f"; {len(out)} good blob(s) kept")
        return out
    finally:
        os.close(fd)


def _descriptor(fd: int, size: int, walked, ids_list) -> bytes:
    """The pack's name computed from its headers and the given ids (docs/format.md §3)."""
    h = pack_namer()
    for (_off, _bh, hdr), ids in zip(walked, ids_list):
        h.update(hdr)
        h.update(ids)
    h.update(os.pread(fd, PACK_TRAILER.size, size - PACK_TRAILER.size))
    return h.digest()


def _whole_file_name(fd: int, ph: bytes) -> bool:
    """A pack from before format revision 1.2: named by the blake3 of the whole file."""
    h = blake3.blake3()
    off = 0
    while True:
        b = os.pread(fd, 1 << 20, off)
        if not b:
            break
        h.update(b)
        off += len(b)
    return h.digest() == ph
