"""Protobuf at the wire level, the one decoder (and encoder) of gpusnap: varints, the fields
of a message, and the framing of CRIU's image files (magic words, then length-prefixed
entries). criu/images.py reads the images through it, criu/protocol.py the image-streamer
messages.

Hand-written because pycriu's import alone costs 0.06-0.1 s, more than reading the images a
restore needs. Everything decoded here comes from a snapshot or a peer, so every length is
checked and anything malformed raises ValueError.
"""

from __future__ import annotations

import struct

IMG_COMMON_MAGIC = 0x54564319
IMG_SERVICE_MAGIC = 0x55105940
# a 64-bit value takes at most 10 bytes (7 bits each); a longer varint is malformed
MAX_VARINT_BYTES = 10


def varint(buf: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it) of the varint at `pos`."""
    v = 0
    for i in range(MAX_VARINT_BYTES):
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        v |= (b & 0x7F) << (7 * i)
        if not b & 0x80:
            return v, pos
    raise ValueError("varint too long")


def encode_varint(v: int) -> bytes:
    out = bytearray()
    while v > 0x7F:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def wire_fields(buf: bytes):
    """(field number, wire type, value) of one message: an int for wire type 0, bytes for the
    others (2: the length-delimited bytes; 1 and 5: the 8 or 4 raw bytes)."""
    pos = 0
    while pos < len(buf):
        key, pos = varint(buf, pos)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, pos = varint(buf, pos)
        elif wt == 2:
            n, pos = varint(buf, pos)
            if n > len(buf) - pos:
                raise ValueError("truncated field")
            v = buf[pos:pos + n]
            pos += n
        elif wt in (1, 5):
            n = 8 if wt == 1 else 4
            if n > len(buf) - pos:
                raise ValueError("truncated field")
            v = buf[pos:pos + n]
            pos += n
        else:
            raise ValueError(f"unsupported wire type {wt}")
        yield num, wt, v


def fields(buf: bytes):
    """(field number, value) of one message: ints for wire type 0, bytes otherwise."""
    for num, _, v in wire_fields(buf):
        yield num, v


def packed(buf: bytes) -> list[int]:
    """The values of a packed repeated varint field."""
    out, pos = [], 0
    while pos < len(buf):
        v, pos = varint(buf, pos)
        out.append(v)
    return out


def header_len(raw: bytes) -> int:
    """Bytes of magic words before the first entry."""
    if len(raw) < 4:
        raise ValueError("image shorter than its magic")
    return 8 if struct.unpack_from("<I", raw, 0)[0] in (IMG_COMMON_MAGIC, IMG_SERVICE_MAGIC) else 4


def entries(raw: bytes, magic: int | None = None):
    """The protobuf entries of a CRIU image (magic words, then u32 length + message each).
    With `magic`, the image must be of that kind (images/magic.h); an empty image has none."""
    if len(raw) < 4:
        return
    pos = header_len(raw)
    if magic is not None and (len(raw) < pos or struct.unpack_from("<I", raw, pos - 4)[0] != magic):
        raise ValueError(f"not an image of magic {magic:#x}")
    while pos + 4 <= len(raw):
        (n,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if n > len(raw) - pos:
            raise ValueError("truncated entry")
        yield raw[pos:pos + n]
        pos += n


def pagemap_entry(vaddr: int, nr_pages: int, flags: int | None) -> bytes:
    """A pagemap_entry message (images/pagemap.proto): vaddr, compat_nr_pages 0, flags,
    nr_pages, as CRIU itself writes them."""
    out = bytearray()
    for num, v in ((1, vaddr), (2, 0), (4, flags), (5, nr_pages)):
        if v is not None:
            out += encode_varint(num << 3) + encode_varint(v)
    return bytes(out)


def image(header: bytes, messages: list[bytes]) -> bytes:
    """An image of the magic words `header` and `messages`."""
    out = bytearray(header)
    for m in messages:
        out += struct.pack("<I", len(m)) + m
    return bytes(out)
