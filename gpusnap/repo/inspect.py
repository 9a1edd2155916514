"""Per-snapshot page statistics and repository usage (for `gpusnap inspect` and `gpusnap ls`)."""

from __future__ import annotations

from .format import BLOB_HEADER, PAGE_ID_LEN
from .repository import Repository, Snapshot


def _id_costs(repo: Repository):
    """-> function id -> stored bytes attributed to it (a page's share of its blob)."""
    idx = repo._load_index()

    def cost(key: bytes) -> float:
        if len(key) == PAGE_ID_LEN:
            loc = idx.page_loc.get(key)
            if loc is None:
                return 0.0
            b = idx.blobs[loc >> 8]
            return (BLOB_HEADER.size + b.stored_len) / b.n_pages
        bno = idx.data_loc.get(key)
        if bno is None:
            return 0.0
        b = idx.blobs[bno]
        return float(BLOB_HEADER.size + b.stored_len)
    return cost


def repo_usage(repo: Repository) -> dict:
    """{snapshot dir name: {id, name, created, bytes_raw, bytes_unique, bytes_shared}}.

    Stored bytes of a page are its share of the compressed blob holding it; a page or blob
    referenced by one snapshot only is "unique" (prune of that snapshot frees it), one
    referenced by several is "shared". Metadata (page lists, manifests, index) is not counted."""
    snaps = repo.snapshots()
    refs: list[set] = []
    count: dict[bytes, int] = {}
    for s in snaps:
        pages, data = s.referenced_ids()
        ids = pages | data
        refs.append(ids)
        for k in ids:
            count[k] = count.get(k, 0) + 1
    cost = _id_costs(repo)
    out = {}
    for s, ids in zip(snaps, refs):
        uniq = shared = 0.0
        for k in ids:
            c = cost(k)
            if count[k] == 1:
                uniq += c
            else:
                shared += c
        out[s.path.name] = {"id": s.id, "name": s.name, "created": s.created,
                            "bytes_raw": s.stats.get("bytes_raw", 0),
                            "bytes_stored_at_dump": s.stats.get("bytes_stored", 0),
                            "bytes_unique": int(uniq), "bytes_shared": int(shared)}
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


def render(report: dict, console) -> None:
    """Human-readable form of inspect_snapshot()'s report (console: anything with print())."""
    def human(n):
        n = float(n)
        for u in ("B", "KiB", "MiB", "GiB", "TiB"):
            if n < 1024 or u == "TiB":
                return f"{n:.1f} {u}" if u != "B" else f"{int(n)} B"
            n /= 1024
    r = report
    console.print(f"snapshot {r['snapshot']}  id {r['id']}  name {r['name']}")
    console.print(f"pages: {r['pages_total']} total, {r['pages_zero']} zero, {r['pages_dedup']} deduplicated, "
                  f"{r['pages_compressed']} compressed, {r['pages_raw']} raw")
    ratio = r["bytes_stored"] / r["bytes_raw"] if r["bytes_raw"] else 0
    console.print(f"bytes: {human(r['bytes_raw'])} from CRIU, {human(r['bytes_stored'])} stored by this dump "
                  f"({ratio:.1%}); now {human(r['bytes_unique'])} unique, {human(r['bytes_shared'])} shared")
    for im in r["images"]:
        if im["type"] == "pages":
            console.print(f"  {im['name']}: {human(im['size'])}, {im['pages']} pages ({im['pages_zero']} zero, "
                          f"{im['pages_dedup']} dedup, {im['pages_compressed']} compressed, {im['pages_raw']} raw)")
        else:
            console.print(f"  {im['name']}: {human(im['size'])}")
