"""gpusnap import is bounded by what the file carries (docs/format.md §11, limits): declared
zero runs cost nothing, declared sizes beyond any real snapshot, oversized manifests and
wrongly typed fields are refused, a damaged copy of a snapshot already held is refused (not
"already present"), an endless stream is cut off, the writer lock is free while the input is
read, and a full disk is the disk-full error. Each import runs in a child with memory and
wall-clock bounds (export_helpers.import_bounded)."""

from __future__ import annotations

import fcntl
import json
import os
import struct
import subprocess
import termios

import blake3
import pytest

from conftest import GPUSNAP, ROOT, run_gpusnap, run_json
from export_helpers import (craft, export_bytes, import_bounded, manifest_body, record, sample,
                            zero_pages_export)
from gpusnap.errors import BadExportFile, CorruptSnapshot, NoSpace, RepositoryLocked
from gpusnap.repo.format import export as X
from gpusnap.ops import import_stream as S
from gpusnap.repo import Repository
from gpusnap.repo import format as F
from repo_helpers import PAGE, dump, read_all


@pytest.fixture(autouse=True)
def _target_is_the_default_location(tmp_path, monkeypatch):
    """tmp_path/b, where these tests import, is $GPUSNAP_REPO: the first import makes it."""
    monkeypatch.setenv("GPUSNAP_REPO", str(tmp_path / "b"))


def _snapshots(repo) -> list:
    """The repository's snapshots ([] when the import never made it)."""
    return Repository.open(repo).snapshots() if os.path.exists(repo) else []


def test_sixteen_tib_of_zero_runs_in_a_few_bytes_imports_at_once(tmp_path):
    """2**32 zero pages (16 TiB, more than a page list record counts) in a 100-byte file:
    committed within the bounds, the page list split where its count would overflow."""
    f = tmp_path / "zeros.gsx"
    f.write_bytes(zero_pages_export(1 << 32))
    assert f.stat().st_size < 2000
    proc = import_bounded(f, tmp_path / "b")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["pages_total"] == 1 << 32 and res["bytes_raw"] == 16 << 40
    snap = Repository.open(tmp_path / "b").snapshot(res["snapshot"])
    assert snap.image("pages-1.img")["size"] == 16 << 40 and snap.image("pages-1.img")["pages_zero"] == 1 << 32
    assert [r[0] for r in snap.iter_page_refs("pages-1.img")] == ["zero", "zero"]


def test_a_small_zero_image_reads_back_exactly(tmp_path):
    """The zero runs an import stores without bytes read back as the zeros they stand for."""
    f = tmp_path / "zeros.gsx"
    f.write_bytes(zero_pages_export(300))
    res = run_json("import", f, "--repo", tmp_path / "b")
    assert read_all(Repository.open(tmp_path / "b").snapshot(res["snapshot"]), "pages-1.img") == bytes(300 * PAGE)


def test_sixty_four_pib_declared_is_refused_at_once(tmp_path):
    f = tmp_path / "huge.gsx"
    f.write_bytes(zero_pages_export(1 << 44))          # 64 PiB
    proc = import_bounded(f, tmp_path / "b")
    assert proc.returncode == BadExportFile.exit_code, proc.stderr
    assert "declares" in proc.stdout and "TiB" in proc.stdout
    assert _snapshots(tmp_path / "b") == []


def test_sum_of_images_over_the_limit_is_refused(tmp_path):
    """Many images each under the limit, together over it."""
    pl = F.encode_pl_zero((1 << 32) - 1)
    ims = [{"name": f"pages-{i}.img", "type": "pages", "size": ((1 << 32) - 1) * PAGE,
            "digest": blake3.blake3(pl).hexdigest(), "pagelist": f"pl-{i:06d}", "pagelist_size": len(pl)}
           for i in range(5)]
    f = tmp_path / "many.gsx"
    f.write_bytes(craft(manifest_body(ims), *[record(X.TAG_PAGELIST, pl)] * 5))
    proc = import_bounded(f, tmp_path / "b")
    assert proc.returncode == BadExportFile.exit_code and "declares" in proc.stdout, proc.stdout


def test_a_64_mib_manifest_is_refused_within_a_small_memory_bound(tmp_path):
    body = manifest_body([], meta={"pad": "x" * (64 << 20)})
    f = tmp_path / "fat.gsx"
    f.write_bytes(craft(body))
    proc = import_bounded(f, tmp_path / "b", memory=1 << 30)
    assert proc.returncode == BadExportFile.exit_code, proc.stderr
    assert "the manifest" in proc.stdout
    assert _snapshots(tmp_path / "b") == []


def test_a_manifest_over_its_limit_is_refused_before_it_is_read(tmp_path):
    """Over 16 MiB with a small meta and fewer images than their limit (long names)."""
    ims = [{"name": f"{i:06d}" + "x" * 240, "type": "blob", "size": 0, "digest": blake3.blake3(b"").hexdigest(),
            "blobs": []} for i in range(60000)]
    f = tmp_path / "long.gsx"
    f.write_bytes(craft(manifest_body(ims)))
    assert f.stat().st_size > S.IMPORT_MANIFEST_MAX
    proc = run_gpusnap("import", f, "--repo", tmp_path / "b")
    assert proc.returncode == BadExportFile.exit_code and "where the manifest belongs" in proc.stderr, proc.stderr


