"""Locations files (docs/format.md 5.4): restore without the index, in bounded memory;
correct after prune/repack; stale or damaged files fall back to the index; fuzzed parsing."""

import os
import random
import struct
import tracemalloc

import blake3
import pytest
from hypothesis import given, settings, strategies as st

from gpusnap.errors import CorruptSnapshot
from gpusnap.repo import Repository
from gpusnap.repo import locations as L
from gpusnap.repo.format import locations as LF
from gpusnap.repo.maint.prune import execute_prune, plan_prune, snapshots_info
from gpusnap.repo.maint.verify import verify
from repo_helpers import PAGE, dump, read_all, text_page


def _packs_named(snap):
    loc = LF.Locations.open(snap.path, LF.image_digests(snap.manifest))
    try:
        return {name for name, _ in loc.iter_packs()}
    finally:
        loc.close()


def _uses_locations(repo, snap):
    s = repo.snapshot(snap.path.name)
    return s.locations() is not None


def test_restore_reads_through_locations(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    rnd = random.Random(1)
    pages = [os.urandom(PAGE) if i % 5 else text_page(rnd) for i in range(300)]
    img = b"".join(p if i % 7 else bytes(PAGE) for i, p in enumerate(pages)) + b"partial tail"
    s1, st1 = dump(repo, {"pages-1.img": img, "core-1.img": os.urandom(2_500_000), "empty.img": b""})
    assert st1["bytes_locations"] == (s1.path / "locations").stat().st_size
    # second dump: mostly dedup against the first, pages moved around, some new
    img2 = img[PAGE * 100:PAGE * 200] + os.urandom(PAGE * 30) + img[:PAGE * 100] + img[PAGE * 200:]
    s2, _ = dump(repo, {"pages-1.img": img2, "core-1.img": os.urandom(10)})
    repo = Repository.open(repo.path)         # as a restore starts: nothing loaded
    for s, want in ((s1, img), (s2, img2)):
        s = repo.snapshot(s.path.name)
        assert s.locations() is not None
        s.check_structure()
        assert not repo.index_loaded            # neither the check nor the read loaded the index
        assert read_all(s, "pages-1.img") == want
    assert read_all(repo.snapshot(s1.path.name), "empty.img") == b""
    assert not repo.index_loaded
    rep = verify(repo)
    assert rep.ok and not [n for n in rep.notes if "locations" in n], (rep.problems, rep.notes)


def test_batched_lookups_build_the_same_file(tmp_path, monkeypatch):
    """build() resolves many short page records together (RESOLVE_BATCH pages at a time);
    runs that span records, zero pages and a tail come out exactly as one record at a time."""
    repo = Repository.open(tmp_path / "repo", create=True)
    rnd = random.Random(5)
    pages = [bytes(PAGE) if rnd.random() < 0.6 else (os.urandom(PAGE) if rnd.random() < 0.5 else text_page(rnd))
             for _ in range(3000)]
    img = b"".join(pages) + b"tail"
    s1, _ = dump(repo, {"pages-1.img": img})
    img2 = img[PAGE * 1000:-4] + os.urandom(PAGE * 40) + img[:PAGE * 1000]
    s2, _ = dump(repo, {"pages-1.img": img2, "pages-2.img": img})
    res = L.index_resolver(repo.index())
    for snap in (s1, s2):
        stored = (snap.path / LF.LOC_NAME).read_bytes()
        per_record = []
        for batch in (1, 7, L.RESOLVE_BATCH):
            monkeypatch.setattr(L, "RESOLVE_BATCH", batch)
            per_record.append(L.build(snap.path, snap.manifest["images"], res))
        assert per_record == [stored] * 3


def test_locations_after_prune_and_repack(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    rnd = random.Random(8)
    base = [os.urandom(PAGE) for _ in range(200)]
    hist = []
    for k in range(5):
        moving = [os.urandom(PAGE) for _ in range(40)] + [text_page(rnd) for _ in range(10)]
        img = b"".join(base[:100] + moving + base[100:]) + bytes(PAGE * 20)
        snap, _ = dump(repo, {"pages-1.img": img, "core-1.img": b"core%d" % k * 50}, pack_target=64 << 10)
        hist.append((snap, img))
    before = {s.path.name: _packs_named(s) for s, _ in hist}
    res = execute_prune(repo, plan_prune(snapshots_info(repo), 2), repack_threshold=0.0)
    assert res["packs_rewritten"] > 0
    present = {p.name for p in (repo.path / "packs").rglob("*") if p.is_file()}
    rewritten = 0
    for snap, img in hist[-2:]:
        s = repo.snapshot(snap.path.name)
        assert s.locations() is not None, s.loc_reason
        named = _packs_named(s)
        assert {n.hex() for n in named} <= present
        rewritten += named != before[snap.path.name]
        assert read_all(s, "pages-1.img") == img
        assert read_all(s, "core-1.img") == b"core%d" % hist.index((snap, img)) * 50
    assert rewritten                          # prune did move pages these snapshots need
    rep = verify(repo)
    assert rep.ok and not [n for n in rep.notes if "locations" in n], (rep.problems, rep.notes)


def test_stale_or_damaged_locations_fall_back_to_index(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    img = b"".join(os.urandom(PAGE) for _ in range(50))
    s, _ = dump(repo, {"pages-1.img": img})
    lp = s.path / "locations"
    good = lp.read_bytes()
    for bad in (None, good[:-1] + bytes([good[-1] ^ 1]), good[:40], b""):
        if bad is None:
            lp.unlink()
        else:
            lp.write_bytes(bad)
        fresh = repo.snapshot(s.path.name)
        assert fresh.locations() is None and fresh.loc_reason
        fresh.check_structure()
        assert read_all(fresh, "pages-1.img") == img
        rep = verify(repo)
        assert rep.ok and any("locations" in n for n in rep.notes)
    # stale: names a pack that is gone (as after a prune by a gpusnap that did not know the file)
    lp.write_bytes(good)
    fake = struct.pack("<32sQ", b"\xee" * 32, 100)
    body = good[:32] + fake + good[72:-32]
    lp.write_bytes(body + blake3.blake3(body).digest())
    fresh = repo.snapshot(s.path.name)
    assert fresh.locations() is None and "gone" in fresh.loc_reason
    assert read_all(fresh, "pages-1.img") == img
    # a prune (nothing to delete) writes it again
    res = execute_prune(repo, plan_prune(snapshots_info(repo), 5))
    assert res["locations_written"] == 1
    assert repo.snapshot(s.path.name).locations() is not None
    assert (s.path / "locations").read_bytes() == good


def test_wrong_locations_are_caught(tmp_path):
    """A well-formed file that points at the wrong slots: verify reports it, restore fails
    on the page checksum (never yields a wrong page)."""
    repo = Repository.open(tmp_path / "repo", create=True)
    img = b"".join(os.urandom(PAGE) for _ in range(40))
    s, _ = dump(repo, {"pages-1.img": img})
    lp = s.path / "locations"
    data = bytearray(lp.read_bytes())
    n_packs = struct.unpack_from("<I", data, 16)[0]
    runs_off = 32 + n_packs * 40 + 48
    # first run: start one slot later, one page shorter ... and make the next page come from slot 0
    slot, count = struct.unpack_from("<HH", data, runs_off + 20)
    struct.pack_into("<HH", data, runs_off + 20, slot + 1, count - 1)
    body = bytes(data[:-32])
    body = body[:runs_off + 24] + body[runs_off:runs_off + 20] + struct.pack("<HH", slot, 1) + body[runs_off + 24:]
    body = body[:24] + struct.pack("<Q", struct.unpack_from("<Q", body, 24)[0] + 1) + body[32:]
    im_off = 32 + n_packs * 40
    body = body[:im_off + 40] + struct.pack("<Q", struct.unpack_from("<Q", body, im_off + 40)[0] + 1) + body[im_off + 48:]
    lp.write_bytes(body + blake3.blake3(body).digest())
    fresh = repo.snapshot(s.path.name)
    assert fresh.locations() is not None
    with pytest.raises(CorruptSnapshot, match="checksum"):
        read_all(fresh, "pages-1.img")
    rep = verify(repo)
    assert not rep.ok and s.path.name in rep.affected_snapshots


def _cheap_unique_pages(n, salt):
    """n distinct, compressible pages (fast to dump)."""
    return b"".join((salt * 1_000_000 + i).to_bytes(8, "little") * 8 + bytes(PAGE - 64) for i in range(n))


def _restore_peak(repo, snap) -> int:
    repo = Repository.open(repo.path)           # as a restore opens it: no index in memory
    s = repo.snapshot(snap.path.name)
    tracemalloc.start()
    try:
        s.check_structure()
        for name in s.image_names():
            for _ in s.read_image(name):
                pass
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_restore_memory_bounded(tmp_path, monkeypatch):
    """Peak Python allocations of check_structure + reading every image do not grow with
    the snapshot (16 MiB vs 256 MiB) nor with the repository (the small one again after
    the big one was added). Reading in 1 MiB chunks with read-ahead and a blob cache costs a
    few MiB whatever the size, with a little scheduling noise; the index-based path costs
    ~45 bytes per page of the repository (the parsed index; its page table is native and
    not counted here): 69632 pages are ~3 MiB more."""
    # no read-ahead thread: its queue is bounded too (PREFETCH_DEPTH chunks), but how full it
    # gets depends on scheduling, which would only add noise here
    from gpusnap.repo import reader
    monkeypatch.setattr(reader, "PREFETCH_MIN", 1 << 62)
    repo = Repository.open(tmp_path / "repo", create=True)
    small, _ = dump(repo, {"pages-1.img": _cheap_unique_pages(4096, 1), "core-1.img": b"x" * 5000},
                    chunk=1 << 20)
    p_small = _restore_peak(repo, small)
    big, _ = dump(repo, {"pages-1.img": _cheap_unique_pages(65536, 2), "core-1.img": b"y" * 5000},
                  chunk=1 << 20)
    p_big = _restore_peak(repo, big)
    p_small2 = _restore_peak(repo, small)
    peaks = (p_small, p_big, p_small2)
    assert max(peaks) < 8 << 20 and max(peaks) - min(peaks) < 1 << 20, peaks
    # the same measure through the index grows with the snapshot: the test can see it
    os.unlink(big.path / "locations")
    p_idx = _restore_peak(repo, big)
    assert p_idx > max(peaks) + (2 << 20), (peaks, p_idx)


# -- fuzzing -----------------------------------------------------------------------------

def _valid_locations():
    runs = [(0, 16, 1, 1, 4, 4 * PAGE, 100, 1, 3), (1, 16, 2, 0, 0, 10, 10, 0, 1), (0, 200, 1, 0, 2, 2 * PAGE, 2 * PAGE, 0, 2)]
    digests = [b"\x0a" * 32, b"\x0b" * 32]
    parts = [LF.LOC_HEADER.pack(LF.LOC_MAGIC, 1, 0, 2, 2, 0, len(runs)),
             LF.LOC_PACK.pack(b"\x01" * 32, 10000), LF.LOC_PACK.pack(b"\x02" * 32, 100),
             LF.LOC_IMAGE.pack(digests[0], 0, 2), LF.LOC_IMAGE.pack(digests[1], 2, 1)]
    parts += [LF.LOC_RUN.pack(*r) for r in runs]
    body = b"".join(parts)
    return body + blake3.blake3(body).digest(), digests


VALID_LOC, DIGESTS = _valid_locations()


def _parse(data):
    loc = LF.Locations.parse(lambda n, off: data[off:off + n], len(data), DIGESTS)
    out = [list(loc.iter_runs(i)) for i in range(len(loc.images))]
    list(loc.iter_packs())
    return out


def test_valid_locations_parse():
    runs = _parse(VALID_LOC)
    assert [len(r) for r in runs] == [2, 1]


def _mutations(valid):
    return st.one_of(
        st.binary(max_size=400),
        st.tuples(st.integers(0, len(valid) - 1), st.integers(1, 255)).map(
            lambda t: valid[:t[0]] + bytes([valid[t[0]] ^ t[1]]) + valid[t[0] + 1:]),
        st.integers(0, len(valid)).map(lambda n: valid[:n]),
        st.tuples(st.integers(0, len(valid)), st.binary(min_size=1, max_size=40)).map(
            lambda t: valid[:t[0]] + t[1] + valid[t[0]:]),
    )


@settings(max_examples=400, deadline=None)
@given(_mutations(VALID_LOC))
def test_fuzz_locations(data):
    try:
        _parse(data)
    except LF.LocationsInvalid:
        pass


@settings(max_examples=400, deadline=None)
@given(_mutations(VALID_LOC[:-32]))
def test_fuzz_locations_rehashed(body):
    """Mutated body with a correct checksum: the structural checks are exercised."""
    try:
        _parse(body + blake3.blake3(body).digest())
    except LF.LocationsInvalid:
        pass
