"""The page pipeline's hot loops in native code (native/pages/, libgpusnap_pages.so): the one
implementation gpusnap runs. `make setup` builds it; without it (or with a build of another
ABI) every function here raises NativeLibraryMissing, which says to run `make setup`.

    scan(buf, npages)         -> (kinds, ids, ndata): kinds[i] 0 = zero page, 1 = data page;
                                 ids[16*i:16*i+16] = blake3-128 of data page i (zeros for zero pages)
    verify(buf, npages, ids, kinds=None)
                              -> index of the first page whose blake3-128 is not its id, or -1;
                                 pages with kinds[i] == 0 are not checked
    shuffle(data, k)          -> bytes: byte planes of k-byte elements (k = 2 or 4), the last
                                 len % k bytes unchanged after them
    unshuffle(data, k)        -> bytes: the inverse
    shuffle_into(data, k, out), unshuffle_into(data, k, out)
                              -> the same written into out[:len(data)] (a buffer the caller owns)
    plane_bits(buf, plane_stride, nplanes, step, count)
                              -> sampled order-0 entropy (milli-bits per byte) of each plane:
                                 plane p's samples are buf[p*plane_stride + j*step], j < count
    table_*                   the page-id table of a dump (gs_table.c, used by pipeline/pagetable.py)

The library is found at $GPUSNAP_NATIVE_LIB (a build outside the checkout, as
scripts/gpu-e2e.sh runs it), else <source root>/build/lib/libgpusnap_pages.so, else
/usr/local/lib/gpusnap/libgpusnap_pages.so. ctypes releases the GIL for the duration of each
call, so pages images of different processes (and the stages of one image's pipeline) run on
different cores. The pure-Python reference of these functions lives in the tests
(tests/page_reference.py), which compare the two.
"""

from __future__ import annotations

import ctypes
import threading
import os

from gpusnap.errors import NativeLibraryMissing

PAGE_SIZE = 4096
ID_LEN = 16
ABI_VERSION = 3                  # gs_abi_version() of the library this code binds
SHUFFLE_PORTABLE = 1             # flags for shuffle/unshuffle: force the portable C code (tests)

_LIB_NAME = "libgpusnap_pages.so"
_lib = None
lib_path: str | None = None

_vp, _sz, _i64, _ui = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64, ctypes.c_uint
# name: (argtypes, restype); the whole ABI this module relies on
_SIGNATURES = {
    "gs_selftest": ([], ctypes.c_int),
    "gs_scan": ([_vp, _sz, _vp, _vp], _sz),
    "gs_verify": ([_vp, _sz, _vp, _vp], ctypes.c_long),
    "gs_shuffle": ([_vp, _sz, _ui, _vp, _ui], ctypes.c_int),
    "gs_unshuffle": ([_vp, _sz, _ui, _vp, _ui], ctypes.c_int),
    "gs_plane_bits": ([_vp, _sz, _ui, _sz, _sz, _vp], ctypes.c_int),
    "gs_table_new": ([_sz], _vp),
    "gs_table_free": ([_vp], None),
    "gs_table_len": ([_vp], _sz),
    "gs_table_bytes": ([_vp], _sz),
    "gs_table_add_run": ([_vp, _vp, _sz, _i64], ctypes.c_long),
    "gs_table_add_runs": ([_vp, _vp, _sz, _vp, _vp], ctypes.c_long),
    "gs_table_get": ([_vp, _vp, _sz, _vp], None),
    "gs_table_claim": ([_vp, _vp, _vp, _vp, _sz, _i64, _vp], ctypes.c_long),
}


_load_lock = threading.Lock()


def _candidates() -> list[str]:
    env = os.environ.get("GPUSNAP_NATIVE_LIB")
    if env:
        return [env]
    from gpusnap.system.paths import source_root

    return [str(source_root() / "build" / "lib" / _LIB_NAME), f"/usr/local/lib/gpusnap/{_LIB_NAME}"]


def _open(path: str):
    """The library at path, bound and checked; raises OSError or ValueError."""
    lib = ctypes.CDLL(path)
    try:
        abi = lib.gs_abi_version()
    except AttributeError:
        raise ValueError("not a gpusnap page library (no gs_abi_version)") from None
    if abi != ABI_VERSION:
        raise ValueError(f"ABI version {abi}, this checkout needs {ABI_VERSION}")
    for name, (args, res) in _SIGNATURES.items():
        f = getattr(lib, name)            # present in every library of this ABI
        f.argtypes, f.restype = args, res
    if lib.gs_selftest() != 0:            # page ids are part of the format: they must be blake3
        raise ValueError("self test failed (its page ids differ from blake3)")
    return lib


