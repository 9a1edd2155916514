"""Pack files (docs/format.md §3): header, blob headers, trailer, the pack's name."""

from __future__ import annotations

from dataclasses import dataclass

import blake3

from gpusnap.repo.format.common import (BLOB_HEADER, BLOB_MAGIC, CODECS, CODEC_NONE, FORMAT_VERSION, KINDS, KIND_PAGES, MAX_BLOB_RAW,
                                       MAX_GROUP_PAGES, PACK_HEADER, PACK_MAGIC, PACK_NAME_MAGIC,
                                       PACK_TRAILER, PACK_TRAILER_MAGIC, PAGE_SIZE, FormatError)


def encode_pack_header() -> bytes:
    return PACK_HEADER.pack(PACK_MAGIC, FORMAT_VERSION, 0, 0)


def parse_pack_header(data: bytes) -> None:
    if len(data) < PACK_HEADER.size:
        raise FormatError("pack shorter than its header")
    magic, version, flags, reserved = PACK_HEADER.unpack_from(data, 0)
    if magic != PACK_MAGIC:
        raise FormatError("bad pack magic")
    if version != FORMAT_VERSION:
        raise FormatError(f"unsupported pack version {version}")
    if flags or reserved:
        raise FormatError("pack header reserved fields not zero")


def pack_namer():
    """A blake3 hasher holding the start of a pack's descriptor (docs/format.md §3):
    PACK_NAME_MAGIC + pack header. Feed it, per blob in pack order, the 16-byte blob header
    and the blob's ids (index record ids), then the 16-byte trailer; its digest is the
    pack's name."""
    h = blake3.blake3(PACK_NAME_MAGIC)
    h.update(encode_pack_header())
    return h


def encode_blob_header(kind: int, codec: int, n_pages: int, raw_len: int, stored_len: int) -> bytes:
    return BLOB_HEADER.pack(BLOB_MAGIC, kind, codec, n_pages, 0, raw_len, stored_len)


@dataclass(frozen=True, slots=True)
class BlobHeader:
    kind: int
    codec: int
    n_pages: int
    raw_len: int
    stored_len: int


def check_blob_fields(kind, codec, n_pages, raw_len, stored_len) -> None:
    if kind not in KINDS:
        raise FormatError(f"unknown blob kind {kind}")
    if codec not in CODECS:
        raise FormatError(f"unknown codec id {codec}")
    if kind == KIND_PAGES:
        if not 1 <= n_pages <= MAX_GROUP_PAGES or raw_len != n_pages * PAGE_SIZE:
            raise FormatError("page blob with inconsistent page count / length")
    else:
        if n_pages != 0 or not 1 <= raw_len <= MAX_BLOB_RAW:
            raise FormatError("data blob with bad length / page count")
    if codec == CODEC_NONE:
        if stored_len != raw_len:
            raise FormatError("uncompressed blob whose stored length differs from its length")
    elif not 1 <= stored_len < raw_len:
        raise FormatError("compressed blob not smaller than its raw length")


def parse_blob_header(data, offset: int = 0) -> BlobHeader:
    if offset < 0 or len(data) - offset < BLOB_HEADER.size:
        raise FormatError("truncated blob header")
    magic, kind, codec, n_pages, reserved, raw_len, stored_len = BLOB_HEADER.unpack_from(data, offset)
    if magic != BLOB_MAGIC or reserved:
        raise FormatError("bad blob header magic")
    check_blob_fields(kind, codec, n_pages, raw_len, stored_len)
    return BlobHeader(kind, codec, n_pages, raw_len, stored_len)


def encode_pack_trailer(n_blobs: int) -> bytes:
    return PACK_TRAILER.pack(PACK_TRAILER_MAGIC, n_blobs, 0)


def parse_pack(data) -> list[tuple[int, BlobHeader]]:
    """Walk a whole pack file held in memory: [(offset of blob header, header)].

    Checks magic, version, every blob header, that blobs tile the file exactly and that
    the trailer's count matches. (Hashing the file against its name is the caller's job.)
    """
    parse_pack_header(data)
    size = len(data)
    if size < PACK_HEADER.size + PACK_TRAILER.size:
        raise FormatError("pack too short")
    magic, n_blobs, reserved = PACK_TRAILER.unpack_from(data, size - PACK_TRAILER.size)
    if magic != PACK_TRAILER_MAGIC or reserved:
        raise FormatError("bad pack trailer")
    end = size - PACK_TRAILER.size
    out = []
    pos = PACK_HEADER.size
    while pos < end:
        if len(out) >= n_blobs:
            raise FormatError("more blobs than the trailer says")
        h = parse_blob_header(data, pos)
        nxt = pos + BLOB_HEADER.size + h.stored_len
        if nxt > end:
            raise FormatError(f"blob at offset {pos} runs past the end of the pack")
        out.append((pos, h))
        pos = nxt
    if len(out) != n_blobs:
        raise FormatError(f"pack trailer says {n_blobs} blobs, found {len(out)}")
    return out
