"""Every checksum and bound of docs/format.md, each with a damage that only it catches: the
rest of the file stays well formed (JSON valid, structure intact, other checksums
recomputed), so each test fails when its check is removed (the report of issue 37 lists
which were tried). Repository: manifest, index, page list, page, data blob, blob image,
locations file. Export (§11): whole-file trailer, page list, page, tail, blob image, image
boundary, end of file, stored length."""

from __future__ import annotations

import io
import json
import os

import blake3
import pytest

from export_helpers import TRAILER, export_bytes, records, rehash, retrailer, sample
from gpusnap.errors import BadExportFile, CorruptSnapshot
from gpusnap.ops.import_ import read_import
from gpusnap.repo.format import export as X
from gpusnap.repo import Repository
from gpusnap.repo import format as F
from gpusnap.repo.codec import decompress
from gpusnap.repo.format import FormatError
from repo_helpers import PAGE, dump, read_all


# -- repository ------------------------------------------------------------------------------

def _snap(tmp_path, images, **kw):
    repo = Repository.open(tmp_path / "r", create=True)
    snap, _ = dump(repo, images, name="job", compress="none", chunk=1 << 20, **kw)
    return repo, snap


def _flip_in_packs(repo, needle: bytes) -> None:
    """Flip one bit of `needle` where it is stored (raw: compress='none') in a pack."""
    for dp, _dn, fns in os.walk(repo.path / "packs"):
        for fn in fns:
            p = os.path.join(dp, fn)
            data = bytearray(open(p, "rb").read())
            at = data.find(needle)
            if at >= 0:
                data[at + len(needle) // 2] ^= 1
                os.chmod(p, 0o600)
                open(p, "wb").write(data)
                return
    raise AssertionError("needle not in any pack")


def test_manifest_checksum_catches_a_digit_changed_to_a_digit(tmp_path):
    """The JSON stays valid and every field well formed: only the checksum can tell."""
    repo, snap = _snap(tmp_path, {"core-1.img": b"abc"}, meta={"pid": 1234})
    p = snap.path / "manifest"
    data = p.read_bytes()
    assert data.count(b'"pid": 1234') == 1
    damaged = data.replace(b'"pid": 1234', b'"pid": 1235')
    json.loads(damaged[:-F.MANIFEST_TRAILER_LEN])        # still valid JSON
    with pytest.raises(FormatError, match="checksum"):
        F.parse_manifest(damaged)
    p.write_bytes(damaged)
    with pytest.raises(CorruptSnapshot, match="checksum"):
        Repository.open(repo.path).snapshot_at(snap.path)


def test_index_checksum_catches_a_changed_page_id(tmp_path):
    repo, snap = _snap(tmp_path, {"pages-1.img": os.urandom(3 * PAGE)})
    (name,) = os.listdir(repo.path / "index")
    data = bytearray((repo.path / "index" / name).read_bytes())
    good = F.parse_index(bytes(data))
    data[-33] ^= 1                      # the last byte of the last record's ids: structure intact
    with pytest.raises(FormatError, match="checksum"):
        F.parse_index(bytes(data))
    body = bytes(data[:-32])
    assert F.parse_index(body + blake3.blake3(body).digest()).blobs != good.blobs   # well formed otherwise


def test_page_list_digest_catches_two_pages_swapped(tmp_path):
    """Two page ids swapped in the page list: every id is still in the index, so only the
    page list's digest can tell (the locations file is removed: it would also disagree)."""
    a, b = os.urandom(PAGE), os.urandom(PAGE)
    repo, snap = _snap(tmp_path, {"pages-1.img": a + b})
    os.unlink(snap.path / "locations")
    im = snap.image("pages-1.img")
    p = snap.path / im["pagelist"]
    pl = p.read_bytes()
    ida, idb = F.page_id(a), F.page_id(b)
    assert pl == F.encode_pl_pages([ida, idb])
    p.write_bytes(F.encode_pl_pages([idb, ida]))
    snap = Repository.open(repo.path).snapshot_at(snap.path)
    with pytest.raises(CorruptSnapshot, match="page list"):
        read_all(snap, "pages-1.img")


def test_page_id_catches_a_flipped_bit_in_a_stored_page(tmp_path):
    page = os.urandom(PAGE)
    repo, snap = _snap(tmp_path, {"pages-1.img": page})
    _flip_in_packs(repo, page)
    with pytest.raises(CorruptSnapshot, match="checksum"):
        read_all(Repository.open(repo.path).snapshot_at(snap.path), "pages-1.img")


def test_blob_id_catches_a_flipped_bit_in_a_stored_blob(tmp_path):
    core = os.urandom(3000)
    repo, snap = _snap(tmp_path, {"core-1.img": core})
    _flip_in_packs(repo, core)
    with pytest.raises(CorruptSnapshot, match="blob .* fails its checksum"):   # before the image's digest
        read_all(Repository.open(repo.path).snapshot_at(snap.path), "core-1.img")


def test_blob_image_digest_catches_its_blobs_reordered(tmp_path):
    """The blob list reordered (manifest rewritten with a valid checksum): each blob checks,
    only the image's digest can tell."""
    one, two = os.urandom(1 << 20), os.urandom(1 << 20)
    repo, snap = _snap(tmp_path, {"core-1.img": one + two})
    p = snap.path / "manifest"
    m = json.loads(p.read_bytes()[:-F.MANIFEST_TRAILER_LEN])
    m["images"][0]["blobs"].reverse()
    p.write_bytes(F.encode_manifest(m)[0])
    os.unlink(snap.path / "locations")    # bound to the old manifest: the reader takes the index
    with pytest.raises(CorruptSnapshot, match="does not match"):
        read_all(Repository.open(repo.path).snapshot_at(snap.path), "core-1.img")


def test_locations_checksum_catches_a_changed_offset(tmp_path):
    """A flipped bit in the locations file's runs: the checksum sends the reader to the
    index, which reads the right bytes (without it, the wrong offset is read)."""
    img = os.urandom(4 * PAGE)
    repo, snap = _snap(tmp_path, {"pages-1.img": img})
    p = snap.path / "locations"
    data = bytearray(p.read_bytes())
    data[-32 - 12] ^= 0x10                # inside the last run record (its offset field)
    p.write_bytes(bytes(data))
    snap = Repository.open(repo.path).snapshot_at(snap.path)
    assert read_all(snap, "pages-1.img") == img
    assert "checksum" in (snap.loc_reason or "")


# -- export files (§11) -----------------------------------------------------------------------

@pytest.fixture
def exp(tmp_path):
    """(export bytes, the exported snapshot, a fresh receiving repository path)."""
    _, snap = sample(tmp_path)
    return export_bytes(snap), snap, tmp_path / "b"


def _import(target, data: bytes):
    return read_import(Repository.open(target, create=True), io.BytesIO(data))


def _data_records_of(data: bytes) -> list[tuple]:
    """[(offset, image name)] of every data record, in order."""
    m, _ = F.parse_manifest(data[X.HEADER.size + X.RECORD.size:records(data)[1][0]])
    recs = records(data)[1:-1]
    out, i = [], 0
    for im in m["images"]:
        if im["type"] == "pages":
            i += 1           # its page list record
        carried = 0
        need = im["size"] if im["type"] == "blob" else None
        while i < len(recs) and recs[i][1] == X.TAG_DATA:
            out.append((recs[i], im["name"]))
            carried += recs[i][4]
            i += 1
            if need is not None and carried >= need:
                break
    return out


def _raw(data: bytes, rec) -> bytes:
    off, _tag, codec, _res, raw, stored = rec
    return bytes(decompress(data[off + 12:off + 12 + stored], codec, raw))


def _replace(data: bytes, rec, payload: bytes, codec: int = 0, raw_len: int | None = None) -> bytes:
    """data with record `rec` replaced by a data record of `payload` (raw by default)."""
    off, _tag, _codec, _res, _raw_len, stored = rec
    head = X.RECORD.pack(X.TAG_DATA, codec, 0, len(payload) if raw_len is None else raw_len, len(payload))
    return data[:off] + head + payload + data[off + 12 + stored:]


def _image_record(data: bytes, name: str, k: int = 0):
    return [r for r, n in _data_records_of(data) if n == name][k]


def test_the_untouched_export_and_its_rewritten_records_import(exp):
    """The rewriting below changes nothing by itself: each record re-stored raw imports."""
    data, snap, target = exp
    for rec, _name in reversed(_data_records_of(data)):
        data = _replace(data, rec, _raw(data, rec))
    res = _import(target, retrailer(data))
    got = Repository.open(target).snapshot(res["snapshot"])
    for name in snap.image_names():
        assert read_all(got, name) == read_all(snap, name)


def test_export_trailer_catches_a_change_in_itself(exp):
    data, _, target = exp
    bad = bytearray(data)
    bad[-1] ^= 1
    with pytest.raises(BadExportFile, match="checksum does not match its contents"):
        _import(target, bytes(bad))


def test_import_page_check_catches_a_damaged_page_under_a_recomputed_trailer(exp):
    data, _, target = exp
    rec = _image_record(data, "pages-1.img")
    raw = bytearray(_raw(data, rec))
    raw[100] ^= 1                       # in the first (random) page
    with pytest.raises(BadExportFile, match="a page of pages-1.img does not match"):
        _import(target, retrailer(_replace(data, rec, bytes(raw))))


def test_import_tail_check_catches_a_damaged_tail_under_a_recomputed_trailer(exp):
    data, _, target = exp
    rec = _image_record(data, "pages-1.img", -1)
    raw = bytearray(_raw(data, rec))
    raw[-1] ^= 1                        # the partial last page
    with pytest.raises(BadExportFile, match="last partial page"):
        _import(target, retrailer(_replace(data, rec, bytes(raw))))


def test_import_blob_check_catches_a_damaged_image_under_a_recomputed_trailer(exp):
    data, _, target = exp
    rec = _image_record(data, "core-1.img")
    raw = bytearray(_raw(data, rec))
    raw[5] ^= 1
    with pytest.raises(BadExportFile, match="image core-1.img does not match"):
        _import(target, retrailer(_replace(data, rec, bytes(raw))))


def test_import_page_list_digest_catches_a_rewritten_page_list(exp):
    """The page list rewritten with the same meaning (a zero run of 9 as 4 + 5), its length
    in a manifest whose own checksum is recomputed: only the digest can tell."""
    data, _, target = exp
    recs = records(data)
    mrec = recs[0]
    (plrec,) = [r for r in recs if r[1] == X.TAG_PAGELIST]
    pl = data[plrec[0] + 12:plrec[0] + 12 + plrec[5]]
    assert pl.count(F.encode_pl_zero(9)) == 1
    new_pl = pl.replace(F.encode_pl_zero(9), F.encode_pl_zero(4) + F.encode_pl_zero(5))
    mbytes = data[mrec[0] + 12:mrec[0] + 12 + mrec[5]]
    m = json.loads(mbytes[:-F.MANIFEST_TRAILER_LEN])
    (im,) = [i for i in m["images"] if i["type"] == "pages"]
    im["pagelist_size"] = len(new_pl)
    new_m = F.encode_manifest(m)[0]
    body = (data[:mrec[0]] + X.RECORD.pack(X.TAG_MANIFEST, 0, 0, len(new_m), len(new_m)) + new_m
            + data[mrec[0] + 12 + mrec[5]:plrec[0]]
            + X.RECORD.pack(X.TAG_PAGELIST, 0, 0, len(new_pl), len(new_pl)) + new_pl
            + data[plrec[0] + 12 + plrec[5]:-TRAILER])
    with pytest.raises(BadExportFile, match="page list of pages-1.img does not match"):
        _import(target, rehash(body))


def test_import_boundary_check_catches_a_byte_carried_by_the_wrong_image(exp):
    """The first byte of core-1.img carried at the end of big.img's last record (the images
    follow each other in that order): the bytes and their order are unchanged, only the
    record boundary is wrong."""
    data, _, target = exp
    big, core = _image_record(data, "big.img", -1), _image_record(data, "core-1.img")
    assert big[0] < core[0]
    big_raw, core_raw = _raw(data, big), _raw(data, core)
    data = _replace(data, core, core_raw[1:])            # the later record first: offsets stay valid
    data = _replace(data, big, big_raw + core_raw[:1])
    with pytest.raises(BadExportFile, match="bytes too many"):
        _import(target, retrailer(data))


def test_import_end_of_file_check_catches_bytes_after_the_trailer(exp):
    data, _, target = exp
    with pytest.raises(BadExportFile, match="bytes follow the trailer"):
        _import(target, data + b"\0")


def test_import_stored_length_bound_catches_a_record_larger_than_its_bytes(exp):
    """A data record stored larger than its raw bytes (lz4 of random data grows): it
    decompresses correctly, but no writer makes one, and it would let a file cost more than
    it carries."""
    import lz4.block

    data, _, target = exp
    rec = _image_record(data, "core-1.img")
    raw = _raw(data, rec)
    grown = lz4.block.compress(raw, store_size=False)
    assert len(grown) > len(raw)
    with pytest.raises(BadExportFile, match="stored length"):
        _import(target, retrailer(_replace(data, rec, grown, codec=F.CODEC_LZ4, raw_len=len(raw))))
