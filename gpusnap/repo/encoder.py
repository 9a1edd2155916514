"""The storing phase's compress loop (native/pages/gs_encode.c in libgpusnap_pages.so): one
call compresses a whole batch of page groups without the GIL, with the codec choices and
payloads of codec.compress and the skip / lz4-first heuristics the pages sink keeps per
compressor thread (repo/pipeline/sinks.py). The library is loaded by repo/native.py.
"""

from __future__ import annotations

import ctypes
import threading

from gpusnap.errors import NativeLibraryMissing
from gpusnap.repo import codec as _codec
from gpusnap.repo import native

_vp, _sz, _i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64

# The heuristics each compressor thread's Encoder carries from batch to batch (`state`):
#   skip, skip_next  after a group that did not compress, store this many groups raw without
#                    trying (1, then doubling up to SKIP_MAX while they keep failing):
#                    incompressible memory costs no wasted compressor time
#   lz4_futile       auto: groups in a row where lz4 lost to shuffle4-zstd; from LZ4_FUTILE on,
#                    lz4 is no longer tried first (its attempt was ~20 % of the compressor's
#                    time on fp32 state) ...
#   since_probe      ... except on every LZ4_PROBE-th group
SKIP_MAX = 8
LZ4_FUTILE = 4
LZ4_PROBE = 16
FRESH_STATE = (0, 1, 0, 0)     # skip, skip_next, lz4_futile, since_probe of a new encoder


def encoder_params() -> dict:
    """The native encoder's constants: codec.py's and the heuristics' above."""
    p = _codec.PLANE_PARAMS
    return {"gain_limit": _codec.GAIN_LIMIT, "auto_lz4_good": _codec.AUTO_LZ4_GOOD,
            "auto_est_gain": _codec.AUTO_EST_GAIN, "plane_try_bits": _codec.PLANE_TRY_BITS,
            "plane_samples": _codec.PLANE_SAMPLES, "zstd_level": _codec.ZSTD_LEVEL,
            "skip_max": SKIP_MAX, "lz4_futile": LZ4_FUTILE, "lz4_probe": LZ4_PROBE,
            "sample_part": _codec.SAMPLE_PART, "sample_slices": _codec.SAMPLE_SLICES,
            "sample_bytes": _codec.SAMPLE_BYTES, "plane_accel": _codec.PLANE_ACCEL, **p}

# gs_enc_new's parameters, in the C code's order: codec.py's and this module's constants and
# PLANE_PARAMS, handed over so that those files stay their one definition.
ENC_PARAM_NAMES = ("gain_limit", "auto_lz4_good", "auto_est_gain", "plane_try_bits", "plane_samples",
                   "zstd_level", "skip_max", "lz4_futile", "lz4_probe", "window_log", "hash_log",
                   "chain_log", "search_log", "min_match", "target_length", "strategy",
                   "sample_part", "sample_slices", "sample_bytes", "plane_accel")
ENC_STATE_NAMES = ("skip", "skip_next", "lz4_futile", "since_probe")
# Encoder.stats(), gs_enc_stats's counters in its order: groups compressed in full (or
# tried), groups stored raw on the sample's word alone (auto: codec.sample_says_raw),
# groups stored raw by the skip heuristic without a look
STAT_NAMES = ("tried", "sampled_raw", "skipped")
_ENC_ERRORS = {-1: "bad arguments", -3: "output buffer too small", -4: "a compression library failed"}
_ENC_SIGNATURES = {
    "gs_enc_new": ([_vp, _sz], _vp),
    "gs_enc_free": ([_vp], None),
    "gs_encode_groups": ([_vp, _vp, _vp, _sz, ctypes.c_int, _vp, _vp, _sz, _vp], _i64),
    "gs_enc_out_cap": ([_vp, _sz], _sz),
    "gs_enc_stats": ([_vp, _vp, _sz], _sz),
    "gs_enc_buf_new": ([_sz], _vp),
    "gs_enc_buf_free": ([_vp], None),
}
_OUT_ROUND = 1 << 16     # output buffers' sizes rounded up to this (ctypes keeps a type per size)
_enc_lib = None


def _encoder_lib():
    """The library with gs_encode.c's functions bound (a build from before them is
    NativeLibraryMissing, as any other stale build)."""
    global _enc_lib
    lib = native.load()
    if _enc_lib is not lib:
        try:
            for name, (args, res) in _ENC_SIGNATURES.items():
                f = getattr(lib, name)
                f.argtypes, f.restype = args, res
        except AttributeError:
            raise NativeLibraryMissing(f"gpusnap's native page library at {native.lib_path} has no compress loop",
                                       hint="run `make setup` in the gpusnap checkout") from None
        _enc_lib = lib
    return lib


class Encoder:
    """One compressor thread's native encoder (gs_encode.c): its zstd contexts, scratch
    buffers and heuristic state (`state`, int64 skip, skip_next, lz4_futile, since_probe,
    carried from batch to batch). Not for two threads at once."""

    def __init__(self, params: dict | None = None):
        self._h = None
        lib = _encoder_lib()
        params = encoder_params() if params is None else params
        p = (ctypes.c_double * len(ENC_PARAM_NAMES))(*(float(params[k]) for k in ENC_PARAM_NAMES))
        self._h = lib.gs_enc_new(p, len(ENC_PARAM_NAMES))
        if not self._h:
            raise MemoryError("native encoder (or parameters zstd refuses)")
        self.state = (ctypes.c_int64 * len(ENC_STATE_NAMES))(*FRESH_STATE)

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
            keep = [native.buffer_address(r) for r in raws]
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

    def stats(self) -> dict[str, int]:
        """The encoder's counters since it was made (STAT_NAMES)."""
        if self._h is None:
            raise ValueError("encoder is closed")
        out = (ctypes.c_int64 * len(STAT_NAMES))()
        _encoder_lib().gs_enc_stats(self._h, out, len(STAT_NAMES))
        return dict(zip(STAT_NAMES, out))

    def close(self) -> None:
        h, self._h = self._h, None
        if h is not None and _enc_lib is not None:
            _enc_lib.gs_enc_free(h)

    def __del__(self):
        self.close()


class _OutBuf:
    """Frees one gs_enc_buf_new() buffer when the ctypes array over it (and so every view
    of it) is gone."""
    __slots__ = ("p",)

    def __init__(self, p: int):
        self.p = p

    def __del__(self):
        if _enc_lib is not None:
            _enc_lib.gs_enc_buf_free(self.p)


_blob_enc = threading.local()


def encode_blob(chunk: bytes, codec: int) -> tuple[int, bytes | memoryview]:
    """codec.compress(chunk, codec) for one data blob, by this thread's native encoder (a
    dump then never loads python-lz4 or zstandard, 20-50 ms from a cold cache, and that
    inside CRIU's stream): its heuristics start afresh for every blob."""
    enc = getattr(_blob_enc, "enc", None)
    if enc is None:
        enc = _blob_enc.enc = Encoder()
    enc.state[:] = FRESH_STATE
    res, out = enc.encode([chunk], codec)
    if res[0] == _codec.CODEC_NONE:
        return _codec.CODEC_NONE, chunk
    return res[0], out[:res[1]]