def load():
    """The loaded library (loaded on first use). Raises NativeLibraryMissing.

    Under a lock: the parallel readers' first calls come at once, and two self tests running
    side by side share the library's static test buffer (a spurious 'self test failed')."""
    with _load_lock:
        return _lib or _load()


def _load():
    global _lib, lib_path
    errors = []
    for p in _candidates():
        if not os.path.exists(p):
            errors.append(f"{p}: not found")
            continue
        try:
            lib = _open(p)
        except (OSError, ValueError, AttributeError) as e:
            errors.append(f"{p}: {e}")
            continue
        _lib, lib_path = lib, p
        return lib
    raise NativeLibraryMissing(
        "gpusnap's native page library is missing or was built for another version: " + "; ".join(errors),
        hint="run `make setup` in the gpusnap checkout (it builds build/lib/libgpusnap_pages.so)")


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


# -- pages ------------------------------------------------------------------------------------
def scan(buf, npages: int) -> tuple[bytearray, bytearray, int]:
    lib = _lib or load()
    if len(buf) < npages * PAGE_SIZE:
        raise ValueError("buffer shorter than npages pages")
    kinds = bytearray(npages)
    ids = bytearray(npages * ID_LEN)
    if not npages:
        return kinds, ids, 0
    a, keep = _addr(buf)
    kc = (ctypes.c_char * npages).from_buffer(kinds)
    ic = (ctypes.c_char * (npages * ID_LEN)).from_buffer(ids)
    nd = lib.gs_scan(a, npages, kc, ic)
    del keep, kc, ic
    return kinds, ids, nd


def verify(buf, npages: int, ids, kinds=None) -> int:
    lib = _lib or load()
    if len(buf) < npages * PAGE_SIZE or len(ids) < npages * ID_LEN or (kinds is not None and len(kinds) < npages):
        raise ValueError("buffer, ids or kinds shorter than npages")
    if not npages:
        return -1
    a, keep = _addr(buf)
    ia, ikeep = _addr(ids)
    ka, kkeep = _addr(kinds) if kinds is not None else (None, None)
    r = lib.gs_verify(a, npages, ia, ka)
    del keep, ikeep, kkeep
    return r


# -- byte shuffle for the float-aware codecs (gpusnap/repo/codec.py) -------------------------
_U32x4 = ctypes.c_uint32 * 4    # (creating a ctypes array type per call costs ~10 us)


def _shuf(fn_name: str, data, k: int, flags: int) -> bytes:
    lib = _lib or load()
    if k not in (2, 4):
        raise ValueError("element size must be 2 or 4")
    n = len(data)
    if not n:
        return b""
    out = bytearray(n)
    a, keep = _addr(data)
    oc = (ctypes.c_char * n).from_buffer(out)
    getattr(lib, fn_name)(a, n, k, oc, flags)
    del keep, oc
    return bytes(out)


def shuffle(data, k: int, flags: int = 0) -> bytes:
    return _shuf("gs_shuffle", data, k, flags)


def unshuffle(data, k: int, flags: int = 0) -> bytes:
    return _shuf("gs_unshuffle", data, k, flags)


def _shuf_into(fn_name: str, data, k: int, out, flags: int) -> None:
    lib = _lib or load()
    if k not in (2, 4):
        raise ValueError("element size must be 2 or 4")
    n = len(data)
    omv = memoryview(out)
    if omv.readonly or not omv.c_contiguous or omv.nbytes < n:
        raise ValueError("output must be a writable contiguous buffer of at least len(data) bytes")
    if not n:
        return
    a, keep = _addr(data)
    oc = (ctypes.c_char * n).from_buffer(omv)
    getattr(lib, fn_name)(a, n, k, oc, flags)
    del keep, oc
    omv.release()


def shuffle_into(data, k: int, out, flags: int = 0) -> None:
    """shuffle() written into out[:len(data)] (a writable buffer the caller owns and may
    reuse: no zero-filled output, no copy to bytes)."""
    _shuf_into("gs_shuffle", data, k, out, flags)


