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

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # annotations only; numpy is imported where it is used
    import numpy as np

from gpusnap.repo import fsutil
from gpusnap.repo.format import KIND_PAGES, PAGE_ID_LEN, FormatError, iter_pagelist
from gpusnap.repo.format.locations import LOC_NAME, LOC_RUN, Locations, LocationsInvalid, encode_locations, image_digests

__all__ = ["MissingData", "Resolver", "build", "check_packs", "index_resolver", "preload_numpy", "refresh",
           "write_at_commit"]


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
    """Where pages and data blobs are. Pages: first the sorted table set by
    set_sorted_pages() (numpy, no per-page Python), then page_maps (dicts or
    pagetable.PageTables: page id -> blob_no << 8 | slot) in order. Data: data_maps (blob id -> blob_no) in order.
    blob(blob_no) -> its format.Blob record."""

    def __init__(self, page_maps: list, data_maps: list, blob: Callable[[int], tuple]):
        self.page_maps = page_maps
        self.data_maps = data_maps
        self.blob = blob
        self._hi = None

    def set_sorted_pages(self, ids: bytes, locs: np.ndarray) -> None:
        """ids: n*16 bytes of page ids, locs: their n locations."""
        import numpy as np
        k = np.frombuffer(ids, dtype="<u8").reshape(-1, 2)
        order = np.argsort(k[:, 0], kind="stable")
        self._hi = np.ascontiguousarray(k[order, 0])
        self._lo = np.ascontiguousarray(k[order, 1])
        self._locs = locs[order]

    def pages(self, ids: bytes) -> np.ndarray:
        """Locations of the n page ids in `ids` (n*16 bytes); -1 where unknown."""
        import numpy as np
        n = len(ids) // PAGE_ID_LEN
        out = np.full(n, -1, dtype=np.int64)
        todo = None
        if self._hi is not None and len(self._hi):
            q = np.frombuffer(ids, dtype="<u8").reshape(-1, 2)
            pos = np.searchsorted(self._hi, q[:, 0])
            np.minimum(pos, len(self._hi) - 1, out=pos)
            hit = (self._hi[pos] == q[:, 0]) & (self._lo[pos] == q[:, 1])
            out[hit] = self._locs[pos[hit]]
            todo = np.flatnonzero(~hit).tolist()   # (a 64-bit prefix shared by two ids lands here too)
            if not todo:
                return out
        if todo is None:
            todo = range(n)
        for m in self.page_maps:
            if hasattr(m, "get_many"):         # a pagetable.PageTable: one call for all
                sub = b"".join(ids[i * PAGE_ID_LEN:(i + 1) * PAGE_ID_LEN] for i in todo)
                found = np.frombuffer(m.get_many(sub), dtype=np.int64)
                hit = found >= 0
                sel = np.asarray(todo, dtype=np.int64)
                out[sel[hit]] = found[hit]
                todo = sel[~hit].tolist()
                if not todo:
                    break
                continue
            get = m.get
            left = []
            for i in todo:
                v = get(ids[i * PAGE_ID_LEN:(i + 1) * PAGE_ID_LEN])
                if v is None:
                    left.append(i)
                else:
                    out[i] = v
            todo = left
            if not todo:
                break
        if todo and self._hi is not None:      # prefix collisions: exact search among equal prefixes
            for i in todo:
                pid = ids[i * PAGE_ID_LEN:(i + 1) * PAGE_ID_LEN]
                h, l = np.frombuffer(pid, dtype="<u8")
                a, b = np.searchsorted(self._hi, h, "left"), np.searchsorted(self._hi, h, "right")
                for j in range(a, b):
                    if self._lo[j] == l:
                        out[i] = self._locs[j]
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
    import numpy as np          # (writing only: restore never imports numpy)
    packs: dict[bytes, int] = {}
    pack_list: list[list] = []            # [name, min size]
    runs = bytearray()
    table = []
    nruns = 0
    rpack = LOC_RUN.pack

    def add_run(bno, slot, count):
        nonlocal nruns
        b = res.blob(bno)
        pno = packs.get(b.pack)
        if pno is None:
            pno = packs[b.pack] = len(pack_list)
            pack_list.append([b.pack, 0])
        if pack_list[pno][1] < b.end:
            pack_list[pno][1] = b.end
        runs.extend(rpack(pno, b.offset, b.kind, b.codec, b.n_pages, b.raw_len, b.stored_len, slot, count))
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
                if (a < 0).any():
                    i = int(np.flatnonzero(a < 0)[0])
                    raise MissingData(f"page {ids[i * PAGE_ID_LEN:(i + 1) * PAGE_ID_LEN].hex()} has no location")
                # a run continues while the next page is the next slot of the same blob
                cont = np.empty(len(a), dtype=bool)
                cont[0] = length > 0 and a[0] == cur + length and (a[0] & 0xFF) != 0
                if len(a) > 1:
                    cont[1:] = (np.diff(a) == 1) & ((a[1:] & 0xFF) != 0)
                starts = np.flatnonzero(~cont)
                if len(starts) == 0:
                    length += len(a)
                    return
                s0 = int(starts[0])
                if length:
                    add_run(cur >> 8, cur & 0xFF, length + s0)
                bounds = starts.tolist() + [len(a)]
                vals = a[starts].tolist()
                for i in range(len(bounds) - 2):
                    v = vals[i]
                    add_run(v >> 8, v & 0xFF, bounds[i + 1] - bounds[i])
                cur = vals[-1]
                length = len(a) - bounds[-2]

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
                    # a page record is as short as the data between two zero pages: numpy
                    # pays per call, so records are resolved together, RESOLVE_BATCH pages
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
    return Resolver([idx.page_table()], [idx.data_loc], idx.blobs.__getitem__)


def preload_numpy() -> None:
    """Import numpy (~0.1 s) in a background thread while the dump streams, so that
    write_at_commit() finds it loaded instead of importing it on the commit path. The
    import lock makes a concurrent `import numpy` wait for this one."""
    # numpy's OpenBLAS starts a thread per core that spins after use; gpusnap does no linear
    # algebra and its cores belong to CRIU and the page pipeline (read once, at load time)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

    def run():
        try:
            import numpy  # noqa: F401
        except BaseException:       # write_at_commit's own import reports it
            pass
    threading.Thread(target=run, name="gpusnap-preload-numpy", daemon=True).start()


def write_at_commit(writer, packs: list) -> int:
    """SnapshotWriter.commit() hook: write tmpdir/locations for the images of this dump
    (old pages from the index the dump started with, new ones from `packs`, the packs
    just written). -> its size in bytes."""
    import numpy as np          # (writing only: restore never imports numpy)
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

    def blob(bno):
        return new_blobs[bno - base] if bno >= base else old[bno]

    res = Resolver([writer.known_pages], [writer.known_data, new_data], blob)
    if page_ids:
        counts = np.array(page_counts, dtype=np.int64)
        starts = np.cumsum(counts) - counts
        total = int(counts.sum())
        slots = np.arange(total, dtype=np.int64) - np.repeat(starts, counts)
        locs = (np.repeat(np.array(page_bnos, dtype=np.int64), counts) << 8) | slots
        res.set_sorted_pages(b"".join(page_ids), locs)
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
