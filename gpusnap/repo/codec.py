"""Compression codecs with incompressible passthrough (docs/compression.md, docs/format.md §3).

Stored codecs: 0 none, 1 lz4, 2 zstd, 3 shuffle4-zstd, 4 shuffle2-zstd. The shuffle codecs
split the data into byte planes (plane i = byte i of every 2- or 4-byte element, see
native.shuffle) and store each plane as one zstd frame or raw, whichever is smaller: the
sign/exponent planes of floats compress well on their own, the low mantissa planes do not.

"auto" (CODEC_AUTO, never stored) chooses per call: lz4 when it compresses well; otherwise,
when a sampled entropy estimate of the 4-byte planes promises a real gain, shuffle4-zstd;
the smallest result wins, and raw when nothing gains more than 3 %.

lz4 and zstandard are imported on first use: dumps encode and restores decode in the native
library (repo/encoder.py, repo/native.py) and never need them, and from a cold page cache
their extension modules (zstandard's is 11 MiB) cost 20-50 ms to load.
"""

from __future__ import annotations

import functools
import struct
import threading

from gpusnap.repo import native
from gpusnap.repo.format import CODEC_LZ4, CODEC_NONE, CODEC_SHUF2_ZSTD, CODEC_SHUF4_ZSTD, CODEC_ZSTD, CODECS, FormatError

# Store compressed only when it saves more than 3 %: restore then never decompresses
# data that barely shrank.
GAIN_LIMIT = 0.97
ZSTD_LEVEL = 3

CODEC_AUTO = -1                        # "auto": chosen per call; never stored
NAMES = {**CODECS, CODEC_AUTO: "auto"}
# what `dump --compress` (and its completions) accept, default first: the one list
CHOICES = ("auto", *(NAMES[c] for c in sorted(CODECS) if c != CODEC_NONE), NAMES[CODEC_NONE])
SHUFFLE_K = {CODEC_SHUF4_ZSTD: 4, CODEC_SHUF2_ZSTD: 2}

# zstd for one byte plane: planes have almost no repeated strings, so the fastest match
# finder with the longest minimum match leaves nearly everything to the Huffman literal
# coder: smaller (0.34 vs 0.40 of an fp32 exponent plane) and ~3x faster than level 1.
PLANE_PARAMS = {"window_log": 17, "hash_log": 6, "chain_log": 6, "search_log": 1, "min_match": 7,
                "target_length": 0, "strategy": 1}     # strategy 1 = zstandard.STRATEGY_FAST (ZSTD_fast)
# ... and on top of those, the match finder accelerated (targetLength 16) with every literal
# still Huffman-coded (ZSTD_c_literalCompressionMode, which python-zstandard cannot set: the
# planes are compressed by the native library, native.PlaneCompressor). An fp32 exponent plane:
# 0.3244 of its size instead of 0.3264, ~1.3x as fast. More acceleration is faster still but
# loses the matches of integer-like planes (int32 counters: 0.254 of their size plain, 0.266
# at 16, 0.356 at 256). 0: the plain PLANE_PARAMS (also what a libzstd without the mode gets).
PLANE_ACCEL = 16


@functools.cache
def plane_params():
    """PLANE_PARAMS as zstandard.ZstdCompressionParameters (the native encoder takes the
    numbers, so that a dump never loads zstandard)."""
    return _zstd().ZstdCompressionParameters(**PLANE_PARAMS, write_content_size=False,
                                             write_checksum=False, write_dict_id=False)


# auto: keep lz4 outright below this ratio (zero-heavy, text, pointers: lz4 is fast both ways)
AUTO_LZ4_GOOD = 0.5
# auto: a plane is worth handing to zstd when its sampled entropy is below this (milli-bits/byte)
PLANE_TRY_BITS = 7700
# auto: try shuffle4-zstd when its estimated size is below this share of the best so far
AUTO_EST_GAIN = 0.95
PLANE_SAMPLES = 2048                   # samples per plane for the entropy estimate
# auto: before any attempt, a sample of min(len // SAMPLE_PART, SAMPLE_SLICES) slices of
# together ~SAMPLE_BYTES (one per page of a 16-page group; only for data of at least twice
# SAMPLE_BYTES):
# when each of its 4 byte planes is at or above PLANE_TRY_BITS (1024 samples: random data
# reads ~7.82 bits/byte) and lz4 gains nothing on it, the data is stored raw without
# compressing it (sample_says_raw)
SAMPLE_PART = 4096
SAMPLE_SLICES = 16
SAMPLE_BYTES = 4096

