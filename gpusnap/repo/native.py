"""The page pipeline's hot loop in native code (native/pages/gs_pages.c), with a pure-Python
fallback that gives identical results.

    scan(buf, npages)         -> (kinds, ids, ndata): kinds[i] 0 = zero page, 1 = data page;
                                 ids[16*i:16*i+16] = blake3-128 of data page i (zeros for zero pages)
    verify(buf, npages, ids, kinds=None)
                              -> index of the first page whose blake3-128 is not its id, or -1;
                                 pages with kinds[i] == 0 are not checked
    shuffle(data, k)          -> bytes: byte planes of k-byte elements (k = 2 or 4), the last
                                 len % k bytes unchanged after them (native/pages/gs_shuffle.c)
    unshuffle(data, k)        -> bytes: the inverse
    plane_bits(buf, plane_stride, nplanes, step, count)
                              -> sampled order-0 entropy (milli-bits per byte) of each plane:
                                 plane p's samples are buf[p*plane_stride + j*step], j < count

The library is found at $GPUSNAP_NATIVE_LIB, else <source root>/build/lib/libgpusnap_pages.so,
else /usr/local/lib/gpusnap/libgpusnap_pages.so. GPUSNAP_NATIVE=0 forces the Python path.
ctypes releases the GIL for the duration of each call, so pages images of different
processes (and the stages of one image's pipeline) run on different cores.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import blake3

PAGE_SIZE = 4096
ID_LEN = 16
_ZP = bytes(PAGE_SIZE)

_LIB_NAME = "libgpusnap_pages.so"
_lib = None
_load_error: str | None = None
lib_path: str | None = None


def _candidates() -> list[str]:
    env = os.environ.get("GPUSNAP_NATIVE_LIB")
    if env:
        return [env]
    from gpusnap.system.paths import source_root

    root = source_root()
    return [str(root / "build" / "lib" / _LIB_NAME), f"/usr/local/lib/gpusnap/{_LIB_NAME}"]


def _load():
    global _lib, _load_error, lib_path
    if os.environ.get("GPUSNAP_NATIVE", "1") == "0":
        _load_error = "disabled by GPUSNAP_NATIVE=0"
        return
    errors = []
    for p in _candidates():
        if not os.path.exists(p):
            errors.append(f"{p}: not found")
            continue
        try:
            lib = ctypes.CDLL(p)
            if lib.gs_abi_version() != 2:
                errors.append(f"{p}: ABI version {lib.gs_abi_version()}, expected 2")
                continue
            if lib.gs_selftest() != 0:
                errors.append(f"{p}: self test failed (page ids differ from blake3)")
                continue
        except (OSError, AttributeError) as e:
            errors.append(f"{p}: {e}")
            continue
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.gs_scan.argtypes = [vp, sz, vp, vp]
        lib.gs_scan.restype = sz
        lib.gs_verify.argtypes = [vp, sz, vp, vp]
        lib.gs_verify.restype = ctypes.c_long
        lib.gs_hash_pages.argtypes = [vp, sz, vp]
        lib.gs_hash_pages.restype = None
        if hasattr(lib, "gs_shuffle"):      # absent in libraries built before the shuffle codecs
            ui = ctypes.c_uint
            lib.gs_shuffle.argtypes = lib.gs_unshuffle.argtypes = [vp, sz, ui, vp, ui]
            lib.gs_shuffle.restype = lib.gs_unshuffle.restype = ctypes.c_int
            lib.gs_plane_bits.argtypes = [vp, sz, ui, sz, sz, vp]
            lib.gs_plane_bits.restype = ctypes.c_int
            lib.gs_shuffle_simd.argtypes = []
            lib.gs_shuffle_simd.restype = ctypes.c_int
        _lib, lib_path = lib, p
        return
    _load_error = "; ".join(errors)


_load()


def available() -> bool:
    return _lib is not None


def why_unavailable() -> str | None:
    return None if _lib is not None else _load_error


def _addr(buf) -> tuple[int, object]:
    """Address of a readable buffer (bytes, bytearray, memoryview) and an object keeping it alive."""
    if type(buf) is bytes:
        return ctypes.cast(ctypes.c_char_p(buf), ctypes.c_void_p).value, buf
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise ValueError("buffer is not contiguous")
    if mv.readonly:
        b = bytes(mv)       # ctypes cannot take the address of a read-only view; copy
        return ctypes.cast(ctypes.c_char_p(b), ctypes.c_void_p).value, b
    c = (ctypes.c_char * mv.nbytes).from_buffer(mv)
    return ctypes.addressof(c), c


# -- native ---------------------------------------------------------------------------------
def scan_native(buf, npages: int) -> tuple[bytearray, bytearray, int]:
    if len(buf) < npages * PAGE_SIZE:
        raise ValueError("buffer shorter than npages pages")
    kinds = bytearray(npages)
    ids = bytearray(npages * ID_LEN)
    a, keep = _addr(buf)
    kc = (ctypes.c_char * npages).from_buffer(kinds) if npages else None
    ic = (ctypes.c_char * (npages * ID_LEN)).from_buffer(ids) if npages else None
    nd = _lib.gs_scan(a, npages, kc, ic) if npages else 0
    del keep, kc, ic
    return kinds, ids, nd


def verify_native(buf, npages: int, ids, kinds=None) -> int:
    if len(buf) < npages * PAGE_SIZE or len(ids) < npages * ID_LEN or (kinds is not None and len(kinds) < npages):
        raise ValueError("buffer, ids or kinds shorter than npages")
    if not npages:
        return -1
    a, keep = _addr(buf)
    ia, ikeep = _addr(ids)
    ka, kkeep = _addr(kinds) if kinds is not None else (None, None)
    r = _lib.gs_verify(a, npages, ia, ka)
    del keep, ikeep, kkeep
    return r


# -- pure Python (the reference) -----------------------------------------------------------------
def scan_python(buf, npages: int) -> tuple[bytearray, bytearray, int]:
    if len(buf) < npages * PAGE_SIZE:
        raise ValueError("buffer shorter than npages pages")
    b3 = blake3.blake3
    if type(buf) is not bytes:
        buf = bytes(memoryview(buf)[:npages * PAGE_SIZE])
    startswith = buf.startswith
    kinds = bytearray(npages)
    ids = bytearray(npages * ID_LEN)
    nd = 0
    for i in range(npages):
        o = i * PAGE_SIZE
        if startswith(_ZP, o):
            continue
        kinds[i] = 1
        nd += 1
        ids[i * ID_LEN:(i + 1) * ID_LEN] = b3(buf[o:o + PAGE_SIZE]).digest(ID_LEN)
    return kinds, ids, nd


def verify_python(buf, npages: int, ids, kinds=None) -> int:
    if len(buf) < npages * PAGE_SIZE or len(ids) < npages * ID_LEN or (kinds is not None and len(kinds) < npages):
        raise ValueError("buffer, ids or kinds shorter than npages")
    b3 = blake3.blake3
    mv = memoryview(buf)
    idv = memoryview(ids)
    for i in range(npages):
        if kinds is not None and not kinds[i]:
            continue
        if b3(mv[i * PAGE_SIZE:(i + 1) * PAGE_SIZE]).digest(ID_LEN) != idv[i * ID_LEN:(i + 1) * ID_LEN]:
            return i
    return -1


if _lib is not None:
    scan, verify = scan_native, verify_native
else:
    scan, verify = scan_python, verify_python


# -- byte shuffle for the float-aware codecs (gpusnap/repo/codec.py) -------------------------
SHUFFLE_PORTABLE = 1     # flags for *_native: force the portable C code (tests)
_U32x4 = ctypes.c_uint32 * 4    # (creating a ctypes array type per call costs ~10 us)


def shuffle_available() -> bool:
    return _lib is not None and hasattr(_lib, "gs_shuffle")


def shuffle_simd() -> bool:
    """True when the native shuffle runs its AVX2 code."""
    return shuffle_available() and bool(_lib.gs_shuffle_simd())


def _shuf_native(fn, data, k: int, flags: int) -> bytes:
    if k not in (2, 4):
        raise ValueError("element size must be 2 or 4")
    n = len(data)
    if not n:
        return b""
    out = bytearray(n)
    a, keep = _addr(data)
    oc = (ctypes.c_char * n).from_buffer(out)
    fn(a, n, k, oc, flags)
    del keep, oc
    return bytes(out)


def shuffle_native(data, k: int, flags: int = 0) -> bytes:
    return _shuf_native(_lib.gs_shuffle, data, k, flags)


def unshuffle_native(data, k: int, flags: int = 0) -> bytes:
    return _shuf_native(_lib.gs_unshuffle, data, k, flags)


def _check_planes(buf, plane_stride: int, nplanes: int, step: int, count: int) -> None:
    if step < 1 or plane_stride < 0 or nplanes < 0 or count < 0 or nplanes > 64:
        raise ValueError("bad plane_bits arguments")
    if count and nplanes and (nplanes - 1) * plane_stride + (count - 1) * step >= len(buf):
        raise ValueError("plane samples outside the buffer")


def plane_bits_native(buf, plane_stride: int, nplanes: int, step: int, count: int) -> list[int]:
    _check_planes(buf, plane_stride, nplanes, step, count)
    out = (_U32x4 if nplanes <= 4 else ctypes.c_uint32 * nplanes)()
    if not count:
        return [8000] * nplanes
    a, keep = _addr(buf)
    _lib.gs_plane_bits(a, plane_stride, nplanes, step, count, out)
    del keep
    return list(out[:nplanes])


def shuffle_python(data, k: int) -> bytes:
    if k not in (2, 4):
        raise ValueError("element size must be 2 or 4")
    b = bytes(data)
    end = len(b) // k * k
    return b"".join([b[i:end:k] for i in range(k)]) + b[end:]


def unshuffle_python(data, k: int) -> bytes:
    if k not in (2, 4):
        raise ValueError("element size must be 2 or 4")
    b = bytes(data)
    m = len(b) // k
    out = bytearray(len(b))
    for i in range(k):
        out[i:m * k:k] = b[i * m:(i + 1) * m]
    out[m * k:] = b[m * k:]
    return bytes(out)


def plane_bits_python(buf, plane_stride: int, nplanes: int, step: int, count: int) -> list[int]:
    """The formula of gs_plane_bits, step by step in the same order (same doubles)."""
    import math
    _check_planes(buf, plane_stride, nplanes, step, count)
    mv = buf if isinstance(buf, bytes) else memoryview(buf).cast("B")
    res = []
    for p in range(nplanes):
        if not count:
            res.append(8000)
            continue
        o = p * plane_stride
        s = bytes(mv[o:o + (count - 1) * step + 1:step])
        hist = [0] * 256
        for x in s:
            hist[x] += 1
        acc = 0.0
        for c in hist:
            if c > 1:
                acc += float(c) * math.log2(float(c))
        bits = math.log2(float(count)) - acc / float(count)
        res.append(min(max(int(bits * 1000.0), 0), 8000))
    return res


if shuffle_available():
    shuffle, unshuffle, plane_bits = shuffle_native, unshuffle_native, plane_bits_native
else:
    shuffle, unshuffle, plane_bits = shuffle_python, unshuffle_python, plane_bits_python
