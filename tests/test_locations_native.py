"""The locations file without numpy (gpusnap/repo/locations.py on native/pages/gs_table.c):
gs_table_fill and gs_run_starts against pure-Python references; every locations file a
commit writes, and build() over the index, byte for byte equal to a page-by-page reference
(old and new pages, zero pages, tails, data blobs, several packs, an incremental dump);
the first page without a location is the one named; and a real dump never imports numpy."""

from __future__ import annotations

import json
import os
import random
import re
from array import array
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from conftest import kill_pids, run_gpusnap, run_json
from gpusnap.repo import Repository, native
from gpusnap.repo import locations as L
from gpusnap.repo.format import KIND_PAGES, PAGE_ID_LEN, iter_pagelist
from gpusnap.repo.format.locations import LOC_NAME, LOC_RUN, encode_locations
from gpusnap.repo.pipeline.pagetable import PageTable
from page_reference import DictPageTable
from repo_helpers import PAGE, dump, read_all, text_page


# -- the two native helpers --------------------------------------------------------------------

def _ref_run_starts(locs, cur, length):
    """The rule page by page: a run goes on while the location is the previous one + 1
    and its slot is not 0; the first page may continue the pending run (cur, length)."""
    starts = []
    for i, v in enumerate(locs):
        if v < 0:
            return [], -1 - i
        prev = locs[i - 1] if i else (cur + length - 1 if length > 0 else None)
        if not (prev is not None and v == prev + 1 and v & 0xFF):
            starts.append(i)
    return starts, len(starts)


_loc = st.tuples(st.integers(0, 6), st.integers(0, 255)).map(lambda t: t[0] << 8 | t[1])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(_loc, st.sampled_from([-1, 1 << 8, 1 << 8 | 1, 1 << 8 | 2, 1 << 8 | 3])), max_size=40),
       st.one_of(st.just((-2, 0)), st.tuples(_loc, st.integers(1, 5))), st.integers(0, 3))
def test_run_starts_matches_the_page_by_page_rule(locs, pending, ramp):
    # runs of consecutive slots are what the rule is about: make some
    locs = [v + i if v >= 0 and ramp else v for i, v in enumerate(locs)]
    cur, length = pending
    starts, k = native.run_starts(array("q", locs), cur, length)
    want, wk = _ref_run_starts(locs, cur, length)
    assert k == wk
    if k > 0:
        assert list(starts[:k]) == want


def test_run_starts_refuses_other_arrays():
    with pytest.raises(ValueError):
        native.run_starts([1, 2, 3], -2, 0)
    with pytest.raises(ValueError):
        native.run_starts(array("i", [1, 2]), -2, 0)
    assert native.run_starts(array("q"), 5, 3)[1] == 0


_ids = st.lists(st.integers(0, 40), max_size=60)


@settings(max_examples=200, deadline=None)
@given(_ids, _ids, _ids, st.lists(st.integers(-1, 3), max_size=60))
def test_fill_matches_the_dict_reference(first, second, query, preset):
    """fill() after another table's answers: only entries < 0 are looked up, the others
    stay as they are; the count returned is what is still < 0."""
    def pid(k):
        return k.to_bytes(2, "little") * 8

    t, ref = PageTable(), DictPageTable()
    for j, k in enumerate(second):
        t.add_run(pid(k), 1000 + j)
        ref.add_run(pid(k), 1000 + j)
    ids = b"".join(pid(k) for k in query)
    out = array("q", [(preset[i] if i < len(preset) else -1) for i in range(len(query))])
    want = [v if v >= 0 else ref.get_many(pid(k))[0] for k, v in zip(query, out)]
    left = t.fill(ids, out)
    assert list(out) == want and left == sum(v < 0 for v in want)
    with pytest.raises(ValueError):
        t.fill(ids + b"x", out)
    with pytest.raises(ValueError):
        t.fill(ids, array("q", list(out) + [0]))


# -- whole locations files -------------------------------------------------------------------

