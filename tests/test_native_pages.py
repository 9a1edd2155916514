"""The native page hot loop (native/pages/gs_pages.c via gpusnap/repo/native.py) against the
pure-Python reference: identical kinds and page ids, verify finds damaged pages, and the
writer/reader give the same snapshot either way."""

from __future__ import annotations

import os
import random

import blake3
import pytest
from hypothesis import given, settings, strategies as st

from gpusnap.repo import native
from repo_helpers import PAGE, dump, read_all

needs_native = pytest.mark.skipif(not native.available(),
                                  reason=f"libgpusnap_pages.so not loaded: {native.why_unavailable()}")

_page = st.one_of(
    st.just(bytes(PAGE)),                                                   # zero page
    st.binary(min_size=PAGE, max_size=PAGE),                                # arbitrary
    st.tuples(st.integers(0, PAGE - 1), st.integers(1, 255)).map(           # one non-zero byte
        lambda t: bytes(t[0]) + bytes([t[1]]) + bytes(PAGE - t[0] - 1)),
    st.integers(0, 255).map(lambda b: bytes([b]) * PAGE),                   # constant
)


def _ref_ids(buf, n):
    kinds, ids = bytearray(n), bytearray(16 * n)
    for i in range(n):
        p = buf[i * PAGE:(i + 1) * PAGE]
        if p != bytes(PAGE):
            kinds[i] = 1
            ids[16 * i:16 * i + 16] = blake3.blake3(p).digest(16)
    return kinds, ids


def test_python_fallback_matches_blake3():
    buf = os.urandom(3 * PAGE) + bytes(PAGE) + os.urandom(PAGE)
    kinds, ids, nd = native.scan_python(buf, 5)
    assert (kinds, ids) == _ref_ids(buf, 5) and nd == 4
    assert native.verify_python(buf, 5, bytes(ids), kinds) == -1


@needs_native
@settings(max_examples=60, deadline=None)
@given(st.lists(_page, min_size=0, max_size=70))
def test_scan_native_equals_python(pages):
    buf = b"".join(pages)
    n = len(pages)
    a = native.scan_native(buf, n)
    b = native.scan_python(buf, n)
    assert a == b
    assert (a[0], a[1]) == _ref_ids(buf, n)
    assert native.verify_native(buf, n, bytes(a[1]), a[0]) == -1


@needs_native
@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 17, 31, 33, 256, 300])
def test_scan_random_zero_mixed(n):
    rnd = random.Random(n)
    rand = os.urandom(n * PAGE)
    zero = bytes(n * PAGE)
    mixed = b"".join(bytes(PAGE) if rnd.random() < 0.5 else os.urandom(PAGE) for _ in range(n))
    for buf in (rand, zero, mixed):
        assert native.scan_native(buf, n) == native.scan_python(buf, n)
    # ids of all pages (zero pages too) agree with verify
    ids = bytearray(16 * n)
    for i in range(n):
        ids[16 * i:16 * i + 16] = blake3.blake3(mixed[i * PAGE:(i + 1) * PAGE]).digest(16)
    assert native.verify_native(mixed, n, bytes(ids)) == -1


@pytest.mark.parametrize("impl", ["native", "python"])
def test_verify_catches_flipped_byte(impl):
    if impl == "native" and not native.available():
        pytest.skip("libgpusnap_pages.so not loaded")
    verify = native.verify_native if impl == "native" else native.verify_python
    n = 40
    buf = bytearray(os.urandom(n * PAGE))
    kinds, ids, _ = native.scan_python(bytes(buf), n)
    ids = bytes(ids)
    assert verify(bytes(buf), n, ids) == -1
    for page, off in [(0, 0), (17, 4095), (33, 1000), (39, 2048)]:
        bad = bytearray(buf)
        bad[page * PAGE + off] ^= 0x10
        assert verify(bytes(bad), n, ids) == page
        assert native.verify_python(bytes(bad), n, ids) == page
        k = bytearray(kinds)
        k[page] = 0                      # a page marked zero is not checked
        assert verify(bytes(bad), n, ids, k) == -1


@needs_native
def test_scan_accepts_bytearray_and_memoryview():
    buf = os.urandom(5 * PAGE)
    want = native.scan_python(buf, 5)
    assert native.scan_native(bytearray(buf), 5) == want
    assert native.scan_native(memoryview(buf), 5) == want


@needs_native
def test_selftest_and_length_checks():
    assert native._lib.gs_selftest() == 0
    with pytest.raises(ValueError):
        native.scan_native(bytes(PAGE), 2)
    with pytest.raises(ValueError):
        native.verify_native(bytes(2 * PAGE), 2, bytes(16))


@needs_native
def test_writer_native_and_python_write_identical_snapshots(tmp_path, monkeypatch):
    """Same images through both paths: same page lists, same packs (names are content
    hashes), and each reads back with the other path's verify."""
    from gpusnap.repo import Repository, repository
    from gpusnap.repo.pipeline import sinks
    rnd = random.Random(5)
    base = os.urandom(300 * PAGE)
    img = b"".join(bytes(PAGE) if rnd.random() < 0.3 else os.urandom(PAGE) for _ in range(500))
    images = {"pages-1.img": img + base + bytes(PAGE * 20) + base[:PAGE * 50] + b"tail",
              "pages-2.img": base[PAGE * 3:PAGE * 90], "core-1.img": b"core" * 99}
    out = {}
    monkeypatch.setattr(sinks, "COMPRESS_WORKERS", 1)   # several would order blobs by chance
    for mode in ("native", "python"):
        if mode == "python":
            monkeypatch.setattr(native, "scan", native.scan_python)
            monkeypatch.setattr(native, "verify", native.verify_python)
        repo = Repository.open(tmp_path / mode, create=True)
        snap, st1 = dump(repo, images, name="a", chunk=300000)
        for fn, data in images.items():
            assert read_all(snap, fn) == data
        out[mode] = ([(im["name"], im["digest"], im.get("pages_dedup")) for im in snap.manifest["images"]],
                     sorted(p.name for p in (repo.path / "packs").rglob("*") if p.is_file()),
                     {k: v for k, v in st1.items() if k not in ("bytes_stored",)})
    assert out["native"] == out["python"]
