"""The native page hot loop (native/pages/gs_pages.c via gpusnap/repo/native.py) against the
pure-Python reference (tests/page_reference.py): identical kinds and page ids, verify finds
damaged pages, the writer gives the same snapshot with either, and a missing or foreign
library is one clear error."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import blake3
import pytest
from hypothesis import given, settings, strategies as st

import page_reference as ref
from gpusnap.repo import native
from repo_helpers import PAGE, dump, read_all

ROOT = Path(__file__).resolve().parents[1]

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


def test_reference_matches_blake3():
    buf = os.urandom(3 * PAGE) + bytes(PAGE) + os.urandom(PAGE)
    kinds, ids, nd = ref.scan(buf, 5)
    assert (kinds, ids) == _ref_ids(buf, 5) and nd == 4
    assert ref.verify(buf, 5, bytes(ids), kinds) == -1


@settings(max_examples=60, deadline=None)
@given(st.lists(_page, min_size=0, max_size=70))
def test_scan_native_equals_reference(pages):
    buf = b"".join(pages)
    n = len(pages)
    a = native.scan(buf, n)
    b = ref.scan(buf, n)
    assert a == b
    assert (a[0], a[1]) == _ref_ids(buf, n)
    assert native.verify(buf, n, bytes(a[1]), a[0]) == -1


@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 17, 31, 33, 256, 300])
def test_scan_random_zero_mixed(n):
    rnd = random.Random(n)
    rand = os.urandom(n * PAGE)
    zero = bytes(n * PAGE)
    mixed = b"".join(bytes(PAGE) if rnd.random() < 0.5 else os.urandom(PAGE) for _ in range(n))
    for buf in (rand, zero, mixed):
        assert native.scan(buf, n) == ref.scan(buf, n)
    # ids of all pages (zero pages too) agree with verify
    ids = bytearray(16 * n)
    for i in range(n):
        ids[16 * i:16 * i + 16] = blake3.blake3(mixed[i * PAGE:(i + 1) * PAGE]).digest(16)
    assert native.verify(mixed, n, bytes(ids)) == -1


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_verify_catches_flipped_byte(impl):
    verify = native.verify if impl == "native" else ref.verify
    n = 40
    buf = bytearray(os.urandom(n * PAGE))
    kinds, ids, _ = ref.scan(bytes(buf), n)
    ids = bytes(ids)
    assert verify(bytes(buf), n, ids) == -1
    for page, off in [(0, 0), (17, 4095), (33, 1000), (39, 2048)]:
        bad = bytearray(buf)
        bad[page * PAGE + off] ^= 0x10
        assert verify(bytes(bad), n, ids) == page
        assert ref.verify(bytes(bad), n, ids) == page
        k = bytearray(kinds)
        k[page] = 0                      # a page marked zero is not checked
        assert verify(bytes(bad), n, ids, k) == -1


def test_scan_accepts_bytearray_and_memoryview():
    buf = os.urandom(5 * PAGE)
    want = ref.scan(buf, 5)
    assert native.scan(bytearray(buf), 5) == want
    assert native.scan(memoryview(buf), 5) == want
    assert native.scan(buf, 0) == (bytearray(), bytearray(), 0)


def test_length_checks():
    with pytest.raises(ValueError):
        native.scan(bytes(PAGE), 2)
    with pytest.raises(ValueError):
        native.verify(bytes(2 * PAGE), 2, bytes(16))


def _load_in_child(lib: str) -> subprocess.CompletedProcess:
    code = ("from gpusnap.repo import native\n"
            "from gpusnap.errors import NativeLibraryMissing\n"
            "try:\n    native.scan(bytes(4096), 1)\n"
            "except NativeLibraryMissing as e:\n    print(e.exit_code, e, '|', e.hint)\n"
            "else:\n    print('loaded', native.lib_path)\n")
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, GPUSNAP_NATIVE_LIB=lib),
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_missing_library_is_one_clear_error(tmp_path):
    r = _load_in_child(str(tmp_path / "libgpusnap_pages.so"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("27 ") and "not found" in r.stdout and "make setup" in r.stdout


def test_library_of_another_abi_is_refused(tmp_path):
    """A build of another version of the C code (here: ABI 2) is refused, not half used."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler")
    src = tmp_path / "old.c"
    src.write_text("int gs_abi_version(void) { return 2; }\n")
    lib = tmp_path / "libgpusnap_pages.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    r = _load_in_child(str(lib))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("27 ") and "ABI version 2" in r.stdout and "make setup" in r.stdout


