"""Bad input, as a user meets it: each gets a clear message, its own exit code, and loses
nothing (the job keeps running, no half-written snapshot is visible)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import GPUSNAP, ROOT, kill_pids, require_nobody_can_run, run_gpusnap, run_json
from gpusnap.errors import CorruptSnapshot, CriuFailed, CriuUnavailable, Interrupted, NoSpace, NotRoot, PidsInUse, ProcessNotFound, SnapshotNotFound

pytestmark = pytest.mark.criu


def snapshots_in(repo: Path) -> list[str]:
    d = repo / "snapshots"
    return sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) if d.exists() else []


def test_missing_pid(repo):
    proc = run_gpusnap("dump", 4194000, "--repo", repo)
    assert proc.returncode == ProcessNotFound.exit_code
    assert "no running process with PID 4194000" in proc.stderr
    proc = run_gpusnap("dump", 4194000, "--repo", repo, "--json")
    err = json.loads(proc.stdout)
    assert err["exit_code"] == ProcessNotFound.exit_code and "4194000" in err["message"]


def test_not_root(repo, sample_job):
    require_nobody_can_run()
    nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--inh-caps=-all"]
    job = sample_job(steps=100, mb=4, threads=1, step_ms=20)
    job.wait_steps(2)
    proc = subprocess.run([*nobody, *GPUSNAP, "dump", str(job.pid), "--repo", str(repo)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == NotRoot.exit_code, proc.stderr
    assert "must run as root" in proc.stderr
    assert job.alive() and not repo.exists()


def test_criu_missing(repo, sample_job):
    job = sample_job(steps=100, mb=4, threads=1, step_ms=20)
    job.wait_steps(2)
    proc = run_gpusnap("dump", job.pid, "--repo", repo, env={"GPUSNAP_CRIU": "/nonexistent/criu"})
    assert proc.returncode == CriuUnavailable.exit_code
    assert "make setup" in proc.stderr
    assert job.alive()


def test_old_criu_is_refused_with_install_advice():
    from gpusnap.criu import runner

    with pytest.raises(CriuUnavailable, match="3.17.1 .* too old") as e:
        runner.check_version((3, 17, 1), "/usr/sbin/criu")
    assert "make setup" in e.value.hint
    assert runner.check_version((4, 1, 1), "/usr/sbin/criu") == (4, 1, 1)
    assert runner.parse_version("Version: 4.1.1\nGitID: v4.1.1") == (4, 1, 1)


def test_restore_of_something_that_is_not_a_snapshot(tmp_path, repo):
    (tmp_path / "junk").mkdir()
    proc = run_gpusnap("restore", tmp_path / "junk", "--repo", repo)
    assert proc.returncode == SnapshotNotFound.exit_code
    assert "not a gpusnap snapshot" in proc.stderr
    proc = run_gpusnap("restore", "no-such-name", "--repo", repo)
    assert proc.returncode == SnapshotNotFound.exit_code


@pytest.mark.slow
def test_pids_in_use_while_original_runs(sample_job, repo):
    job = sample_job(steps=400, mb=8, threads=1, step_ms=20)
    job.wait_steps(3)
    info = run_json("dump", job.pid, "--repo", repo)
    proc = run_gpusnap("restore", info["snapshot"])
    assert proc.returncode == PidsInUse.exit_code
    assert "original job is probably still running" in proc.stderr
    assert job.alive()


@pytest.mark.slow
def test_pids_held_by_a_dying_process_are_waited_for(sample_job, repo, reference):
    kw = dict(steps=150, mb=8, threads=1)
    expected = reference(**kw)
    job = sample_job(**kw, step_ms=20)
    job.wait_steps(3)
    info = run_json("dump", job.pid, "--repo", repo)
    for pid in job.pids:
        os.kill(pid, signal.SIGKILL)
    # the parent stays a zombie (its PID taken) for a moment before we reap it
    reaper = subprocess.Popen(["sleep", "1.5"])
    restore = subprocess.Popen([*GPUSNAP, "restore", info["snapshot"], "--json"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=ROOT)
    reaper.wait()
    job.popen.wait()
    out, errout = restore.communicate(timeout=120)
    assert restore.returncode == 0, errout
    assert json.loads(out)["pid"] == job.pid
    try:
        assert job.result() == expected
    finally:
        kill_pids(job.pids)


def test_criu_failure_shows_its_errors_and_keeps_the_log(undumpable, repo):
    """A job CRIU cannot dump (conftest's undumpable): CRIU fails, the user sees CRIU's own
    error lines and where the full log is, and the job runs on."""
    proc = run_gpusnap("dump", undumpable.pid, "--repo", repo)
    assert proc.returncode == CriuFailed.exit_code, proc.stderr
    assert "criu dump failed" in proc.stderr
    assert "Error" in proc.stderr  # CRIU's own lines
    log = next(ln.split("full CRIU log: ")[1].strip() for ln in proc.stderr.splitlines()
               if "full CRIU log:" in ln)
    assert Path(log).is_file() and "Dumping FAILED" in Path(log).read_text()
    assert undumpable.poll() is None  # still running
    assert snapshots_in(repo) == []


def test_full_disk_loses_nothing(sample_job, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=80m,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        # random memory does not compress: 160 MiB of it cannot fit in 80 MiB
        job = sample_job(steps=400, mb=640, threads=1, step_ms=20)
        job.wait_steps(3)
        repo = mnt / "repo"
        run_gpusnap("init", "--repo", repo, check=True)
        proc = run_gpusnap("dump", job.pid, "--repo", repo)
        assert proc.returncode == NoSpace.exit_code, proc.stderr
        assert "is full" in proc.stderr
        assert job.alive()
        at = job.steps_done()
        job.wait_steps(at + 3)  # and still making progress: not frozen
        assert snapshots_in(repo) == []
        r = run_gpusnap("verify", "--repo", repo)
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_interrupted_dump_leaves_job_running_and_no_snapshot(sample_job, repo):
    """SIGINT (a user's Ctrl-C) while CRIU is dumping the job: exit 130, the job runs on, no
    snapshot. The signal lands while CRIU works through the fault hook (docs/faults.md), never
    after a dump that was quicker than a sleep."""
    job = sample_job(steps=600, mb=64, threads=1, step_ms=20)
    job.wait_steps(3)
    d = run_gpusnap("dump", job.pid, "--repo", repo, env={"GPUSNAP_FAULT": "dump:criu-running:INT"})
    assert d.returncode == Interrupted.exit_code, (d.stdout, d.stderr)
    assert "interrupted" in d.stderr and "Traceback" not in d.stderr, d.stderr
    assert job.alive()
    at = job.steps_done()
    job.wait_steps(at + 3)
    assert snapshots_in(repo) == []


def test_corrupt_pack_refuses_restore_and_starts_nothing(sample_job, repo):
    job = sample_job(steps=300, mb=16, threads=1, step_ms=20)
    job.wait_steps(3)
    info = run_json("dump", job.pid, "--repo", repo)
    job.kill()
    packs = sorted((repo / "packs").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else 0)
    pack = packs[-1]
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0x40
    os.chmod(pack, 0o600)
    pack.write_bytes(bytes(data))
    steps_before = job.steps_done()
    proc = run_gpusnap("restore", info["snapshot"])
    assert proc.returncode == CorruptSnapshot.exit_code, proc.stderr
    # which check catches the flipped bit depends on where it lands: the codec (the
    # compressed stream no longer decodes) or the blake3 id of the decoded pages
    assert pack.name[:12] in proc.stderr, proc.stderr
    assert "fails its checksum" in proc.stderr or "cannot decompress" in proc.stderr, proc.stderr
    # CRIU killed the half-built tree before it ran: each of its processes is gone (or a
    # zombie) once the SIGKILL is through, and the job's log did not move
    from gpusnap.system.proc import exists
    deadline = time.monotonic() + 30                     # (a safety net, not a measure)
    while any(exists(p) for p in job.pids):
        assert time.monotonic() < deadline, "a restored process is running"
        time.sleep(0.01)
    assert job.steps_done() == steps_before
    v = run_gpusnap("verify", "--repo", repo)
    assert v.returncode == CorruptSnapshot.exit_code
    assert Path(info["snapshot"]).name in v.stdout + v.stderr


# -- what `dump` refuses: a kernel thread, a repository that is a file --------------------------


def test_kernel_thread_is_named_as_such():
    p = run_gpusnap("dump", "2", "--repo", "/nonexistent-gpusnap-repo")
    assert p.returncode == 16 and "kernel thread" in p.stderr and "session leader" not in p.stderr, p.stderr


def test_dump_into_a_file_is_a_clean_error(sample_job, tmp_path):
    job = sample_job(steps=5000, mb=8, threads=1, step_ms=20)
    job.wait_steps(2)
    f = tmp_path / "file"
    f.write_text("x")
    p = run_gpusnap("dump", job.pid, "--repo", f)
    assert p.returncode == 14 and "Traceback" not in p.stderr and "not a gpusnap repository" in p.stderr, p.stderr
    assert job.alive() and f.read_text() == "x"
