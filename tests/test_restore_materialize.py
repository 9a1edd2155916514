"""Image files written out of the repository for `criu restore -D` (real repositories, real files):
byte-identical to what CRIU wrote, zero pages as holes, every page checked, the directory
private and gone afterwards. The restore through these files runs in test_e2e / test_hugepages
and test_restore_via."""

from __future__ import annotations

import os
import random
import stat
import threading

import pytest

from gpusnap.repo import materialize
from gpusnap.errors import CorruptSnapshot, Interrupted
from gpusnap.repo import Repository
from gpusnap.repo import parallel_read
from repo_helpers import PAGE, dump, text_page


def _image(rnd: random.Random, mib: int) -> bytes:
    """Pages of every kind, in runs: random, text, zero (short and long runs), repeats."""
    parts: list[bytes] = []
    seen: list[bytes] = []
    size = 0
    while size < mib << 20:
        k = rnd.choice(["rand", "text", "zero", "zero-long", "repeat"])
        n = rnd.randint(1, 40)
        if k == "rand":
            pages = [os.urandom(PAGE) for _ in range(n)]
        elif k == "text":
            pages = [text_page(rnd) for _ in range(n)]
        elif k == "zero":
            pages = [bytes(PAGE)] * n
        elif k == "zero-long":
            pages = [bytes(PAGE)] * rnd.randint(300, 1500)
        else:
            pages = [rnd.choice(seen) for _ in range(n)] if seen else []
        seen.extend(pages[:5])
        parts.extend(pages)
        size += len(pages) * PAGE
    return b"".join(parts)


@pytest.fixture
def snap(tmp_path):
    repo = Repository.open(tmp_path / "repo", create=True)
    rnd = random.Random(11)
    images = {
        "pages-1.img": _image(rnd, 13),                       # > JOB_BYTES: the parallel path
        "pages-2.img": _image(rnd, 1) + b"tail-bytes" * 37,  # small, with a tail
        "pages-3.img": bytes(6 << 20),                        # only zero pages: all hole
        "core-1.img": os.urandom(3000),
        "files.img": b"",
    }
    s, _ = dump(repo, images, name="mat")
    return repo, s, images


@pytest.mark.parametrize("threads", [1, 3])
def test_images_are_byte_identical_and_zero_pages_are_holes(snap, tmp_path, threads):
    repo, s, images = snap
    d = tmp_path / "out"
    d.mkdir()
    written = parallel_read.write_images(s, d, threads, threading.Event(), [0])
    assert sorted(os.listdir(d)) == sorted(images)
    for name, data in images.items():
        assert (d / name).read_bytes() == data, name
    st = os.stat(d / "pages-3.img")
    assert st.st_size == 6 << 20 and st.st_blocks * 512 < 1 << 20      # a hole, not 6 MiB of zeros
    assert written < sum(map(len, images.values()))


def test_without_locations_file_the_sequential_reader_writes_the_same(snap, tmp_path):
    repo, s, images = snap
    os.unlink(s.path / "locations")
    s2 = repo.snapshot(s.path.name)
    d = tmp_path / "out"
    d.mkdir()
    parallel_read.write_images(s2, d, 2, threading.Event(), [0])
    for name, data in images.items():
        assert (d / name).read_bytes() == data, name


def test_a_damaged_page_fails_the_materialization(snap, tmp_path):
    repo, s, images = snap
    packs = sorted(p for p in (repo.path / "packs").rglob("*") if p.is_file())
    for p in packs:                        # flip a byte in the middle of every pack
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0x40
        os.chmod(p, 0o600)
        p.write_bytes(bytes(data))
    d = tmp_path / "out"
    d.mkdir()
    with pytest.raises(CorruptSnapshot):
        materialize.write_images(repo.snapshot(s.path.name), d, threads=2)


def test_images_dir_is_private_and_removed_on_every_exit(snap, tmp_path):
    repo, s, _ = snap
    with materialize.images_dir(s, repo.path) as (d, plan):
        assert d.name.startswith(f"{materialize.PREFIX}{os.getpid()}-")
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700 and os.stat(d).st_uid == os.geteuid()
        assert plan.where in ("tmpfs", "disk")
        (d / "x").write_bytes(b"1")
    assert not d.exists()
    with pytest.raises(RuntimeError):
        with materialize.images_dir(s, repo.path) as (d, _):
            raise RuntimeError("boom")
    assert not d.exists()
    with pytest.raises(Interrupted):
        with materialize.images_dir(s, repo.path) as (d, _):
            os.kill(os.getpid(), 15)        # SIGTERM: handled like Ctrl-C
            threading.Event().wait(5)
    assert not d.exists()


def test_leftovers_of_a_dead_gpusnap_are_removed(snap, tmp_path):
    repo, s, _ = snap
    parent = tmp_path / "parent"
    parent.mkdir()
    dead = parent / f"{materialize.PREFIX}999999999-abc"        # no such PID
    alive = parent / f"{materialize.PREFIX}1-abc"               # PID 1 lives
    other = parent / "something-else"
    for p in (dead, alive, other):
        p.mkdir()
    materialize.remove_stale(parent)
    assert not dead.exists() and alive.exists() and other.exists()


def test_tmpfs_only_when_memory_leaves_room_for_the_job_too():
    mib = 1 << 20
    assert materialize.fits_tmpfs(100 * mib, 1000 * mib, 1000 * mib)
    assert not materialize.fits_tmpfs(400 * mib, 1000 * mib, 1000 * mib)   # images + the job + margin
    assert not materialize.fits_tmpfs(100 * mib, 1000 * mib, 200 * mib)    # /dev/shm itself too small
    assert not materialize.fits_tmpfs(100 * mib, None, 1000 * mib)


def test_where_images_go_can_be_chosen(snap, monkeypatch):
    repo, s, _ = snap
    monkeypatch.setenv("GPUSNAP_RESTORE_IMAGES", "disk")
    p = materialize.plan(s, repo.path)
    assert p.where == "disk" and p.parent == repo.path / "tmp"
    monkeypatch.setenv("GPUSNAP_RESTORE_IMAGES", "tmpfs")
    assert materialize.plan(s, repo.path).where == "tmpfs"


@pytest.mark.parametrize("threads", [1, 3])
def test_parallel_stream_reader_yields_the_image_in_order(snap, threads):
    repo, s, images = snap
    for name in ("pages-1.img", "pages-2.img", "pages-3.img"):
        assert b"".join(parallel_read.iter_image_parallel(s, name, threads)) == images[name]
    assert parallel_read.parallel_ok(s, "pages-1.img")
    assert not parallel_read.parallel_ok(s, "core-1.img")      # a blob image: the plain reader


def test_parallel_stream_reader_fails_on_a_damaged_page(snap):
    repo, s, images = snap
    for p in sorted(q for q in (repo.path / "packs").rglob("*") if q.is_file()):
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0x40
        os.chmod(p, 0o600)
        p.write_bytes(bytes(data))
    s = repo.snapshot(s.path.name)
    with pytest.raises(CorruptSnapshot):
        b"".join(parallel_read.iter_image_parallel(s, "pages-1.img", 2))
