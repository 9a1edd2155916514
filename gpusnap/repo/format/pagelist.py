"""Page lists (docs/format.md §5.2): encode records, parse."""

from __future__ import annotations

from gpusnap.repo.format.common import (BLOB_ID_LEN, PAGE_ID_LEN, PAGE_SIZE, PL_PAGES, PL_RECORD, PL_TAIL, PL_ZERO, FormatError)


PL_COUNT_MAX = (1 << 32) - 1    # what a record's u32 count holds


def encode_pl_zero(count: int) -> bytes:
    """A zero run: one record, or more where count passes a record's u32 (16 TiB)."""
    full, rest = divmod(count, PL_COUNT_MAX)
    return PL_RECORD.pack(PL_ZERO, PL_COUNT_MAX) * full + (PL_RECORD.pack(PL_ZERO, rest) if rest else b"")


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
