import os
import random

import pytest

from gpusnap.errors import CorruptSnapshot
from gpusnap.repo import Repository
from gpusnap.repo.maint.verify import verify
from gpusnap.render.maint import verify_summary
from repo_helpers import PAGE, dump, read_all, text_page


@pytest.fixture
def setup(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    rnd = random.Random(7)
    base = [text_page(rnd) for _ in range(50)] + [os.urandom(PAGE) for _ in range(50)]
    img1 = b"".join(base)
    s1, _ = dump(repo, {"pages-1.img": img1, "core-1.img": b"core" * 300}, name="one")
    img2 = os.urandom(PAGE * 40)                     # s2 shares nothing with s1's pages
    s2, _ = dump(repo, {"pages-1.img": img2}, name="two")
    assert verify(repo).ok
    return repo, s1, s2, img1, img2


def _packs(repo):
    return sorted(p for p in (repo.path / "packs").rglob("*") if p.is_file())


def _pack_of(repo, snap):
    """The pack holding the first page of snap's pages-1.img."""
    idx = repo.index()
    for rec in snap.iter_page_refs("pages-1.img"):
        if rec[0] == "pages":
            loc = idx.page_table().get(rec[1][:16])
            b = idx.blobs[loc >> 8]
            from gpusnap.repo.store import pack_path
            return pack_path(repo.path, b.pack), b
    raise AssertionError


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    os.chmod(path, 0o600)
    path.write_bytes(bytes(data))


def test_flipped_byte_in_pack(setup):
    repo, s1, s2, img1, img2 = setup
    pp, b = _pack_of(repo, s1)
    _flip(pp, b.offset + 16 + b.stored_len // 2)
    rep = verify(repo)
    assert not rep.ok
    assert s1.path.name in rep.affected_snapshots
    assert any(p.scope == "pack" and p.name == pp.name for p in rep.problems)
    with pytest.raises(CorruptSnapshot, match=pp.name):
        read_all(s1, "pages-1.img")
    if _pack_of(repo, s2)[0] != pp:
        assert s2.path.name not in rep.affected_snapshots
        assert read_all(s2, "pages-1.img") == img2
    # structure-only check does not read data: it passes
    s1.check_structure()


def test_flipped_byte_in_manifest(setup):
    repo, s1, s2, *_ = setup
    _flip(s1.path / "manifest", 40)
    rep = verify(repo)
    assert not rep.ok and s1.path.name in rep.affected_snapshots
    assert s2.path.name not in rep.affected_snapshots
    with pytest.raises(CorruptSnapshot):
        repo.snapshot(s1.path.name)
    assert [s.id for s in repo.snapshots()] == [s2.id]


def test_flipped_byte_in_pagelist(setup):
    repo, s1, s2, *_ = setup
    _flip(s1.path / s1.image("pages-1.img")["pagelist"], 30)
    rep = verify(repo)
    assert s1.path.name in rep.affected_snapshots and not rep.ok
    with pytest.raises(CorruptSnapshot):
        s1.check_structure()
    with pytest.raises(CorruptSnapshot):
        read_all(s1, "pages-1.img")


def test_flipped_byte_in_index(setup):
    repo, s1, s2, *_ = setup
    idxs = sorted((repo.path / "index").iterdir())
    assert len(idxs) == 2
    for f in idxs:
        _flip(f, 100)
    rep = verify(repo)
    assert not rep.ok
    assert {p.name for p in rep.problems if p.scope == "index"} == {f.name for f in idxs}
    # the snapshots themselves are intact: an index problem, not a damaged snapshot (issue 8)
    assert rep.affected_snapshots == [] and "no snapshot is affected" in verify_summary(rep)
    # restore reads through the snapshot's locations file, not the index: the data is intact
    # and every page is checked, so it still restores (docs/format.md 5.4)
    fresh = Repository.open(repo.path)
    fresh.snapshot(s1.path.name).check_structure()
    assert read_all(fresh.snapshot(s1.path.name), "pages-1.img") == setup[3]
    # without its locations file it needs the index, which is damaged: refused
    os.unlink(s1.path / "locations")
    fresh = Repository.open(repo.path)
    with pytest.raises(CorruptSnapshot, match="index"):
        fresh.snapshot(s1.path.name).check_structure()
    with pytest.raises(CorruptSnapshot):
        read_all(fresh.snapshot(s1.path.name), "pages-1.img")


def test_truncated_pack(setup):
    repo, s1, s2, *_ = setup
    pp, b = _pack_of(repo, s1)
    size = pp.stat().st_size
    os.truncate(pp, size // 2)
    rep = verify(repo)
    assert not rep.ok and s1.path.name in rep.affected_snapshots
    assert any(p.name == pp.name for p in rep.problems)
    with pytest.raises(CorruptSnapshot, match="truncated"):
        repo.snapshot(s1.path.name).check_structure()
    rep2 = verify(repo, read_data=False)
    assert not rep2.ok and s1.path.name in rep2.affected_snapshots


def test_missing_pack(setup):
    repo, s1, s2, *_ = setup
    pp, b = _pack_of(repo, s2)
    os.unlink(pp)
    rep = verify(repo, [s2.path.name])
    assert not rep.ok and rep.affected_snapshots == [s2.path.name]
    assert any(p.scope == "pack" and p.name == pp.name and "missing" in p.message for p in rep.problems)
    with pytest.raises(CorruptSnapshot, match="missing"):
        s2.check_structure()
    with pytest.raises(CorruptSnapshot, match=pp.name):
        read_all(s2, "pages-1.img")


def test_corrupt_data_blob(setup):
    repo, s1, *_ = setup
    idx = repo.index()
    bid = bytes.fromhex(s1.image("core-1.img")["blobs"][0])
    b = idx.blobs[idx.data_loc[bid]]
    from gpusnap.repo.store import pack_path
    _flip(pack_path(repo.path, b.pack), b.offset + 16 + 1)
    with pytest.raises(CorruptSnapshot):
        read_all(s1, "core-1.img")
    assert s1.path.name in verify(repo).affected_snapshots


def test_leftovers_are_not_problems(setup):
    repo, *_ = setup
    (repo.path / "tmp" / "pack-dead.tmp").write_bytes(b"junk")
    (repo.path / "snapshots" / ".tmp-x-1-2").mkdir()
    rep = verify(repo)
    assert rep.ok and rep.notes


def _blob_of(repo, snap, codec_none: bool):
    """(pack path, record) of a pages blob of snap's pages-1.img stored raw / compressed."""
    from gpusnap.repo.format import CODEC_NONE
    from gpusnap.repo.store import pack_path
    idx = repo.index()
    table = idx.page_table()
    for rec in snap.iter_page_refs("pages-1.img"):
        if rec[0] == "pages":
            for i in range(0, len(rec[1]), 16):
                b = idx.blobs[table.get(rec[1][i:i + 16]) >> 8]
                if (b.codec == CODEC_NONE) == codec_none:
                    return pack_path(repo.path, b.pack), b
    raise AssertionError("no such blob")


@pytest.mark.parametrize("codec_none", [True, False], ids=["raw", "compressed"])
@pytest.mark.parametrize("with_locations", [True, False], ids=["locations", "from-index"])
def test_one_read_path_names_image_and_pack(setup, tmp_path, monkeypatch, codec_none, with_locations):
    """A flipped byte in a page is refused the same way whether the runs come from the
    snapshot's locations file or from one built from the index, by the sequential reader and
    by the parallel materializer alike: CorruptSnapshot naming the image and the pack."""
    import threading

    from gpusnap.repo import parallel_read

    monkeypatch.setattr(parallel_read, "JOB_BYTES", 16 * PAGE)     # small jobs: the parallel path
    repo, s1, s2, img1, img2 = setup
    assert parallel_read.parallel_ok(s1, "pages-1.img")
    pp, b = _blob_of(repo, s1, codec_none)
    if not with_locations:
        os.unlink(s1.path / "locations")
    _flip(pp, b.offset + 16 + b.stored_len // 2)
    s = Repository.open(repo.path).snapshot(s1.path.name)
    assert (s.locations() is not None) == with_locations
    with pytest.raises(CorruptSnapshot, match="pages-1.img") as e:
        read_all(s, "pages-1.img")
    assert pp.name in str(e.value)
    out = tmp_path / "images"
    out.mkdir(mode=0o700)
    with pytest.raises(CorruptSnapshot, match="pages-1.img") as e:
        parallel_read.write_images(s, out, 2, threading.Event(), [0])
    assert pp.name in str(e.value)
    # the other snapshot shares no page with it and still reads
    assert read_all(Repository.open(repo.path).snapshot(s2.path.name), "pages-1.img") == img2


def test_read_through_the_index_equals_the_file(setup, tmp_path, monkeypatch):
    """Without its locations file a snapshot reads, and materializes in parallel, to the same
    bytes through locations built from the index."""
    import threading

    from gpusnap.repo import parallel_read

    monkeypatch.setattr(parallel_read, "JOB_BYTES", 16 * PAGE)     # small jobs: the parallel path
    repo, s1, s2, img1, img2 = setup
    os.unlink(s1.path / "locations")
    s = Repository.open(repo.path).snapshot(s1.path.name)
    assert s.locations() is None and s.reading_locations() is not None
    assert read_all(s, "pages-1.img") == img1
    out = tmp_path / "images"
    out.mkdir(mode=0o700)
    parallel_read.write_images(s, out, 2, threading.Event(), [0])
    assert (out / "pages-1.img").read_bytes() == img1
    assert b"".join(parallel_read.iter_image_parallel(s, "pages-1.img", 2)) == img1
    assert (out / "core-1.img").read_bytes() == b"core" * 300
