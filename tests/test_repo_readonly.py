"""Read-only repositories (issue 31 item 4), on a real read-only bind mount (`mount --bind`,
then `mount -o remount,bind,ro`) of a repository holding real snapshots: every command that
only reads (ls, inspect, verify, export, restore) works, a restore brings the job back with
the result of an uninterrupted run, and the ones that take the readers lock say in one line
that the repository is read-only; every command that writes (dump, prune, forget, import,
repair) exits 14 with one message and no traceback, and the job runs on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, kill_pids, run_gpusnap, run_json
from gpusnap.errors import RepositoryError, RepositoryLocked

pytestmark = pytest.mark.criu

JOB = dict(steps=120, mb=24, threads=2)


@pytest.fixture
def ro_mount(tmp_path):
    """ro_mount(dir) -> a read-only bind mount of dir (unmounted afterwards)."""
    mounts: list[Path] = []

    def make(src: Path) -> Path:
        dst = tmp_path / f"ro-{len(mounts)}"
        dst.mkdir()
        subprocess.run(["mount", "--bind", str(src), str(dst)], check=True)
        mounts.append(dst)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(dst)], check=True)
        assert subprocess.run(["touch", str(dst / "x")], capture_output=True).returncode != 0
        return dst

    yield make
    for m in reversed(mounts):
        subprocess.run(["umount", str(m)], check=True)


def _notes(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "read-only" in ln]


def test_reading_commands_work_and_say_so_in_one_line(sample_job, repo, ro_mount, tmp_path):
    job = sample_job(**JOB)
    job.wait_steps(5)
    dumped = run_json("dump", job.pid, "--repo", repo, "--name", "job")
    snap = dumped["snapshot"]
    job.kill()
    assert run_gpusnap("verify", "--repo", repo).returncode == 0      # (its lock file exists now)
    ro = ro_mount(repo)
    name = Path(snap).name
    assert [s["dir"] for s in run_json("ls", "--repo", ro)["snapshots"]] == [name]
    assert run_json("inspect", "job", "--repo", ro)["id"] == dumped["id"]
    v = run_gpusnap("verify", "--repo", ro, "--json")
    assert v.returncode == 0 and json.loads(v.stdout)["ok"] is True, v.stderr
    assert len(_notes(v.stderr)) == 1 and "Traceback" not in v.stderr, v.stderr
    out = tmp_path / "x.gsx"
    e = run_gpusnap("export", "job", "-o", out, "--repo", ro, "--json")
    assert e.returncode == 0 and len(_notes(e.stderr)) == 1, e.stderr
    run_gpusnap("init", "--repo", tmp_path / "other", check=True)   # (not the default location)
    assert run_json("import", out, "--repo", tmp_path / "other")["source_id"] == dumped["id"]


@pytest.mark.parametrize("via,images", [("stream", None), ("files", "disk")])
def test_a_restore_from_a_read_only_copy_finishes_right(sample_job, repo, ro_mount, reference, via, images):
    """--via files with the images meant for the repository's disk: they go to tmpfs instead
    (the read-only repository's tmp/ takes nothing), and the restore says so."""
    job = sample_job(**JOB)
    job.wait_steps(10)
    run_json("dump", job.pid, "--repo", repo, "--name", "job")
    job.kill()
    ro = ro_mount(repo)
    env = {"GPUSNAP_RESTORE_IMAGES": images} if images else {}
    r = run_gpusnap("restore", "job", "--repo", ro, "--via", via, "--json", env=env)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        restored = json.loads(r.stdout)
        assert restored["pid"] == job.pid and restored["via"] == via
        assert job.result() == reference(**JOB)
    finally:
        kill_pids(job.pids)
    notes = _notes(r.stderr)
    assert notes and len(notes) == (2 if images else 1), r.stderr
    assert restored["images"] == ("tmpfs" if images else None)


def test_writing_commands_exit_14_with_one_message(sample_job, repo, ro_mount, tmp_path):
    job = sample_job(steps=5000, mb=8, threads=1, step_ms=20)
    job.wait_steps(3)
    run_json("dump", job.pid, "--repo", repo, "--name", "job")
    out = tmp_path / "x.gsx"
    run_json("export", "job", "-o", out, "--repo", repo)
    ro = ro_mount(repo)
    for args in (("dump", job.pid, "--name", "job"), ("prune", "--keep-last", "1"), ("forget", "job"),
                 ("import", out), ("repair",)):
        p = run_gpusnap(*args, "--repo", ro)
        assert p.returncode == RepositoryError.exit_code, (args, p.returncode, p.stderr)
        assert "Traceback" not in p.stderr and f"repository {ro} is read-only" in p.stderr, (args, p.stderr)
        j = run_gpusnap(*args, "--repo", ro, "--json")
        assert json.loads(j.stdout)["exit_code"] == RepositoryError.exit_code
    s = job.steps_done()
    job.wait_steps(s + 2)                   # the job runs on
    assert len(run_json("ls", "--repo", repo)["snapshots"]) == 1


RESTORE_READING = """
import sys
from gpusnap.repo import Repository
r = Repository.open(sys.argv[1])
with r.readers_lock():
    print("reading", flush=True)
    sys.stdin.read()
"""


def test_a_reader_of_the_read_only_view_keeps_a_prune_of_the_writable_one_out(tmp_path, ro_mount):
    """The read-only bind mount shares the readers lock file (one inode) with the writable
    view: a reader there holds it (read-only), and a prune through the writable path waits
    for it, then refuses (exit 10) rather than delete data under it."""
    from gpusnap.repo import Repository
    from repo_helpers import PAGE, dump

    repo = Repository.open(tmp_path / "repo", create=True)
    for k in range(2):
        dump(repo, {"pages-1.img": bytes([k + 1]) * PAGE * 4})
    with repo.readers_lock():
        pass                                              # its lock file exists from now on
    ro = ro_mount(repo.path)
    r = subprocess.Popen([sys.executable, "-c", RESTORE_READING, str(ro)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert r.stdout.readline().strip() == "reading", r.stderr.read()
        p = run_gpusnap("prune", "--keep-last", "1", "--repo", repo.path, "--lock-wait", "0.3")
        assert p.returncode == RepositoryLocked.exit_code and "a restore is reading" in p.stderr, p.stderr
        assert len(Repository.open(repo.path).snapshots()) == 2
    finally:
        r.stdin.close()
        r.wait(timeout=60)
    assert "read-only" in r.stderr.read()
    assert run_json("prune", "--keep-last", "1", "--repo", repo.path)["snapshots_deleted"]