def test_a_meta_over_its_limit_is_refused(tmp_path):
    f = tmp_path / "meta.gsx"
    f.write_bytes(craft(manifest_body([], meta={"pad": "x" * (S.IMPORT_META_MAX + 1)})))
    proc = run_gpusnap("import", f, "--repo", tmp_path / "b")
    assert proc.returncode == BadExportFile.exit_code and "meta is larger" in proc.stderr, proc.stderr


def test_too_many_images_are_refused(tmp_path):
    ims = [{"name": f"e{i}", "type": "blob", "size": 0, "digest": blake3.blake3(b"").hexdigest(), "blobs": []}
           for i in range(S.IMPORT_IMAGES_MAX + 1)]
    f = tmp_path / "imgs.gsx"
    f.write_bytes(craft(manifest_body(ims)))
    proc = run_gpusnap("import", f, "--repo", tmp_path / "b")
    assert proc.returncode == BadExportFile.exit_code and "images" in proc.stderr, proc.stderr


def test_a_page_list_longer_than_its_image_allows_is_refused(tmp_path):
    pl = F.encode_pl_zero(1) + b"\0" * 100
    im = {"name": "pages-1.img", "type": "pages", "size": PAGE, "digest": blake3.blake3(pl).hexdigest(),
          "pagelist": "pl-000000", "pagelist_size": len(pl)}
    f = tmp_path / "pl.gsx"
    f.write_bytes(craft(manifest_body([im]), record(X.TAG_PAGELIST, pl)))
    proc = run_gpusnap("import", f, "--repo", tmp_path / "b")
    assert proc.returncode == BadExportFile.exit_code and "longer than an image of its size" in proc.stderr


