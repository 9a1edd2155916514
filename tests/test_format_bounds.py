"""Each checksum and bound of the repository's format (docs/format.md) refuses on its own:
every input here is damaged so that exactly one check can see it (the JSON still parses,
the other checksums still hold, the damaged blob still decompresses), so a check that went
missing would let it through. scripts/mutate.py removes each check in turn to prove it."""

import json
import os

import pytest

from gpusnap.errors import CorruptSnapshot
from gpusnap.repo import Repository
from gpusnap.repo.format import FormatError, iter_pagelist, parse_manifest
from gpusnap.repo.format.common import CODEC_NONE, KIND_DATA, MANIFEST_TRAILER_LEN, MANIFEST_TRAILER_PREFIX
from gpusnap.repo.format.manifest import encode_manifest
from gpusnap.repo.format.pack import encode_blob_header, encode_pack_header, encode_pack_trailer, parse_pack
from gpusnap.repo.format.pagelist import encode_pl_pages, encode_pl_zero
from repo_helpers import PAGE, dump, read_all


def _manifest() -> bytes:
    body = {"format": "gpusnap-snapshot", "version": 1, "name": "job", "created": 1700000000.5, "meta": {},
            "stats": {}, "repo_id": "r", "images": []}
    data, _ = encode_manifest(body)
    assert parse_manifest(data)[0] == body
    return data


def test_manifest_changed_under_its_trailer_is_refused_by_the_checksum():
    """A change that keeps the JSON valid and the schema right (a name, one letter)."""
    data = _manifest().replace(b'"name": "job"', b'"name": "jab"')
    json.loads(data[:-MANIFEST_TRAILER_LEN])
    with pytest.raises(FormatError, match="checksum mismatch"):
        parse_manifest(data)


def test_manifest_trailer_of_another_kind_is_refused():
    """The right digest under another prefix is not a gpusnap trailer."""
    data = _manifest()
    other = data.replace(MANIFEST_TRAILER_PREFIX, b"\nblake2:")
    assert len(other) == len(data)
    with pytest.raises(FormatError, match="no checksum trailer"):
        parse_manifest(other)


def _pack(payloads: list[bytes], n_blobs: int | None = None, stretch: int = 0) -> bytes:
    out = encode_pack_header()
    for i, p in enumerate(payloads):
        extra = stretch if i == len(payloads) - 1 else 0
        out += encode_blob_header(KIND_DATA, CODEC_NONE, 0, len(p) + extra, len(p) + extra) + p
    return out + encode_pack_trailer(len(payloads) if n_blobs is None else n_blobs)


def test_pack_whose_trailer_counts_more_blobs_than_it_holds_is_refused():
    assert len(parse_pack(_pack([b"a" * 100, b"b" * 50]))) == 2
    with pytest.raises(FormatError, match="trailer says 3 blobs, found 2"):
        parse_pack(_pack([b"a" * 100, b"b" * 50], n_blobs=3))


def test_pack_blob_running_past_the_end_is_refused():
    with pytest.raises(FormatError, match="runs past the end of the pack"):
        parse_pack(_pack([b"a" * 100, b"b" * 50], stretch=8))


def test_page_list_shorter_than_its_image_is_refused():
    pl = encode_pl_zero(2) + encode_pl_pages([bytes(16)])
    assert [r[0] for r in iter_pagelist(_reader(pl), 3 * PAGE)] == ["zero", "pages"]
    with pytest.raises(FormatError, match=f"describes {3 * PAGE} bytes, image has {4 * PAGE}"):
        list(iter_pagelist(_reader(pl), 4 * PAGE))


def _reader(data: bytes):
    pos = [0]

    def read(n):
        out = data[pos[0]:pos[0] + n]
        pos[0] += len(out)
        return out
    return read


@pytest.fixture
def data_snapshot(tmp_path):
    """A snapshot with one data image of random bytes (stored uncompressed: a flipped byte
    still "decompresses"), and the image."""
    repo = Repository.open(tmp_path / "repo", create=True)
    img = os.urandom(20000)
    snap, _ = dump(repo, {"core-1.img": img, "pages-1.img": os.urandom(PAGE * 4)}, compress="none")
    assert read_all(snap, "core-1.img") == img
    return repo, snap, img


def test_damaged_data_blob_is_refused_by_its_own_checksum_naming_the_pack(data_snapshot):
    """The blob's id is checked where it is read, so the error names the blob and its pack
    (what repair needs), not merely the image."""
    repo, snap, img = data_snapshot
    [pack] = [p for p in (repo.path / "packs").rglob("*") if p.is_file() and img[5000:5100] in p.read_bytes()]
    data = bytearray(pack.read_bytes())
    data[data.find(img[5000:5100]) + 50] ^= 1
    os.chmod(pack, 0o600)
    pack.write_bytes(bytes(data))
    snap = Repository.open(repo.path).snapshot_at(snap.path)
    with pytest.raises(CorruptSnapshot, match="fails its checksum") as e:
        read_all(snap, "core-1.img")
    assert pack.name[:12] in str(e.value) + str(e.value.hint or ""), (e.value, e.value.hint)


def test_image_that_differs_from_its_recorded_digest_is_refused(data_snapshot):
    """Every blob intact, the manifest (rehashed, so its own checksum holds) records another
    digest for the image: the image read back is checked against it."""
    repo, snap, img = data_snapshot
    m = json.loads((snap.path / "manifest").read_bytes()[:-MANIFEST_TRAILER_LEN])
    [im] = [i for i in m["images"] if i["name"] == "core-1.img"]
    im["digest"] = "0" * 64
    data, _ = encode_manifest(m)
    mf = snap.path / "manifest"
    os.chmod(mf, 0o600)
    mf.write_bytes(data)
    snap = Repository.open(repo.path).snapshot_at(snap.path)
    with pytest.raises(CorruptSnapshot, match="does not match its recorded size/checksum"):
        read_all(snap, "core-1.img")
