"""Shared fixtures: the gpusnap command, private repositories, and real sample jobs.

Everything here is real: jobs are real processes (gpusnap.samples.job), dumps and
restores go through the real CRIU, repositories are real directories.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
GPUSNAP = [PY, "-m", "gpusnap"]

# A suite started in the background of a script (`make test &`: POSIX shells make background
# jobs ignore SIGINT) would pass the ignored SIGINT on to every gpusnap it runs, and the tests
# that interrupt a dump with SIGINT, as Ctrl-C on a terminal does, would see it finish (exit 0).
# The tests run gpusnap as a terminal would: SIGINT handled (exec resets a handler to default).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    if os.geteuid() != 0:
        skip = pytest.mark.skip(reason="needs root: CRIU dumps and restores real processes")
        for item in items:
            if "criu" in item.keywords:
                item.add_marker(skip)


def checkout_bin(where: Path) -> Path:
    """A directory holding `gpusnap`: an executable that runs this checkout's code whatever the
    caller's environment, as `make install`'s /usr/local/bin/gpusnap does for the installed copy
    (put first on PATH, it is also what `schedule add` writes on a cron line)."""
    d = where / "bin"
    d.mkdir(exist_ok=True)
    exe = d / "gpusnap"
    exe.write_text(f'#!/bin/sh\nPYTHONPATH={ROOT} exec {PY} -m gpusnap "$@"\n')
    exe.chmod(0o755)
    return d


_nobody_probe: list[str] = []


def require_nobody_can_run() -> None:
    """Skip the calling test when user nobody cannot run this checkout's gpusnap at all (a
    checkout under /root, 0700: no other user can reach its .venv); the reason says so."""
    if not _nobody_probe:
        try:
            p = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                                *GPUSNAP, "--version"], capture_output=True, text=True, cwd="/", timeout=60)
            _nobody_probe.append("" if p.returncode == 0 else (p.stderr.strip()[-200:] or f"exit {p.returncode}"))
        except (OSError, subprocess.SubprocessError) as e:
            _nobody_probe.append(str(e))
    if _nobody_probe[0]:
        pytest.skip(f"user nobody cannot run gpusnap from {ROOT}: {_nobody_probe[0]}")


def run_gpusnap(*args, env=None, check=False, timeout=300, **kw) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run([*GPUSNAP, *map(str, args)], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=ROOT, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"gpusnap {' '.join(map(str, args))} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def run_json(*args, **kw) -> dict:
    proc = run_gpusnap(*args, "--json", check=True, **kw)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, f"--json must print exactly one line, got: {proc.stdout!r}"
    return json.loads(lines[0])


@pytest.fixture(autouse=True)
def _default_repo(tmp_path, monkeypatch) -> None:
    """Each test's default repository location ($GPUSNAP_REPO) is its own tmp_path/repo, never
    /var/lib/gpusnap: the first dump, run or import there makes it, as at the real default
    (anywhere else only `gpusnap init` makes one: tests/test_repo_init.py)."""
    monkeypatch.setenv("GPUSNAP_REPO", str(tmp_path / "repo"))


@pytest.fixture
def repo(tmp_path) -> Path:
    return tmp_path / "repo"


class SampleJob:
    """A running gpusnap.samples.job tree (parent, threads, child over pipes, growing log)."""

    def __init__(self, out: Path, *, steps=300, mb=64, threads=3, step_ms=20, from_shell=False, seed=1234):
        """from_shell: start the job as a background command of a shell (`sh -c 'job &'`) that
        leads its own session, so the job's session and process group leader is the shell,
        outside the dumped tree, as for a job started by hand from a terminal."""
        self.out = out
        self.args = ["--steps", steps, "--mb", mb, "--threads", threads, "--step-ms", step_ms, "--seed", seed]
        out.mkdir(parents=True, exist_ok=True)
        self._stdio = open(out / "stdio.txt", "ab")
        cmd = [PY, "-m", "gpusnap.samples.job", str(out), *map(str, self.args)]
        if from_shell:
            pidfile = out / "shell-child"
            cmd = ["sh", "-c", '"$@" & echo $! > "$0.tmp" && mv "$0.tmp" "$0"; wait', str(pidfile), *cmd]
        self.popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._stdio, stderr=self._stdio,
                                      cwd=ROOT, start_new_session=True)
        self.pid = self.popen.pid
        if from_shell:
            deadline = time.monotonic() + 30
            while not pidfile.exists():
                assert time.monotonic() < deadline and self.popen.poll() is None, "the shell did not start the job"
                time.sleep(0.02)
            self.pid = int(pidfile.read_text())
        self.pids: list[int] = []

    def wait_steps(self, n: int, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.steps_done()
            if s >= n:
                if not self.pids:
                    self.pids = [int(x) for x in (self.out / "pid").read_text().split()]
                return s
            if self.popen.poll() is not None and not (self.out / "result").exists():
                raise AssertionError(f"job died: {(self.out / 'stdio.txt').read_text()}")
            time.sleep(0.05)
        raise AssertionError(f"job did not reach step {n} in {timeout} s")

    def steps_done(self) -> int:
        from gpusnap.samples.job import steps_done

        return steps_done(self.out)

    def alive(self) -> bool:
        try:
            st = Path(f"/proc/{self.pid}/stat").read_text()
        except FileNotFoundError:
            return False
        return st[st.rindex(")") + 2] not in "ZX"

    def kill(self) -> None:
        for pid in self.pids or [self.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait(timeout=30)
        # the child is reparented when its parent dies; wait until its PID is free
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in self.pids):
            time.sleep(0.05)

    def result(self, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        path = self.out / "result"
        while time.monotonic() < deadline:
            if path.exists():
                return path.read_text().strip()
            time.sleep(0.1)
        raise AssertionError(f"no result after {timeout} s; log tail: "
                             f"{(self.out / 'job.log').read_text().splitlines()[-1:]}")

    def close(self) -> None:
        for pid in self.pids or [self.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._stdio.close()


_reference_cache: dict[tuple, str] = {}


def reference_result(tmp_root: Path, **kw) -> str:
    """The result of an uninterrupted run with the same arguments (cached per session)."""
    key = tuple(sorted(kw.items()))
    if key not in _reference_cache:
        out = tmp_root / f"reference-{abs(hash(key))}"
        args = {"steps": 300, "mb": 64, "threads": 3, "seed": 1234, **kw, "step_ms": 0}
        cmd = [PY, "-m", "gpusnap.samples.job", str(out)]
        for k, v in args.items():
            cmd += [f"--{k.replace('_', '-')}", str(v)]
        subprocess.run(cmd, check=True, cwd=ROOT, stdin=subprocess.DEVNULL, timeout=600)
        _reference_cache[key] = (out / "result").read_text().strip()
    return _reference_cache[key]


@pytest.fixture
def sample_job(tmp_path):
    jobs: list[SampleJob] = []

    def start(name="job", **kw) -> SampleJob:
        job = SampleJob(tmp_path / name, **kw)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.close()


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    return lambda **kw: reference_result(root, **kw)


_URING = ("import ctypes,time; libc=ctypes.CDLL(None, use_errno=True); p=ctypes.create_string_buffer(120); "
          "fd=libc.syscall(425, 4, p); print('ready' if fd >= 0 else f'errno {ctypes.get_errno()}', "
          "flush=True); time.sleep(120)")


@pytest.fixture
def undumpable():
    """A running process that CRIU 4.2 fails to dump and gpusnap's preflight lets through: it
    holds an io_uring instance (io_uring_setup). The one way tests make CRIU itself fail (a
    big deleted file held open was, until the preflight chose --ghost-limit)."""
    p = subprocess.Popen([sys.executable, "-c", _URING], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        said = p.stdout.readline().strip()
        if said != "ready":
            pytest.skip(f"io_uring_setup failed here ({said}): no io_uring to make CRIU fail with")
        yield p
    finally:
        p.kill()
        p.wait()


def wait_for(pred, what: str, timeout: float = 60) -> None:
    """Until pred() is true; a test failure naming `what` after `timeout` s (a safety net)."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def kill_pids(pids) -> None:
    """Kill restored processes by PID (they are not our children: nothing to reap). Never by
    process group: a job started from a shell shares the shell's group."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
