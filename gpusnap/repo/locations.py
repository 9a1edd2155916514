"""Per-snapshot locations files (docs/format.md §5.4): where every page and data blob of a
snapshot lies (pack, blob, slot), in the order the images need them.

Restore reads a snapshot through this file instead of the repository index: the runs are
read in pieces with pread alongside the page lists, so restore needs neither the index in
memory nor any lookup per page, and its memory does not depend on the size of the
snapshot or of the repository. The file is derived data: it is written at commit (from
the dump's in-memory index), rewritten by prune before it deletes or replaces any pack a
snapshot still needs, and ignored (restore falls back to the index) when it is missing,
damaged or names a pack that is gone. Nothing read through it is trusted: every page and
blob is still checked against its id from the page list / manifest.
"""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import blake3

if TYPE_CHECKING:  # annotations only; numpy is imported where it is used
    import numpy as np

from gpusnap.errors import CorruptSnapshot
from gpusnap.repo import fsutil
from gpusnap.repo.format import BLOB_HEADER, KIND_DATA, KIND_PAGES, PAGE_ID_LEN, PAGE_SIZE, FormatError, check_blob_fields, iter_pagelist

LOC_NAME = "locations"
LOC_MAGIC = b"GSNLOC\x00\x00"
LOC_VERSION = 1
LOC_HEADER = struct.Struct("<8sHHIIIQ")        # magic, version, flags, n_images, n_packs, reserved, n_runs (32)
LOC_PACK = struct.Struct("<32sQ")              # pack name, min size (40)
LOC_IMAGE = struct.Struct("<32sQQ")            # image digest, first run, run count (48)
LOC_RUN = struct.Struct("<IIBBHIIHH")          # pack_no, offset, kind, codec, n_pages, raw_len, stored_len, slot, count (24)
RUN_PIECE = 4096                               # runs read per pread (96 KiB)
HASH_PIECE = 1 << 20
MAX_IMAGES = 1 << 20


class LocationsInvalid(FormatError):
    """The locations file cannot be used (missing, damaged, stale); restore uses the index."""


# =====================================================================================
# reading
# =====================================================================================