def unshuffle_into(data, k: int, out, flags: int = 0) -> None:
    """unshuffle() written into out[:len(data)] (e.g. straight into its place in an image)."""
    _shuf_into("gs_unshuffle", data, k, out, flags)


def check_planes(buf, plane_stride: int, nplanes: int, step: int, count: int) -> None:
    """The arguments plane_bits accepts (ValueError otherwise)."""
    if step < 1 or plane_stride < 0 or nplanes < 0 or count < 0 or nplanes > 64:
        raise ValueError("bad plane_bits arguments")
    if count and nplanes and (nplanes - 1) * plane_stride + (count - 1) * step >= len(buf):
        raise ValueError("plane samples outside the buffer")


def plane_bits(buf, plane_stride: int, nplanes: int, step: int, count: int) -> list[int]:
    lib = _lib or load()
    check_planes(buf, plane_stride, nplanes, step, count)
    if not count:
        return [8000] * nplanes
    out = (_U32x4 if nplanes <= 4 else ctypes.c_uint32 * nplanes)()
    a, keep = _addr(buf)
    lib.gs_plane_bits(a, plane_stride, nplanes, step, count, out)
    del keep
    return list(out[:nplanes])


# -- the page-id table (native/pages/gs_table.c): handles for pipeline/pagetable.py ----------
def table_new(hint: int) -> int:
    t = (_lib or load()).gs_table_new(hint)
    if not t:
        raise MemoryError("page table")
    return t


def table_free(t: int) -> None:
    if _lib is not None:
        _lib.gs_table_free(t)


def table_len(t: int) -> int:
    return _lib.gs_table_len(t)


def table_bytes(t: int) -> int:
    return _lib.gs_table_bytes(t)


def _checked(r: int) -> int:
    if r < 0:
        raise MemoryError("page table")
    return r


def table_add_run(t: int, ids, n: int, base: int) -> int:
    a, keep = _addr(ids)
    r = _lib.gs_table_add_run(t, a, n, base)
    del keep
    return _checked(r)


def table_add_runs(t: int, ids, nruns: int, bases_addr: int, counts_addr: int) -> int:
    """bases_addr: nruns int64 locations; counts_addr: nruns uint32 counts."""
    a, keep = _addr(ids)
    r = _lib.gs_table_add_runs(t, a, nruns, bases_addr, counts_addr)
    del keep
    return _checked(r)


def table_get(t: int, ids, n: int, out_addr: int) -> None:
    """Writes n int64 locations (-1 where absent) at out_addr."""
    a, keep = _addr(ids)
    _lib.gs_table_get(t, a, n, out_addr)
    del keep


def table_claim(known: int | None, claimed: int, kinds, ids, npages: int, value: int, out_addr: int) -> int:
    """-> how many uint32 page indices were written at out_addr."""
    ka, kkeep = _addr(kinds)
    ia, ikeep = _addr(ids)
    r = _lib.gs_table_claim(known, claimed, ka, ia, npages, value, out_addr)
    del kkeep, ikeep
    return _checked(r)


# -- the storing phase's compress loop (native/pages/gs_encode.c) ---------------------------
# gs_enc_new's parameters, in the C code's order: codec.py's and sinks.py's constants and
# PLANE_PARAMS, handed over so that those files stay their one definition.
ENC_PARAM_NAMES = ("gain_limit", "auto_lz4_good", "auto_est_gain", "plane_try_bits", "plane_samples",
                   "zstd_level", "skip_max", "lz4_futile", "lz4_probe", "window_log", "hash_log",
                   "chain_log", "search_log", "min_match", "target_length", "strategy")
ENC_STATE_NAMES = ("skip", "skip_next", "lz4_futile", "since_probe")
_ENC_ERRORS = {-1: "bad arguments", -3: "output buffer too small", -4: "a compression library failed"}
_ENC_SIGNATURES = {
    "gs_enc_new": ([_vp, _sz], _vp),
    "gs_enc_free": ([_vp], None),
    "gs_encode_groups": ([_vp, _vp, _vp, _sz, ctypes.c_int, _vp, _vp, _sz, _vp], _i64),
    "gs_enc_out_cap": ([_vp, _sz], _sz),
    "gs_enc_buf_new": ([_sz], _vp),
    "gs_enc_buf_free": ([_vp], None),
}
_OUT_ROUND = 1 << 16     # output buffers' sizes rounded up to this (ctypes keeps a type per size)
_enc_lib = None


