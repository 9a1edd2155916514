"""Locations files made and kept (docs/format.md §5.4): the resolver (page id -> blob and
slot), build() (a snapshot's runs from its page lists), the dump's commit hook, prune's
refresh, and the check that a file's packs are all there.

Restore reads a snapshot through this file instead of the repository index (repo/reader.py):
the runs are read in pieces with pread alongside the page lists, so restore needs neither
the index in memory nor any lookup per page. The file is derived data: it is written at
commit (from the dump's in-memory index), rewritten by prune before it deletes or replaces
any pack a snapshot still needs; when it is missing, damaged or names a pack that is gone,
a reader builds one in memory from the index (Snapshot.reading_locations). Nothing read
through it is trusted: every page and blob is still checked against its id.
"""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import Callable

from gpusnap.repo import fsutil, native
from gpusnap.repo.format import BLOB_HEADER, KIND_PAGES, PACK_TRAILER, PAGE_ID_LEN, FormatError, iter_pagelist
from gpusnap.repo.format.locations import LOC_NAME, LOC_RUN, Locations, LocationsInvalid, encode_locations, image_digests

__all__ = ["MissingData", "Resolver", "build", "check_packs", "index_resolver", "refresh", "write_at_commit"]


def check_packs(loc: Locations, root: Path) -> None:
    """Every pack the file names exists and is long enough; else LocationsInvalid
    (stale: prune replaced a pack this file was written against)."""
    from gpusnap.repo.store import pack_sizes
    need = list(loc.iter_packs())
    sizes = pack_sizes(root, [name for name, _ in need])
    for name, end in need:
        if sizes[name] is None:
            raise LocationsInvalid(f"pack {name.hex()[:16]} is gone (stale locations file)")
        if sizes[name] < end:
            raise LocationsInvalid(f"pack {name.hex()[:16]} shorter than the locations file says")


class Resolver:
    """Where pages and data blobs are. Pages: page_maps (pagetable.PageTables, or dicts:
    page id -> blob_no << 8 | slot) asked in order, the first that has an id wins; the
    native tables answer a whole batch without Python per page. Data: data_maps (blob id ->
    blob_no) in order. fields(blob_no) -> that blob's format.Blob.fields(): all a run needs,
    read from an index still in records without building its Blob (index.BlobList.fields)."""

    def __init__(self, page_maps: list, data_maps: list, fields: Callable[[int], tuple]):
        self.page_maps = page_maps
        self.data_maps = data_maps
        self.fields = fields

    def pages(self, ids: bytes) -> array:
        """Locations of the n page ids in `ids` (n*16 bytes): array('q'), -1 where unknown."""
        n = len(ids) // PAGE_ID_LEN
        out = array("q", [-1]) * n
        left = n
        for m in self.page_maps:
            if not left:
                break
            if hasattr(m, "fill"):             # a pagetable.PageTable: one call for all
                left = m.fill(ids, out)
                continue
            get = m.get
            left = 0
            for i in range(n):
                if out[i] < 0:
                    v = get(ids[i * PAGE_ID_LEN:(i + 1) * PAGE_ID_LEN])
                    if v is None:
                        left += 1
                    else:
                        out[i] = v
        return out

    def data(self, bid: bytes):
        for m in self.data_maps:
            b = m.get(bid)
            if b is not None:
                return b
        return None


class MissingData(Exception):
    pass


RESOLVE_BATCH = 1 << 16   # pages whose locations are looked up in one pass (1 MiB of ids)