def test_cli_without_the_library_exits_27(tmp_path):
    """What a user sees: `gpusnap verify` of a good repository, run without the library."""
    from gpusnap.repo import Repository
    repo = Repository.open(tmp_path / "r", create=True)
    dump(repo, {"pages-1.img": os.urandom(8 * PAGE)})
    r = subprocess.run([sys.executable, "-m", "gpusnap", "verify", "--repo", str(repo.path)], cwd=ROOT,
                       env=dict(os.environ, GPUSNAP_NATIVE_LIB=str(tmp_path / "none.so")),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 27, r.stdout + r.stderr
    assert "native page library" in r.stderr and "make setup" in r.stderr


def test_the_checkout_library_loads():
    r = _load_in_child("")
    assert r.stdout.startswith("loaded ") and r.stdout.strip().endswith("libgpusnap_pages.so"), r.stdout + r.stderr


def test_writer_native_and_reference_write_identical_snapshots(tmp_path, monkeypatch):
    """Same images through the native page functions and through the reference: same page
    lists, same packs (names are content hashes), and each reads back."""
    from gpusnap.repo import Repository
    from gpusnap.repo.pipeline import sinks
    rnd = random.Random(5)
    base = os.urandom(300 * PAGE)
    img = b"".join(bytes(PAGE) if rnd.random() < 0.3 else os.urandom(PAGE) for _ in range(500))
    images = {"pages-1.img": img + base + bytes(PAGE * 20) + base[:PAGE * 50] + b"tail",
              "pages-2.img": base[PAGE * 3:PAGE * 90], "core-1.img": b"core" * 99}
    out = {}
    monkeypatch.setattr(sinks, "COMPRESS_WORKERS", 1)   # several would order blobs by chance
    for mode in ("native", "reference"):
        if mode == "reference":
            monkeypatch.setattr(native, "scan", ref.scan)
            monkeypatch.setattr(native, "verify", ref.verify)
        repo = Repository.open(tmp_path / mode, create=True)
        snap, st1 = dump(repo, images, name="a", chunk=300000)
        for fn, data in images.items():
            assert read_all(snap, fn) == data
        out[mode] = ([(im["name"], im["digest"], im.get("pages_dedup")) for im in snap.manifest["images"]],
                     sorted(p.name for p in (repo.path / "packs").rglob("*") if p.is_file()),
                     {k: v for k, v in st1.items() if k not in ("bytes_stored",)})
    assert out["native"] == out["reference"]


def test_doctor_reports_a_missing_library(tmp_path):
    """doctor fails the 'page library' check (with dump's exit code) where every command would
    stop with exit 27, and reports the library it found otherwise."""
    def page_check(env):
        r = subprocess.run([sys.executable, "-m", "gpusnap", "doctor", "--json"], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=120)
        checks = [c for c in json.loads(r.stdout)["checks"] if c["name"] == "page library"]
        assert len(checks) == 1, r.stdout + r.stderr
        return r.returncode, checks[0]

    rc, c = page_check(dict(os.environ, GPUSNAP_NATIVE_LIB=str(tmp_path / "none.so")))
    assert rc != 0 and c["status"] == "fail" and c["exit_code"] == 27 and "make setup" in c["fix"]
    rc, c = page_check(dict(os.environ))
    assert c["status"] == "ok" and c["detail"].endswith("libgpusnap_pages.so")


def test_self_test_runs_side_by_side():
    """The parallel readers load the library from several threads at once: its self test
    must be reentrant (a shared buffer made it fail at random: 'self test failed')."""
    import threading

    lib = native.load()
    bad = []

    def run():
        for _ in range(100):
            if lib.gs_selftest() != 0:
                bad.append(1)

    ts = [threading.Thread(target=run) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not bad
