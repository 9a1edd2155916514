"""The repository index in memory (RepoIndex: the union of index/*, docs/format.md §4) and
index files written: which blob of which pack holds each page and data blob."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from gpusnap.repo import fsutil
from gpusnap.repo.format import HEX64, INDEX_HEADER, INDEX_MAGIC, KIND_PAGES, Blob, FormatError, encode_index, parse_index
from gpusnap.repo.store import pack_sizes


def encode_index_file(packs: list[tuple[bytes, list]]) -> bytes:
    """The index file (docs/format.md §4) covering `packs` ([(pack hash, [blob records])])."""
    names = []
    blobs = []
    for ph, recs in packs:
        if any(r.pack != ph for r in recs):
            raise ValueError("a blob record filed under a pack it does not name")
        names.append(ph)
        blobs.extend(recs)
    return encode_index(names, blobs)


def write_index_file(root: Path, packs: list[tuple[bytes, list]], on_name=None) -> tuple[Path, int] | None:
    """Write one index file covering `packs` ([(pack hash, [blob records])]); -> (path, size).
    on_name(path) is called with the final path before anything is written (so that an
    abort can tell whether the index got there, SnapshotWriter._abort)."""
    if not packs:
        return None
    data = encode_index_file(packs)
    dest = root / "index" / data[-32:].hex()
    if on_name is not None:
        on_name(dest)
    fsutil.write_file_atomic(root / "tmp", dest, data)
    return dest, len(data)


def index_pack_names(path: Path) -> list[bytes]:
    """The pack names an index file lists, from its header alone (no checksum check: a
    cheap look for recovery; the full parse checks everything). Raises OSError, FormatError."""
    with open(path, "rb") as f:
        head = f.read(INDEX_HEADER.size)
        if len(head) < INDEX_HEADER.size:
            raise FormatError("index file too short")
        magic, _version, _flags, n_packs, _n_blobs = INDEX_HEADER.unpack(head)
        if magic != INDEX_MAGIC:
            raise FormatError("bad index magic")
        raw = f.read(32 * n_packs)
    if len(raw) != 32 * n_packs:
        raise FormatError("index file too short for its pack list")
    return [raw[i:i + 32] for i in range(0, len(raw), 32)]


# =====================================================================================
# the in-memory index
# =====================================================================================

@dataclass
class RepoIndex:
    """Union of all index files: blobs, one format.Blob record per blob (not per page);
    page ids -> blob_no << 8 | slot in a PageTable (page_table(), built on first use, in
    bulk); data_loc: blob id -> blob_no. The first index file (by name) to list an id wins."""

    blobs: list[Blob] = field(default_factory=list)
    data_loc: dict = field(default_factory=dict)
    bad_files: dict = field(default_factory=dict)     # name -> reason
    # load(check_packs=True): pack -> names of the index files whose records were left out
    missing_packs: dict = field(default_factory=dict)   # ... because the pack is missing
    short_packs: dict = field(default_factory=dict)     # ... because it ends before the record
    _page_table: object = field(default=None, repr=False)

    def page_table(self):
        """The page locations as a pagetable.PageTable."""
        if self._page_table is None:
            from gpusnap.repo.pipeline.pagetable import PageTable
            t = PageTable(hint=sum(b.n_pages for b in self.blobs if b.kind == KIND_PAGES))
            step = 1 << 16                # blobs per call: bounds the joined ids (~16 MiB)
            for lo in range(0, len(self.blobs), step):
                part = [(bno, b) for bno, b in enumerate(self.blobs[lo:lo + step], lo) if b.kind == KIND_PAGES]
                t.add_runs(b"".join(b.ids for _, b in part), [bno << 8 for bno, _ in part],
                           [b.n_pages for _, b in part])
            self._page_table = t
        return self._page_table

    @classmethod
    def load(cls, root: Path, names: list[str] | None = None, check_packs: bool = False) -> "RepoIndex":
        """The union of index files `names` (default: all of index/). With check_packs, a
        record whose pack is missing, or shorter than the record's end, is left out (and
        counted in missing_packs / short_packs): a dump must never deduplicate against data
        that is not there."""
        idx = cls()
        d = root / "index"
        if names is None:
            names = sorted(os.listdir(d))
        sizes = None
        if check_packs:       # the pack lists first (file headers), so files are parsed one at a time
            packs: set = set()
            for name in names:
                if HEX64.match(name):
                    try:
                        packs.update(index_pack_names(d / name))
                    except (OSError, FormatError):
                        pass          # reported by the parse below
            sizes = pack_sizes(root, packs)
        for name in names:
            if name.startswith("."):
                continue
            if not HEX64.match(name):
                idx.bad_files[name] = "unexpected file in index/"
                continue
            try:
                with open(d / name, "rb") as f:
                    data = f.read()
                if len(data) >= 32 and data[-32:].hex() != name:
                    raise FormatError("file name is not its checksum")
                parsed = parse_index(data)
            except FileNotFoundError:
                continue
            except (OSError, FormatError) as e:
                idx.bad_files[name] = str(e)
                continue
            if sizes is not None:
                for ph in parsed.packs:
                    if ph not in sizes:       # (the file changed between the two reads)
                        sizes.update(pack_sizes(root, [ph]))
            idx.add_file(name, parsed, sizes)
        return idx

    def add_file(self, name, parsed, sizes: dict | None = None) -> None:
        """Add one parsed index file; with `sizes` (pack -> size, None = missing), records
        whose data is not in the pack are left out (load(check_packs=True))."""
        if self._page_table is not None:
            raise RuntimeError("add_file() after the page locations were built")
        data_loc = self.data_loc
        for b in parsed.blobs:
            if sizes is not None:
                size = sizes.get(b.pack)
                if size is None:
                    self.missing_packs.setdefault(b.pack, set()).add(name)
                    continue
                if b.end > size:
                    self.short_packs.setdefault(b.pack, set()).add(name)
                    continue
            bno = len(self.blobs)
            self.blobs.append(b)
            if b.kind != KIND_PAGES:
                data_loc.setdefault(b.ids, bno)

    def packs_present(self, root: Path) -> bool:
        """Is every pack this index uses still there and long enough? (one stat per pack)"""
        need: dict[bytes, int] = {}
        for b in self.blobs:
            if need.get(b.pack, 0) < b.end:
                need[b.pack] = b.end
        sizes = pack_sizes(root, need)
        return all(sizes[ph] is not None and sizes[ph] >= end for ph, end in need.items())
