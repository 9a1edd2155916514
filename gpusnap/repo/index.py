"""The repository index in memory (RepoIndex: the union of index/*, docs/format.md §4) and
index files written: which blob of which pack holds each page and data blob."""

from __future__ import annotations

import os
from array import array
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpusnap.repo import fsutil
from gpusnap.repo.format import HEX64, INDEX_HEADER, INDEX_MAGIC, KIND_PAGES, Blob, FormatError, encode_index
from gpusnap.repo.format.index import IndexRecords, parse_index_records
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


def named_packs(root: Path) -> set[bytes]:
    """Every pack some index file in index/ names, from the files' headers alone (one whose
    header cannot be read is skipped; prune refuses to delete packs while one is damaged)."""
    out: set[bytes] = set()
    for n in os.listdir(root / "index"):
        if n.startswith("."):
            continue
        try:
            out.update(index_pack_names(root / "index" / n))
        except (OSError, FormatError):
            continue
    return out


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

class _StatFailed(Exception):
    """A pack's stat failed inside an index file's parse (args[0]: the OSError)."""


class BlobList(Sequence):
    """RepoIndex.blobs: the blob records by number. A file loaded in bulk is one segment of
    fixed-size records (format.index.IndexRecords): a blob asked for by number is built from
    its record (a dump asks for few: the old blobs its locations file names), and a segment
    asked for often becomes a list of format.Blobs; a file added as Blobs (add_file) is a
    segment that is a list. Iterating (verify, prune, usage) makes every segment a list, once."""

    def __init__(self):
        self._segs: list = []       # IndexRecords, or list[Blob] once built or added
        self._starts: list[int] = []
        self._hits: list[int] = []      # per segment: blobs built one by one so far
        self._len = 0
        self._flat: list | None = []    # all blobs in one list, while every segment is a list

    def __len__(self) -> int:
        return self._len

    def _add_records(self, recs: IndexRecords) -> None:
        if recs.n:
            self._segs.append(recs)
            self._starts.append(self._len)
            self._hits.append(0)
            self._len += recs.n
            self._flat = None

    def append(self, b: Blob) -> None:
        if not self._segs or not isinstance(self._segs[-1], list):
            self._segs.append([])
            self._starts.append(self._len)
            self._hits.append(0)
        self._segs[-1].append(b)
        self._len += 1
        if self._flat is not None:
            self._flat.append(b)

    def _seg(self, k: int) -> list:
        seg = self._segs[k]
        if not isinstance(seg, list):
            seg = self._segs[k] = seg.blobs()
        return seg

    def _all(self) -> list:
        if self._flat is None:
            flat: list = []
            for k in range(len(self._segs)):
                flat.extend(self._seg(k))
            self._flat = flat
        return self._flat

    def __getitem__(self, i):
        if self._flat is not None or isinstance(i, slice):
            return self._all()[i]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError("blob number out of range")
        k = bisect_right(self._starts, i) - 1
        seg = self._segs[k]
        if not isinstance(seg, list):
            self._hits[k] += 1
            if self._hits[k] <= seg.n >> 3:    # (all of them as Blobs costs ~8 single ones)
                return seg.blob(i - self._starts[k])
        return self._seg(k)[i - self._starts[k]]

    def fields(self, i: int) -> tuple:
        """Blob i's Blob.fields(), without building a Blob (and copying its ids) from a
        segment still in records."""
        if self._flat is not None:
            return self._flat[i].fields()
        if not 0 <= i < self._len:
            raise IndexError("blob number out of range")
        k = bisect_right(self._starts, i) - 1
        seg = self._segs[k]
        if not isinstance(seg, list):
            return seg.fields(i - self._starts[k])
        return seg[i - self._starts[k]].fields()

    def __iter__(self):
        return iter(self._all())


