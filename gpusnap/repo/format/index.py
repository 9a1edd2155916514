"""Index files (docs/format.md §4): encode, parse."""

from __future__ import annotations

from dataclasses import dataclass

import blake3

from gpusnap.repo.format.common import (BLOB_HEADER, BLOB_ID_LEN, FORMAT_VERSION, INDEX_HEADER, INDEX_MAGIC, INDEX_RECORD, KIND_PAGES,
                                       MAX_PACK_SIZE, PACK_HASH_LEN, PACK_HEADER, PAGE_ID_LEN, Blob,
                                       FormatError)
from gpusnap.repo.format.pack import check_blob_fields


@dataclass(slots=True)
class IndexFile:
    packs: list[bytes]     # 32-byte pack names, in file order
    blobs: list[Blob]      # each names its pack (one of `packs`)


def encode_index(packs: list[bytes], blobs: list[Blob]) -> bytes:
    """The index file listing `packs` (in this order) and `blobs` (each in one of them)."""
    pack_no = {ph: i for i, ph in enumerate(packs)}
    parts = [INDEX_HEADER.pack(INDEX_MAGIC, FORMAT_VERSION, 0, len(packs), len(blobs))]
    parts.extend(packs)
    for b in blobs:
        parts.append(INDEX_RECORD.pack(pack_no[b.pack], b.offset, b.kind, b.codec, b.n_pages, b.raw_len, b.stored_len))
        parts.append(b.ids)
    body = b"".join(parts)
    return body + blake3.blake3(body).digest()


def parse_index(data: bytes) -> IndexFile:
    n = len(data)
    if n < INDEX_HEADER.size + 32:
        raise FormatError("index file too short")
    body = memoryview(data)[: n - 32]
    if blake3.blake3(body).digest() != data[n - 32:]:
        raise FormatError("index file checksum mismatch")
    magic, version, flags, n_packs, n_blobs = INDEX_HEADER.unpack_from(data, 0)
    if magic != INDEX_MAGIC:
        raise FormatError("bad index magic")
    if version != FORMAT_VERSION or flags:
        raise FormatError(f"unsupported index version {version}/flags {flags}")
    end = n - 32
    pos = INDEX_HEADER.size
    if n_packs > (end - pos) // PACK_HASH_LEN:
        raise FormatError("index pack count exceeds file size")
    packs = [bytes(data[pos + i * 32: pos + i * 32 + 32]) for i in range(n_packs)]
    if len(set(packs)) != len(packs):
        raise FormatError("index lists a pack twice")
    pos += n_packs * 32
    if n_blobs > (end - pos) // (INDEX_RECORD.size + BLOB_ID_LEN // 2):
        raise FormatError("index blob count exceeds file size")
    blobs = []
    rec = INDEX_RECORD
    for _ in range(n_blobs):
        if end - pos < rec.size:
            raise FormatError("truncated index record")
        pack_no, offset, kind, codec, n_pages, raw_len, stored_len = rec.unpack_from(data, pos)
        pos += rec.size
        check_blob_fields(kind, codec, n_pages, raw_len, stored_len)
        if pack_no >= n_packs:
            raise FormatError("index record names a pack out of range")
        if offset < PACK_HEADER.size or offset + BLOB_HEADER.size + stored_len > MAX_PACK_SIZE:
            raise FormatError("index record offset out of range")
        idlen = n_pages * PAGE_ID_LEN if kind == KIND_PAGES else BLOB_ID_LEN
        if end - pos < idlen:
            raise FormatError("truncated index ids")
        blobs.append(Blob(packs[pack_no], offset, kind, codec, n_pages, raw_len, stored_len, bytes(data[pos:pos + idlen])))
        pos += idlen
    if pos != end:
        raise FormatError("trailing bytes in index file")
    return IndexFile(packs, blobs)