_tls = threading.local()


@functools.cache
def _zstd():
    import zstandard
    return zstandard


@functools.cache
def _lz4():
    import lz4.block
    return lz4.block


PLANE_PARAM_ORDER = ("window_log", "hash_log", "chain_log", "search_log", "min_match", "target_length", "strategy")


def plane_compressor(accel: int | None = None) -> "native.PlaneCompressor":
    """A native plane compressor (the one the storing phase's encoder compresses planes with:
    the same parameters, the same bytes); accel: PLANE_ACCEL unless given."""
    return native.PlaneCompressor([PLANE_PARAMS[k] for k in PLANE_PARAM_ORDER]
                                  + [PLANE_ACCEL if accel is None else accel])


def _plane_compressor() -> "native.PlaneCompressor":
    """This thread's plane compressor."""
    c = getattr(_tls, "plane", None)
    if c is None:
        c = _tls.plane = plane_compressor()
    return c


def _dctx():
    d = getattr(_tls, "dctx", None)
    if d is None:
        d = _tls.dctx = _zstd().ZstdDecompressor()
    return d


def codec_id(name: str) -> int:
    for k, v in NAMES.items():
        if v == name:
            return k
    raise ValueError(f"unknown compression {name!r} (choose {', '.join(sorted(NAMES.values()))})")


def codec_name(codec: int) -> str:
    return NAMES[codec]


# -- shuffle codecs ----------------------------------------------------------------------------
def _work(n: int) -> bytearray:
    """This thread's scratch buffer of at least n bytes (reused: no zero-fill per call).
    A new one replaces it when it is too small (views of the old one may still be alive)."""
    w = getattr(_tls, "work", None)
    if w is None or len(w) < n:
        w = _tls.work = bytearray(max(n, 1 << 16))
    return w


def encode_shuffled(data, k: int, bits: list[int] | None = None) -> bytes | None:
    """Payload of shuffle<k>-zstd (docs/format.md §3), or None when len(data) < k.
    bits: the planes' entropy estimates when known (planes at or above PLANE_TRY_BITS are
    stored raw without trying zstd); None tries every plane.

    The planes are shuffled into this thread's scratch buffer and compressed from there;
    the payload is built by one join (header, planes and tail copied once)."""
    n = len(data)
    m = n // k
    if m == 0:
        return None
    mv = memoryview(_work(n))[:n]
    native.shuffle_into(data, k, mv)
    comp = _plane_compressor()
    lens = []
    parts = [b""]
    for i in range(k):
        plane = mv[i * m:(i + 1) * m]
        if bits is None or bits[i] < PLANE_TRY_BITS:
            z = comp.compress(plane)
            if len(z) < m:
                lens.append(len(z))
                parts.append(z)
                continue
        lens.append(m)
        parts.append(plane)
    parts.append(mv[m * k:])
    parts[0] = struct.pack(f"<{k}I", *lens)
    return b"".join(parts)


def _zstd_into(dctx, payload, out, what: str) -> None:
    """Decompress the one zstd frame `payload` into all of `out` (a writable view),
    exactly: a frame declaring or producing another size is FormatError."""
    m = len(out)
    try:
        fcs = _zstd().frame_content_size(payload)
        if fcs not in (-1, m):
            raise FormatError(f"zstd frame of {what} declares a different size")
        r = dctx.stream_reader(payload)
        got = 0
        while got < m:
            k = r.readinto(out[got:])
            if not k:
                break
            got += k
        extra = r.read(1) if got == m else b""
    except FormatError:
        raise
    except Exception as e:   # zstandard.ZstdError, ValueError
        raise FormatError(f"cannot decompress {what}: {e}") from None
    if got != m or extra:
        raise FormatError(f"{what} decompressed to another size than {m} bytes")


