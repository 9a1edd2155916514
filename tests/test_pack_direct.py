"""Pack files are written around the page cache (O_DIRECT through an aligned buffer) where the
filesystem allows, and buffered where it does not: the bytes on disk are the same either way,
and a pack written direct leaves nothing of itself in the page cache."""

import ctypes
import mmap
import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest

from conftest import ROOT
from gpusnap.repo.materialize import _is_tmpfs
from gpusnap.repo import Repository
from gpusnap.repo.maint.verify import verify
from gpusnap.repo.pipeline import packout, packwriter
from gpusnap.repo.store import pack_path
from repo_helpers import PAGE, dump, read_all, text_page

_libc = ctypes.CDLL(None, use_errno=True)


def _resident_pages(path) -> int:
    """Pages of the file in the page cache (mincore on a fresh mapping, which faults nothing in)."""
    size = os.path.getsize(path)
    mm, mc, mu = _libc.mmap, _libc.mincore, _libc.munmap
    mm.restype = ctypes.c_void_p
    mm.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    mc.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    mu.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = mm(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value)
        try:
            vec = (ctypes.c_ubyte * -(-size // PAGE))()
            assert mc(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(v & 1 for v in vec)
        finally:
            mu(addr, size)
    finally:
        os.close(fd)


def _write_packs(root, direct: str, monkeypatch, target=9 << 20, n=2600) -> dict:
    """The same blobs (seeded) through a PackWriter; {pack name: path}."""
    monkeypatch.setenv("GPUSNAP_PACK_DIRECT", direct)
    repo = Repository.open(root, create=True)
    rnd = random.Random(5)
    w = packwriter.PackWriter(repo.path, target_size=target)
    batch = []
    for i in range(n):
        k = rnd.choice([1, 3, 16])
        payload = rnd.randbytes(k * PAGE - rnd.randrange(0, 3000))    # "compressed": any length
        batch.append((1, 1, k, k * PAGE, payload, rnd.randbytes(16 * k)))
        if len(batch) == 7:
            w.add_many(batch)
            batch = []
    w.add_many(batch)
    done = w.finish()
    return {ph.hex(): pack_path(repo.path, ph) for ph, _ in done}


@pytest.fixture
def disk_dir(tmp_path):
    """A private directory on a filesystem with a page cache of its own (not tmpfs, which
    keeps every file in the page cache, so that residency would say nothing): tmp_path where
    it is one, else /var/tmp, else the checkout's own filesystem (Debian 13's /tmp is tmpfs)."""
    for base in (tmp_path, Path("/var/tmp"), ROOT):
        if base.is_dir() and not _is_tmpfs(base):
            d = Path(tempfile.mkdtemp(prefix="gpusnap-direct-", dir=base))
            yield d
            shutil.rmtree(d, ignore_errors=True)
            return
    pytest.fail("no directory here is on a filesystem other than tmpfs (tried the test's tmp dir, /var/tmp "
                f"and {ROOT})")


def test_direct_packs_match_buffered_ones_and_skip_the_page_cache(tmp_path, disk_dir, monkeypatch):
    pd = _write_packs(tmp_path / "direct", "1", monkeypatch)
    pb = _write_packs(tmp_path / "buffered", "0", monkeypatch)
    assert len(pd) >= 2 and sorted(pd) == sorted(pb)
    sizes = []
    for name in pd:
        data = pd[name].read_bytes()
        assert data == pb[name].read_bytes()
        sizes.append(len(data))
    # packs that take several buffers, and tails that are not block-aligned (padding cut back)
    assert max(sizes) > 2 * packout.DirectBuffer.SIZE and all(n % 4096 for n in sizes), sizes
    assert not _is_tmpfs(disk_dir)
    pd, pb = _write_packs(disk_dir / "direct2", "1", monkeypatch), _write_packs(disk_dir / "buffered2", "0", monkeypatch)
    os.sync()
    for name in pd:      # not read since written: direct packs never entered the page cache
        assert _resident_pages(pd[name]) <= 1
        assert _resident_pages(pb[name]) > os.path.getsize(pb[name]) // PAGE // 2


def test_a_dump_with_direct_packs_reads_back_and_verifies(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSNAP_PACK_DIRECT", "1")
    repo = Repository.open(tmp_path / "repo", create=True)
    rnd = random.Random(11)
    img = b"".join(rnd.randbytes(PAGE) if i % 3 else text_page(rnd) for i in range(3000)) + b"tail"
    images = {"pages-1.img": img, "core-1.img": b"core" * 3000}
    snap, _ = dump(repo, images, name="one", pack_target=9 << 20)
    for fn, data in images.items():
        assert read_all(snap, fn) == data
    assert verify(repo).ok


def test_a_filesystem_refusing_the_alignment_falls_back_to_buffered(tmp_path, monkeypatch):
    """The first O_DIRECT write is refused (EINVAL): the pack is written buffered instead,
    byte for byte the same. An alignment of 1 makes the kernel refuse the tail write."""
    monkeypatch.setattr(packout.DirectBuffer, "ALIGN", 1)
    got = _write_packs(tmp_path / "fallback", "1", monkeypatch, target=1 << 20, n=40)
    want = _write_packs(tmp_path / "ref", "0", monkeypatch, target=1 << 20, n=40)
    assert got and sorted(got) == sorted(want)
    for name in got:
        assert got[name].read_bytes() == want[name].read_bytes()
        assert _resident_pages(got[name]) > 0          # written through the page cache


def test_writes_refused_by_both_flushers_at_once_fall_back_together(disk_dir, monkeypatch):
    """Every O_DIRECT write is refused (the bounce buffers start one byte off alignment), and
    each pack's first writes go to the disk from two flusher threads at once: whichever is
    refused second finds the pack already switched to buffered and writes again. Several
    buffers per pack, byte for byte the buffered result."""
    def skewed(self):
        self.map = mmap.mmap(-1, self.COUNT * self.SIZE + mmap.PAGESIZE)
        whole = memoryview(self.map)
        self.views = [whole[1 + i * self.SIZE:1 + (i + 1) * self.SIZE] for i in range(self.COUNT)]
        whole.release()
        self.io = packout._Flusher(self.views, 2)
    monkeypatch.setattr(packout.DirectBuffer, "__init__", skewed)
    got = _write_packs(disk_dir / "skewed", "1", monkeypatch)
    want = _write_packs(disk_dir / "ref", "0", monkeypatch)
    assert len(got) >= 2 and sorted(got) == sorted(want)
    assert max(os.path.getsize(p) for p in got.values()) > 2 * packout.DirectBuffer.SIZE
    for name in got:
        assert got[name].read_bytes() == want[name].read_bytes()
        assert _resident_pages(got[name]) > 0          # written through the page cache


@pytest.mark.parametrize("direct", ["0", "1"])
def test_pack_tmp_files_are_gone_after_an_abort(tmp_path, monkeypatch, direct):
    """An aborted writer leaves no temporary pack, direct or buffered."""
    monkeypatch.setenv("GPUSNAP_PACK_DIRECT", direct)
    repo = Repository.open(tmp_path / "r", create=True)
    w = packwriter.PackWriter(repo.path, target_size=8 << 20)
    w.add(1, 0, 1, PAGE, os.urandom(PAGE), os.urandom(16))
    w.abort()
    assert not list((repo.path / "tmp").glob("pack-*"))


@pytest.mark.parametrize("direct", ["1", "0"])
def test_done_is_called_once_after_the_payloads_are_taken(tmp_path, monkeypatch, direct):
    """add_many's done (the page pipeline lets go of staging slots with it) runs exactly once:
    after the writer has copied or written the payloads it covers, also when they are
    dropped after an error, and at once when nothing could be handed over. The payloads
    are reused right after done: the pack must still hold what they were."""
    monkeypatch.setenv("GPUSNAP_PACK_DIRECT", direct)
    repo = Repository.open(tmp_path / "r", create=True)
    w = packwriter.PackWriter(repo.path, target_size=5 << 20)
    rnd = random.Random(9)
    calls, expect = [], []
    for i in range(12):                         # 12 x 1 MiB: packs fill and close in between
        buf = bytearray(rnd.randbytes(1 << 20))
        expect.append(bytes(buf))

        def done(i=i, buf=buf):
            calls.append(i)
            buf[:] = bytes(len(buf))            # reused by its owner from now on
        w.add_many([(1, 0, 256, 1 << 20, memoryview(buf), rnd.randbytes(16 * 256))], done)
    finished = w.finish()
    assert sorted(calls) == list(range(12))
    got = []
    for ph, blobs in finished:
        data = pack_path(repo.path, ph).read_bytes()
        got += [(b.offset, data[b.offset + 16:b.offset + 16 + b.stored_len]) for b in blobs]
    assert sorted(p for _, p in got) == sorted(expect)

    late = []
    with pytest.raises(RuntimeError):
        w.add_many([(1, 0, 1, PAGE, bytes(PAGE), bytes(16))], lambda: late.append(1))
    assert late == [1]                          # closed: nothing handed over, done at once
