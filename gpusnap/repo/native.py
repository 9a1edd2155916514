"""The page pipeline's hot loop in native code (native/pages/gs_pages.c), with a pure-Python
fallback that gives identical results.

    scan(buf, npages)         -> (kinds, ids, ndata): kinds[i] 0 = zero page, 1 = data page;
                                 ids[16*i:16*i+16] = blake3-128 of data page i (zeros for zero pages)
    verify(buf, npages, ids, kinds=None)
                              -> index of the first page whose blake3-128 is not its id, or -1;
                                 pages with kinds[i] == 0 are not checked

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
    root = Path(__file__).resolve().parent.parent.parent
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
