"""The export format fuzzed as the repository's formats are (tests/test_repo_fuzz.py):
truncation at many points, bit flips, random edits, crafted lengths, tags, codecs and field
types. Every changed file is refused with BadExportFile (a file whose trailer was recomputed
may only be accepted when what it imports is byte for byte the exported snapshot), and the
receiving repository stays as it was. Crafted declarations run in a child under memory
(RLIMIT_AS) and wall-clock bounds."""

from __future__ import annotations

import io
import os
import random

import blake3
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from export_helpers import (TRAILER, craft, export_bytes, import_bounded, manifest_body, record, records, rehash,
                            retrailer, sample)
from gpusnap.errors import BadExportFile
from gpusnap.ops.import_ import read_import
from gpusnap.repo.format import export as X
from gpusnap.repo import Repository
from gpusnap.repo import format as F
from repo_helpers import PAGE, read_all
from test_repo_fuzz import mutations

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(valid export bytes, the exported snapshot, a receiving repository holding another snapshot)."""
    d = tmp_path_factory.mktemp("exportfuzz")
    _, snap = sample(d)
    target = Repository.open(d / "b", create=True)
    from repo_helpers import dump
    dump(target, {"pages-1.img": os.urandom(PAGE * 3)}, name="resident")
    return export_bytes(snap), snap, target.path


def _state(path) -> dict:
    """Every file of the repository but its lock files, with its size."""
    out = {}
    for dp, _dn, fns in os.walk(path):
        for f in fns:
            p = os.path.join(dp, f)
            if "/locks" not in p:
                out[os.path.relpath(p, path)] = os.path.getsize(p)
    return out


def _refused(target, data: bytes) -> None:
    before = _state(target)
    with pytest.raises(BadExportFile):
        read_import(Repository.open(target), io.BytesIO(data))
    assert _state(target) == before


def _refused_or_identical(world, data: bytes) -> None:
    """A file whose end record matches its bytes: refused, or it imports exactly the
    exported snapshot (an equivalent encoding of the same bytes), nothing else."""
    _, snap, target = world
    try:
        res = read_import(Repository.open(target), io.BytesIO(data))
    except BadExportFile:
        return
    got = Repository.open(target).snapshot(res["snapshot"])
    assert res["source_id"] == snap.id
    assert sorted(got.image_names()) == sorted(snap.image_names())
    for name in snap.image_names():
        assert read_all(got, name) == read_all(snap, name)


def test_the_valid_sample_imports(tmp_path, world):
    good, snap, _ = world
    res = read_import(Repository.open(tmp_path / "r", create=True), io.BytesIO(good))
    got = Repository.open(tmp_path / "r").snapshot(res["snapshot"])
    for name in snap.image_names():
        assert read_all(got, name) == read_all(snap, name)


@FUZZ
@given(st.data())
def test_fuzz_any_change_is_refused(world, d):
    """Random edits of the head (header, manifest), of the end record, or anywhere."""
    good, _, target = world
    lo, hi = d.draw(st.sampled_from([(0, 4096), (len(good) - TRAILER, len(good)), (0, len(good))]))
    data = good[:lo] + d.draw(mutations(good[lo:hi])) + good[hi:]
    assume(data != good)
    _refused(target, data)


@FUZZ
@given(st.data())
def test_fuzz_changes_under_a_recomputed_trailer(world, d):
    """The structural checks and the per-page, per-image, page-list and manifest checksums,
    with the whole-file checksum made to match."""
    good, _, _ = world
    body = good[:-TRAILER]
    k = d.draw(st.integers(0, len(body) - 1))
    flipped = body[:k] + bytes([body[k] ^ d.draw(st.integers(1, 255))]) + body[k + 1:]
    data = d.draw(st.sampled_from([flipped, None]))
    if data is None:
        data = d.draw(mutations(body[:8192])) + body[8192:]
    assume(data != body)
    _refused_or_identical(world, rehash(data))


def test_truncation_at_every_record_boundary_and_many_points(world):
    good, _, target = world
    cuts = {0, 1, 7, 8, 15, 16, len(good) - 1}
    for off, *_ in records(good):
        cuts |= {off - 1, off, off + 1, off + 11, off + 12, off + 13}
    rnd = random.Random(7)
    cuts |= {rnd.randrange(len(good)) for _ in range(200)}
    for cut in sorted(c for c in cuts if 0 <= c < len(good)):
        _refused(target, good[:cut])


def test_every_bit_of_the_heads_and_many_others_flipped(world):
    good, _, target = world
    positions = list(range(16))
    for off, *_ in records(good):
        positions += range(off, off + 12)
    rnd = random.Random(11)
    positions += [rnd.randrange(len(good)) for _ in range(200)]
    for pos in positions:
        bad = bytearray(good)
        bad[pos] ^= 1 << rnd.randrange(8)
        _refused(target, bytes(bad))


def _set_head(good: bytes, i: int, **kw) -> bytes:
    """The export with record i's head fields replaced, the trailer recomputed."""
    recs = records(good)
    off, tag, codec, res, raw, stored = recs[i]
    vals = {"tag": tag, "codec": codec, "reserved": res, "raw_len": raw, "stored_len": stored} | kw
    head = X.RECORD.pack(vals["tag"], vals["codec"], vals["reserved"], vals["raw_len"], vals["stored_len"])
    return retrailer(good[:off] + head + good[off + 12:])


