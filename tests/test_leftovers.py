"""Nothing is left that nothing cleans (issue 31 item 5): a SIGKILLed dump's work directory
(CRIU's log) carries the dead gpusnap's PID and start time and the next dump or prune removes
it, while a live gpusnap's stays; lock files under /run/gpusnap (here $GPUSNAP_LOCK_DIR) are
removed when free, and two processes never hold one lock on two files; an import interrupted
by SIGTERM, SIGINT or SIGHUP removes what it had written and says so."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import GPUSNAP, ROOT, run_gpusnap, run_json
from gpusnap.errors import Interrupted
from gpusnap.system import proc


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout          # (a safety net, not a measure)
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _dump_dirs(pid: int) -> list[Path]:
    tmp = Path(tempfile.gettempdir())
    return [p for p in tmp.iterdir() if p.name.startswith(f"gpusnap-dump-{pid}-")]


@pytest.mark.criu
@pytest.mark.parametrize("then", ["dump", "prune"])
def test_a_sigkilled_dumps_directory_is_swept_by_the_next_run(sample_job, repo, tmp_path, then):
    job = sample_job(steps=5000, mb=8, threads=1, step_ms=20)
    job.wait_steps(3)
    hold = tmp_path / "held.json"
    d = subprocess.Popen([*GPUSNAP, "dump", str(job.pid), "--repo", str(repo), "--name", "k"], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env={**os.environ, "GPUSNAP_TEST_HOLD": f"after-gate:{hold}"})
    _wait(hold.exists, 120, "the dump never reached its hold point")
    d.kill()
    d.wait()
    left = _dump_dirs(d.pid)
    assert len(left) == 1 and (left[0] / "criu.log").stat().st_size > 0, left
    assert left[0].name.split("-")[3].isdigit()       # its start time: the PID alone could be reused
    s = job.steps_done()
    job.wait_steps(s + 2)                             # the job runs on
    args = ("dump", job.pid, "--name", "k") if then == "dump" else ("prune",)
    assert run_gpusnap(*args, "--repo", repo).returncode == 0
    assert _dump_dirs(d.pid) == []


def test_only_the_directories_of_gone_gpusnaps_are_swept(tmp_path):
    from gpusnap.system import tmpdirs

    me = proc.read_stat(os.getpid())
    parent = tmp_path / "parent"
    parent.mkdir()
    live = parent / f"{tmpdirs.DUMP}{os.getpid()}-{me.starttime}-abc"        # this process
    reused = parent / f"{tmpdirs.DUMP}1-{proc.read_stat(1).starttime + 1}-abc"  # PID 1, another start
    dead = parent / f"{tmpdirs.DUMP}999999999-5-abc"                          # no such PID
    old_live = parent / f"{tmpdirs.DUMP}1-abc"                                # an older name: PID 1 lives
    link = parent / f"{tmpdirs.DUMP}999999998-5-abc"                          # a planted link: never followed
    other = parent / "something-else"
    for p in (live, reused, dead, old_live, other):
        p.mkdir()
        (p / "criu.log").write_text("x")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("precious")
    link.symlink_to(victim)
    removed = tmpdirs.remove_dead(parent, tmpdirs.DUMP)
    assert sorted(removed) == sorted([str(reused), str(dead)])
    assert live.exists() and old_live.exists() and other.exists() and link.is_symlink()
    assert (victim / "keep").read_text() == "precious"


HOSTLOCK = """
import sys
from gpusnap.system import hostlock
with hostlock.held(sys.argv[1], lambda: print("waiting", flush=True)):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_host_lock_files_are_removed_when_free_and_never_split(tmp_path):
    d = tmp_path / "locks"
    env = {**os.environ, "GPUSNAP_LOCK_DIR": str(d)}
    start = lambda: subprocess.Popen([sys.executable, "-c", HOSTLOCK, "dump-pid-1"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    a = start()
    assert a.stdout.readline().strip() == "held"
    b = start()
    assert b.stdout.readline().strip() == "waiting"
    a.stdin.close()                                # A lets go, and removes the file
    assert a.wait(timeout=60) == 0
    assert b.stdout.readline().strip() == "held"
    c = start()                                    # B holds it on the file the path names now
    assert c.stdout.readline().strip() == "waiting"
    b.stdin.close()
    assert b.wait(timeout=60) == 0
    assert c.stdout.readline().strip() == "held"
    c.stdin.close()
    assert c.wait(timeout=60) == 0
    assert os.listdir(d) == []
    (d / "restore-pid-7.lock").write_text("")     # left by a gpusnap before this one: free
    a = start()
    assert a.stdout.readline().strip() == "held"
    a.stdin.close()
    assert a.wait(timeout=60) == 0
    assert os.listdir(d) == []


@pytest.mark.criu
def test_the_lock_files_stay_bounded_after_many_dumps(repo, tmp_path):
    d = tmp_path / "locks"
    sleepers = [subprocess.Popen(["setsid", "sleep", "600"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL) for _ in range(6)]
    try:
        for p in sleepers:
            _wait(lambda: proc.read_stat(p.pid) is not None and proc.read_stat(p.pid).comm == "sleep", 30,
                  "sleep never started")
            r = run_gpusnap("dump", p.pid, "--repo", repo, "--name", "s", env={"GPUSNAP_LOCK_DIR": str(d)})
            assert r.returncode == 0, r.stderr
    finally:
        for p in sleepers:
            p.kill()
            p.wait()
    assert len(run_json("ls", "--repo", repo)["snapshots"]) == len(sleepers)
    assert os.listdir(d) == []


@pytest.fixture
def export_file(sample_job, tmp_path):
    job = sample_job(steps=5000, mb=32, threads=1, step_ms=20)
    job.wait_steps(3)
    src = tmp_path / "src"
    run_gpusnap("init", "--repo", src, check=True)     # (not the default location)
    run_json("dump", job.pid, "--repo", src, "--name", "big")
    export = tmp_path / "x.gsx"
    run_json("export", "big", "-o", export, "--repo", src)
    return export


def _nothing_left(repo: Path) -> None:
    assert os.listdir(repo / "snapshots") == []
    assert os.listdir(repo / "tmp") == []
    assert run_json("ls", "--repo", repo)["snapshots"] == []


@pytest.mark.criu
@pytest.mark.parametrize("sig", ["TERM", "INT", "HUP"])
def test_an_import_interrupted_while_storing_cleans_up_and_says_so(export_file, repo, sig):
    """The signal lands while the import stores (its snapshot's .tmp- directory and a pack
    temporary file exist: the fault point where the pack file has just been opened)."""
    r = run_gpusnap("import", export_file, "--repo", repo, env={"GPUSNAP_FAULT": f"pack:opened:{sig}"})
    assert r.returncode == Interrupted.exit_code, (r.returncode, r.stderr)
    assert "import interrupted" in r.stderr and "removed" in r.stderr and "Traceback" not in r.stderr, r.stderr
    _nothing_left(repo)


@pytest.mark.criu
def test_an_import_terminated_while_reading_a_pipe_cleans_up_and_says_so(export_file, repo):
    data = export_file.read_bytes()
    assert len(data) > 4 << 20                      # more than the pipe holds: it is being read
    imp = subprocess.Popen([*GPUSNAP, "import", "-", "--repo", str(repo)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    imp.stdin.write(data[: len(data) * 3 // 4])     # returns once the import has read most of it
    imp.stdin.flush()
    imp.send_signal(signal.SIGTERM)
    out, err = imp.communicate(timeout=120)
    assert imp.returncode == Interrupted.exit_code, (imp.returncode, err)
    assert b"import interrupted" in err and b"Traceback" not in err, err
    _nothing_left(repo)
