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
    run_starts(locs, cur, length)
                              -> (starts, k): where runs of consecutive slots start in a batch of
                                 page locations, or k = -1 - i for the first locs[i] < 0
                                 (gs_table.c, used by repo/locations.py build)
    decode_job(pieces, npieces, buf, npages, ids, kinds, token)
                              -> None or (code, piece, detail, message): one job of the read path
                                 (gs_decode.c, used by repo/reader.py assemble)
    decode_payload(payload, codec, out)
                              -> None or (code, message): one blob's payload decoded into out
                                 (gs_decode.c; the data blobs of a restore, repo/store.py)
    index_parse(...), index_runs(...)
                              index files checked and parsed into fixed-size records, and the page
                                 ids of their page blobs gathered (gs_index.c, used by
                                 repo/format/index.py and repo/index.py; tests/test_index_bulk.py
                                 compares them with the Python parse)
    PlaneCompressor(params)   one byte plane -> one zstd frame, with the plane parameters the
                                 storing phase's encoder uses (gs_encode.c; codec.encode_shuffled)
    buffer_address(buf)       -> (address, keep-alive) of a buffer, for the bindings here and in
                                 repo/encoder.py (the storing phase's compress loop, gs_encode.c)

The library is found at $GPUSNAP_NATIVE_LIB (a build outside the checkout, as
scripts/gpu-e2e.sh runs it), else <source root>/build/lib/libgpusnap_pages.so, else
/usr/local/lib/gpusnap/libgpusnap_pages.so. ctypes releases the GIL for the duration of each
call, so pages images of different processes (and the stages of one image's pipeline) run on
different cores. The pure-Python reference of these functions lives in the tests
(tests/page_reference.py), which compare the two.

Over 400 lines: it is the library's whole ABI in one module (one signature table, one ABI
check), each function with the argument checks that keep a bad call from reaching C.
"""

from __future__ import annotations

import ctypes
import threading
import os
from array import array

from gpusnap.system.buffers import buffer_address  # noqa: F401 - (native.buffer_address)
from gpusnap.errors import NativeLibraryMissing
from gpusnap import settings

PAGE_SIZE = 4096
ID_LEN = 16
ABI_VERSION = 8                  # gs_abi_version() of the library this code binds
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
    "gs_table_fill": ([_vp, _vp, _sz, _vp], _sz),
    "gs_run_starts": ([_vp, _sz, _i64, _i64, _vp], _i64),
    "gs_decode_job": ([_vp, _sz, _vp, _sz, _sz, _vp, _vp, _i64, _vp, _vp, _sz], ctypes.c_int),
    "gs_decode_payload": ([_ui, _vp, _sz, _vp, _sz, _vp, _sz], ctypes.c_int),
    "gs_index_parse": ([_vp, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint32, _vp, _vp, _vp, _vp,
                        _vp, _vp, _vp], _i64),
    "gs_index_runs": ([_vp, _vp, ctypes.c_uint64, _i64, ctypes.c_uint32, _vp, _vp, _vp, _vp, _vp], _i64),
    "gs_plane_new": ([_vp, _sz], _vp),
    "gs_plane_free": ([_vp], None),
    "gs_plane_compress": ([_vp, _vp, _sz, _vp, _sz], _i64),
}


_load_lock = threading.Lock()


def _candidates() -> list[str]:
    env = settings.get("GPUSNAP_NATIVE_LIB")
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


# -- pages ------------------------------------------------------------------------------------
def scan(buf, npages: int) -> tuple[bytearray, bytearray, int]:
    lib = _lib or load()
    if len(buf) < npages * PAGE_SIZE:
        raise ValueError("buffer shorter than npages pages")
    kinds = bytearray(npages)
    ids = bytearray(npages * ID_LEN)
    if not npages:
        return kinds, ids, 0
    a, keep = buffer_address(buf)
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
    a, keep = buffer_address(buf)
    ia, ikeep = buffer_address(ids)
    ka, kkeep = buffer_address(kinds) if kinds is not None else (None, None)
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
    a, keep = buffer_address(data)
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
    a, keep = buffer_address(data)
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
    a, keep = buffer_address(buf)
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
    a, keep = buffer_address(ids)
    r = _lib.gs_table_add_run(t, a, n, base)
    del keep
    return _checked(r)


def table_add_runs(t: int, ids, nruns: int, bases_addr: int, counts_addr: int) -> int:
    """bases_addr: nruns int64 locations; counts_addr: nruns uint32 counts."""
    a, keep = buffer_address(ids)
    r = _lib.gs_table_add_runs(t, a, nruns, bases_addr, counts_addr)
    del keep
    return _checked(r)


def table_get(t: int, ids, n: int, out_addr: int) -> None:
    """Writes n int64 locations (-1 where absent) at out_addr."""
    a, keep = buffer_address(ids)
    _lib.gs_table_get(t, a, n, out_addr)
    del keep


def table_claim(known: int | None, claimed: int, kinds, ids, npages: int, value: int, out_addr: int) -> int:
    """-> how many uint32 page indices were written at out_addr."""
    ka, kkeep = buffer_address(kinds)
    ia, ikeep = buffer_address(ids)
    r = _lib.gs_table_claim(known, claimed, ka, ia, npages, value, out_addr)
    del kkeep, ikeep
    return _checked(r)


def table_fill(t: int, ids, n: int, out_addr: int) -> int:
    """Fills the int64 locations at out_addr that are < 0 with those of ids (n ids) the table
    has. -> how many are still < 0."""
    a, keep = buffer_address(ids)
    r = _lib.gs_table_fill(t, a, n, out_addr)
    del keep
    return r


def run_starts(locs, cur: int, length: int) -> tuple[array, int]:
    """locs: array('q') of page locations in page-list order; (cur, length): the run pending
    before them (length 0: none). -> (starts, k): starts[:k] are the indices where a new run
    starts (a run goes on while a location is the previous one + 1 and its slot is not 0);
    k < 0: locs[-1 - k] is the first location < 0."""
    lib = _lib or load()
    if not isinstance(locs, array) or locs.typecode != "q":
        raise ValueError("locs must be an array('q')")
    n = len(locs)
    starts = array("q", [0]) * n
    if not n:
        return starts, 0
    k = lib.gs_run_starts(locs.buffer_info()[0], n, cur, length, starts.buffer_info()[0])
    return starts, k


# -- the read path's decode loop (native/pages/gs_decode.c) -----------------------------------
PIECE_FIELDS = 11    # per piece: fd, key, offset, kind, codec, n_pages, raw_len, stored_len, slot, count, dst
DECODE_IO = -1       # detail: errno
DECODE_FORMAT = -2   # message: what is wrong (a FormatError's text)
DECODE_PAGE = -3     # detail: the job's first page that fails its checksum
DECODE_ARGS = -4
DECODE_NOMEM = -5
DECODE_CODEC = -6    # message: why the payload does not decode (the C libraries' words)
_MSG_LEN = 256
_tls = threading.local()


def decode_job(pieces, npieces: int, buf, npages: int, ids, kinds, token: int = 0):
    """Decode the job's pieces into buf and check its npages pages (gs_decode_job).
    pieces: a buffer of npieces * PIECE_FIELDS int64 (e.g. array('q')), key = the pack's
    number for `token` (a reader's own non-zero number: the last blob decoded for part of
    a job is kept per thread for that token's next job; 0 keeps nothing); buf: the job's
    writable buffer; ids/kinds: as verify() takes them. -> None when every piece decoded and
    every page matched, else (code, piece index or -1, errno / page index, message).
    ValueError for arguments that do not fit together, MemoryError when out of memory."""
    lib = _lib or load()
    mv = memoryview(buf)
    if mv.readonly or not mv.c_contiguous:
        raise ValueError("output must be a writable contiguous buffer")
    if len(pieces) * memoryview(pieces).itemsize < npieces * PIECE_FIELDS * 8:
        raise ValueError("pieces shorter than npieces")
    if npages and (len(ids) < npages * ID_LEN or len(kinds) < npages):
        raise ValueError("ids or kinds shorter than npages")
    st = getattr(_tls, "st", None)
    if st is None:
        st = _tls.st = ((ctypes.c_int64 * 2)(), ctypes.create_string_buffer(_MSG_LEN))
    err, msg = st
    n = mv.nbytes
    if not n:
        return None if not npieces else (DECODE_ARGS, 0, 0, "")
    bc = (ctypes.c_char * n).from_buffer(mv)
    pa, pkeep = buffer_address(pieces)
    ia, ikeep = buffer_address(ids) if npages else (None, None)
    ka, kkeep = buffer_address(kinds) if npages else (None, None)
    rc = lib.gs_decode_job(pa, npieces, bc, n, npages, ia, ka, token, err, msg, _MSG_LEN)
    del bc, pkeep, ikeep, kkeep
    mv.release()
    if rc == 0:
        return None
    if rc == DECODE_ARGS:
        raise ValueError(f"decode_job: piece {err[0]} does not fit the buffer")
    if rc == DECODE_NOMEM:
        raise MemoryError("decode_job scratch buffers")
    return rc, err[0], err[1], msg.value.decode("utf-8", "replace")


def decode_payload(data, start: int, length: int, codec: int, out):
    """The payload data[start:start+length] of one blob (codec not none; its header already
    checked by the caller) decoded into out, a writable buffer of exactly the blob's raw
    length (gs_decode_payload). data: bytes (read in place) or another buffer.
    -> None, or (DECODE_FORMAT / DECODE_CODEC, message) when it does not decode.
    MemoryError when out of memory."""
    lib = _lib or load()
    if start < 0 or length < 0 or start + length > len(data):
        raise ValueError("payload outside its buffer")
    mv = memoryview(out)
    if mv.readonly or not mv.c_contiguous:
        raise ValueError("output must be a writable contiguous buffer")
    st = getattr(_tls, "st", None)
    if st is None:
        st = _tls.st = ((ctypes.c_int64 * 2)(), ctypes.create_string_buffer(_MSG_LEN))
    msg = st[1]
    n = mv.nbytes
    pa, pkeep = buffer_address(data)
    oc = (ctypes.c_char * n).from_buffer(mv) if n else None
    rc = lib.gs_decode_payload(codec, pa + start, length, oc, n, msg, _MSG_LEN)
    del oc, pkeep
    mv.release()
    if rc == 0:
        return None
    if rc == DECODE_NOMEM:
        raise MemoryError("decode_payload scratch buffers")
    return rc, msg.value.decode("utf-8", "replace")


# ---- index files (gs_index.c; gpusnap/repo/format/index.py) ---------------------------
INDEX_REC_SIZE = 32              # one gs_index_rec


def index_parse(data, pos: int, n_packs: int, n_blobs: int, params, pack_size) -> tuple:
    """gs_index_parse over data[:-32] (an index file whose header, pack list and checksum
    the caller checked; n_blobs records fit). params: array('Q') of the format's limits;
    pack_size: array('q') per pack (-1 missing) or None. -> (kept or -error, error value,
    records bytearray, pages, pack_flags bytearray, pack_end array('Q'))."""
    lib = _lib or load()
    body_len = len(data) - 32
    if body_len < 0 or pos > body_len or (pack_size is not None and len(pack_size) < n_packs):
        raise ValueError("index_parse: arguments do not fit the file")
    out = bytearray(INDEX_REC_SIZE * n_blobs or 1)
    flags = bytearray(n_packs or 1)
    ends = array("Q", bytes(8 * (n_packs or 1)))
    vals = (ctypes.c_uint64 * 2)()
    da, dkeep = buffer_address(data)
    ob = (ctypes.c_char * len(out)).from_buffer(out)
    fb = (ctypes.c_char * len(flags)).from_buffer(flags)
    r = lib.gs_index_parse(da, body_len, pos, n_packs, n_blobs, params.buffer_info()[0],
                           pack_size.buffer_info()[0] if pack_size is not None else None,
                           fb, ends.buffer_info()[0], ob, ctypes.addressof(vals),
                           ctypes.addressof(vals) + 8)
    del ob, fb, dkeep
    return r, vals[1], out, vals[0], flags, ends


def index_runs(data, recs, n: int, bno0: int, kind_pages: int, pages: int | None) -> tuple:
    """gs_index_runs over `n` records of `data` (from index_parse). pages: the page count
    index_parse reported (gather the ids), or None (the data records only).
    -> (ids bytearray, bases array('q'), counts array('I'), data record numbers array('I'))."""
    lib = _lib or load()
    if len(recs) < n * INDEX_REC_SIZE:
        raise ValueError("index_runs: fewer records than n")
    data_no = array("I", bytes(4 * (n or 1)))
    nd = ctypes.c_uint64()
    da, dkeep = buffer_address(data)
    rb = (ctypes.c_char * len(recs)).from_buffer(recs)
    if pages is None:
        ids, bases, counts = None, None, None
        lib.gs_index_runs(da, rb, n, bno0, kind_pages, None, None, None, data_no.buffer_info()[0], ctypes.byref(nd))
    else:
        ids = bytearray(ID_LEN * pages or 1)
        bases = array("q", bytes(8 * (n or 1)))
        counts = array("I", bytes(4 * (n or 1)))
        ib = (ctypes.c_char * len(ids)).from_buffer(ids)
        runs = lib.gs_index_runs(da, rb, n, bno0, kind_pages, ib, bases.buffer_info()[0], counts.buffer_info()[0],
                                 data_no.buffer_info()[0], ctypes.byref(nd))
        del ib
        del ids[ID_LEN * pages:], bases[runs:], counts[runs:]
    del rb, dkeep
    del data_no[nd.value:]
    return ids, bases, counts, data_no


# -- plane compressor ---------------------------------------------------------------------------
class PlaneCompressor:
    """gs_encode.c's plane compressor on its own: params = codec.PLANE_PARAMS' window_log,
    hash_log, chain_log, search_log, min_match, target_length, strategy, then PLANE_ACCEL.
    Not for two threads at once."""

    def __init__(self, params):
        self._h = None
        lib = _lib or load()
        p = (ctypes.c_double * len(params))(*map(float, params))
        self._h = lib.gs_plane_new(p, len(params))
        if not self._h:
            raise ValueError("plane compressor: bad parameters (or out of memory)")
        self._out = None

    def compress(self, data) -> bytes:
        if self._h is None:
            raise ValueError("plane compressor is closed")
        n = len(data)
        cap = n + (n >> 7) + 1024                 # >= ZSTD_compressBound(n)
        if self._out is None or len(self._out) < cap:
            self._out = ctypes.create_string_buffer(cap)
        addr, keep = buffer_address(data) if n else (None, None)
        r = _lib.gs_plane_compress(self._h, addr, n, self._out, len(self._out))
        del keep
        if r < 0:
            raise RuntimeError(f"plane compressor failed ({r})")
        return self._out.raw[:r]

    def close(self) -> None:
        h, self._h = self._h, None
        if h is not None and _lib is not None:
            _lib.gs_plane_free(h)

    def __del__(self):
        self.close()
