"""Both restore paths with the real CRIU: `--via stream` and `--via files` (tmpfs and the
repository's disk) bring the job back and it finishes with the uninterrupted result; a
damaged snapshot fails before anything runs, and no image directory is left behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import kill_pids, run_gpusnap, run_json

pytestmark = pytest.mark.criu

JOB = dict(steps=120, mb=24, threads=2)


def _image_dirs(repo: Path) -> list[Path]:
    return [p for d in (Path("/dev/shm"), repo / "tmp") if d.is_dir() for p in d.iterdir()
            if p.name.startswith("gpusnap-images-")
            and not Path(f"/proc/{p.name.split('-')[2]}").exists()]


@pytest.mark.parametrize("via,where,threads", [("stream", None, 1), ("stream", None, 3), ("files", "tmpfs", 3),
                                                ("files", "disk", 2)])
@pytest.mark.slow
def test_each_path_restores_the_job_identically(sample_job, repo, reference, via, where, threads):
    job = sample_job(**JOB)
    job.wait_steps(10)
    snap = run_json("dump", job.pid, "--repo", repo)["snapshot"]
    job.kill()
    env = {"GPUSNAP_RESTORE_THREADS": str(threads)}     # 3 on the stream: the parallel reader
    if where:
        env["GPUSNAP_RESTORE_IMAGES"] = where
    restored = run_json("restore", snap, "--repo", repo, "--via", via, env=env)
    try:
        assert restored["via"] == via and restored["pid"] == job.pid
        assert restored["images"] == where
        assert (restored["phases"].get("materialize", 0) > 0) == (via == "files")
        assert job.result() == reference(**JOB)
    finally:
        kill_pids(job.pids)
    assert not _image_dirs(repo)


def test_damaged_snapshot_fails_before_the_job_runs(sample_job, repo):
    job = sample_job(**JOB)
    job.wait_steps(5)
    snap = run_json("dump", job.pid, "--repo", repo)["snapshot"]
    job.kill()
    packs = sorted(p for p in (repo / "packs").rglob("*") if p.is_file())
    big = max(packs, key=lambda p: p.stat().st_size)
    data = bytearray(big.read_bytes())
    data[len(data) // 2] ^= 0x40
    os.chmod(big, 0o600)
    big.write_bytes(bytes(data))
    r = run_gpusnap("restore", snap, "--repo", repo, "--via", "files", "--json")
    assert r.returncode == 9, r.stdout + r.stderr
    assert json.loads(r.stdout)["hint"]
    assert not any(Path(f"/proc/{p}").exists() for p in job.pids)
    assert not _image_dirs(repo)
