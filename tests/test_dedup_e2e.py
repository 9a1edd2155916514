"""Deduplication end to end, through the real CRIU and the real CLI, as root.

Workloads from tests/jobs/workloads.py are dumped into a real repository; sizes are checked
against what CRIU produced (bytes_raw: every byte CRIU streamed) and against earlier dumps,
and every job is then killed, restored and must finish with the digest of an uninterrupted
run with the same arguments and events.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PY, ROOT, kill_pids, run_json
from jobs.workloads import expected_digest

pytestmark = pytest.mark.criu

WORKLOAD = ROOT / "tests" / "jobs" / "workloads.py"


class Workload:
    """A running tests/jobs/workloads.py process (own session, no terminal)."""

    def __init__(self, out: Path, kind: str, mb: int, seed: int = 1):
        self.out, self.kind, self.mb, self.seed = out, kind, mb, seed
        self.gen = 0
        out.mkdir(parents=True, exist_ok=True)
        self._stdio = open(out / "stdio.txt", "ab")
        self.popen = subprocess.Popen(
            [PY, str(WORKLOAD), str(out), "--kind", kind, "--mb", str(mb), "--seed", str(seed)],
            stdin=subprocess.DEVNULL, stdout=self._stdio, stderr=self._stdio, cwd=ROOT,
            start_new_session=True)
        self.pid = self.popen.pid

    def _wait_file(self, name: str, timeout: float = 60) -> str:
        path = self.out / name
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists():
                return path.read_text()
            if self.popen.poll() is not None and not (self.out / "result").exists():
                raise AssertionError(f"workload died: {(self.out / 'stdio.txt').read_text()}")
            time.sleep(0.02)
        raise AssertionError(f"{path} did not appear in {timeout} s")

    def wait_ready(self) -> dict:
        return json.loads(self._wait_file("ready"))

    def relocate(self) -> dict:
        self.gen += 1
        (self.out / f"relocate.{self.gen}").touch()
        return json.loads(self._wait_file(f"relocated.{self.gen}"))

    def kill(self) -> None:
        """Kill the original process, reap it and wait until its PID is free."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and Path(f"/proc/{self.pid}").exists():
            time.sleep(0.02)

    def finish(self, timeout: float = 60) -> str:
        """Ask the (restored) job for its digest; it exits afterwards."""
        (self.out / "finish").touch()
        path = self.out / "result"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists():
                return path.read_text().strip()
            time.sleep(0.05)
        raise AssertionError(f"no result from the {self.kind} workload after {timeout} s")

    def expected(self) -> str:
        return expected_digest(self.kind, self.mb, self.seed, relocations=self.gen)

    def close(self) -> None:
        kill_pids([self.pid])
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._stdio.close()


@pytest.fixture
def workload(tmp_path):
    jobs: list[Workload] = []

    def start(kind: str, mb: int, name: str | None = None) -> Workload:
        job = Workload(tmp_path / (name or kind), kind, mb)
        jobs.append(job)
        job.wait_ready()
        return job

    yield start
    for job in jobs:
        job.close()


def dump(job: Workload, repo: Path, name: str) -> dict:
    info = run_json("dump", job.pid, "--repo", repo, "--name", name)
    assert info["pid"] == job.pid
    assert info["bytes_raw"] >= job.mb << 20, "all of the job's memory went through the stream"
    return info


def restore_and_check(job: Workload, snapshot, repo: Path) -> None:
    """Kill the job, restore `snapshot`, and check it finishes with the uninterrupted digest."""
    job.kill()
    restored = run_json("restore", snapshot, "--repo", repo)
    try:
        assert restored["pid"] == job.pid
        assert job.finish() == job.expected()
    finally:
        kill_pids(restored.get("pids") or [job.pid])


def test_zero_heavy_job_stores_a_small_fraction(workload, repo):
    job = workload("inference", 128)
    info = dump(job, repo, "inference")
    assert info["pages_zero"] >= (128 << 20) * 0.85 * 0.95 // 4096
    ratio = info["bytes_stored"] / info["bytes_raw"]
    assert ratio < 0.2, f"zero-heavy job stored {ratio:.3f} of CRIU's bytes"
    restore_and_check(job, info["snapshot"], repo)


def test_incompressible_job_stores_about_what_criu_wrote(workload, repo):
    job = workload("random", 64)
    info = dump(job, repo, "random")
    ratio = info["bytes_stored"] / info["bytes_raw"]
    assert ratio <= 1.01, f"random job stored {ratio:.4f} x CRIU's bytes"
    restore_and_check(job, info["snapshot"], repo)


def test_second_dump_of_unchanged_job_stores_almost_nothing(workload, repo):
    job = workload("fp32", 64)
    first = dump(job, repo, "fp32")
    second = dump(job, repo, "fp32")
    assert second["pages_dedup"] >= (64 << 20) * 0.95 // 4096
    ratio = second["bytes_stored"] / first["bytes_stored"]
    assert ratio < 0.05, f"second dump of an unchanged job stored {ratio:.3f} of the first"
    restore_and_check(job, second["snapshot"], repo)


@pytest.mark.slow
def test_relocated_buffer_is_deduplicated(workload, repo):
    job = workload("relocate", 128)
    first = dump(job, repo, "reloc")
    moved = job.relocate()
    assert moved["old"] != moved["new"], "the weights must live at a new address"
    second = dump(job, repo, "reloc")
    # the frozen weights (98 % of the job) come back as references to the first dump's pages
    assert second["pages_dedup"] >= (128 << 20) * 0.98 * 0.95 // 4096
    ratio = second["bytes_stored"] / first["bytes_stored"]
    assert ratio < 0.08, f"dump after relocation stored {ratio:.3f} of the first"
    restore_and_check(job, second["snapshot"], repo)


@pytest.mark.slow
def test_restore_after_older_snapshots_were_pruned(workload, repo):
    job = workload("relocate", 64)
    dump(job, repo, "pr")
    job.relocate()
    dump(job, repo, "pr")
    job.relocate()
    last = dump(job, repo, "pr")
    pruned = run_json("prune", "--keep-last", 1, "--repo", repo)
    assert pruned is not None
    left = sorted(p.name for p in (repo / "snapshots").iterdir() if not p.name.startswith("."))
    assert left == [Path(last["snapshot"]).name], left
    # the kept snapshot's pages mostly live in packs written by the pruned dumps
    assert last["pages_dedup"] > last["pages_total"] // 2
    run_json("verify", "--repo", repo)
    restore_and_check(job, last["snapshot"], repo)
