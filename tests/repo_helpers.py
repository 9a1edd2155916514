"""Shared helpers for tests/test_repo_*.py (real files in tmp dirs, no mocks)."""

from __future__ import annotations

import os
import random

from gpusnap.repo import Repository

PAGE = 4096


def dump(repo: Repository, images: dict[str, bytes], name="job", compress="lz4", chunk=None, meta=None, **kw):
    """Write one snapshot; images {filename: bytes}; chunk: write size (None = random sizes)."""
    rnd = random.Random(len(images))
    with repo.writer_lock():
        w = repo.new_snapshot(name, compress=compress, meta=meta, **kw)
        for fn, data in images.items():
            s = w.image_sink(fn)
            i = 0
            while i < len(data):
                n = chunk or rnd.choice([1, 7, 100, 4095, 4096, 4097, 65536, 300000])
                s.write(memoryview(data)[i:i + n])
                i += n
            s.close()
        snap = w.commit()
    return snap, w.stats


def read_all(snap, fn) -> bytes:
    return b"".join(snap.read_image(fn))


def text_page(rnd: random.Random) -> bytes:
    words = [b"alpha", b"beta", b"gamma", b"delta", b"tensor", b"weight", b"grad", b"loss"]
    return b" ".join(rnd.choice(words) for _ in range(900))[:PAGE].ljust(PAGE, b".")


def file_tree_size(path) -> int:
    total = 0
    for dp, dn, fns in os.walk(path):
        for f in fns:
            total += os.path.getsize(os.path.join(dp, f))
    return total
