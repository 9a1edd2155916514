"""Per-snapshot locations files (docs/format.md §5.4): where every page and data blob of a
snapshot lies (pack, blob, slot), in the order the images need them. Parse (in pieces,
with pread: restore never holds the whole file) and encode."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Callable, Iterator

import blake3

from gpusnap.repo.format.common import BLOB_HEADER, KIND_PAGES, FormatError
from gpusnap.repo.format.pack import check_blob_fields

LOC_NAME = "locations"
LOC_MAGIC = b"GSNLOC\x00\x00"
LOC_VERSION = 1
LOC_HEADER = struct.Struct("<8sHHIIIQ")        # magic, version, flags, n_images, n_packs, reserved, n_runs (32)
LOC_PACK = struct.Struct("<32sQ")              # pack name, min size (40)
LOC_IMAGE = struct.Struct("<32sQQ")            # image digest, first run, run count (48)
LOC_RUN = struct.Struct("<IIBBHIIHH")          # pack_no, offset, kind, codec, n_pages, raw_len, stored_len, slot, count (24)
RUN_PIECE = 4096                               # runs read per pread (96 KiB)
HASH_PIECE = 1 << 20
MAX_IMAGES = 1 << 20


class LocationsInvalid(FormatError):
    """The locations file cannot be used (missing, damaged, stale): readers build one from
    the repository index instead (Snapshot.reading_locations)."""


class Locations:
    """An opened, checked locations file. Thread-safe: every read is a pread on one fd
    (kept open, so a file replaced by prune after the check is never mixed in)."""

    def __init__(self, pread, fd: int, size: int, n_packs: int, images: list[tuple[int, int]], packs_off: int,
                 runs_off: int):
        self._pr = pread
        self.fd = fd
        self.size = size
        self.n_packs = n_packs
        self.images = images            # per manifest image: (first run, run count)
        self.packs_off = packs_off
        self.runs_off = runs_off

    # -- opening -------------------------------------------------------------------------
    @classmethod
    def open(cls, snap_dir: Path, digests: list[bytes]) -> "Locations":
        """Open and check snapshot_dir/locations against the manifest's image digests
        (manifest order). Raises LocationsInvalid."""
        try:
            fd = os.open(Path(snap_dir) / LOC_NAME, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise LocationsInvalid("no locations file") from None
        except OSError as e:
            raise LocationsInvalid(f"locations file unreadable: {e}") from None
        try:
            size = os.fstat(fd).st_size
            return cls.parse(lambda n, off: os.pread(fd, n, off), size, digests, fd)
        except OSError as e:
            os.close(fd)
            raise LocationsInvalid(f"locations file unreadable: {e}") from None
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def from_bytes(cls, data: bytes, digests: list[bytes]) -> "Locations":
        """A file held in memory (one built from the index). Raises LocationsInvalid."""
        return cls.parse(lambda n, off: data[off:off + n], len(data), digests)

    @classmethod
    def parse(cls, pread: Callable[[int, int], bytes], size: int, digests: list[bytes], fd: int = -1) -> "Locations":
        """Check header, checksum, binding to the images and every run's fields (the file is
        read twice, in pieces: hash, then runs). Raises LocationsInvalid."""
        if size < LOC_HEADER.size + 32:
            raise LocationsInvalid("locations file too short")
        hdr = pread(LOC_HEADER.size, 0)
        if len(hdr) != LOC_HEADER.size:
            raise LocationsInvalid("locations file truncated")
        magic, version, flags, n_images, n_packs, reserved, n_runs = LOC_HEADER.unpack(hdr)
        if magic != LOC_MAGIC:
            raise LocationsInvalid("bad locations magic")
        if version != LOC_VERSION or flags or reserved:
            raise LocationsInvalid(f"unsupported locations version {version}/flags {flags}")
        if n_images != len(digests) or n_images > MAX_IMAGES:
            raise LocationsInvalid("locations file lists a different number of images")
        packs_off = LOC_HEADER.size
        images_off = packs_off + n_packs * LOC_PACK.size
        runs_off = images_off + n_images * LOC_IMAGE.size
        if runs_off + n_runs * LOC_RUN.size + 32 != size:
            raise LocationsInvalid("locations file size does not match its counts")
        # checksum, in pieces
        h = blake3.blake3()
        end = size - 32
        pos = 0
        while pos < end:
            b = pread(min(HASH_PIECE, end - pos), pos)
            if not b:
                raise LocationsInvalid("locations file truncated")
            h.update(b)
            pos += len(b)
        if pread(32, end) != h.digest():
            raise LocationsInvalid("locations file checksum mismatch")
        # images: bound to the manifest, runs tile [0, n_runs)
        raw = pread(n_images * LOC_IMAGE.size, images_off)
        images = []
        nxt = 0
        for i, (dg, first, cnt) in enumerate(LOC_IMAGE.iter_unpack(raw)):
            if dg != digests[i]:
                raise LocationsInvalid("locations file belongs to other images")
            if first != nxt or cnt > n_runs - first:
                raise LocationsInvalid("locations image table malformed")
            images.append((first, cnt))
            nxt = first + cnt
        if nxt != n_runs:
            raise LocationsInvalid("locations image table does not cover the runs")
        loc = cls(pread, fd, size, n_packs, images, packs_off, runs_off)
        for i in range(n_images):          # every run's fields, in pieces
            for _ in loc.iter_runs(i):
                pass
        return loc

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:   # noqa: BLE001
            pass

    def _pread(self, n: int, off: int) -> bytes:
        b = self._pr(n, off)
        if len(b) != n:
            raise LocationsInvalid("locations file truncated")
        return b

    # -- packs -----------------------------------------------------------------------------
    def pack(self, pack_no: int) -> tuple[bytes, int]:
        """(pack name, min size)."""
        return LOC_PACK.unpack(self._pread(LOC_PACK.size, self.packs_off + pack_no * LOC_PACK.size))

    def iter_packs(self) -> Iterator[tuple[bytes, int]]:
        for o in range(0, self.n_packs, RUN_PIECE):
            k = min(RUN_PIECE, self.n_packs - o)
            yield from LOC_PACK.iter_unpack(self._pread(k * LOC_PACK.size, self.packs_off + o * LOC_PACK.size))

    # -- runs ------------------------------------------------------------------------------
    def iter_runs(self, image_no: int) -> Iterator[tuple]:
        """(pack_no, offset, kind, codec, n_pages, raw_len, stored_len, slot, count) of one
        image, checked field by field."""
        first, cnt = self.images[image_no]
        n_packs = self.n_packs
        for o in range(0, cnt, RUN_PIECE):
            k = min(RUN_PIECE, cnt - o)
            raw = self._pread(k * LOC_RUN.size, self.runs_off + (first + o) * LOC_RUN.size)
            for r in LOC_RUN.iter_unpack(raw):
                pack_no, offset, kind, codec, n_pages, raw_len, stored_len, slot, count = r
                try:
                    check_blob_fields(kind, codec, n_pages, raw_len, stored_len)
                except FormatError as e:
                    raise LocationsInvalid(f"locations run malformed: {e}") from None
                if pack_no >= n_packs or offset < 16 or offset + BLOB_HEADER.size + stored_len + 16 > 1 << 32:
                    raise LocationsInvalid("locations run out of range")
                if kind == KIND_PAGES:
                    if count < 1 or slot + count > n_pages:
                        raise LocationsInvalid("locations run slots out of range")
                elif slot != 0 or count != 1:
                    raise LocationsInvalid("locations data run malformed")
                yield r


def image_digests(manifest: dict) -> list[bytes]:
    return [bytes.fromhex(im["digest"]) for im in manifest["images"]]


def encode_locations(packs: list, images: list, runs: bytes, n_runs: int) -> bytes:
    """The file: packs [(name, min size)], images [(digest, first run, run count)] in
    manifest order, runs (n_runs LOC_RUN records, concatenated)."""
    parts = [LOC_HEADER.pack(LOC_MAGIC, LOC_VERSION, 0, len(images), len(packs), 0, n_runs)]
    parts.extend(LOC_PACK.pack(ph, size) for ph, size in packs)
    parts.extend(LOC_IMAGE.pack(*t) for t in images)
    parts.append(bytes(runs))
    body = b"".join(parts)
    return body + blake3.blake3(body).digest()