def build(snap_dir: Path, images: list[dict], res: Resolver) -> bytes:
    """The locations file of a snapshot whose page lists are in snap_dir and whose manifest
    images (manifest order) are `images`. Raises MissingData if an id has no location."""
    packs: dict[bytes, int] = {}
    pack_list: list[list] = []            # [name, min size]
    runs = bytearray()
    table = []
    nruns = 0
    rpack = LOC_RUN.pack
    fields = res.fields
    over = BLOB_HEADER.size + PACK_TRAILER.size      # a blob's end (Blob.end) past offset + stored_len

    def add_run(bno, slot, count):
        # (per run, ~2x10^4 per GiB of random pages: no Blob built, no attribute lookups)
        nonlocal nruns
        pack, offset, kind, codec, n_pages, raw_len, stored_len = fields(bno)
        pno = packs.get(pack)
        if pno is None:
            pno = packs[pack] = len(pack_list)
            pack_list.append([pack, 0])
        end = offset + stored_len + over
        ent = pack_list[pno]
        if ent[1] < end:
            ent[1] = end
        runs.extend(rpack(pno, offset, kind, codec, n_pages, raw_len, stored_len, slot, count))
        nruns += 1

    def add_data(bid):
        bno = res.data(bid)
        if bno is None:
            raise MissingData(f"blob {bid.hex()[:16]} has no location")
        add_run(bno, 0, 1)

    for im in images:
        first = nruns
        if im["type"] == "blob":
            for bh in im["blobs"]:
                add_data(bytes.fromhex(bh))
        else:
            cur = -2                      # pending run: start loc, length
            length = 0
            pending: list[bytes] = []     # ids of page records not resolved yet
            npending = 0

            def resolve(ids):
                """Extend the pending run / add runs for the pages `ids` (n*16 bytes)."""
                nonlocal cur, length
                a = res.pages(ids)
                starts, k = native.run_starts(a, cur, length)
                if k < 0:
                    i = -1 - k
                    raise MissingData(f"page {ids[i * PAGE_ID_LEN:(i + 1) * PAGE_ID_LEN].hex()} has no location")
                if k == 0:                    # every page continues the pending run
                    length += len(a)
                    return
                if length:
                    add_run(cur >> 8, cur & 0xFF, length + starts[0])
                for j in range(k - 1):
                    v = a[starts[j]]
                    add_run(v >> 8, v & 0xFF, starts[j + 1] - starts[j])
                cur = a[starts[k - 1]]
                length = len(a) - starts[k - 1]

            with open(Path(snap_dir) / im["pagelist"], "rb", buffering=1 << 20) as f:
                for rec in iter_pagelist(f.read, im["size"]):
                    if rec[0] == "zero":
                        continue              # zero pages have no location: runs go on
                    if rec[0] == "tail":
                        if pending:
                            resolve(b"".join(pending))
                            pending, npending = [], 0
                        if length:
                            add_run(cur >> 8, cur & 0xFF, length)
                            length = 0
                        add_data(rec[2])
                        continue
                    # a page record is as short as the data between two zero pages: each
                    # lookup pays per call, so records are resolved together, RESOLVE_BATCH pages
                    # at a time (the result is the same)
                    pending.append(rec[1])
                    npending += len(rec[1])
                    if npending >= RESOLVE_BATCH * PAGE_ID_LEN:
                        resolve(b"".join(pending))
                        pending, npending = [], 0
            if pending:
                resolve(b"".join(pending))
            if length:
                add_run(cur >> 8, cur & 0xFF, length)
        table.append((bytes.fromhex(im["digest"]), first, nruns - first))
    return encode_locations(pack_list, table, runs, nruns)


def index_resolver(idx) -> Resolver:
    """A Resolver over a store.RepoIndex."""
    return Resolver([idx.page_table()], [idx.data_loc], idx.blobs.fields)


def write_at_commit(writer, packs: list) -> int:
    """SnapshotWriter.commit() hook: write tmpdir/locations for the images of this dump
    (old pages from the index the dump started with, new ones from `packs`, the packs
    just written). -> its size in bytes."""
    from gpusnap.repo.pipeline import pagetable     # (the dump has it loaded; restore never needs it)
    idx = writer.index
    base = len(idx.blobs)
    new_blobs: list = []
    new_data: dict = {}
    page_ids: list[bytes] = []
    page_bnos: list[int] = []
    page_counts: list[int] = []
    for _ph, recs in packs:
        for r in recs:
            bno = base + len(new_blobs)
            new_blobs.append(r)
            if r.kind == KIND_PAGES:
                page_ids.append(r.ids)
                page_bnos.append(bno)
                page_counts.append(r.n_pages)
            else:
                new_data.setdefault(r.ids, bno)
    old = idx.blobs

    def fields(bno):
        return new_blobs[bno - base].fields() if bno >= base else old.fields(bno)

    maps = [writer.known_pages]
    if page_ids:            # new pages: asked first (a page is new or known, never both)
        new_pages = pagetable.PageTable(sum(page_counts))
        new_pages.add_runs(b"".join(page_ids), [b << 8 for b in page_bnos], page_counts)
        maps.insert(0, new_pages)
    res = Resolver(maps, [writer.known_data, new_data], fields)
    images = [writer.images[k] for k in sorted(writer.images)]
    data = build(writer.tmpdir, images, res)
    fsutil.write_private(writer.tmpdir / LOC_NAME, data)
    return len(data)


def refresh(repo, snapshots: list, idx, live: set | None, fault=lambda s: None) -> int:
    """Prune hook: (re)write the locations file of every snapshot in `snapshots` whose file
    is missing, unusable, or names a pack outside `live` (None: any pack not present),
    from `idx` (a RepoIndex describing exactly the packs that will remain). Each file is
    replaced atomically. -> number of files written."""
    root = repo.path
    res = index_resolver(idx)
    n = 0
    for s in snapshots:
        ok = True
        try:
            loc = Locations.open(s.path, image_digests(s.manifest))
            try:
                if live is None:
                    check_packs(loc, root)
                else:
                    ok = all(name in live for name, _ in loc.iter_packs())
            finally:
                loc.close()
        except LocationsInvalid:
            ok = False
        if ok:
            continue
        try:
            data = build(s.path, s.manifest["images"], res)
        except (MissingData, FormatError, OSError):
            continue          # the snapshot cannot be located; verify reports it, restore uses the index
        fsutil.write_file_atomic(root / "tmp", s.path / LOC_NAME, data)
        n += 1
        fault("locations-one")
    return n