def test_crafted_record_heads_are_refused(world):
    good, _, target = world
    recs = records(good)[:-1]            # not the end record: its head is covered by the cuts above
    for i, (off, tag, codec, res, raw, stored) in enumerate(recs):
        crafted = [dict(tag=t) for t in (0, 1, 2, 3, 4, 0xFE, 0xFF) if t != tag]
        crafted += [dict(codec=c) for c in range(8) if c != codec]
        crafted += [dict(reserved=1), dict(reserved=0xFFFF)]
        crafted += [dict(raw_len=v) for v in (0, 1, raw - 1, raw + 1, X.READER_DATA_MAX + 1, (1 << 32) - 1)
                    if v != raw and v >= 0]
        crafted += [dict(stored_len=v) for v in (0, stored - 1, stored + 1, (1 << 32) - 1) if v != stored and v >= 0]
        for kw in crafted:
            data = _set_head(good, i, **kw)
            if tag == X.TAG_DATA and set(kw) == {"codec"} and codec != 0 and kw["codec"] in F.CODECS:
                # another codec's decoder may (rarely) read the same payload; the page ids decide
                _refused_or_identical(world, data)
            else:
                _refused(target, data)


_IMG = {"name": "core-1.img", "type": "blob", "size": 3, "digest": blake3.blake3(b"abc").hexdigest(),
        "blobs": ["c" * 64]}
_PAGES = {"name": "pages-1.img", "type": "pages", "size": PAGE, "digest": "a" * 64, "pagelist": "pl-000000",
          "pagelist_size": 5}


@pytest.mark.parametrize("image,key,value", [
    (_IMG, "size", "3"), (_IMG, "size", -1), (_IMG, "size", 1 << 63), (_IMG, "size", 3.0), (_IMG, "size", True),
    (_IMG, "digest", 5), (_IMG, "digest", "A" * 64), (_IMG, "blobs", "c" * 64), (_IMG, "blobs", [5]),
    (_IMG, "type", "pagez"), (_IMG, "name", ["core"]), (_IMG, "name", "../x"), (_IMG, "pages", "x"),
    (_PAGES, "pagelist", 0), (_PAGES, "pagelist", "pl-1"), (_PAGES, "pagelist_size", "5"),
    (_PAGES, "pagelist_size", -5), (_PAGES, "pages_zero", -1),
])
def test_crafted_field_types_in_the_manifest_are_refused(tmp_path, image, key, value):
    data = craft(manifest_body([dict(image, **{key: value})]), record(X.TAG_DATA, b"abc"))
    _refused(Repository.open(tmp_path / "r", create=True).path, data)


@pytest.mark.parametrize("top,value", [("name", 5), ("name", "../x"), ("created", "1"), ("created", -1.0),
                                       ("created", 1e12), ("meta", []), ("stats", None), ("images", {}),
                                       ("repo_id", 1), ("version", "1"), ("version", 2), ("format", "x")])
def test_crafted_manifest_fields_are_refused(tmp_path, top, value):
    body = manifest_body([])
    body[top] = value
    _refused(Repository.open(tmp_path / "r", create=True).path, craft(body))


def _bombs() -> dict[str, bytes]:
    """Crafted declarations that ask for far more than the file carries."""
    pl = F.encode_pl_zero(3)
    big_pl = {"name": "pages-1.img", "type": "pages", "size": 3 * PAGE, "digest": blake3.blake3(pl).hexdigest(),
              "pagelist": "pl-000000", "pagelist_size": 1 << 31}
    blob = {"name": "core-1.img", "type": "blob", "size": 60 << 40, "digest": "a" * 64, "blobs": ["b" * 64]}
    manifest = X.HEADER.pack(X.MAGIC, X.VERSION, 0, 0) + X.RECORD.pack(X.TAG_MANIFEST, 0, 0, (1 << 32) - 1,
                                                                        (1 << 32) - 1)
    return {
        "page list of 2 GiB declared": craft(manifest_body([big_pl]), record(X.TAG_PAGELIST, pl)),
        "manifest of 4 GiB declared": manifest + b"x" * 1000,
        "data record of 4 MiB in 1 byte": craft(manifest_body([dict(_IMG, size=4 << 20)]),
                                                X.RECORD.pack(X.TAG_DATA, 2, 0, 4 << 20, 1) + b"\0"),
        "blob image of 60 TiB, endless data records": craft(manifest_body([blob])) [:-TRAILER]
        + record(X.TAG_DATA, bytes(64)) * 20000,
    }


@pytest.mark.parametrize("name", list(_bombs()))
def test_crafted_declarations_stay_within_memory_and_time(tmp_path, name):
    f = tmp_path / "bomb.gsx"
    f.write_bytes(_bombs()[name])
    proc = import_bounded(f, tmp_path / "r", memory=1 << 30)
    assert proc.returncode == BadExportFile.exit_code, proc.stdout + proc.stderr
