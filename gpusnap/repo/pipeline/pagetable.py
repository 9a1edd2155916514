"""Page id -> location tables for a dump: the repository's known pages and the pages a dump
claims, in native code (native/pages/gs_table.c) with a dict fallback that gives the same
results.

A location is an int >= 0 (blob_no << 8 | slot, docs/format.md); -1 means absent. Ids are
16-byte page ids. The native table costs ~32 bytes per page instead of ~110 for a dict,
and is filled a blob at a time (one call per blob instead of a dict insert per page).
"""

from __future__ import annotations

import ctypes
from array import array

from gpusnap.repo import native

ID_LEN = native.ID_LEN
_lib = native._lib if native.available() and hasattr(native._lib, "gs_table_new") else None
if _lib is not None:
    _vp, _sz, _i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64
    _lib.gs_table_new.argtypes = [_sz]
    _lib.gs_table_new.restype = _vp
    _lib.gs_table_free.argtypes = [_vp]
    _lib.gs_table_free.restype = None
    _lib.gs_table_len.argtypes = _lib.gs_table_bytes.argtypes = [_vp]
    _lib.gs_table_len.restype = _lib.gs_table_bytes.restype = _sz
    _lib.gs_table_add_run.argtypes = [_vp, _vp, _sz, _i64]
    _lib.gs_table_add_run.restype = ctypes.c_long
    _lib.gs_table_add_runs.argtypes = [_vp, _vp, _sz, _vp, _vp]
    _lib.gs_table_add_runs.restype = ctypes.c_long
    _lib.gs_table_get.argtypes = [_vp, _vp, _sz, _vp]
    _lib.gs_table_get.restype = None
    _lib.gs_table_claim.argtypes = [_vp, _vp, _vp, _vp, _sz, _i64, _vp]
    _lib.gs_table_claim.restype = ctypes.c_long


def native_available() -> bool:
    return _lib is not None


def _check_ids(ids, n: int | None = None) -> int:
    if len(ids) % ID_LEN or (n is not None and len(ids) < n * ID_LEN):
        raise ValueError("ids must be whole 16-byte page ids")
    return len(ids) // ID_LEN if n is None else n