def test_damaged_export_of_a_snapshot_already_held_is_refused(tmp_path):
    """Not "already present" without reading: the damaged copy is read to its end and refused."""
    _, snap = sample(tmp_path)
    good = tmp_path / "good.gsx"
    good.write_bytes(export_bytes(snap))
    first = run_json("import", good, "--repo", tmp_path / "b")
    bad = bytearray(good.read_bytes())
    bad[len(bad) // 2] ^= 0x10
    (tmp_path / "bad.gsx").write_bytes(bytes(bad))
    proc = run_gpusnap("import", tmp_path / "bad.gsx", "--repo", tmp_path / "b", "--json")
    assert proc.returncode == BadExportFile.exit_code, proc.stdout + proc.stderr
    # the intact copy is still recognised
    again = run_json("import", good, "--repo", tmp_path / "b")
    assert again["already_present"] is True and again["snapshot"] == first["snapshot"]
    assert again["bytes_read"] == good.stat().st_size


def _unread(fd: int) -> int:
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


def test_endless_stream_of_a_held_snapshot_is_cut_off_without_holding_the_lock(tmp_path):
    """The export of a snapshot the repository holds, followed by data records without end,
    through a pipe: while the importer waits for more, the writer lock is free; the stream
    is refused once it goes past what the manifest allows."""
    _, snap = sample(tmp_path)
    data = export_bytes(snap)
    target = tmp_path / "b"
    run_json("import", "-", "--repo", target, input=data.decode("latin-1"), encoding="latin-1")
    proc = subprocess.Popen([*GPUSNAP, "import", "-", "--repo", str(target)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    try:
        # the header, the manifest and the first images, then a pause: the importer is reading
        cut = len(data) // 2
        proc.stdin.write(data[:cut])
        proc.stdin.flush()
        while _unread(proc.stdin.fileno()) and proc.poll() is None:
            os.sched_yield()      # until the importer has taken every byte (it blocks for more)
        assert proc.poll() is None
        with Repository.open(target).writer_lock():    # free: reading holds no lock
            pass
        junk = record(X.TAG_DATA, b"\x01" * 4096)
        sent = 0
        with pytest.raises(BrokenPipeError):
            while sent < 1 << 30:          # far past anything the manifest allows
                proc.stdin.write(junk * 256)
                proc.stdin.flush()
                sent += len(junk) * 256
        assert proc.wait(timeout=60) == BadExportFile.exit_code
        assert sent < 64 << 20
    finally:
        proc.kill()
        proc.wait()
    assert len(_snapshots(target)) == 1


def test_writer_lock_held_elsewhere_does_not_stop_the_checking_pass(tmp_path):
    """A repository locked by a prune (the exclusive lock): the file is still read and checked
    in full (a damaged one says so, exit 32, not 'locked'); an intact new one waits for nothing
    but the commit, which reports the lock. Another writer (the shared lock) stops nothing:
    the import commits beside it (docs/format.md §6)."""
    _, snap = sample(tmp_path)
    good = export_bytes(snap)
    bad = bytearray(good)
    bad[-100] ^= 1
    (tmp_path / "bad.gsx").write_bytes(bytes(bad))
    (tmp_path / "good.gsx").write_bytes(good)
    target = Repository.open(tmp_path / "b", create=True)
    with target.writer_lock(exclusive=True):
        p1 = run_gpusnap("import", tmp_path / "bad.gsx", "--repo", target.path)
        p2 = run_gpusnap("import", tmp_path / "good.gsx", "--repo", target.path, "--lock-wait", "0")
    assert p1.returncode == BadExportFile.exit_code, p1.stderr
    assert p2.returncode == RepositoryLocked.exit_code, p2.stderr
    with target.writer_lock():
        p3 = run_gpusnap("import", tmp_path / "good.gsx", "--repo", target.path, "--lock-wait", "0")
    assert p3.returncode == 0, p3.stderr


@pytest.mark.parametrize("meta", [{"gpu": 5}, {"cmdline": ["a"]}, {"dump_seconds": "x"}, {"pids": "1"},
                                  {"imported_from": []}, {"gpu": {"processes": {"x": []}}}])
def test_wrongly_typed_fields_are_refused_on_import(tmp_path, meta):
    f = tmp_path / "types.gsx"
    f.write_bytes(craft(manifest_body([], meta=meta)))
    proc = run_gpusnap("import", f, "--repo", tmp_path / "b")
    assert proc.returncode == BadExportFile.exit_code and "malformed" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("where,key,value", [("meta", "gpu", 5), ("meta", "dump_seconds", "x"),
                                             ("stats", "bytes_raw", "x"), ("image", "pages", "x")])
def test_every_reader_says_damaged_for_a_bad_field_in_a_stored_manifest(tmp_path, where, key, value):
    """A stored manifest with a wrong field type (its checksum recomputed, as a crafted one
    would be): inspect, ls and verify report a damaged snapshot, never a traceback."""
    repo = Repository.open(tmp_path / "r", create=True)
    snap, _ = dump(repo, {"pages-1.img": os.urandom(3 * PAGE)}, name="job", meta={"pid": 1})
    path = snap.path / "manifest"
    m = json.loads(path.read_bytes()[:-F.MANIFEST_TRAILER_LEN])
    (m["images"][0] if where == "image" else m[where])[key] = value
    path.write_bytes(F.encode_manifest(m)[0])
    p = run_gpusnap("inspect", snap.path, "--repo", repo.path)
    assert p.returncode in (CorruptSnapshot.exit_code, 6), p.stdout + p.stderr
    assert "Traceback" not in p.stderr and "malformed" in p.stderr + p.stdout
    for cmd in (["ls"], ["verify"]):
        p = run_gpusnap(*cmd, "--repo", repo.path)
        assert "Traceback" not in p.stderr, p.stderr
        assert "malformed" in p.stdout + p.stderr, (cmd, p.stdout, p.stderr)


def test_unknown_header_flags_are_said_as_such(tmp_path):
    f = tmp_path / "flags.gsx"
    f.write_bytes(craft(manifest_body([]), flags=1))
    proc = run_gpusnap("import", f, "--repo", tmp_path / "b")
    assert proc.returncode == BadExportFile.exit_code
    assert "unknown flags" in proc.stderr and "version" not in proc.stderr, proc.stderr


def test_full_disk_during_an_import_is_the_disk_full_error(tmp_path):
    _, snap = sample(tmp_path)
    # 48 MiB of random data cannot fit a 24 MiB file system
    repo = Repository.open(tmp_path / "src")
    big, _ = dump(repo, {"pages-1.img": os.urandom(48 << 20)}, name="big")
    f = tmp_path / "big.gsx"
    f.write_bytes(export_bytes(big))
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        Repository.open(mnt / "repo", create=True)
        proc = run_gpusnap("import", f, "--repo", mnt / "repo")
        assert proc.returncode == NoSpace.exit_code, proc.stderr
        assert "Traceback" not in proc.stderr
        assert _snapshots(mnt / "repo") == []
        # through a pipe (its bytes kept in the repository's tmp/ while checked) the same
        p = subprocess.run(f"cat {f} | {' '.join(GPUSNAP)} import - --repo {mnt / 'repo'}", shell=True,
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert p.returncode == NoSpace.exit_code, p.stderr
        assert "Traceback" not in p.stderr
        assert os.listdir(mnt / "repo" / "tmp") == []
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_at_a_zero_image_is_the_disk_full_error(tmp_path):
    """A repository on a file system with no block left: the import of a zero image (whose
    page list is the only thing to write) fails with the disk-full error, not a traceback."""
    f = tmp_path / "zeros.gsx"
    f.write_bytes(zero_pages_export(1 << 20))
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        Repository.open(mnt / "repo", create=True)
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        with pytest.raises(OSError):
            while True:
                os.write(fd, b"\1" * 4096)
        os.close(fd)
        proc = run_gpusnap("import", f, "--repo", mnt / "repo")
        assert proc.returncode == NoSpace.exit_code, proc.stderr
        assert "Traceback" not in proc.stderr
        assert _snapshots(mnt / "repo") == []
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
