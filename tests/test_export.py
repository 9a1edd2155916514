"""gpusnap export / import: a real CRIU dump moved as one file (and through a pipe) into a
second repository, restored from there with the uninterrupted result; damaged or truncated
files refused with the receiving repository unchanged."""

from __future__ import annotations

import os
import subprocess

import pytest

from conftest import GPUSNAP, ROOT, kill_pids, run_gpusnap, run_json
from gpusnap.ops.export import write_export
from gpusnap.ops.import_ import read_import
from gpusnap.repo.format.export import MAGIC
from gpusnap.errors import BadExportFile
from gpusnap.repo import Repository
from gpusnap.repo.maint.verify import verify
from repo_helpers import PAGE, dump, read_all, text_page
from restore_helpers import job_and_two_repos


def _tree(path) -> dict:
    """Every file under `path` with its size (what a failed import must leave unchanged)."""
    out = {}
    for dp, _dn, fns in os.walk(path):
        for f in fns:
            p = os.path.join(dp, f)
            out[os.path.relpath(p, path)] = os.path.getsize(p)
    return out


def _sample(tmp_path):
    import random
    repo = Repository.open(tmp_path / "a", create=True)
    rnd = random.Random(3)
    img = b"".join([os.urandom(PAGE) for _ in range(40)] + [bytes(PAGE)] * 9 + [text_page(rnd) for _ in range(60)])
    img += os.urandom(100)   # a partial last page
    images = {"pages-1.img": img, "core-1.img": os.urandom(3000), "empty.img": b"", "big.img": os.urandom(3 << 20)}
    snap, _ = dump(repo, images, name="job", meta={"pid": 1})
    return repo, snap, images


def test_roundtrip_keeps_every_byte_and_dedups(tmp_path):
    repo, snap, images = _sample(tmp_path)
    out = tmp_path / "job.gsx"
    res = run_json("export", snap.path, "-o", out)
    assert res["bytes"] == out.stat().st_size and oct(out.stat().st_mode & 0o777) == "0o600"
    # only what the snapshot needs: zero pages are not carried, the rest is compressed
    assert out.stat().st_size < sum(map(len, images.values()))
    assert out.read_bytes()[:8] == MAGIC
    b = Repository.open(tmp_path / "b", create=True)
    first = run_json("import", out, "--repo", b.path)
    assert first["name"] == "job" and first["source_id"] == snap.id
    s2 = Repository.open(b.path).snapshot(first["snapshot"])
    for name, data in images.items():
        assert read_all(s2, name) == data
    assert s2.created == snap.created and s2.meta["pid"] == 1 and s2.meta["imported_from"]["id"] == snap.id
    assert verify(Repository.open(b.path)).ok
    # the same snapshot again: nothing is stored twice
    again = run_json("import", out, "--repo", b.path)
    assert again["already_present"] is True and again["snapshot"] == first["snapshot"]
    assert len(Repository.open(b.path).snapshots()) == 1
    # a later snapshot of the same job: the receiving repository deduplicates what it holds
    later = dict(images, **{"core-1.img": os.urandom(3000)})
    snap2, _ = dump(repo, later, name="job")
    run_json("export", snap2.path, "-o", tmp_path / "later.gsx")
    second = run_json("import", tmp_path / "later.gsx", "--repo", b.path)
    assert second["already_present"] is False
    assert second["pages_dedup"] == second["pages_total"] - 9          # every non-zero page was there
    assert second["bytes_stored"] < first["bytes_stored"] / 10
    s3 = Repository.open(b.path).snapshot(second["snapshot"])
    assert read_all(s3, "core-1.img") == later["core-1.img"] and read_all(s3, "big.img") == images["big.img"]


def test_through_a_pipe(tmp_path):
    repo, snap, images = _sample(tmp_path)
    run_gpusnap("init", "--repo", tmp_path / "c", check=True)
    cmd = (f"{' '.join(GPUSNAP)} export {snap.path} -o - | "
           f"{' '.join(GPUSNAP)} import --repo {tmp_path / 'c'} - --json")
    proc = subprocess.run(cmd, shell=True, capture_output=True, text=True, cwd=ROOT, timeout=300, check=True)
    import json
    res = json.loads(proc.stdout)
    s = Repository.open(tmp_path / "c").snapshot(res["snapshot"])
    assert read_all(s, "big.img") == images["big.img"]


@pytest.mark.parametrize("damage", ["flip-header", "flip-manifest", "flip-middle", "flip-trailer", "truncate",
                                    "truncate-end", "append", "empty"])
