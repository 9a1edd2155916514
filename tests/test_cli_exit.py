"""The process ends right after the command (gpusnap.cli.run -> exit_now, no interpreter
teardown): what a user sees (stdout, stderr, exit code) is exactly what the ordinary exit
gives, and nothing is left behind (work and image directories, staging spill files, the
repository lock, CRIU processes)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import GPUSNAP, PY, ROOT, kill_pids
from gpusnap.errors import ProcessNotFound

# the same command through main() and the interpreter's ordinary exit (what `gpusnap` did before)
ORDINARY = [PY, "-c", "import sys; sys.argv[0] = 'gpusnap'; from gpusnap.cli import main; main()"]


def _run(entry, *args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([*entry, *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, **(env or {})})


def _no_such_pid() -> int:
    """A PID no process can have (above the kernel's pid_max): never one that a process
    started meanwhile took, so nothing else is ever dumped."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


def _leftovers(*dirs: Path) -> list[str]:
    return sorted(str(p) for d in dirs if d.exists() for p in d.iterdir())


def _processes_naming(text: str) -> list[str]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and d.name != str(os.getpid()):
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                found.append(f"{d.name}: {cmd}")
    return found


@pytest.mark.parametrize("json_flag", [["--json"], []])
def test_error_output_and_code_are_as_before(tmp_path, json_flag):
    args = ["dump", _no_such_pid(), "--repo", tmp_path / "r", *json_flag]
    fast, ordinary = _run(GPUSNAP, *args), _run(ORDINARY, *args)
    assert fast.returncode == ordinary.returncode == ProcessNotFound.exit_code
    assert (fast.stdout, fast.stderr) == (ordinary.stdout, ordinary.stderr)
    assert (fast.stdout if json_flag else fast.stderr).strip(), "the error was printed"


def test_help_and_version_are_as_before():
    for args in (["--help"], ["--version"], ["dump", "--help"]):
        fast, ordinary = _run(GPUSNAP, *args), _run(ORDINARY, *args)
        assert (fast.returncode, fast.stdout, fast.stderr) == (ordinary.returncode, ordinary.stdout, ordinary.stderr)
        assert fast.returncode == 0 and fast.stdout


def test_a_thread_still_running_is_waited_for_and_atexit_handlers_run():
    """The ordinary shutdown's work that matters still happens: a non-daemon thread is joined
    (exit_now falls back to the ordinary exit), and atexit handlers run."""
    code = ("import atexit, threading, time\nfrom gpusnap.cli import exit_now\n"
            "atexit.register(lambda: print('atexit ran', flush=True))\n"
            "t = threading.Thread(target=lambda: (time.sleep(0.3), print('thread finished', flush=True)))\n"
            "{start}exit_now(3)\n")
    for start, want in (("t.start(); ", ["thread finished", "atexit ran"]), ("", ["atexit ran"])):
        p = subprocess.run([PY, "-c", code.format(start=start)], capture_output=True, text=True, timeout=60)
        assert p.returncode == 3 and p.stdout.split("\n")[:-1] == want, (p.stdout, p.stderr)


@pytest.mark.criu
def test_dump_and_restore_leave_nothing_behind(sample_job, repo, reference):
    kw = dict(steps=300, mb=8, threads=2)
    expected = reference(**kw)
    job = sample_job(**kw, step_ms=20)
    job.wait_steps(5)
    # the commands' work directories (tempfile) go here; a short path (CRIU's sockets live there)
    tmp = Path(tempfile.mkdtemp(prefix="gs-exit-"))
    env = {"TMPDIR": str(tmp), "GPUSNAP_RESTORE_IMAGES": "disk"}

    fast = _run(GPUSNAP, "dump", job.pid, "--repo", repo, "--name", "fast", "--json", env=env)
    ordinary = _run(ORDINARY, "dump", job.pid, "--repo", repo, "--name", "ordinary", "--json", env=env)
    assert fast.returncode == ordinary.returncode == 0, (fast.stderr, ordinary.stderr)
    assert fast.stderr == ordinary.stderr == ""
    a, b = (json.loads(p.stdout) for p in (fast, ordinary))       # exactly one JSON object each
    assert list(a) == list(b) and a["job_running"] is True

    job.kill()
    restored = _run(GPUSNAP, "restore", "fast", "--repo", repo, "--via", "files", "--json", env=env)
    assert restored.returncode == 0, restored.stderr
    info = json.loads(restored.stdout)
    try:
        assert info["pid"] == job.pid and info["images"] == "disk"
        assert job.result() == expected          # the snapshot was complete on disk
    finally:
        kill_pids(job.pids)

    assert _leftovers(tmp) == []                 # CRIU's work directories
    assert _leftovers(repo / "tmp") == []        # staging spill files
    assert not [p for p in repo.rglob("gpusnap-images-*")], "materialized images left behind"
    assert _processes_naming(str(tmp)) == []     # no CRIU (or helper) still running on them
    fd = os.open(repo / "locks" / "writer", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # the writer lock is free
    finally:
        os.close(fd)
    tmp.rmdir()