@dataclass
class RepoIndex:
    """Union of all index files: blobs, one record per blob (not per page; a BlobList);
    page ids -> blob_no << 8 | slot in a PageTable (page_table(), built on first use, in
    bulk); data_loc: blob id -> blob_no. The first index file (by name) to list an id wins."""

    blobs: BlobList = field(default_factory=BlobList)
    data_loc: dict = field(default_factory=dict)
    bad_files: dict = field(default_factory=dict)     # name -> reason
    # load(check_packs=True): pack -> names of the index files whose records were left out
    missing_packs: dict = field(default_factory=dict)   # ... because the pack is missing
    short_packs: dict = field(default_factory=dict)     # ... because it ends before the record
    _page_table: object = field(default=None, repr=False)

    def page_table(self):
        """The page locations as a pagetable.PageTable."""
        if self._page_table is None:
            from gpusnap.repo import native
            from gpusnap.repo.pipeline.pagetable import PageTable
            segs = list(zip(self.blobs._starts, self.blobs._segs))
            t = PageTable(hint=sum(seg.pages if isinstance(seg, IndexRecords) else
                                   sum(b.n_pages for b in seg if b.kind == KIND_PAGES) for _, seg in segs))
            for bno0, seg in segs:
                if isinstance(seg, IndexRecords):     # the ids gathered from the file in one call
                    ids, bases, counts, _ = native.index_runs(seg.data, seg.recs, seg.n, bno0, KIND_PAGES, seg.pages)
                    t.add_runs(ids, bases, counts)
                    continue
                step = 1 << 16                # blobs per call: bounds the joined ids (~16 MiB)
                for lo in range(0, len(seg), step):
                    part = [(bno, b) for bno, b in enumerate(seg[lo:lo + step], bno0 + lo) if b.kind == KIND_PAGES]
                    t.add_runs(b"".join(b.ids for _, b in part), [bno << 8 for bno, _ in part],
                               [b.n_pages for _, b in part])
            self._page_table = t
        return self._page_table

    @classmethod
    def load(cls, root: Path, names: list[str] | None = None, check_packs: bool = False) -> "RepoIndex":
        """The union of index files `names` (default: all of index/). With check_packs, a
        record whose pack is missing, or shorter than the record's end, is left out (and
        counted in missing_packs / short_packs): a dump must never deduplicate against data
        that is not there. Each file is parsed in bulk (format.index.parse_index_records)."""
        idx = cls()
        d = root / "index"
        if names is None:
            names = sorted(os.listdir(d))
        sizes: dict | None = {} if check_packs else None

        def pack_size(packs: list[bytes]) -> array:
            # one stat per pack not seen in an earlier file
            try:
                sizes.update(pack_sizes(root, [ph for ph in packs if ph not in sizes]))
            except OSError as e:      # not the index file's fault: raised from load
                raise _StatFailed(e) from e
            return array("q", [-1 if sizes[ph] is None else sizes[ph] for ph in packs])

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
                recs = parse_index_records(data, pack_size if check_packs else None)
            except _StatFailed as e:
                raise e.args[0] from None
            except FileNotFoundError:
                continue
            except (OSError, FormatError) as e:
                idx.bad_files[name] = str(e)
                continue
            idx._add_records(name, recs)
        return idx

    def _add_records(self, name: str, recs: IndexRecords) -> None:
        if self._page_table is not None:
            raise RuntimeError("add_file() after the page locations were built")
        for pno, flag in enumerate(recs.pack_flags[:len(recs.packs)]):
            if flag & 1:
                self.missing_packs.setdefault(recs.packs[pno], set()).add(name)
            if flag & 2:
                self.short_packs.setdefault(recs.packs[pno], set()).add(name)
        bno0 = len(self.blobs)
        if recs.n:
            from gpusnap.repo import native
            _, _, _, data_no = native.index_runs(recs.data, recs.recs, recs.n, bno0, KIND_PAGES, None)
            data_loc = self.data_loc
            for i in data_no:
                data_loc.setdefault(recs.blob(i).ids, bno0 + i)
        self.blobs._add_records(recs)

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
        for seg in self.blobs._segs:
            if isinstance(seg, IndexRecords):     # (the largest end per pack, from the parse)
                ends = [(ph, e) for ph, e in zip(seg.packs, seg.pack_end) if e]
            else:
                ends = [(b.pack, b.end) for b in seg]
            for ph, e in ends:
                if need.get(ph, 0) < e:
                    need[ph] = e
        sizes = pack_sizes(root, need)
        return all(sizes[ph] is not None and sizes[ph] >= end for ph, end in need.items())
