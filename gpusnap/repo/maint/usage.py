"""Per-snapshot page statistics and repository usage (for `gpusnap inspect` and `gpusnap ls`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpusnap.repo.format import BLOB_HEADER, KIND_PAGES

if TYPE_CHECKING:
    from gpusnap.repo.repository import Repository, Snapshot


def repo_usage(repo: Repository) -> dict:
    """{snapshot dir name: {id, name, created, bytes_raw, bytes_unique, bytes_shared}}.

    Stored bytes of a page are its share of the compressed blob holding it; a page or blob
    referenced by one snapshot only is "unique" (prune of that snapshot frees it), one
    referenced by several is "shared". Metadata (page lists, manifests, index) is not counted.

    Page ids are handled as numpy arrays of 16-byte values (sorted, counted, looked up in the
    index's page table in bulk): 16 bytes per page reference instead of a Python set entry."""
    import numpy as np
    snaps = repo.snapshots()
    idx = repo.index()
    table = idx.page_table()
    blob_cost = np.array([(BLOB_HEADER.size + b.stored_len) / max(b.n_pages, 1) if b.kind == KIND_PAGES
                          else float(BLOB_HEADER.size + b.stored_len) for b in idx.blobs] or [0.0])
    page_sets = []
    data_sets = []
    for s in snaps:
        raw, data = s.referenced_page_bytes()
        page_sets.append(np.unique(np.frombuffer(raw, dtype="V16")))
        data_sets.append(data)
    # how many snapshots reference each page id / data blob id
    if page_sets:
        all_ids, counts = np.unique(np.concatenate(page_sets), return_counts=True)
    else:
        all_ids, counts = np.array([], dtype="V16"), np.array([], dtype=np.int64)
    data_count: dict[bytes, int] = {}
    for d in data_sets:
        for k in d:
            data_count[k] = data_count.get(k, 0) + 1
    out = {}
    for s, ids, data in zip(snaps, page_sets, data_sets):
        uniq = shared = 0.0
        if len(ids):
            locs = np.frombuffer(table.get_many(ids.tobytes()), dtype=np.int64)
            cost = np.where(locs >= 0, blob_cost[np.maximum(locs, 0) >> 8], 0.0)
            single = counts[np.searchsorted(all_ids, ids)] == 1
            uniq += float(cost[single].sum())
            shared += float(cost[~single].sum())
        for k in data:
            bno = idx.data_loc.get(k)
            c = float(blob_cost[bno]) if bno is not None else 0.0
            if data_count[k] == 1:
                uniq += c
            else:
                shared += c
        out[s.path.name] = {"id": s.id, "name": s.name, "created": s.created,
                            "bytes_raw": s.stats.get("bytes_raw", 0),
                            "bytes_stored_at_dump": s.stats.get("bytes_stored", 0),
                            "bytes_unique": int(round(uniq)), "bytes_shared": int(round(shared))}
    return out


def snapshot_stats(repo: Repository, snap: Snapshot, usage: dict | None = None) -> dict:
    """Page statistics of one snapshot: totals recorded at dump time, per image rows, and
    how much of it is shared with other snapshots now."""
    st = snap.stats
    images = []
    for im in snap.manifest["images"]:
        row = {"name": im["name"], "type": im["type"], "size": im["size"]}
        if im["type"] == "pages":
            for k in ("pages", "pages_zero", "pages_dedup", "pages_compressed", "pages_raw"):
                row[k] = im.get(k, 0)
        else:
            row["blobs"] = len(im["blobs"])
        images.append(row)
    u = (usage or repo_usage(repo)).get(snap.path.name, {})
    return {
        "snapshot": str(snap.path), "id": snap.id, "name": snap.name, "created": snap.created,
        "meta": snap.meta,
        "pages_total": st.get("pages_total", 0), "pages_zero": st.get("pages_zero", 0),
        "pages_dedup": st.get("pages_dedup", 0), "pages_compressed": st.get("pages_compressed", 0),
        "pages_raw": st.get("pages_raw", 0),
        "bytes_raw": st.get("bytes_raw", 0), "bytes_stored": st.get("bytes_stored", 0),
        "bytes_unique": u.get("bytes_unique", 0), "bytes_shared": u.get("bytes_shared", 0),
        "images": images,
    }


def inspect_snapshot(repo: Repository, snap: Snapshot) -> dict:
    """The report behind `gpusnap inspect` (JSON-ready)."""
    return snapshot_stats(repo, snap)


def repo_totals(repo: Repository, usage: dict) -> dict:
    """Repository totals for `gpusnap ls`: snapshots, bytes CRIU produced for all of them, and
    what the repository holds on disk (packs, index, snapshot metadata), hence the saving."""
    import os

    def tree_bytes(sub: str) -> int:
        total = 0
        for dp, _dn, fns in os.walk(repo.path / sub):
            for f in fns:
                try:
                    total += os.lstat(os.path.join(dp, f)).st_size
                except OSError:
                    pass
        return total

    packs, index, snaps = tree_bytes("packs"), tree_bytes("index"), tree_bytes("snapshots")
    raw = sum(int(r.get("bytes_raw", 0)) for r in usage.values())
    stored = packs + index + snaps
    return {"snapshots": len(usage), "names": len({r.get("name") for r in usage.values()}),
            "bytes_raw": raw, "bytes_stored": stored, "bytes_packs": packs, "bytes_index": index,
            "bytes_metadata": snaps, "ratio": round(stored / raw, 4) if raw else None}
