"""Restore leaves runs of zero pages of private anonymous memory out of the images CRIU
reads (gpusnap/criu/sparse.py): the pure page arithmetic against a page-by-page model, the
pagemap it writes read back by pycriu, and, with the real CRIU, a job whose zero pages lie
in private anonymous memory, over a privately mapped file, and in a copy-on-write area a
forked child changed: by both paths it comes back with every byte as it was."""

from __future__ import annotations

import random
import struct
import subprocess
import time
from pathlib import Path

import pycriu
import pytest

from conftest import PY, kill_pids, run_json
from gpusnap.criu import pbwire, sparse
from gpusnap.repo.locate import open_snapshot

PAGE = sparse.PAGE
ANON = sparse.VMA_AREA_REGULAR | sparse.VMA_ANON_PRIVATE
FILE_PRIVATE = sparse.VMA_AREA_REGULAR | (1 << 6)


def _model(entries, vmas, zero_pages: set[int], min_run: int):
    """Page by page: (page index -> vaddr) of what is left out, and the vaddrs kept."""
    idx, pages = 0, []
    for e in entries:
        if e["flags"] & sparse.PE_PRESENT:
            pages += [(idx + i, e["vaddr"] + i * PAGE) for i in range(e["nr_pages"])]
            idx += e["nr_pages"]
    ok = {i for i, va in pages if i in zero_pages and any(
        v["start"] <= va < v["end"] and sparse.plain_anonymous(v) for v in vmas)}
    drop = set()
    run: list[int] = []
    for i, _ in pages + [(-5, 0)]:
        if i in ok and (not run or run[-1] == i - 1):
            run.append(i)
            continue
        if len(run) >= min_run:
            drop.update(run)
        run = [i] if i in ok else []
    return drop, [va for i, va in pages if i not in drop]


def _case(rng: random.Random):
    vmas, entries, va = [], [], 0x10000000
    for _ in range(rng.randint(1, 6)):
        n = rng.randint(1, 300)
        status = rng.choice([ANON, ANON | sparse.VMA_AREA_HEAP, FILE_PRIVATE, ANON | (1 << 8)])
        flags = rng.choice([0x22, 0x22, 0x22 | sparse.MAP_HUGETLB])
        vmas.append({"start": va, "end": va + n * PAGE, "flags": flags, "status": status})
        p = va
        while p < va + n * PAGE:        # entries cut anywhere, some spanning into the next VMA
            k = rng.randint(1, 80)
            entries.append({"vaddr": p, "nr_pages": k, "flags": sparse.PE_PRESENT | rng.choice([0, sparse.PE_LAZY]),
                            "has_flags": True})
            p += k * PAGE
        va = p + rng.choice([0, 7]) * PAGE
    total = sum(e["nr_pages"] for e in entries)
    zero = {i for i in range(total) if rng.random() < 0.8} if rng.random() < 0.7 else set(range(total))
    return entries, vmas, zero, total


def _zero_refs(zero: set[int], total: int):
    """Page-list records for `total` pages, `zero` of them zero pages."""
    i = 0
    while i < total:
        j = i
        while j < total and (j in zero) == (i in zero):
            j += 1
        yield ("zero", j - i) if i in zero else ("pages", bytes(16 * (j - i)))
        i = j


@pytest.mark.parametrize("seed", range(200))
def test_page_arithmetic_matches_a_page_by_page_model(seed):
    rng = random.Random(seed)
    entries, vmas, zero, total = _case(rng)
    min_run = rng.choice([1, 4, 16])
    runs = sparse.droppable(entries, vmas)
    drop = sparse.intersect(sparse.zero_runs(_zero_refs(zero, total)), runs, min_run)
    want_drop, want_kept = _model(entries, vmas, zero, min_run)
    assert {i for a, n in drop for i in range(a, a + n)} == want_drop
    kept = [e["vaddr"] + i * PAGE for e in sparse.split_entries(entries, drop) for i in range(e["nr_pages"])]
    assert kept == want_kept


def test_a_parent_image_or_a_tail_leaves_the_image_whole():
    e = [{"vaddr": 0x1000, "nr_pages": 4, "flags": sparse.PE_PARENT | sparse.PE_PRESENT, "has_flags": True}]
    assert sparse.droppable(e, [{"start": 0, "end": 1 << 20, "flags": 0x22, "status": ANON}]) is None
    assert sparse.zero_runs([("zero", 3), ("tail", 100, b"x" * 32)]) is None


def test_written_pagemap_reads_back_through_pycriu():
    entries = [{"vaddr": 0x7F0000000000 + i * 0x5000, "nr_pages": 1 + i * 40, "flags": 4 | (i & 2),
                "has_flags": True} for i in range(50)]
    magic = pycriu.images.magic.by_name
    raw = pbwire.image(struct.pack("<II", magic["IMG_COMMON"], magic["PAGEMAP"]),
                       [b"\x08\x07"] + [pbwire.pagemap_entry(e["vaddr"], e["nr_pages"], e["flags"]) for e in entries])
    img = pycriu.images.loads(raw)
    assert img["magic"] == "PAGEMAP" and img["entries"][0] == {"pages_id": 7}
    got = [(int(x["vaddr"]), x["nr_pages"], x["flags"], x["compat_nr_pages"]) for x in img["entries"][1:]]
    assert got == [(e["vaddr"], e["nr_pages"], e["flags"], 0) for e in entries]


def _start(out: Path):
    p = subprocess.Popen([PY, str(Path(__file__).parent / "jobs" / "zero_pages.py"), str(out)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    deadline = time.monotonic() + 60
    while not (out / "expected-parent").exists():
        assert p.poll() is None and time.monotonic() < deadline, "the job did not start"
        time.sleep(0.02)
    return p, [int(x) for x in (out / "pid").read_text().split()]


def _results(out: Path) -> dict:
    deadline = time.monotonic() + 60
    while not all((out / f"result-{r}").exists() for r in ("parent", "child")):
        assert time.monotonic() < deadline, "the restored job did not finish"
        time.sleep(0.05)
    return {r: (out / f"result-{r}").read_text() for r in ("parent", "child")}


@pytest.mark.criu
@pytest.mark.parametrize("via", ["stream", "files"])
def test_zero_pages_are_left_out_and_every_byte_comes_back(tmp_path, repo, via):
    out = tmp_path / "job"
    p, pids = _start(out)
    try:
        expected = {r: (out / f"expected-{r}").read_text() for r in ("parent", "child")}
        snap = run_json("dump", pids[0], "--repo", repo, "--exit")["snapshot"]
        p.wait(timeout=30)
        sp = sparse.plan(open_snapshot(snap, repo)[1])
        # the parent's 4 MiB of zeros and the child's zeroed MiB at least; never the file's
        assert sp.pages_left_out >= 5 * 256
        for name, raw in sp.pagemaps.items():
            kept = sum(e["nr_pages"] for e in pycriu.images.loads(raw)["entries"][1:])
            pages = f"pages-{pycriu.images.loads(raw)['entries'][0]['pages_id']}.img"
            assert kept * PAGE == sp.size[pages]
        restored = run_json("restore", snap, "--repo", repo, "--via", via)
        assert restored["via"] == via and restored["pid"] == pids[0]
        (out / "finish").touch()
        assert _results(out) == expected
    finally:
        kill_pids(pids)