def _encoder_lib():
    """The library with gs_encode.c's functions bound (a build from before them is
    NativeLibraryMissing, as any other stale build)."""
    global _enc_lib
    lib = _lib or load()
    if _enc_lib is not lib:
        try:
            for name, (args, res) in _ENC_SIGNATURES.items():
                f = getattr(lib, name)
                f.argtypes, f.restype = args, res
        except AttributeError:
            raise NativeLibraryMissing(f"gpusnap's native page library at {lib_path} has no compress loop",
                                       hint="run `make setup` in the gpusnap checkout") from None
        _enc_lib = lib
    return lib


class Encoder:
    """One compressor thread's native encoder (gs_encode.c): its zstd contexts, scratch
    buffers and heuristic state (`state`, int64 skip, skip_next, lz4_futile, since_probe,
    carried from batch to batch). Not for two threads at once."""

    def __init__(self, params: dict):
        self._h = None
        lib = _encoder_lib()
        p = (ctypes.c_double * len(ENC_PARAM_NAMES))(*(float(params[k]) for k in ENC_PARAM_NAMES))
        self._h = lib.gs_enc_new(p, len(ENC_PARAM_NAMES))
        if not self._h:
            raise MemoryError("native encoder (or parameters zstd refuses)")
        self.state = (ctypes.c_int64 * len(ENC_STATE_NAMES))(0, 1, 0, 0)

    def encode(self, raws: list, codec: int, in_place: bool = True) -> tuple[list[int], memoryview | bytes]:
        """Encode the groups raws (bytes or other buffers) with codec (codec.CODEC_AUTO or a
        stored codec) -> (res, out): res[2*g], res[2*g+1] = group g's codec and payload
        length; the payloads of the compressed groups lie one after the other in out (a
        memoryview whose native buffer lives as long as it or a view of it); a CODEC_NONE
        group's payload is its raw bytes. The GIL is released for the batch."""
        lib = _enc_lib or _encoder_lib()
        if self._h is None:
            raise ValueError("encoder is closed")
        n = len(raws)
        if all(type(r) is bytes for r in raws):
            ptrs = (ctypes.c_char_p * n)(*raws)     # points at the bytes' own buffers
            keep = None
        else:
            keep = [_addr(r) for r in raws]
            ptrs = (ctypes.c_void_p * n)(*[a for a, _ in keep])
        lens = (ctypes.c_size_t * n)(*map(len, raws))
        # an uninitialized buffer in which every attempt is made in place (gs_enc_out_cap);
        # in_place=False (tests): just the groups' size, some payloads then go through scratch
        if in_place:
            cap = -(-max(lib.gs_enc_out_cap(lens, n), 1) // _OUT_ROUND) * _OUT_ROUND
        else:
            cap = max(sum(lens), 1)
        p = lib.gs_enc_buf_new(cap)
        if not p:
            raise MemoryError("native encoder output")
        owner = _OutBuf(p)
        res = (ctypes.c_int64 * (2 * n))()
        r = lib.gs_encode_groups(self._h, ptrs, lens, n, codec, self.state, p, cap, res)
        del keep
        if r < 0:
            if r == -2:
                raise MemoryError("native encoder")
            raise RuntimeError(f"native encoder: {_ENC_ERRORS.get(r, r)}")
        if r == 0:
            return list(res), b""
        # the payloads stay where the encoder wrote them: a view of the buffer, freed with
        # the last view of it (the pack writer's, once written)
        arr = (ctypes.c_char * cap).from_address(p)
        arr._owner = owner
        return list(res), memoryview(arr).cast("B")[:r]

    def close(self) -> None:
        h, self._h = self._h, None
        if h is not None and _lib is not None:
            _lib.gs_enc_free(h)

    def __del__(self):
        self.close()


class _OutBuf:
    """Frees one gs_enc_buf_new() buffer when the ctypes array over it (and so every view
    of it) is gone."""
    __slots__ = ("p",)

    def __init__(self, p: int):
        self.p = p

    def __del__(self):
        if _lib is not None:
            _lib.gs_enc_buf_free(self.p)
