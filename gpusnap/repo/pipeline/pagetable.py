"""Page id -> location tables for a dump: the repository's known pages and the pages a dump
claims, held in native code (native/pages/gs_table.c through gpusnap/repo/native.py).

A location is an int >= 0 (blob_no << 8 | slot, docs/format.md); -1 means absent. Ids are
16-byte page ids. The table costs ~32 bytes per page (a dict would cost ~110) and is filled
a blob at a time (one call per blob instead of an insert per page). The tests compare it
with a dict-based reference (tests/page_reference.py).
"""

from __future__ import annotations

import ctypes
from array import array

from gpusnap.repo import native

ID_LEN = native.ID_LEN
CLAIMED = 0      # the value claim() stores: claimed pages have no location until commit
_ONE = ctypes.c_int64 * 1


def _check_ids(ids, n: int | None = None) -> int:
    if len(ids) % ID_LEN or (n is not None and len(ids) < n * ID_LEN):
        raise ValueError("ids must be whole 16-byte page ids")
    return len(ids) // ID_LEN if n is None else n


class PageTable:
    """id -> location, the first location added for an id wins (like dict.setdefault)."""

    def __init__(self, hint: int = 0):
        self._t = None                   # set first: __del__ runs even when table_new raises
        self._t = native.table_new(hint)

    def __del__(self):
        t, self._t = getattr(self, "_t", None), None
        if t:
            native.table_free(t)

    def __len__(self) -> int:
        return native.table_len(self._t)

    def nbytes(self) -> int:
        """Memory held by the table."""
        return native.table_bytes(self._t)

    def add_run(self, ids, base: int, n: int | None = None) -> int:
        """ids[i] -> base + i for each 16-byte id in `ids` (the first n), unless present.
        -> how many were added."""
        n = _check_ids(ids, n)
        if base < 0:
            raise ValueError("locations are >= 0")
        if not n:
            return 0
        return native.table_add_run(self._t, ids, n, base)

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
        ba = array("q", bases)
        ca = array("I", counts)
        return native.table_add_runs(self._t, ids, len(bases), ba.buffer_info()[0], ca.buffer_info()[0])

    def get(self, key, default=None):
        """One id's location, or default (the dict interface, for per-page callers)."""
        if len(key) != ID_LEN:
            return default
        out = _ONE()
        native.table_get(self._t, key, 1, ctypes.addressof(out))
        return default if out[0] < 0 else out[0]

    def __contains__(self, key) -> bool:
        return self.get(key) is not None

    def get_many(self, ids) -> array:
        """Locations of the ids in `ids` (n*16 bytes), -1 where absent: array('q')."""
        n = _check_ids(ids)
        out = array("q", bytes(8 * n))
        if n:
            native.table_get(self._t, ids, n, out.buffer_info()[0])
        return out

    def fill(self, ids, out: array) -> int:
        """For each i with out[i] < 0, out[i] = the location of id i of `ids` (n*16 bytes)
        where the table has it (a second table completes a first one's get_many()).
        out: array('q') of n entries. -> how many are still < 0."""
        n = _check_ids(ids)
        if not isinstance(out, array) or out.typecode != "q" or len(out) != n:
            raise ValueError("out must be an array('q') with one entry per id")
        if not n:
            return 0
        return native.table_fill(self._t, ids, n, out.buffer_info()[0])


def claim(known: PageTable | None, claimed: PageTable, kinds, ids, npages: int) -> list[int]:
    """The dedup decision for a batch: indices i < npages (kinds[i] != 0) whose id is in
    neither table, in order; they are added to `claimed` (as CLAIMED). An id twice in the
    batch is new the first time only. Thread-safe: the native tables lock, so of two sinks
    claiming one id, one gets it."""
    _check_ids(ids, npages)
    if len(kinds) < npages:
        raise ValueError("kinds shorter than npages")
    if not npages:
        return []
    out = array("I", bytes(4 * npages))
    r = native.table_claim(known._t if known is not None else None, claimed._t, kinds, ids, npages,
                           CLAIMED, out.buffer_info()[0])
    return out[:r].tolist()
