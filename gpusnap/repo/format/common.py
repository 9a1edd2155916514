"""What every file kind of the format shares (docs/format.md §1-2): sizes, codec and blob
kind ids, magics and record layouts, names, FormatError, the id functions and the one blob
record.

Every parser in this package treats its input as hostile: all lengths, offsets, counts and
codec ids are validated before use; malformed input raises FormatError (never IndexError,
struct.error, MemoryError from an attacker-chosen size, or a hang). Callers turn
FormatError into CorruptSnapshot / RepositoryError with the file's name attached.
"""

from __future__ import annotations

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


@dataclass(frozen=True, slots=True)
class Blob:
    """One blob in a pack: what an index record says (§4), what the pack writer reports,
    what repair reads back from a pack. pack: the pack's name (b"" for a blob whose pack
    is still being written); offset: of its blob header in the pack; ids: KIND_PAGES:
    n_pages*16 bytes of page ids, KIND_DATA: the 32-byte blob id."""
    pack: bytes
    offset: int
    kind: int
    codec: int
    n_pages: int
    raw_len: int
    stored_len: int
    ids: bytes

    def fields(self) -> tuple:
        """(pack, offset, kind, codec, n_pages, raw_len, stored_len): where the blob is and
        what it holds, without its ids (a locations file's runs need no more)."""
        return self.pack, self.offset, self.kind, self.codec, self.n_pages, self.raw_len, self.stored_len

    @property
    def end(self) -> int:
        """The smallest size of a pack that holds this blob and a trailer."""
        return self.offset + BLOB_HEADER.size + self.stored_len + PACK_TRAILER.size


# Readers build images in chunks of READ_CHUNK; an all-zero chunk is this one object, so
# that a consumer can tell it apart (a hole) without looking at its bytes.
READ_CHUNK = 1 << 20
ZERO_CHUNK = bytes(READ_CHUNK)