def decode_shuffled(payload, k: int, raw_len: int) -> bytearray:
    """Inverse of encode_shuffled; any malformed payload is FormatError."""
    out = bytearray(raw_len)
    decode_shuffled_into(payload, k, raw_len, memoryview(out))
    return out


def decode_shuffled_into(payload, k: int, raw_len: int, out) -> None:
    """decode_shuffled() written into out (a writable view of raw_len bytes): the planes
    are decompressed into this thread's scratch buffer and unshuffled straight into out."""
    m = raw_len // k
    t = raw_len - m * k
    hdr = 4 * k
    if m == 0:
        raise FormatError(f"shuffle{k} blob shorter than one element")
    if len(payload) < hdr + t:
        raise FormatError("shuffle payload shorter than its header")
    lens = struct.unpack_from(f"<{k}I", payload)
    if any(ln < 1 or ln > m for ln in lens) or hdr + sum(lens) + t != len(payload):
        raise FormatError("shuffle payload: bad plane lengths")
    mv = memoryview(payload)
    sh = memoryview(_work(raw_len))[:raw_len]
    pos = hdr
    dctx = _dctx()
    for i, ln in enumerate(lens):
        seg = mv[pos:pos + ln]
        if ln == m:
            sh[i * m:(i + 1) * m] = seg
        else:
            _zstd_into(dctx, seg, sh[i * m:(i + 1) * m], f"plane {i}")
        pos += ln
    sh[m * k:] = mv[pos:]
    native.unshuffle_into(sh, k, out)


