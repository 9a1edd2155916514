"""Export files (docs/format.md §11), version 1: the layout every reader and writer of
them shares (magic, header, record head, tags, the sizes a record may have)."""

from __future__ import annotations

import struct

MAGIC = b"GSNEXP\0\0"
VERSION = 1
HEADER = struct.Struct("<8sHHI")          # magic, version, flags, reserved
RECORD = struct.Struct("<BBHII")          # tag, codec, reserved, raw_len, stored_len
TAG_MANIFEST, TAG_PAGELIST, TAG_DATA, TAG_END = 1, 2, 3, 0xFF
DATA_RAW_MAX = 1 << 20                    # raw bytes per data record (the writer's; a reader allows 4 MiB)
READER_DATA_MAX = 4 << 20
