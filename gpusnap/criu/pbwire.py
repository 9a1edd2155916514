"""CRIU image files at the protobuf wire level: the magic words, the length-prefixed
entries, their fields, and the pagemap entries restore writes back (criu/sparse.py).

For the few images a restore reads itself: pycriu's import alone costs 0.06-0.1 s, more
than reading these images. Everything here is read from a snapshot, so lengths are
checked and anything malformed raises ValueError.
"""

from __future__ import annotations

import struct

IMG_COMMON_MAGIC = 0x54564319
IMG_SERVICE_MAGIC = 0x55105940


def varint(buf: bytes, pos: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        v |= (b & 0x7F) << shift
        if not b & 0x80:
            return v, pos
        shift += 7
        if shift > 70:
            raise ValueError("varint too long")


def fields(buf: bytes):
    """(field number, value) of one message: ints for wire type 0, bytes otherwise."""
    pos = 0
    while pos < len(buf):
        key, pos = varint(buf, pos)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, pos = varint(buf, pos)
        elif wt == 2:
            n, pos = varint(buf, pos)
            v = buf[pos:pos + n]
            if len(v) != n:
                raise ValueError("truncated field")
            pos += n
        elif wt == 1:
            v = buf[pos:pos + 8]
            pos += 8
        elif wt == 5:
            v = buf[pos:pos + 4]
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wt}")
        if pos > len(buf):
            raise ValueError("truncated field")
        yield num, v


def header_len(raw: bytes) -> int:
    """Bytes of magic words before the first entry."""
    if len(raw) < 4:
        raise ValueError("image shorter than its magic")
    return 8 if struct.unpack_from("<I", raw, 0)[0] in (IMG_COMMON_MAGIC, IMG_SERVICE_MAGIC) else 4


def entries(raw: bytes):
    """The protobuf entries of a CRIU image (magic words, then u32 length + message each)."""
    if len(raw) < 4:
        return
    pos = header_len(raw)
    while pos + 4 <= len(raw):
        (n,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + n > len(raw):
            raise ValueError("truncated entry")
        yield raw[pos:pos + n]
        pos += n


def _put_varint(out: bytearray, v: int) -> None:
    while v > 0x7F:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)


def pagemap_entry(vaddr: int, nr_pages: int, flags: int | None) -> bytes:
    """A pagemap_entry message (images/pagemap.proto): vaddr, compat_nr_pages 0, flags,
    nr_pages, as CRIU itself writes them."""
    out = bytearray()
    for num, v in ((1, vaddr), (2, 0), (4, flags), (5, nr_pages)):
        if v is not None:
            _put_varint(out, num << 3)
            _put_varint(out, v)
    return bytes(out)


def image(header: bytes, messages: list[bytes]) -> bytes:
    """An image of the magic words `header` and `messages`."""
    out = bytearray(header)
    for m in messages:
        out += struct.pack("<I", len(m)) + m
    return bytes(out)
