"""The pure-Python reference of gpusnap's native page functions (gpusnap/repo/native.py,
native/pages/) and of its page table (gpusnap/repo/pipeline/pagetable.py): the test oracle
the native results are compared with. Written for clarity, not speed; gpusnap never runs it.
"""

from __future__ import annotations

import math

import blake3

from gpusnap.repo.native import ID_LEN, PAGE_SIZE, check_planes

_ZP = bytes(PAGE_SIZE)


# -- pages -------------------------------------------------------------------------------------
def scan(buf, npages: int) -> tuple[bytearray, bytearray, int]:
    if len(buf) < npages * PAGE_SIZE:
        raise ValueError("buffer shorter than npages pages")
    buf = bytes(memoryview(buf)[:npages * PAGE_SIZE])
    kinds = bytearray(npages)
    ids = bytearray(npages * ID_LEN)
    nd = 0
    for i in range(npages):
        page = buf[i * PAGE_SIZE:(i + 1) * PAGE_SIZE]
        if page == _ZP:
            continue
        kinds[i] = 1
        nd += 1
        ids[i * ID_LEN:(i + 1) * ID_LEN] = blake3.blake3(page).digest(ID_LEN)
    return kinds, ids, nd


def verify(buf, npages: int, ids, kinds=None) -> int:
    if len(buf) < npages * PAGE_SIZE or len(ids) < npages * ID_LEN or (kinds is not None and len(kinds) < npages):
        raise ValueError("buffer, ids or kinds shorter than npages")
    mv = memoryview(buf)
    idv = memoryview(ids)
    for i in range(npages):
        if kinds is not None and not kinds[i]:
            continue
        if blake3.blake3(mv[i * PAGE_SIZE:(i + 1) * PAGE_SIZE]).digest(ID_LEN) != idv[i * ID_LEN:(i + 1) * ID_LEN]:
            return i
    return -1


# -- byte shuffle and plane entropy ------------------------------------------------------------
def shuffle(data, k: int) -> bytes:
    if k not in (2, 4):
        raise ValueError("element size must be 2 or 4")
    b = bytes(data)
    end = len(b) // k * k
    return b"".join([b[i:end:k] for i in range(k)]) + b[end:]


def unshuffle(data, k: int) -> bytes:
    if k not in (2, 4):
        raise ValueError("element size must be 2 or 4")
    b = bytes(data)
    m = len(b) // k
    out = bytearray(len(b))
    for i in range(k):
        out[i:m * k:k] = b[i * m:(i + 1) * m]
    out[m * k:] = b[m * k:]
    return bytes(out)


def plane_bits(buf, plane_stride: int, nplanes: int, step: int, count: int) -> list[int]:
    """The formula of gs_plane_bits, step by step in the same order (same doubles)."""
    check_planes(buf, plane_stride, nplanes, step, count)
    mv = bytes(buf)
    res = []
    for p in range(nplanes):
        if not count:
            res.append(8000)
            continue
        o = p * plane_stride
        hist = [0] * 256
        for x in mv[o:o + (count - 1) * step + 1:step]:
            hist[x] += 1
        acc = 0.0
        for c in hist:
            if c > 1:
                acc += float(c) * math.log2(float(c))
        bits = math.log2(float(count)) - acc / float(count)
        res.append(min(max(int(bits * 1000.0), 0), 8000))
    return res


# -- the page table ------------------------------------------------------------------------------
def _check_ids(ids, n: int | None = None) -> int:
    if len(ids) % ID_LEN or (n is not None and len(ids) < n * ID_LEN):
        raise ValueError("ids must be whole 16-byte page ids")
    return len(ids) // ID_LEN if n is None else n


class DictPageTable:
    """pagetable.PageTable's interface on a dict: the first location added for an id wins."""

    def __init__(self, hint: int = 0):
        self.d: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self.d)

    def add_run(self, ids, base: int, n: int | None = None) -> int:
        n = _check_ids(ids, n)
        if base < 0:
            raise ValueError("locations are >= 0")
        before = len(self.d)
        for i in range(n):
            self.d.setdefault(bytes(ids[i * ID_LEN:(i + 1) * ID_LEN]), base + i)
        return len(self.d) - before

    def add_runs(self, ids, bases: list[int], counts: list[int]) -> int:
        if len(bases) != len(counts) or any(c < 0 for c in counts):
            raise ValueError("bases and counts differ in length, or a count is negative")
        _check_ids(ids, sum(counts))
        if any(b < 0 for b in bases):
            raise ValueError("locations are >= 0")
        added = o = 0
        for b, c in zip(bases, counts):
            added += self.add_run(ids[o * ID_LEN:(o + c) * ID_LEN], b, c)
            o += c
        return added

    def get(self, key, default=None):
        return self.d.get(bytes(key), default) if len(key) == ID_LEN else default

    def __contains__(self, key) -> bool:
        return self.get(key) is not None

    def get_many(self, ids) -> list[int]:
        n = _check_ids(ids)
        return [self.d.get(bytes(ids[i * ID_LEN:(i + 1) * ID_LEN]), -1) for i in range(n)]


def claim(known: DictPageTable | None, claimed: DictPageTable, kinds, ids, npages: int) -> list[int]:
    """pagetable.claim on dict tables (single-threaded)."""
    _check_ids(ids, npages)
    if len(kinds) < npages:
        raise ValueError("kinds shorter than npages")
    kd = known.d if known is not None else {}
    new = []
    for i in range(npages):
        pid = bytes(ids[i * ID_LEN:(i + 1) * ID_LEN])
        if kinds[i] and pid not in kd and pid not in claimed.d:
            claimed.d[pid] = 0
            new.append(i)
    return new
