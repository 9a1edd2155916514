"""Pack files read: where a pack lives, which packs are there (the one listing of packs/),
and BlobReader (a blob read, its header checked against its record, decompressed)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gpusnap.repo.codec import decompress, decompress_into
from gpusnap.repo import fsutil, native
from gpusnap.repo.format import BLOB_HEADER, CODEC_NONE, HEX64, KIND_PAGES, PAGE_ID_LEN, PAGE_SIZE, Blob, FormatError, blob_id, page_id, parse_blob_header

_ZERO_PAGE_ID = page_id(bytes(PAGE_SIZE))


def pack_path(root: Path, pack_hash: bytes) -> Path:
    h = pack_hash.hex()
    return root / "packs" / h[:2] / h


def list_packs(root: Path) -> tuple[list[bytes], list[str]]:
    """-> (names of the pack files in packs/ab/: regular files named by 64 hex digits starting
    with ab, sorted; every other entry there, as a 'packs/...' path: left alone)."""
    present: list[bytes] = []
    other: list[str] = []
    pdir = root / "packs"
    for sub in sorted(os.listdir(pdir)):
        sp = pdir / sub
        if len(sub) != 2 or not stat.S_ISDIR(os.lstat(sp).st_mode):
            other.append(f"packs/{sub}")
            continue
        for f in sorted(os.listdir(sp)):
            if HEX64.match(f) and f.startswith(sub) and stat.S_ISREG(os.lstat(sp / f).st_mode):
                present.append(bytes.fromhex(f))
            else:
                other.append(f"packs/{sub}/{f}")
    return present, other


def pack_sizes(root: Path, packs) -> dict[bytes, int | None]:
    """pack name -> its size in bytes, or None when it is missing (never follows a symlink
    as a pack: a symlink counts as missing)."""
    out: dict[bytes, int | None] = {}
    for ph in packs:
        try:
            st = os.lstat(pack_path(root, ph))
        except (FileNotFoundError, NotADirectoryError):
            out[ph] = None
            continue
        out[ph] = st.st_size if stat.S_ISREG(st.st_mode) else None
    return out


def decode_blob(data, pos: int, offset: int, kind: int, codec: int, n_pages: int, raw_len: int,
                stored_len: int, out=None, python: bool = False) -> bytes | bytearray | None:
    """The payload of the blob whose header is at data[pos:] (at `offset` in its pack),
    after checking the header against its record (kind..stored_len), decompressed; with
    out (a writable view of raw_len bytes), decompressed into it and None returned. Raises
    FormatError.

    Compressed payloads are decoded by the native library (native.decode_payload), so that
    no reader loads python-lz4 or zstandard; a payload it refuses is handed to the Python
    decoder (codec.decompress) for the reason in its words, as the pages reader does.
    python=True decodes with the Python decoder only (the reference the tests compare with)."""
    if len(data) - pos < BLOB_HEADER.size + stored_len:
        raise FormatError(f"blob at offset {offset} runs past the end of the pack")
    h = parse_blob_header(data, pos)
    if (h.kind, h.codec, h.n_pages, h.raw_len, h.stored_len) != (kind, codec, n_pages, raw_len, stored_len):
        raise FormatError(f"blob header at offset {offset} disagrees with the index")
    start = pos + BLOB_HEADER.size
    if codec == CODEC_NONE:
        if stored_len != raw_len:
            raise FormatError("stored length differs from raw length")
        if out is not None:
            out[:] = memoryview(data)[start:start + stored_len]
            return None
        return bytes(memoryview(data)[start:start + stored_len])
    if python:
        payload = memoryview(data)[start:start + stored_len]
        if out is not None:
            decompress_into(payload, codec, out)
            return None
        return decompress(payload, codec, raw_len)
    target = bytearray(raw_len) if out is None else out
    bad = native.decode_payload(data, start, stored_len, codec, target)
    if bad is not None:
        decompress(memoryview(data)[start:start + stored_len], codec, raw_len)   # raises, in its words
        raise FormatError(bad[1])
    return None if out is not None else target


def check_decoded(raw, b: Blob) -> str | None:
    """A decoded blob checked against its record's ids (the native batch page verifier for
    pages, format.blob_id for data): -> what is wrong, or None."""
    if b.kind == KIND_PAGES:
        bad = native.verify(raw, b.n_pages, b.ids)
        if bad >= 0:
            return f"page {bad} of the blob at offset {b.offset} fails its checksum"
    elif blob_id(raw) != b.ids:
        return f"data blob at offset {b.offset} fails its checksum"
    return None



def decoded_ids(kind: int, n_pages: int, raw) -> bytes:
    """The ids of a decoded blob, from its content: one native batch scan for pages (a zero
    page gets format.page_id's id; the writer never groups one, but its id is defined),
    format.blob_id for data."""
    if kind != KIND_PAGES:
        return blob_id(raw)
    kinds, ids, _ = native.scan(raw, n_pages)
    for i in range(n_pages):
        if not kinds[i]:
            ids[i * PAGE_ID_LEN:(i + 1) * PAGE_ID_LEN] = _ZERO_PAGE_ID
    return bytes(ids)


class BlobReader:
    """Reads blobs: each checked against its record (header fields), then decompressed.
    Keeps up to max_fds packs open. One per reading thread (not shared), so no locking."""

    def __init__(self, root: Path, max_fds: int = 16):
        self.root = root
        self.fds: dict[bytes, int] = {}
        self.max_fds = max_fds

    def close(self) -> None:
        fsutil.close_all(self.fds)

    def fd(self, pack: bytes) -> int:
        """An open fd of the pack (kept; closed by close()). Raises OSError."""
        fd = self.fds.get(pack)
        if fd is None:
            if len(self.fds) >= self.max_fds:
                k = next(iter(self.fds))
                os.close(self.fds.pop(k))
            fd = os.open(pack_path(self.root, pack), os.O_RDONLY | os.O_CLOEXEC)
            self.fds[pack] = fd
        return fd

    def read_at(self, pack: bytes, offset: int, kind: int, codec: int, n_pages: int, raw_len: int,
                stored_len: int, out=None, python: bool = False) -> bytes | bytearray | None:
        """The blob at `offset` of `pack`, whose record says kind..stored_len: read, header
        checked against the record, decompressed (into out, and python, as decode_blob).
        Raises FormatError / OSError."""
        want = BLOB_HEADER.size + stored_len
        data = os.pread(self.fd(pack), want, offset)
        if len(data) != want:
            raise FormatError(f"pack truncated: blob at offset {offset} cut short")
        return decode_blob(data, 0, offset, kind, codec, n_pages, raw_len, stored_len, out, python)

    def read_raw(self, b: Blob) -> bytes:
        """read_at() for a blob record."""
        return self.read_at(b.pack, b.offset, b.kind, b.codec, b.n_pages, b.raw_len, b.stored_len)
