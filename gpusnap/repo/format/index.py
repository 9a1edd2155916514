"""Index files (docs/format.md §4): encode, parse."""

from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass

import blake3

from gpusnap.repo.format.common import (BLOB_HEADER, BLOB_ID_LEN, CODEC_NONE, CODECS, FORMAT_VERSION, INDEX_HEADER, INDEX_MAGIC,
                                       INDEX_RECORD, KIND_PAGES, KINDS, MAX_BLOB_RAW, MAX_GROUP_PAGES, MAX_PACK_SIZE,
                                       PACK_HASH_LEN, PACK_HEADER, PACK_TRAILER, PAGE_ID_LEN, PAGE_SIZE, Blob, FormatError)
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


def _parse_head(data) -> tuple[list[bytes], int, int]:
    """Checksum, header and pack list of an index file -> (packs, first record's offset,
    n_blobs), n_blobs checked to fit the file."""
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
    return packs, pos, n_blobs


def parse_index(data: bytes) -> IndexFile:
    """The reference parse: one Blob per record (RepoIndex.load uses parse_index_records)."""
    packs, pos, n_blobs = _parse_head(data)
    n_packs = len(packs)
    end = len(data) - 32
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


# =====================================================================================
# the bulk parse (native/pages/gs_index.c): no Python object per record
# =====================================================================================

REC = struct.Struct("<QIIIIIBBxx")     # gs_index_rec: ids_off, offset, n_pages, raw_len, stored_len, pack_no, kind, codec
_ERRORS = {1: "truncated index record", 2: "unknown blob kind {}", 3: "unknown codec id {}",
           4: "page blob with inconsistent page count / length", 5: "data blob with bad length / page count",
           6: "uncompressed blob whose stored length differs from its length",
           7: "compressed blob not smaller than its raw length", 8: "index record names a pack out of range",
           9: "index record offset out of range", 10: "truncated index ids", 11: "trailing bytes in index file"}
_params = None


def _limits() -> array:
    global _params
    if _params is None:
        _params = array("Q", [sum(1 << k for k in KINDS), sum(1 << c for c in CODECS), KIND_PAGES, CODEC_NONE,
                              MAX_GROUP_PAGES, PAGE_SIZE, MAX_BLOB_RAW, MAX_PACK_SIZE, PACK_HEADER.size,
                              BLOB_HEADER.size, PACK_TRAILER.size])
    return _params


@dataclass(slots=True)
class IndexRecords:
    """One index file parsed in bulk: `recs` holds n REC entries (the kept records, in file
    order) pointing into `data` (the file); pack_flags[pack_no]: 1 records left out because
    the pack is missing, 2 because it is too short; pack_end[pack_no]: the largest end
    (Blob.end) of a kept record; pages: page count of the kept page blobs."""
    data: bytes
    packs: list[bytes]
    recs: bytearray
    n: int
    pages: int
    pack_flags: bytearray
    pack_end: array

    def blobs(self) -> list[Blob]:
        """Every kept record as a Blob, in order (what parse_index would have built)."""
        packs, data, out = self.packs, self.data, []
        for ids_off, offset, n_pages, raw_len, stored_len, pack_no, kind, codec in REC.iter_unpack(
                memoryview(self.recs)[:self.n * REC.size]):
            idlen = n_pages * PAGE_ID_LEN if kind == KIND_PAGES else BLOB_ID_LEN
            out.append(Blob(packs[pack_no], offset, kind, codec, n_pages, raw_len, stored_len,
                            data[ids_off:ids_off + idlen]))
        return out

    def fields(self, i: int) -> tuple:
        """Record i's Blob.fields(), without building the Blob (its ids are not copied)."""
        if not 0 <= i < self.n:
            raise IndexError("blob record out of range")
        _, offset, n_pages, raw_len, stored_len, pack_no, kind, codec = REC.unpack_from(self.recs, i * REC.size)
        return self.packs[pack_no], offset, kind, codec, n_pages, raw_len, stored_len

    def blob(self, i: int) -> Blob:
        if not 0 <= i < self.n:
            raise IndexError("blob record out of range")
        ids_off, offset, n_pages, raw_len, stored_len, pack_no, kind, codec = REC.unpack_from(self.recs, i * REC.size)
        idlen = n_pages * PAGE_ID_LEN if kind == KIND_PAGES else BLOB_ID_LEN
        return Blob(self.packs[pack_no], offset, kind, codec, n_pages, raw_len, stored_len,
                    self.data[ids_off:ids_off + idlen])


def parse_index_records(data: bytes, pack_size=None) -> IndexRecords:
    """parse_index's checks (the same FormatError for the same damage) without a Blob per
    record. pack_size(packs) -> array('q') of their sizes (-1: missing), or None: every
    record is kept; with it, the records whose data is not in the pack are left out."""
    from gpusnap.repo import native

    packs, pos, n_blobs = _parse_head(data)
    sizes = pack_size(packs) if pack_size is not None else None
    r, val, recs, pages, flags, ends = native.index_parse(data, pos, len(packs), n_blobs, _limits(), sizes)
    if r < 0:
        raise FormatError(_ERRORS.get(-r, "bad index record {}").format(val))
    return IndexRecords(data, packs, recs, r, pages, flags, ends)