class Locations:
    """An opened, checked locations file. Thread-safe: every read is a pread on one fd
    (kept open, so a file replaced by prune after the check is never mixed in)."""

    def __init__(self, pread, fd: int, size: int, n_packs: int, images: list[tuple[int, int]], packs_off: int,
                 runs_off: int):
        self._pr = pread
        self.fd = fd
        self.size = size
        self.n_packs = n_packs
        self.images = images            # per manifest image: (first run, run count)
        self.packs_off = packs_off
        self.runs_off = runs_off

    # -- opening -------------------------------------------------------------------------
    @classmethod
    def open(cls, snap_dir: Path, digests: list[bytes]) -> "Locations":
        """Open and check snapshot_dir/locations against the manifest's image digests
        (manifest order). Raises LocationsInvalid."""
        try:
            fd = os.open(Path(snap_dir) / LOC_NAME, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise LocationsInvalid("no locations file") from None
        except OSError as e:
            raise LocationsInvalid(f"locations file unreadable: {e}") from None
        try:
            size = os.fstat(fd).st_size
            return cls.parse(lambda n, off: os.pread(fd, n, off), size, digests, fd)
        except OSError as e:
            os.close(fd)
            raise LocationsInvalid(f"locations file unreadable: {e}") from None
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def parse(cls, pread: Callable[[int, int], bytes], size: int, digests: list[bytes], fd: int = -1) -> "Locations":
        """Check header, checksum, binding to the images and every run's fields (the file is
        read twice, in pieces: hash, then runs). Raises LocationsInvalid."""
        if size < LOC_HEADER.size + 32:
            raise LocationsInvalid("locations file too short")
        hdr = pread(LOC_HEADER.size, 0)
        if len(hdr) != LOC_HEADER.size:
            raise LocationsInvalid("locations file truncated")
        magic, version, flags, n_images, n_packs, reserved, n_runs = LOC_HEADER.unpack(hdr)
        if magic != LOC_MAGIC:
            raise LocationsInvalid("bad locations magic")
        if version != LOC_VERSION or flags or reserved:
            raise LocationsInvalid(f"unsupported locations version {version}/flags {flags}")
        if n_images != len(digests) or n_images > MAX_IMAGES:
            raise LocationsInvalid("locations file lists a different number of images")
        packs_off = LOC_HEADER.size
        images_off = packs_off + n_packs * LOC_PACK.size
        runs_off = images_off + n_images * LOC_IMAGE.size
        if runs_off + n_runs * LOC_RUN.size + 32 != size:
            raise LocationsInvalid("locations file size does not match its counts")
        # checksum, in pieces
        h = blake3.blake3()
        end = size - 32
        pos = 0
        while pos < end:
            b = pread(min(HASH_PIECE, end - pos), pos)
            if not b:
                raise LocationsInvalid("locations file truncated")
            h.update(b)
            pos += len(b)
        if pread(32, end) != h.digest():
            raise LocationsInvalid("locations file checksum mismatch")
        # images: bound to the manifest, runs tile [0, n_runs)
        raw = pread(n_images * LOC_IMAGE.size, images_off)
        images = []
        nxt = 0
        for i, (dg, first, cnt) in enumerate(LOC_IMAGE.iter_unpack(raw)):
            if dg != digests[i]:
                raise LocationsInvalid("locations file belongs to other images")
            if first != nxt or cnt > n_runs - first:
                raise LocationsInvalid("locations image table malformed")
            images.append((first, cnt))
            nxt = first + cnt
        if nxt != n_runs:
            raise LocationsInvalid("locations image table does not cover the runs")
        loc = cls(pread, fd, size, n_packs, images, packs_off, runs_off)
        for i in range(n_images):          # every run's fields, in pieces
            for _ in loc.iter_runs(i):
                pass
        return loc

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:   # noqa: BLE001
            pass

    def _pread(self, n: int, off: int) -> bytes:
        b = self._pr(n, off)
        if len(b) != n:
            raise LocationsInvalid("locations file truncated")
        return b

    # -- packs -----------------------------------------------------------------------------
    def pack(self, pack_no: int) -> tuple[bytes, int]:
        """(pack name, min size)."""
        return LOC_PACK.unpack(self._pread(LOC_PACK.size, self.packs_off + pack_no * LOC_PACK.size))

    def iter_packs(self) -> Iterator[tuple[bytes, int]]:
        for o in range(0, self.n_packs, RUN_PIECE):
            k = min(RUN_PIECE, self.n_packs - o)
            yield from LOC_PACK.iter_unpack(self._pread(k * LOC_PACK.size, self.packs_off + o * LOC_PACK.size))

    def check_packs(self, root: Path) -> None:
        """Every pack the file names exists and is long enough; else LocationsInvalid
        (stale: prune replaced a pack this file was written against)."""
        from gpusnap.repo.store import pack_path
        for name, need in self.iter_packs():
            try:
                st = os.stat(pack_path(root, name))
            except OSError:
                raise LocationsInvalid(f"pack {name.hex()[:16]} is gone (stale locations file)") from None
            if st.st_size < need:
                raise LocationsInvalid(f"pack {name.hex()[:16]} shorter than the locations file says")

    # -- runs ------------------------------------------------------------------------------
    def iter_runs(self, image_no: int) -> Iterator[tuple]:
        """(pack_no, offset, kind, codec, n_pages, raw_len, stored_len, slot, count) of one
        image, checked field by field."""
        first, cnt = self.images[image_no]
        n_packs = self.n_packs
        for o in range(0, cnt, RUN_PIECE):
            k = min(RUN_PIECE, cnt - o)
            raw = self._pread(k * LOC_RUN.size, self.runs_off + (first + o) * LOC_RUN.size)
            for r in LOC_RUN.iter_unpack(raw):
                pack_no, offset, kind, codec, n_pages, raw_len, stored_len, slot, count = r
                try:
                    check_blob_fields(kind, codec, n_pages, raw_len, stored_len)
                except FormatError as e:
                    raise LocationsInvalid(f"locations run malformed: {e}") from None
                if pack_no >= n_packs or offset < 16 or offset + BLOB_HEADER.size + stored_len + 16 > 1 << 32:
                    raise LocationsInvalid("locations run out of range")
                if kind == KIND_PAGES:
                    if count < 1 or slot + count > n_pages:
                        raise LocationsInvalid("locations run slots out of range")
                elif slot != 0 or count != 1:
                    raise LocationsInvalid("locations data run malformed")
                yield r


def image_digests(manifest: dict) -> list[bytes]:
    return [bytes.fromhex(im["digest"]) for im in manifest["images"]]


# =====================================================================================
# restore through a locations file
# =====================================================================================

from gpusnap.repo.format import _ONES, _ZCHUNK, _ZIDS, _ZKINDS, _ZVIEW, READ_CHUNK


class RunReader:
    """Reads the blobs runs point to (one per reading thread): open pack fds and a small
    FIFO of decompressed blobs, keyed by (pack_no, offset)."""

    def __init__(self, root: Path, loc: Locations, cache_blobs: int = 32):
        from gpusnap.repo.store import BlobReader
        self.loc = loc
        self.br = BlobReader(root, None, cache_blobs=0)
        self.cache: dict = {}
        self.cache_blobs = cache_blobs
        self.names: dict[int, bytes] = {}

    def close(self) -> None:
        self.br.close()
        self.cache.clear()

    def pack_name(self, pack_no: int) -> bytes:
        n = self.names.get(pack_no)
        if n is None:
            if len(self.names) >= 64:
                self.names.clear()
            n = self.names[pack_no] = self.loc.pack(pack_no)[0]
        return n

    def get(self, r) -> bytes:
        key = (r[0], r[1])
        c = self.cache
        data = c.get(key)
        if data is not None:
            return data
        from gpusnap.repo.store import BlobLoc
        data = self.br.read_raw(BlobLoc(self.pack_name(r[0]), r[1], r[2], r[3], r[4], r[5], r[6], b""))
        if len(c) >= self.cache_blobs:
            del c[next(iter(c))]
        c[key] = data
        return data


def read_image(snap, im: dict, loc: Locations, image_no: int) -> Iterator[bytes]:
    """The bytes of one image rebuilt from its runs, in chunks of at most 1 MiB (like
    Snapshot._read_image, which is the index-based equivalent)."""
    reader = RunReader(snap.repo.path, loc)
    runs = loc.iter_runs(image_no)
    name = im["name"]

    def next_run(kind):
        try:
            r = next(runs)
        except StopIteration:
            raise snap._corrupt(f"locations file ends before image {name} does") from None
        except LocationsInvalid as e:
            raise snap._corrupt(f"locations file of {name}: {e}") from None
        if r[2] != kind:
            raise snap._corrupt(f"locations file of {name} disagrees with its page list")
        return r

    def blob(r):
        try:
            return reader.get(r)
        except FileNotFoundError:
            raise snap._corrupt(f"{name}: pack missing", reader.pack_name(r[0])) from None
        except (OSError, FormatError) as e:
            raise snap._corrupt(f"{name}: {e}", reader.pack_name(r[0])) from None

    def data_blob(bid: bytes) -> bytes:
        r = next_run(KIND_DATA)
        data = blob(r)
        if blake3.blake3(data).digest() != bid:
            raise snap._corrupt(f"blob {bid.hex()[:16]} of {name} fails its checksum", reader.pack_name(r[0]))
        return data

    try:
        if im["type"] == "blob":
            h = blake3.blake3()
            n = 0
            for bh in im["blobs"]:
                data = data_blob(bytes.fromhex(bh))
                reader.cache.clear()
                n += len(data)
                if n > im["size"]:
                    raise snap._corrupt(f"image {name} longer than recorded")
                h.update(data)
                for o in range(0, len(data), READ_CHUNK):
                    yield data[o:o + READ_CHUNK]
            if n != im["size"] or h.hexdigest() != im["digest"]:
                raise snap._corrupt(f"image {name} does not match its recorded size/checksum")
        else:
            yield from _read_pages(snap, name, runs, next_run, blob, data_blob)
        try:
            next(runs)
        except StopIteration:
            pass
        except LocationsInvalid as e:
            raise snap._corrupt(f"locations file of {name}: {e}") from None
        else:
            raise snap._corrupt(f"locations file has more runs than image {name} needs")
    finally:
        reader.close()


def _read_pages(snap, name, runs, next_run, blob, data_blob):
    from gpusnap.repo import native
    verify = native.verify
    out: list = []
    outn = 0
    ids_parts: list = []
    kinds = bytearray()
    has_data = False
    curv = None
    pos = left = 0
    limit = READ_CHUNK

    def finish():
        data = out[0] if len(out) == 1 and type(out[0]) is bytes else b"".join(out)
        if has_data:
            bad = verify(data, len(kinds), b"".join(ids_parts), kinds)
            if bad >= 0:
                raise snap._corrupt(f"a page of {name} fails its checksum")
        return data

    for rec in snap.iter_page_refs(name):
        kind = rec[0]
        if kind == "pages":
            ids = rec[1]
            n = len(ids) // PAGE_ID_LEN
            o = 0
            while o < n:
                take = min((limit - outn) // PAGE_SIZE, n - o)
                if take <= 0:
                    take = n - o
                ids_parts.append(ids[o * PAGE_ID_LEN:(o + take) * PAGE_ID_LEN])
                kinds += _ONES[:take] if take <= len(_ONES) else b"\x01" * take
                has_data = True
                need = take
                while need:
                    if not left:
                        r = next_run(KIND_PAGES)
                        curv = memoryview(blob(r))
                        pos = r[7] * PAGE_SIZE
                        left = r[8]
                    k = need if need < left else left
                    out.append(curv[pos:pos + k * PAGE_SIZE])
                    pos += k * PAGE_SIZE
                    left -= k
                    need -= k
                outn += take * PAGE_SIZE
                o += take
                if outn >= limit:
                    yield finish()
                    out, outn, ids_parts, kinds, has_data = [], 0, [], bytearray(), False
        elif kind == "zero":
            rem = rec[1] * PAGE_SIZE
            while rem:
                k = min(rem, limit - outn)
                if k <= 0:
                    k = rem
                out.append(_ZCHUNK if k == READ_CHUNK else (_ZVIEW[:k] if k < READ_CHUNK else bytes(k)))
                ids_parts.append(_ZIDS[:k // PAGE_SIZE * PAGE_ID_LEN] if k <= READ_CHUNK else bytes(k // PAGE_SIZE * PAGE_ID_LEN))
                kinds += _ZKINDS[:k // PAGE_SIZE] if k <= READ_CHUNK else bytes(k // PAGE_SIZE)
                outn += k
                rem -= k
                if outn >= limit:
                    yield finish()
                    out, outn, ids_parts, kinds, has_data = [], 0, [], bytearray(), False
        else:
            if left:
                raise snap._corrupt(f"locations file of {name} disagrees with its page list")
            data = data_blob(rec[2])
            if len(data) != rec[1]:
                raise snap._corrupt(f"tail of {name} has the wrong length")
            out.append(data)
            outn += len(data)
    if left:
        raise snap._corrupt(f"locations file of {name} disagrees with its page list")
    if out:
        yield finish()


# =====================================================================================
# writing
# =====================================================================================

class Resolver:
    """Where pages and data blobs are. Pages: first the sorted table set by
    set_sorted_pages() (numpy, no per-page Python), then page_maps (dicts or
    pagetable.PageTables: page id -> blob_no << 8 | slot) in order. Data: data_maps (blob id -> blob_no) in order.
    blob(blob_no) -> (pack name, offset, kind, codec, n_pages, raw_len, stored_len)."""

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
        ph, off, kind, codec, n_pages, raw_len, stored_len = res.blob(bno)
        pno = packs.get(ph)
        if pno is None:
            pno = packs[ph] = len(pack_list)
            pack_list.append([ph, 0])
        end = off + BLOB_HEADER.size + stored_len + 16
        if pack_list[pno][1] < end:
            pack_list[pno][1] = end
        runs.extend(rpack(pno, off, kind, codec, n_pages, raw_len, stored_len, slot, count))
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
    parts = [LOC_HEADER.pack(LOC_MAGIC, LOC_VERSION, 0, len(images), len(pack_list), 0, nruns)]
    parts.extend(LOC_PACK.pack(ph, size) for ph, size in pack_list)
    parts.extend(LOC_IMAGE.pack(*t) for t in table)
    parts.append(bytes(runs))
    body = b"".join(parts)
    return body + blake3.blake3(body).digest()


def index_resolver(idx) -> Resolver:
    """A Resolver over a store.RepoIndex."""
    blobs = idx.blobs

    def blob(bno):
        b = blobs[bno]
        return (b.pack, b.offset, b.kind, b.codec, b.n_pages, b.raw_len, b.stored_len)
    return Resolver([idx.page_table()], [idx.data_loc], blob)


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
    new_blobs: list[tuple] = []
    new_data: dict = {}
    page_ids: list[bytes] = []
    page_bnos: list[int] = []
    page_counts: list[int] = []
    for ph, recs in packs:
        for r in recs:
            bno = base + len(new_blobs)
            new_blobs.append((ph, r.offset, r.kind, r.codec, r.n_pages, r.raw_len, r.stored_len))
            if r.kind == KIND_PAGES:
                page_ids.append(r.ids)
                page_bnos.append(bno)
                page_counts.append(r.n_pages)
            else:
                new_data.setdefault(r.ids, bno)
    old = idx.blobs

    def blob(bno):
        if bno >= base:
            return new_blobs[bno - base]
        b = old[bno]
        return (b.pack, b.offset, b.kind, b.codec, b.n_pages, b.raw_len, b.stored_len)

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
                    loc.check_packs(root)
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


def check(snap, idx) -> tuple[str | None, str | None]:
    """For verify: -> (problem, note). problem: the locations file is usable but disagrees
    with the index (a restore would fail); note: missing/unusable/stale (a restore uses
    the index instead)."""
    try:
        loc = Locations.open(snap.path, image_digests(snap.manifest))
    except LocationsInvalid as e:
        return None, f"snapshot {snap.path.name}: locations file not used ({e}); restore reads through the index"
    try:
        try:
            loc.check_packs(snap.repo.path)
        except LocationsInvalid as e:
            return None, f"snapshot {snap.path.name}: locations file not used ({e}); restore reads through the index"
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