def estimate_planes(data, k: int = 4) -> list[int]:
    """Sampled entropy (milli-bits per byte) of the k byte planes of data, read in place."""
    m = len(data) // k
    if m == 0:
        return [8000] * k
    step = max(1, m // PLANE_SAMPLES)
    count = (m - 1) // step + 1
    return native.plane_bits(data, 1, k, step * k, count)


def sample_says_raw(data) -> bool:
    """True when a cheap sample shows that data will not compress: _auto then stores it raw
    without an attempt (random memory costs a look at 1/16 of it instead of an lz4 pass over
    all of it and the planes' estimate).

    The sample: k = min(len // SAMPLE_PART, SAMPLE_SLICES) slices of SAMPLE_BYTES // k bytes
    (rounded down to a multiple of 4), one in the middle of each of k equal parts of data, one
    after the other: 1024 samples per byte plane, whatever the data's length. Data is
    incompressible when each of the sample's 4 byte planes has an order-0 entropy at or above PLANE_TRY_BITS and
    lz4 (block mode) gains nothing at all on the sample: floats' exponents, text, zeros or
    repeats in a sampled page keep it on the full way, with exactly the choices and payloads
    of before. Data shorter than twice SAMPLE_BYTES is always attempted. gs_encode.c
    sample_says_raw is the same."""
    n = len(data)
    k = min(n // SAMPLE_PART, SAMPLE_SLICES)
    ln = SAMPLE_BYTES // k // 4 * 4 if k else 0
    if not ln or n < 2 * SAMPLE_BYTES:
        return False
    step = n // k
    mv = memoryview(data).cast("B")
    sample = b"".join(mv[i * step + (step - ln) // 2:][:ln] for i in range(k))
    if any(b < PLANE_TRY_BITS for b in native.plane_bits(sample, 1, 4, 4, len(sample) // 4)):
        return False
    return len(_lz4().compress(sample, store_size=False)) >= len(sample)


def _auto(data, lz4_first: bool = True) -> tuple[int, bytes | None]:
    """lz4_first=False (the caller saw lz4 lose to shuffle4-zstd on the groups before):
    try shuffle4-zstd first, and lz4 only when shuffle4-zstd gains nothing. With lz4 first,
    data that sample_says_raw is stored raw without an attempt (after groups where
    shuffle4-zstd won, float-like memory, the sample would seldom pay)."""
    n = len(data)
    if lz4_first and sample_says_raw(data):
        return CODEC_NONE, None
    if not lz4_first and n >= 4:
        bits = estimate_planes(data, 4)
        sp = encode_shuffled(data, 4, bits)
        if sp is not None and len(sp) <= n * GAIN_LIMIT:
            return CODEC_SHUF4_ZSTD, sp
    out = _lz4().compress(data, store_size=False)
    if len(out) <= n * AUTO_LZ4_GOOD:
        return CODEC_LZ4, out
    best_codec, best = (CODEC_LZ4, out) if len(out) <= n * GAIN_LIMIT else (CODEC_NONE, None)
    best_len = len(best) if best is not None else n
    if n < 4 or not lz4_first:
        return best_codec, best
    bits = estimate_planes(data, 4)
    m = n // 4
    est = 16 + (n - 4 * m) + sum(m if b >= PLANE_TRY_BITS else (m * b // 8000 + 64) for b in bits)
    if est < best_len * AUTO_EST_GAIN:
        sp = encode_shuffled(data, 4, bits)
        if sp is not None and len(sp) < best_len and len(sp) <= n * GAIN_LIMIT:
            return CODEC_SHUF4_ZSTD, sp
    return best_codec, best


def compress(data, codec: int, lz4_first: bool = True) -> tuple[int, bytes]:
    """-> (codec actually used, payload). Falls back to CODEC_NONE when the gain is small.
    lz4_first: for auto, see _auto.

    ZstdCompressor objects are not thread-safe, so zstd uses one per call (cheap at level 3);
    the plane compressor of the shuffle codecs is one per thread.
    """
    n = len(data)
    if codec == CODEC_AUTO:
        c, out = _auto(data, lz4_first)
        if c == CODEC_NONE:
            return CODEC_NONE, bytes(data)
        return c, out
    if codec == CODEC_LZ4:
        out = _lz4().compress(data, store_size=False)
    elif codec == CODEC_ZSTD:
        out = _zstd().ZstdCompressor(level=ZSTD_LEVEL, write_content_size=False).compress(data)
    elif codec in SHUFFLE_K:
        out = encode_shuffled(data, SHUFFLE_K[codec])
        if out is None:
            return CODEC_NONE, bytes(data)
    else:
        return CODEC_NONE, bytes(data)
    if len(out) > n * GAIN_LIMIT:
        return CODEC_NONE, bytes(data)
    return codec, out


def decompress(payload, codec: int, raw_len: int) -> bytes | bytearray:
    """Decompress exactly raw_len bytes; anything else is FormatError (never a crash or
    an allocation larger than raw_len). zstd and the shuffle codecs decode into a new
    bytearray (decompress_into), so they return one."""
    if codec == CODEC_NONE:
        if len(payload) != raw_len:
            raise FormatError("stored length differs from raw length")
        return bytes(payload)
    if codec == CODEC_ZSTD or codec in SHUFFLE_K:
        out = bytearray(raw_len)
        decompress_into(payload, codec, memoryview(out))
        return out
    try:
        if codec == CODEC_LZ4:
            out = _lz4().decompress(payload, uncompressed_size=raw_len)
        else:
            raise FormatError(f"unknown codec {codec}")
    except FormatError:
        raise
    except Exception as e:  # lz4.block.LZ4BlockError, ValueError
        raise FormatError(f"cannot decompress blob: {e}") from None
    if len(out) != raw_len:
        raise FormatError(f"blob decompressed to {len(out)} bytes, expected {raw_len}")
    return out


def decompress_into(payload, codec: int, out) -> None:
    """decompress() written into out (a writable memoryview of exactly raw_len bytes):
    zstd and the shuffle codecs decode in place, without an intermediate bytes object."""
    raw_len = len(out)
    if codec == CODEC_ZSTD:
        _zstd_into(_dctx(), payload, out, "blob")
    elif codec in SHUFFLE_K:
        decode_shuffled_into(payload, SHUFFLE_K[codec], raw_len, out)
    elif codec == CODEC_NONE:
        if len(payload) != raw_len:
            raise FormatError("stored length differs from raw length")
        out[:] = payload
    else:
        out[:] = decompress(payload, codec, raw_len)