def test_damaged_file_is_refused_and_nothing_is_kept(tmp_path, damage):
    repo, snap, _ = _sample(tmp_path)
    good = tmp_path / "good.gsx"
    run_json("export", snap.path, "-o", good)
    data = bytearray(good.read_bytes())
    if damage == "flip-header":
        data[9] ^= 1
    elif damage == "flip-manifest":
        data[16 + 12 + 40] ^= 1
    elif damage == "flip-middle":
        data[len(data) // 2] ^= 0x10
    elif damage == "flip-trailer":
        data[-1] ^= 1
    elif damage == "truncate":
        data = data[: len(data) * 2 // 3]
    elif damage == "truncate-end":
        data = data[:-1]
    elif damage == "append":
        data += b"x"
    else:
        data = bytearray()
    bad = tmp_path / "bad.gsx"
    bad.write_bytes(bytes(data))
    target = tmp_path / "b"
    b = Repository.open(target, create=True)
    dump(b, {"pages-1.img": os.urandom(PAGE * 3)}, name="resident")
    before = _tree(target)
    proc = run_gpusnap("import", bad, "--repo", target)
    assert proc.returncode == BadExportFile.exit_code, proc.stderr
    assert "nothing was imported" in proc.stderr or "not a gpusnap export" in proc.stderr
    after = _tree(target)
    assert {k: v for k, v in after.items() if not k.startswith("locks/")} == \
        {k: v for k, v in before.items() if not k.startswith("locks/")}


@pytest.mark.criu
def test_real_job_exported_imported_and_restored(sample_job, tmp_path, reference):
    job, expected, repo_a, repo_b = job_and_two_repos(sample_job, tmp_path, reference)
    info = run_json("dump", job.pid, "--repo", repo_a, "--name", "moved")
    job.kill()
    exp = tmp_path / "moved.gsx"
    run_json("export", info["snapshot"], "-o", exp)
    # a flipped byte is refused and leaves the second repository unchanged
    bad = bytearray(exp.read_bytes())
    bad[len(bad) // 3] ^= 4
    (tmp_path / "bad.gsx").write_bytes(bytes(bad))
    assert run_gpusnap("import", tmp_path / "bad.gsx", "--repo", repo_b).returncode == BadExportFile.exit_code
    assert not (repo_b / "snapshots").exists() or os.listdir(repo_b / "snapshots") == []
    assert run_gpusnap("import", "-", "--repo", repo_b, input="not an export").returncode == BadExportFile.exit_code
    assert not repo_b.exists() or os.listdir(repo_b / "snapshots") == []
    # through a pipe, into the second repository, and restored from there
    proc = subprocess.run(f"{' '.join(GPUSNAP)} export {info['snapshot']} -o - | "
                          f"{' '.join(GPUSNAP)} import --repo {repo_b} -", shell=True, capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    imported = proc.stdout.strip()
    assert imported.startswith(str(repo_b / "snapshots"))
    import shutil
    shutil.rmtree(repo_a)                     # nothing is read from the first repository any more
    restored = run_json("restore", imported, "--repo", repo_b)
    try:
        assert restored["pid"] == job.pid
        assert job.result() == expected
    finally:
        kill_pids(job.pids)


def test_every_flipped_byte_is_refused_in_process(tmp_path):
    """Flip bytes all over an export (header, record heads, manifest, page lists, data,
    trailer): each import fails with BadExportFile, never another exception, and leaves the
    receiving repository as it was."""
    import io
    import random

    repo, snap, _ = _sample(tmp_path)
    buf = io.BytesIO()
    write_export(snap, buf)
    good = buf.getvalue()
    target = Repository.open(tmp_path / "b", create=True)
    dump(target, {"pages-1.img": os.urandom(PAGE * 3)}, name="resident")
    before = _tree(target.path)
    rnd = random.Random(5)
    positions = list(range(0, 64)) + [len(good) - k for k in range(1, 40)] + \
        [rnd.randrange(len(good)) for _ in range(60)]
    for pos in positions:
        bad = bytearray(good)
        bad[pos] ^= 1 << rnd.randrange(8)
        with pytest.raises(BadExportFile):
            read_import(Repository.open(target.path), io.BytesIO(bytes(bad)))
    for cut in (0, 1, 15, 16, 27, len(good) // 2, len(good) - 33, len(good) - 1):
        with pytest.raises(BadExportFile):
            read_import(Repository.open(target.path), io.BytesIO(good[:cut]))
    after = _tree(target.path)
    assert {k: v for k, v in after.items() if not k.startswith("locks/")} == \
        {k: v for k, v in before.items() if not k.startswith("locks/")}
    read_import(Repository.open(target.path), io.BytesIO(good))     # the intact file still imports
