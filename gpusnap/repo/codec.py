"""Compression codecs with incompressible passthrough (docs/compression.md)."""

from __future__ import annotations

import lz4.block
import zstandard

from .format import CODEC_LZ4, CODEC_NONE, CODEC_ZSTD, CODEC_BY_NAME, FormatError

# Store compressed only when it saves more than 3 %: restore then never decompresses
# data that barely shrank.
GAIN_LIMIT = 0.97
ZSTD_LEVEL = 3



def codec_id(name: str) -> int:
    try:
        return CODEC_BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown compression {name!r} (choose lz4, zstd or none)") from None


def compress(data, codec: int) -> tuple[int, bytes]:
    """-> (codec actually used, payload). Falls back to CODEC_NONE when the gain is small.

    ZstdCompressor objects are not thread-safe, so zstd uses one per call (cheap at level 3).
    """
    n = len(data)
    if codec == CODEC_LZ4:
        out = lz4.block.compress(data, store_size=False)
    elif codec == CODEC_ZSTD:
        out = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=False).compress(data)
    else:
        return CODEC_NONE, bytes(data)
    if len(out) > n * GAIN_LIMIT:
        return CODEC_NONE, bytes(data)
    return codec, out


def decompress(payload, codec: int, raw_len: int) -> bytes:
    """Decompress exactly raw_len bytes; anything else is FormatError (never a crash or
    an allocation larger than raw_len)."""
    if codec == CODEC_NONE:
        if len(payload) != raw_len:
            raise FormatError("stored length differs from raw length")
        return bytes(payload)
    try:
        if codec == CODEC_LZ4:
            out = lz4.block.decompress(payload, uncompressed_size=raw_len)
        elif codec == CODEC_ZSTD:
            fcs = zstandard.frame_content_size(payload)
            if fcs not in (-1, raw_len):
                raise FormatError("zstd frame declares a different size")
            out = zstandard.ZstdDecompressor().decompress(payload, max_output_size=raw_len)
        else:
            raise FormatError(f"unknown codec {codec}")
    except FormatError:
        raise
    except Exception as e:  # lz4.block.LZ4BlockError, zstandard.ZstdError, ValueError
        raise FormatError(f"cannot decompress blob: {e}") from None
    if len(out) != raw_len:
        raise FormatError(f"blob decompressed to {len(out)} bytes, expected {raw_len}")
    return out
