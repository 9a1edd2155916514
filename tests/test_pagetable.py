"""The dump's page tables (gpusnap/repo/pipeline/pagetable.py, native/pages/gs_table.c): the native
table behaves exactly like the dict reference (tests/page_reference.py), stays exact as it
grows, claims each new id exactly once across threads, and rejects malformed input."""

from __future__ import annotations

import os
import random
import threading

import pytest
from hypothesis import given, settings, strategies as st

import page_reference as ref
from gpusnap.repo import Repository
from gpusnap.repo.pipeline.pagetable import PageTable, claim
from repo_helpers import PAGE, dump

# a small id alphabet, so that runs overlap and ids repeat
_ids = st.lists(st.integers(0, 40).map(lambda i: i.to_bytes(2, "little") * 8), min_size=0, max_size=30)
_ops = st.lists(st.tuples(st.sampled_from(["run", "runs", "claim"]), _ids, st.integers(0, 1 << 20),
                          st.lists(st.booleans(), min_size=30, max_size=30)), max_size=12)


def _apply(tables, ops, claim):
    """Run ops on (known, claimed) tables; -> everything observable."""
    known, claimed = tables
    seen = []
    for op, ids, base, flags in ops:
        buf = b"".join(ids)
        if op == "run":
            seen.append(known.add_run(buf, base))
        elif op == "runs":
            cut = len(ids) // 2
            seen.append(known.add_runs(buf, [base, base + 7], [cut, len(ids) - cut]))
        else:
            kinds = bytes(flags[:len(ids)])
            seen.append(claim(known, claimed, kinds, buf, len(ids)))
    probe = b"".join(i.to_bytes(2, "little") * 8 for i in range(42))
    seen += [len(known), len(claimed), list(known.get_many(probe)), list(claimed.get_many(probe)),
             [known.get(probe[k:k + 16]) for k in range(0, len(probe), 16)]]
    return seen


@settings(max_examples=200, deadline=None)
@given(_ops)
def test_native_matches_the_dict_reference(ops):
    native_t = (PageTable(), PageTable())
    dict_t = (ref.DictPageTable(), ref.DictPageTable())
    assert _apply(native_t, ops, claim) == _apply(dict_t, ops, ref.claim)


@pytest.mark.parametrize("table", [PageTable, ref.DictPageTable])
def test_first_location_wins_and_absent_is_minus_one(table):
    t = table()
    a, b, c = os.urandom(16), os.urandom(16), os.urandom(16)
    assert t.add_run(a + b, 100) == 2
    assert t.add_run(b + c, 200) == 1              # b keeps 101
    assert list(t.get_many(a + b + c + os.urandom(16))) == [100, 101, 201, -1]
    assert t.get(b) == 101 and t.get(os.urandom(16)) is None and t.get(b"short") is None
    assert b in t and len(t) == 3


def test_growth_keeps_every_entry():
    rnd = random.Random(7)
    ids = rnd.randbytes(16 * 300_000)
    t = PageTable()                               # starts small: grows many times
    for lo in range(0, 300_000, 1000):
        t.add_run(ids[lo * 16:(lo + 1000) * 16], lo << 8)
    got = t.get_many(ids)
    assert list(got) == [((i // 1000 * 1000) << 8) + i % 1000 for i in range(300_000)]
    assert len(t) == 300_000
    assert 24 * 300_000 < t.nbytes() <= 24 * 4 * 300_000   # 24-byte slots, at most 3/4 full


def test_concurrent_claims_take_each_id_once():
    rnd = random.Random(3)
    pool = [rnd.randbytes(16) for _ in range(20_000)]
    known = PageTable()
    known.add_run(b"".join(pool[:5000]), 0)        # a quarter is already in the repository
    claimed = PageTable()
    results: list[list[bytes]] = [[] for _ in range(4)]

    def worker(k):
        r = random.Random(k)
        for _ in range(50):
            batch = [r.choice(pool) for _ in range(256)]
            buf = b"".join(batch)
            for i in claim(known, claimed, b"\1" * 256, buf, 256):
                results[k].append(batch[i])

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    won = [i for r in results for i in r]
    assert len(won) == len(set(won))               # nobody stores a page twice
    assert not set(won) & set(pool[:5000])         # nor one the repository has
    assert len(claimed) == len(won)


@pytest.mark.parametrize("table,claim", [(PageTable, claim), (ref.DictPageTable, ref.claim)])
def test_malformed_input_is_refused(table, claim):
    t = table()
    with pytest.raises(ValueError):
        t.add_run(b"x" * 17, 0)
    with pytest.raises(ValueError):
        t.add_run(b"x" * 16, -1)
    with pytest.raises(ValueError):
        t.add_runs(b"x" * 32, [0], [3])
    with pytest.raises(ValueError):
        t.get_many(b"x" * 15)
    with pytest.raises(ValueError):
        claim(None, t, b"\1", b"x" * 16, 2)
    assert len(t) == 0


def test_repository_index_table_equals_its_dict(tmp_path):
    repo = Repository.open(tmp_path / "r", create=True)
    a = os.urandom(PAGE * 50)
    dump(repo, {"pages-1.img": a + bytes(PAGE * 3)})
    dump(repo, {"pages-1.img": os.urandom(PAGE * 20) + a[:PAGE * 10]})
    idx = repo.index()
    table = idx.page_table()
    ref = {}                           # the reference: first record of each id wins
    for bno, b in enumerate(idx.blobs):
        for s in range(b.n_pages):
            ref.setdefault(b.ids[s * 16:(s + 1) * 16], bno << 8 | s)
    keys = list(ref)
    assert len(table) == len(ref) == 70
    assert list(table.get_many(b"".join(keys))) == [ref[k] for k in keys]
