"""On-disk format of a gpusnap repository, version 1 (docs/format.md, byte by byte).

Every parser here treats its input as hostile: all lengths, offsets, counts and codec
ids are validated before use; malformed input raises FormatError (never IndexError,
struct.error, MemoryError from an attacker-chosen size, or a hang). Callers turn
FormatError into CorruptSnapshot / RepositoryError with the file's name attached.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass

import blake3

FORMAT_VERSION = 1
PAGE_SIZE = 4096
PAGE_ID_LEN = 16          # page id = first 16 bytes of blake3(page)
BLOB_ID_LEN = 32          # data blob id = blake3(raw bytes), 32 bytes
PACK_HASH_LEN = 32        # pack name = blake3 of the pack's descriptor (§3; old packs: of the whole file)

# ---- codecs -------------------------------------------------------------------------
CODEC_NONE = 0
CODEC_LZ4 = 1
CODEC_ZSTD = 2
CODEC_SHUF4_ZSTD = 3      # byte planes of 4-byte elements (fp32), each plane zstd or raw
CODEC_SHUF2_ZSTD = 4      # the same for 2-byte elements (bf16/fp16)
CODECS = {CODEC_NONE: "none", CODEC_LZ4: "lz4", CODEC_ZSTD: "zstd",
          CODEC_SHUF4_ZSTD: "shuffle4-zstd", CODEC_SHUF2_ZSTD: "shuffle2-zstd"}
CODEC_BY_NAME = {v: k for k, v in CODECS.items()}

# ---- blob kinds ---------------------------------------------------------------------
KIND_PAGES = 1            # n_pages (1..MAX_GROUP_PAGES) whole 4 KiB pages
KIND_DATA = 2             # bytes of a non-pages image chunk (or a partial trailing page)
KINDS = (KIND_PAGES, KIND_DATA)

MAX_GROUP_PAGES = 256     # format limit; the writer uses a smaller group (see compression.md)
MAX_BLOB_RAW = 4 << 20    # format limit on a blob's uncompressed length
MAX_PACK_SIZE = (1 << 32) - 1
MAX_MANIFEST = 256 << 20
MAX_CONFIG = 1 << 20

# ---- packs --------------------------------------------------------------------------
PACK_MAGIC = b"GSNPACK\x00"
PACK_HEADER = struct.Struct("<8sHHI")        # magic, version, flags, reserved  (16 bytes)
BLOB_MAGIC = b"GB"
BLOB_HEADER = struct.Struct("<2sBBHHII")     # magic, kind, codec, n_pages, reserved, raw_len, stored_len (16)
PACK_TRAILER_MAGIC = b"GSNPEND\x00"
PACK_TRAILER = struct.Struct("<8sII")        # magic, n_blobs, reserved (16 bytes)
PACK_NAME_MAGIC = b"GSNPNAME"                # first 8 bytes of a pack's descriptor (docs/format.md §3)

# ---- index files --------------------------------------------------------------------
INDEX_MAGIC = b"GSNIDX\x00\x00"
INDEX_HEADER = struct.Struct("<8sHHII")      # magic, version, flags, n_packs, n_blobs (20 bytes)
INDEX_RECORD = struct.Struct("<IIBBHII")     # pack_no, offset, kind, codec, n_pages, raw_len, stored_len (20)

# ---- page lists ---------------------------------------------------------------------
PL_ZERO = 0x01
PL_PAGES = 0x02
PL_TAIL = 0x03
PL_RECORD = struct.Struct("<BI")             # tag, count (5 bytes)

MANIFEST_TRAILER_PREFIX = b"\nblake3:"
MANIFEST_TRAILER_LEN = len(MANIFEST_TRAILER_PREFIX) + 64 + 1

HEX64 = re.compile(r"[0-9a-f]{64}\Z")
PAGELIST_NAME = re.compile(r"pl-[0-9]{6}\Z")
SNAPSHOT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}\Z")


class FormatError(ValueError):
    """Malformed on-disk data. The message says what is wrong, without the file name."""


def page_id(page) -> bytes:
    return blake3.blake3(page).digest(PAGE_ID_LEN)


def blob_id(data) -> bytes:
    return blake3.blake3(data).digest()


# =====================================================================================
# config
# =====================================================================================

def make_config(repo_id: str, created: float) -> dict:
    return {
        "format": "gpusnap-repository",
        "version": FORMAT_VERSION,
        "id": repo_id,
        "created": created,
        "page_size": PAGE_SIZE,
        "page_id": "blake3-128",
        "blob_id": "blake3-256",
        "pack_name": "blake3-256",
    }


def encode_config(cfg: dict) -> bytes:
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()


def parse_config(data: bytes) -> dict:
    if len(data) > MAX_CONFIG:
        raise FormatError("config file too large")
    try:
        cfg = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"config is not valid JSON: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("format") != "gpusnap-repository":
        raise FormatError("not a gpusnap repository config")
    v = cfg.get("version")
    if type(v) is not int:
        raise FormatError("config has no integer version")
    if v != FORMAT_VERSION:
        raise FormatError(f"repository format version {v} is not supported (this gpusnap reads version {FORMAT_VERSION})")
    expect = {"page_size": PAGE_SIZE, "page_id": "blake3-128", "blob_id": "blake3-256", "pack_name": "blake3-256"}
    for k, want in expect.items():
        if cfg.get(k) != want:
            raise FormatError(f"config {k}={cfg.get(k)!r} is not supported (expected {want!r})")
    if not isinstance(cfg.get("id"), str) or not re.fullmatch(r"[0-9a-f]{32}", cfg["id"]):
        raise FormatError("config id malformed")
    return cfg


# =====================================================================================
# packs
# =====================================================================================

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


# =====================================================================================
# index files
# =====================================================================================

@dataclass(slots=True)
class IndexBlob:
    pack_no: int          # into IndexFile.packs
    offset: int           # offset of the blob header in the pack
    kind: int
    codec: int
    n_pages: int
    raw_len: int
    stored_len: int
    ids: bytes            # KIND_PAGES: n_pages*16 bytes of page ids; KIND_DATA: 32-byte blob id


@dataclass(slots=True)
class IndexFile:
    packs: list[bytes]     # 32-byte pack hashes
    blobs: list[IndexBlob]


def encode_index(packs: list[bytes], blobs: list[IndexBlob]) -> bytes:
    parts = [INDEX_HEADER.pack(INDEX_MAGIC, FORMAT_VERSION, 0, len(packs), len(blobs))]
    parts.extend(packs)
    for b in blobs:
        parts.append(INDEX_RECORD.pack(b.pack_no, b.offset, b.kind, b.codec, b.n_pages, b.raw_len, b.stored_len))
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
        blobs.append(IndexBlob(pack_no, offset, kind, codec, n_pages, raw_len, stored_len, bytes(data[pos:pos + idlen])))
        pos += idlen
    if pos != end:
        raise FormatError("trailing bytes in index file")
    return IndexFile(packs, blobs)


# =====================================================================================
# page lists
# =====================================================================================

def encode_pl_zero(count: int) -> bytes:
    return PL_RECORD.pack(PL_ZERO, count)


def encode_pl_pages(ids: list[bytes]) -> bytes:
    return PL_RECORD.pack(PL_PAGES, len(ids)) + b"".join(ids)


def encode_pl_tail(length: int, bid: bytes) -> bytes:
    return PL_RECORD.pack(PL_TAIL, length) + bid


MAX_PL_RUN = 1 << 20      # ids per PL_PAGES record (parser reads them in pieces anyway)


def iter_pagelist(read, image_size: int, piece: int = 4096):
    """Parse a page list from `read(n) -> bytes` (a file's read).

    Yields ("zero", count) / ("pages", bytes of k*16 ids, k <= piece) / ("tail", length, blob_id).
    Validates that the records describe exactly `image_size` bytes.
    """
    covered = 0
    tail_seen = False
    while True:
        hdr = read(PL_RECORD.size)
        if not hdr:
            break
        if len(hdr) != PL_RECORD.size:
            raise FormatError("truncated page list record")
        tag, count = PL_RECORD.unpack(hdr)
        if tail_seen:
            raise FormatError("page list continues after its tail record")
        if tag == PL_ZERO:
            if count < 1:
                raise FormatError("empty zero run")
            covered += count * PAGE_SIZE
            if covered > image_size:
                raise FormatError("page list longer than the image")
            yield ("zero", count)
        elif tag == PL_PAGES:
            if not 1 <= count <= MAX_PL_RUN:
                raise FormatError("bad page run length")
            covered += count * PAGE_SIZE
            if covered > image_size:
                raise FormatError("page list longer than the image")
            left = count
            while left:
                k = min(left, piece)
                ids = read(k * PAGE_ID_LEN)
                if len(ids) != k * PAGE_ID_LEN:
                    raise FormatError("truncated page ids")
                yield ("pages", ids)
                left -= k
        elif tag == PL_TAIL:
            if not 1 <= count < PAGE_SIZE:
                raise FormatError("bad tail length")
            bid = read(BLOB_ID_LEN)
            if len(bid) != BLOB_ID_LEN:
                raise FormatError("truncated tail id")
            covered += count
            tail_seen = True
            if covered > image_size:
                raise FormatError("page list longer than the image")
            yield ("tail", count, bid)
        else:
            raise FormatError(f"unknown page list record tag {tag}")
    if covered != image_size:
        raise FormatError(f"page list describes {covered} bytes, image has {image_size}")


# =====================================================================================
# manifest
# =====================================================================================

def encode_manifest(body: dict) -> tuple[bytes, str]:
    """-> (file bytes, snapshot id). The id is the first 16 hex digits of blake3(body)."""
    raw = json.dumps(body, indent=1, sort_keys=True).encode()
    h = blake3.blake3(raw).hexdigest()
    return raw + MANIFEST_TRAILER_PREFIX + h.encode() + b"\n", h[:16]


def _is_int(v, lo=0, hi=(1 << 63) - 1):
    return type(v) is int and lo <= v <= hi


def valid_image_name(name) -> bool:
    return (isinstance(name, str) and 0 < len(name) <= 255 and "/" not in name and "\x00" not in name
            and name not in (".", ".."))


def parse_manifest(data: bytes) -> tuple[dict, str]:
    """-> (manifest dict, snapshot id). Validates the checksum trailer and the schema."""
    if len(data) > MAX_MANIFEST:
        raise FormatError("manifest too large")
    if len(data) < MANIFEST_TRAILER_LEN + 2:
        raise FormatError("manifest too short")
    trailer = data[-MANIFEST_TRAILER_LEN:]
    if not trailer.startswith(MANIFEST_TRAILER_PREFIX) or not trailer.endswith(b"\n"):
        raise FormatError("manifest has no checksum trailer")
    want = trailer[len(MANIFEST_TRAILER_PREFIX):-1]
    body = data[:-MANIFEST_TRAILER_LEN]
    h = blake3.blake3(body).hexdigest()
    if h.encode() != want:
        raise FormatError("manifest checksum mismatch")
    try:
        m = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"manifest is not valid JSON: {e}") from None
    check_manifest(m)
    return m, h[:16]


def check_manifest(m) -> None:
    if not isinstance(m, dict):
        raise FormatError("manifest is not an object")
    if m.get("format") != "gpusnap-snapshot":
        raise FormatError("not a gpusnap snapshot manifest")
    if m.get("version") != FORMAT_VERSION or type(m.get("version")) is not int:
        raise FormatError(f"unsupported snapshot version {m.get('version')!r}")
    if not isinstance(m.get("name"), str) or not SNAPSHOT_NAME.match(m["name"]):
        raise FormatError("manifest name malformed")
    if type(m.get("created")) not in (int, float) or not 0 <= m["created"] < 1e11:
        raise FormatError("manifest created time malformed")
    if not isinstance(m.get("meta"), dict):
        raise FormatError("manifest meta malformed")
    if not isinstance(m.get("stats"), dict):
        raise FormatError("manifest stats malformed")
    if not isinstance(m.get("repo_id"), str):
        raise FormatError("manifest repo_id malformed")
    imgs = m.get("images")
    if not isinstance(imgs, list):
        raise FormatError("manifest images malformed")
    seen = set()
    pls = set()
    for im in imgs:
        if not isinstance(im, dict):
            raise FormatError("image entry malformed")
        name = im.get("name")
        if not valid_image_name(name) or name in seen:
            raise FormatError(f"image name malformed or repeated: {name!r}")
        seen.add(name)
        if not _is_int(im.get("size")):
            raise FormatError(f"image {name}: size malformed")
        if not isinstance(im.get("digest"), str) or not HEX64.match(im["digest"]):
            raise FormatError(f"image {name}: digest malformed")
        t = im.get("type")
        if t == "pages":
            pl = im.get("pagelist")
            if not isinstance(pl, str) or not PAGELIST_NAME.match(pl) or pl in pls:
                raise FormatError(f"image {name}: pagelist malformed")
            pls.add(pl)
            if not _is_int(im.get("pagelist_size")):
                raise FormatError(f"image {name}: pagelist_size malformed")
        elif t == "blob":
            blobs = im.get("blobs")
            if not isinstance(blobs, list) or not all(isinstance(b, str) and HEX64.match(b) for b in blobs):
                raise FormatError(f"image {name}: blob list malformed")
            if (im["size"] == 0) != (len(blobs) == 0) or len(blobs) > im["size"]:
                raise FormatError(f"image {name}: blob list inconsistent with size")
        else:
            raise FormatError(f"image {name}: unknown type {t!r}")


# Restore reads images in chunks of READ_CHUNK; ready-made zero pages, zero page ids and
# page-kind bytes for whole chunks save an allocation per chunk.
READ_CHUNK = 1 << 20
_ZCHUNK = bytes(READ_CHUNK)
_ZVIEW = memoryview(_ZCHUNK)
_ZIDS = bytes(READ_CHUNK // PAGE_SIZE * PAGE_ID_LEN)
_ZKINDS = bytes(READ_CHUNK // PAGE_SIZE)
_ONES = b"\x01" * (READ_CHUNK // PAGE_SIZE)
