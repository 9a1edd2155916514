"""`gpusnap ls` sizes (gpusnap/repo/maint/usage.py repo_usage): the numpy implementation gives
what the definition gives, computed here the slow way with Python sets."""

import os
import random

from gpusnap.repo import Repository
from gpusnap.repo.format import BLOB_HEADER, KIND_PAGES
from gpusnap.repo.maint.usage import repo_usage
from gpusnap.repo.maint.prune import execute_prune, plan_prune, snapshots_info
from repo_helpers import PAGE, dump, text_page


def _by_definition(repo):
    """Every referenced id's stored bytes (a page: its share of its blob), unique when one
    snapshot references it, shared otherwise."""
    idx = repo.index()
    snaps = repo.snapshots()
    refs = []
    count = {}
    for s in snaps:
        raw, data = s.referenced_page_bytes()
        pages = {raw[i:i + 16] for i in range(0, len(raw), 16)}   # the oracle: a set per id
        refs.append(pages | data)
        for k in pages | data:
            count[k] = count.get(k, 0) + 1

    def cost(k):
        if len(k) == 16:
            loc = idx.page_table().get(k)
            if loc is None:
                return 0.0
            b = idx.blobs[loc >> 8]
            assert b.kind == KIND_PAGES
            return (BLOB_HEADER.size + b.stored_len) / b.n_pages
        b = idx.blobs[idx.data_loc[k]]
        return float(BLOB_HEADER.size + b.stored_len)

    out = {}
    for s, ids in zip(snaps, refs):
        u = sum(cost(k) for k in ids if count[k] == 1)
        sh = sum(cost(k) for k in ids if count[k] > 1)
        out[s.path.name] = (u, sh)
    return out


def _check(repo):
    got = repo_usage(repo)
    want = _by_definition(repo)
    assert set(got) == set(want)
    for name, (u, sh) in want.items():
        assert abs(got[name]["bytes_unique"] - u) <= 1, (name, got[name], u)
        assert abs(got[name]["bytes_shared"] - sh) <= 1, (name, got[name], sh)
    return got


def test_usage_matches_the_definition(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    rnd = random.Random(4)
    common = [os.urandom(PAGE) if rnd.random() < 0.5 else text_page(rnd) for _ in range(200)]
    a = b"".join(common) + b"".join(os.urandom(PAGE) for _ in range(50)) + bytes(PAGE * 10)
    b_ = b"".join(common[50:]) + b"".join(text_page(rnd) for _ in range(30)) + b"odd tail"
    c = b"".join(common[:20]) * 3                      # repeats inside one snapshot count once
    core = os.urandom(3 << 20)
    dump(repo, {"pages-1.img": a, "core-1.img": core})
    dump(repo, {"pages-1.img": b_, "core-1.img": core[:1 << 20]})
    dump(repo, {"pages-1.img": c, "core-1.img": b"small"})
    got = _check(repo)
    assert all(v["bytes_unique"] > 0 and v["bytes_shared"] > 0 for v in got.values()), got
    # after a prune (partly used packs rewritten) the sizes follow
    plan = plan_prune(snapshots_info(repo), keep_last=2)
    execute_prune(repo, plan)
    got = _check(repo)
    assert len(got) == 2


def test_empty_repository(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    assert repo_usage(repo) == {}