def _reference_file(snap_dir: Path, images: list, idx) -> bytes:
    """The locations file computed page by page from dicts (docs/format.md 5.4)."""
    page, data = {}, {}
    for bno, b in enumerate(idx.blobs):
        if b.kind == KIND_PAGES:
            for s in range(b.n_pages):
                page.setdefault(b.ids[s * PAGE_ID_LEN:(s + 1) * PAGE_ID_LEN], bno << 8 | s)
        else:
            data.setdefault(b.ids, bno)
    pack_no: dict = {}
    packs: list = []
    runs: list = []
    table = []

    def add(bno, slot, count):
        b = idx.blobs[bno]
        if b.pack not in pack_no:
            pack_no[b.pack] = len(packs)
            packs.append([b.pack, 0])
        p = packs[pack_no[b.pack]]
        p[1] = max(p[1], b.end)
        runs.append(LOC_RUN.pack(pack_no[b.pack], b.offset, b.kind, b.codec, b.n_pages, b.raw_len,
                                 b.stored_len, slot, count))

    for im in images:
        first = len(runs)
        if im["type"] == "blob":
            for bh in im["blobs"]:
                add(data[bytes.fromhex(bh)], 0, 1)
        else:
            run = None                       # [location of its first page, pages]

            def close():
                nonlocal run
                if run:
                    add(run[0] >> 8, run[0] & 0xFF, run[1])
                run = None
            with open(snap_dir / im["pagelist"], "rb") as f:
                for rec in iter_pagelist(f.read, im["size"]):
                    if rec[0] == "zero":
                        continue
                    if rec[0] == "tail":
                        close()
                        add(data[rec[2]], 0, 1)
                        continue
                    for i in range(len(rec[1]) // PAGE_ID_LEN):
                        loc = page[rec[1][i * PAGE_ID_LEN:(i + 1) * PAGE_ID_LEN]]
                        if run and loc == run[0] + run[1] and loc & 0xFF:
                            run[1] += 1
                        else:
                            close()
                            run = [loc, 1]
            close()
        table.append((bytes.fromhex(im["digest"]), first, len(runs) - first))
    return encode_locations(packs, table, b"".join(runs), len(runs))


def _history(repo):
    """Snapshots covering what a locations file holds: zero pages, tails, text and random
    pages, data blobs, an empty image, small packs; then an incremental dump (pages moved,
    a few new, the same data again) and one whose new pages repeat inside the dump."""
    rnd = random.Random(3)
    pages = [bytes(PAGE) if rnd.random() < 0.3 else (os.urandom(PAGE) if rnd.random() < 0.5 else text_page(rnd))
             for _ in range(1500)]
    img = b"".join(pages) + b"a partial tail"
    core = os.urandom(300_000)
    snaps = [dump(repo, {"pages-1.img": img, "core-1.img": core, "empty.img": b""}, pack_target=256 << 10)[0]]
    img2 = img[PAGE * 700:PAGE * 1500] + os.urandom(PAGE * 37) + img[:PAGE * 700] + b"another tail"
    snaps.append(dump(repo, {"pages-1.img": img2, "pages-2.img": img, "core-1.img": core}, pack_target=256 << 10)[0])
    fresh = b"".join(os.urandom(PAGE) for _ in range(300))
    img3 = fresh + img[:PAGE * 50] + bytes(PAGE * 5) + fresh[:PAGE * 120]
    snaps.append(dump(repo, {"pages-1.img": img3, "pages-2.img": fresh[PAGE * 100:]})[0])
    return snaps, {snaps[0]: img, snaps[1]: img2, snaps[2]: img3}


def test_files_equal_the_page_by_page_reference(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    snaps, imgs = _history(repo)
    idx = repo.index()
    by_index = L.index_resolver(idx)
    by_dict = DictPageTable()                # the Resolver's per-page path (objects with get())
    for bno, b in enumerate(idx.blobs):
        if b.kind == KIND_PAGES:
            by_dict.add_run(b.ids, bno << 8, b.n_pages)
    dict_res = L.Resolver([by_dict.d], [idx.data_loc], idx.blobs.fields)
    for snap in snaps:
        stored = (snap.path / LOC_NAME).read_bytes()      # written at commit
        ref = _reference_file(snap.path, snap.manifest["images"], idx)
        assert stored == ref
        assert L.build(snap.path, snap.manifest["images"], by_index) == ref
        assert L.build(snap.path, snap.manifest["images"], dict_res) == ref
        s = Repository.open(repo.path).snapshot(snap.path.name)
        assert s.locations() is not None
        assert read_all(s, "pages-1.img") == imgs[snap]


def test_the_first_page_without_a_location_is_named(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    snaps, _ = _history(repo)
    idx = repo.index()
    snap = snaps[1]
    # leave out the pages of one blob the snapshot uses (a table whose answers come in two
    # parts: the first table misses them, the second has only the others)
    order = []                               # the snapshot's page ids, in page-list order
    for im in snap.manifest["images"]:
        if im["type"] != "blob":
            with open(snap.path / im["pagelist"], "rb") as f:
                for rec in iter_pagelist(f.read, im["size"]):
                    if rec[0] == "pages":
                        order += [rec[1][i:i + PAGE_ID_LEN] for i in range(0, len(rec[1]), PAGE_ID_LEN)]
    assert len(order) > 1000
    victim = order[900]
    def ids_of(b):
        return {b.ids[i:i + PAGE_ID_LEN] for i in range(0, len(b.ids), PAGE_ID_LEN)}
    gone_bno = next(bno for bno, b in enumerate(idx.blobs) if b.kind == KIND_PAGES and victim in ids_of(b))
    gone = ids_of(idx.blobs[gone_bno])
    first_missing = next(pid for pid in order if pid in gone)
    half, rest = PageTable(), PageTable()
    for bno, b in enumerate(idx.blobs):
        if b.kind == KIND_PAGES and bno != gone_bno:
            (half if bno % 2 else rest).add_run(b.ids, bno << 8, b.n_pages)
    res = L.Resolver([half, rest], [idx.data_loc], idx.blobs.fields)
    with pytest.raises(L.MissingData, match=f"page {first_missing.hex()} has no location"):
        L.build(snap.path, snap.manifest["images"], res)


# -- a real dump does not import numpy ----------------------------------------------------------

def _imported(stderr: str) -> set[str]:
    """Module names from PYTHONPROFILEIMPORTTIME's lines ("import time: us | us | name")."""
    return {m.group(1) for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)", stderr, re.M)}


@pytest.mark.criu
def test_a_real_dump_never_imports_numpy(sample_job, repo, reference):
    """Two dumps of a running job (the second mostly known pages), each with Python
    reporting every import it makes: numpy is not among them, the commit wrote the locations
    file, and the job restored from the second finishes with the reference result."""
    kw = dict(steps=200, mb=64, threads=2)
    expected = reference(**kw)
    job = sample_job(**kw, step_ms=20)
    job.wait_steps(10)
    env = {"PYTHONPROFILEIMPORTTIME": "1"}
    snaps = []
    for name in ("first", "second"):
        proc = run_gpusnap("dump", job.pid, "--repo", repo, "--name", name, "--json", env=env, check=True)
        mods = _imported(proc.stderr)
        assert "gpusnap.repo.locations" in mods       # the report works and covers the dump's code
        assert not {m for m in mods if m == "numpy" or m.startswith("numpy.")}, "the dump imported numpy"
        info = json.loads(proc.stdout.strip().splitlines()[-1])
        snaps.append(Path(info["snapshot"]))
        assert (snaps[-1] / LOC_NAME).is_file()
        job.wait_steps(job.steps_done() + 3)
    assert info["pages_dedup"] > 0                      # the second dump found known pages
    job.kill()
    restored = run_json("restore", snaps[-1], "--repo", repo)
    try:
        assert job.result() == expected
    finally:
        kill_pids([restored["pid"], *job.pids])