class PageTable:
    """id -> location, the first location added for an id wins (like dict.setdefault)."""

    def __init__(self, hint: int = 0, native_: bool | None = None):
        use = _lib is not None if native_ is None else native_
        if use and _lib is None:
            raise RuntimeError("native page table unavailable: " + (native.why_unavailable() or "old library"))
        self._t = None
        self._d: dict | None = None
        if use:
            self._t = _lib.gs_table_new(hint)
            if not self._t:
                raise MemoryError("page table")
        else:
            self._d = {}

    @property
    def is_native(self) -> bool:
        return self._t is not None

    def __del__(self):
        t, self._t = getattr(self, "_t", None), None
        if t and _lib is not None:
            _lib.gs_table_free(t)

    def __len__(self) -> int:
        return _lib.gs_table_len(self._t) if self._t else len(self._d)

    def nbytes(self) -> int:
        """Memory held by the table (native), or an estimate for the dict."""
        if self._t:
            return _lib.gs_table_bytes(self._t)
        return len(self._d) * 110

    def add_run(self, ids, base: int, n: int | None = None) -> int:
        """ids[i] -> base + i for each 16-byte id in `ids` (the first n), unless present.
        -> how many were added."""
        n = _check_ids(ids, n)
        if base < 0:
            raise ValueError("locations are >= 0")
        if not n:
            return 0
        if self._t:
            a, keep = native._addr(ids)
            r = _lib.gs_table_add_run(self._t, a, n, base)
            del keep
            if r < 0:
                raise MemoryError("page table")
            return r
        d = self._d
        before = len(d)
        setd = d.setdefault
        for i in range(n):
            setd(bytes(ids[i * ID_LEN:(i + 1) * ID_LEN]), base + i)
        return len(d) - before

    def add_runs(self, ids, bases: list[int], counts: list[int]) -> int:
        """Several add_run()s in one call: run r is the next counts[r] ids of `ids`,
        mapped to bases[r], bases[r] + 1, ... -> how many were added."""
        if len(bases) != len(counts) or any(c < 0 for c in counts):
            raise ValueError("bases and counts differ in length, or a count is negative")
        total = sum(counts)
        _check_ids(ids, total)
        if any(b < 0 for b in bases):
            raise ValueError("locations are >= 0")
        if not total:
            return 0
        if self._t:
            ba = array("q", bases)
            ca = array("I", counts)
            a, keep = native._addr(ids)
            r = _lib.gs_table_add_runs(self._t, a, len(bases), ba.buffer_info()[0], ca.buffer_info()[0])
            del keep
            if r < 0:
                raise MemoryError("page table")
            return r
        added = 0
        o = 0
        for b, c in zip(bases, counts):
            added += self.add_run(ids[o * ID_LEN:(o + c) * ID_LEN], b, c)
            o += c
        return added

    def get(self, key, default=None):
        """One id's location, or default (the dict interface, for per-page callers)."""
        if self._t:
            if len(key) != ID_LEN:
                return default
            out = _ONE()
            a, keep = native._addr(key)
            _lib.gs_table_get(self._t, a, 1, out)
            del keep
            return default if out[0] < 0 else out[0]
        return self._d.get(key, default)

    def __contains__(self, key) -> bool:
        return self.get(key) is not None

    def get_many(self, ids) -> array:
        """Locations of the ids in `ids` (n*16 bytes), -1 where absent: array('q')."""
        n = _check_ids(ids)
        out = array("q", bytes(8 * n))
        if not n:
            return out
        if self._t:
            a, keep = native._addr(ids)
            oa, _ = out.buffer_info()
            _lib.gs_table_get(self._t, a, n, oa)
            del keep
            return out
        get = self._d.get
        for i in range(n):
            out[i] = get(bytes(ids[i * ID_LEN:(i + 1) * ID_LEN]), -1)
        return out


_ONE = ctypes.c_int64 * 1
CLAIMED = 0      # the value claim() stores: claimed pages have no location until commit


def claim(known: PageTable | None, claimed: PageTable, kinds, ids, npages: int) -> list[int]:
    """The dedup decision for a batch: indices i < npages (kinds[i] != 0) whose id is in
    neither table, in order; they are added to `claimed`. An id twice in the batch is new
    the first time only. Thread-safe (the native tables lock; the dict path runs under the
    GIL in one piece of bytecode per page, see below)."""
    _check_ids(ids, npages)
    if len(kinds) < npages:
        raise ValueError("kinds shorter than npages")
    if not npages:
        return []
    if claimed._t and (known is None or known._t):
        ka, kkeep = native._addr(kinds)
        ia, ikeep = native._addr(ids)
        out = array("I", bytes(4 * npages))
        oa, _ = out.buffer_info()
        r = _lib.gs_table_claim(known._t if known is not None else None, claimed._t, ka, ia,
                                npages, CLAIMED, oa)
        del kkeep, ikeep
        if r < 0:
            raise MemoryError("page table")
        return out[:r].tolist()
    if claimed._t or (known is not None and known._t):
        raise ValueError("claim() needs two native tables or two dict tables")
    kd = known._d if known is not None else {}
    # setdefault is atomic under the GIL: of two sinks claiming one id, one gets it
    claim_ = claimed._d.setdefault
    mine = object()
    new = []
    for i in range(npages):
        if not kinds[i]:
            continue
        pid = bytes(ids[i * ID_LEN:(i + 1) * ID_LEN])
        if pid in kd:
            continue
        if claim_(pid, mine) is mine:
            claimed._d[pid] = CLAIMED
            new.append(i)
    return new
