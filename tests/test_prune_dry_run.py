"""`prune --dry-run` says exactly what the real prune then frees: the same bytes, the same
packs, measured on disk (the sizes of the files under packs/ before and after), through the
real CRIU on a real job whose memory changes between dumps (so prune rewrites packs that are
partly still used, the case where an estimate and the truth part)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_gpusnap, run_json

pytestmark = pytest.mark.criu


def _packs_bytes(repo: Path) -> int:
    return sum(p.stat().st_size for p in (repo / "packs").rglob("*") if p.is_file())


def test_dry_run_reports_what_the_prune_frees(sample_job, repo):
    job = sample_job(steps=100000, mb=24, threads=1, step_ms=5)
    for i in range(4):
        job.wait_steps(5 + 20 * i)          # the job rewrites part of its memory every step
        run_gpusnap("dump", job.pid, "--repo", repo, "--name", "victim", "--compress", "none" if i % 2 else "zstd",
                    check=True)
    dry = run_json("prune", "--repo", repo, "--keep-last", "1", "--name", "victim", "--dry-run")
    before = _packs_bytes(repo)
    real = run_json("prune", "--repo", repo, "--keep-last", "1", "--name", "victim")
    freed_on_disk = before - _packs_bytes(repo)
    assert real["packs_rewritten"] >= 1 or real["packs_deleted"] >= 1, real   # there was something to free
    assert real["bytes_freed"] == freed_on_disk
    assert dry["bytes_freed"] == freed_on_disk, (dry["bytes_freed"], freed_on_disk)
    for k in ("packs_deleted", "packs_rewritten", "snapshots_deleted"):
        assert dry[k] == real[k], k
    human = run_gpusnap("prune", "--repo", repo, "--keep-last", "1", "--name", "victim", "--dry-run")
    assert human.returncode == 0
