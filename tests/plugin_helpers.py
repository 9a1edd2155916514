"""Helpers for the CUDA plugin tests: the fake driver's state, the test job, raw CRIU runs.

Nothing is mocked but the CUDA driver: CRIU is the real one, the jobs are real
processes, and the plugin is the one gpusnap ships (build/plugins/gpusnap_cuda.so).
The fake driver (build/fake_cuda/libcuda.so.1, tests/fake_cuda/fake_cuda.c) keeps
its state in files, see FakeCuda.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"
PLUGIN_DIR = BUILD / "plugins"
PLUGIN = PLUGIN_DIR / "gpusnap_cuda.so"
FAKE_LIB_DIR = BUILD / "fake_cuda"
FAKE_LIB_DIR_R550 = BUILD / "fake_cuda_r550"      # the same fake as a driver without the checkpoint API
JOB = ROOT / "tests" / "jobs" / "cuda_like.py"
JOB_PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable

CUDA_ERROR_UNKNOWN = 999
CUDA_ERROR_TIMEOUT = 909
TRANSITIONS = ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
               "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock")
SHORT = {"cuCheckpointProcessLock": "lock", "cuCheckpointProcessCheckpoint": "checkpoint",
         "cuCheckpointProcessRestore": "restore", "cuCheckpointProcessUnlock": "unlock",
         "cuCheckpointProcessGetState": "state", "cuCheckpointProcessGetRestoreThreadId": "tid",
         "cuInit": "init"}


def require_environment() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: CRIU dumps and restores real processes")
    if shutil.which("criu") is None:
        pytest.skip("criu is not installed")


_built = False


def ensure_built() -> None:
    """Builds the plugin and the fake driver (incremental; seconds when up to date)."""
    global _built
    if _built:
        return
    if shutil.which("cmake") is None:
        if PLUGIN.exists() and all((d / "libcuda.so.1").exists() for d in (FAKE_LIB_DIR, FAKE_LIB_DIR_R550)):
            _built = True
            return
        pytest.skip("cmake missing and build/ not built")
    for cmd in (["cmake", "-S", str(ROOT), "-B", str(BUILD)],
                ["cmake", "--build", str(BUILD), "--target", "gpusnap_cuda", "fake_cuda", "fake_cuda_r550"]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}"
    _built = True


@dataclass
class Call:
    call: str
    pid: int
    rc: int
    fields: dict

    @property
    def short(self) -> str:
        return SHORT.get(self.call, self.call)


class FakeCuda:
    """The fake driver's shared state directory ($FAKE_CUDA_DIR)."""

    def __init__(self, root: Path):
        self.dir = root
        (root / "procs").mkdir(parents=True, exist_ok=True)
        (root / "fail").mkdir(exist_ok=True)

    def declare(self, pid: int, tid: int, state: str = "running") -> None:
        (self.dir / "procs" / str(pid)).write_text(f"tid={tid} state={state}\n")

    def state(self, pid: int) -> str:
        for tok in (self.dir / "procs" / str(pid)).read_text().split():
            if tok.startswith("state="):
                return tok[len("state="):]
        return "running"

    def fail(self, call: str, rc: int, pid: int | None = None) -> None:
        name = call if pid is None else f"{call}.{pid}"
        (self.dir / "fail" / name).write_text(f"{rc}\n")

    def clear_failures(self) -> None:
        for f in (self.dir / "fail").iterdir():
            f.unlink()

    def calls(self) -> list[Call]:
        log = self.dir / "calls.log"
        out = []
        if not log.exists():
            return out
        for line in log.read_text().splitlines():
            parts = line.split()
            fields = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
            out.append(Call(parts[0], int(fields["pid"]), int(fields["rc"]), fields))
        return out

    def transitions(self, pid: int | None = None) -> list[str]:
        """Short names of the state-changing calls (optionally for one pid), in order."""
        return [c.short for c in self.calls() if c.call in TRANSITIONS and (pid is None or c.pid == pid)
                and c.fields.get("note") != "hanging"]  # a hung call's start; it logs again if it ends

    def reset_log(self) -> None:
        (self.dir / "calls.log").unlink(missing_ok=True)

    def env(self) -> dict:
        return {"FAKE_CUDA_DIR": str(self.dir), "LD_LIBRARY_PATH": str(FAKE_LIB_DIR)}


@contextlib.contextmanager
def libcuda_process(anon_mb: int = 0):
    """A real process that has a libcuda.so.1 (the fake driver) mapped, as a CUDA job has,
    with `anon_mb` MiB of anonymous memory of its own; killed at the end."""
    ensure_built()
    lib = FAKE_LIB_DIR / "libcuda.so.1"
    p = subprocess.Popen([sys.executable, "-c",
                          f"import ctypes,time; ctypes.CDLL({str(lib)!r}); b = bytearray({anon_mb} << 20); "
                          "b[::4096] = b'x' * (len(b) // 4096); print('ok', flush=True); time.sleep(120)"],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ok"
        yield p
    finally:
        p.kill()
        p.wait()


def wait_for(pred, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def pid_alive(pid: int) -> bool:
    try:
        st = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return st[st.rindex(")") + 2] not in "ZX"


def thread_state(pid: int, tid: int) -> str:
    st = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    return st[st.rindex(")") + 2]


def tracer_pid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("TracerPid:"):
            return int(line.split()[1])
    return -1


class Job:
    """tests/jobs/cuda_like.py, started detached (own session, no terminal, no pipes)."""

    def __init__(self, workdir: Path, tree: bool = False):
        self.dir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        args = [JOB_PY, str(JOB), str(workdir)] + (["--tree"] if tree else [])
        self.popen = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True, cwd="/")
        self.pid = self.popen.pid
        roles = ["root"] + (["cuda-child", "plain-child"] if tree else [])
        self.info = {}
        for role in roles:
            path = workdir / f"info.{role}.json"
            wait_for(path.exists, 30, f"{path.name}")
            self.info[role] = json.loads(path.read_text())
        assert self.info["root"]["pid"] == self.pid

    def pid_of(self, role: str) -> int:
        return self.info[role]["pid"]

    def tid_of(self, role: str) -> int:
        return self.info[role]["tid"]

    def declare_cuda(self, fake: FakeCuda, roles=("root",)) -> None:
        for role in roles:
            fake.declare(self.pid_of(role), self.tid_of(role))

    def reap(self) -> None:
        """Collects the original root after CRIU killed it (frees its pid for the restore)."""
        try:
            self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        for info in self.info.values():
            # gone for good, zombie included: the restore needs the pid free
            wait_for(lambda: not Path(f"/proc/{info['pid']}").exists(), 30, f"pid {info['pid']} gone")

    def finish_and_result(self, timeout=60.0) -> dict:
        (self.dir / "finish").touch()
        res = self.dir / "result.json"
        wait_for(res.exists, timeout, "result.json")
        return json.loads(res.read_text())

    def kill(self, finish: bool = True) -> None:
        """SIGKILLs the job. `finish` also leaves the finish flag, so that a copy restored
        later ends on its own; a test that restores and then checks the copy runs passes
        False, or the copy may see the flag and end before it is looked at."""
        if finish:
            (self.dir / "finish").touch()
        for info in self.info.values():
            try:
                os.kill(info["pid"], 9)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


@dataclass
class CriuRun:
    rc: int
    log: str
    stdout: str
    stderr: str

    def plugin_lines(self) -> list[str]:
        return [ln for ln in self.log.splitlines() if "gpusnap_cuda: " in ln]


def _run_criu(args: list[str], env: dict, images: Path, logname: str, timeout: float) -> CriuRun:
    full = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "FAKE_CUDA_DIR")}
    full.update(env)
    r = subprocess.run(["criu", *args], capture_output=True, text=True, env=full, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    log = (images / logname).read_text() if (images / logname).exists() else ""
    return CriuRun(r.returncode, log, r.stdout, r.stderr)


def criu_dump(pid: int, images: Path, env: dict, *, leave_running: bool = True,
              extra: list[str] | None = None, timeout: float = 120) -> CriuRun:
    images.mkdir(parents=True, exist_ok=True)
    args = ["dump", "-t", str(pid), "-D", str(images), "-o", "dump.log", "-v4",
            "--libdir", str(PLUGIN_DIR)]
    if leave_running:
        args.append("--leave-running")
    env = dict(env)
    env.setdefault("GPUSNAP_LEAVE_RUNNING", "1" if leave_running else "0")
    return _run_criu(args + list(extra or []), env, images, "dump.log", timeout)


def criu_restore(images: Path, env: dict, *, extra: list[str] | None = None, timeout: float = 120) -> CriuRun:
    args = ["restore", "-d", "-D", str(images), "-o", "restore.log", "-v4", "--libdir", str(PLUGIN_DIR)]
    return _run_criu(args + list(extra or []), env, images, "restore.log", timeout)


def read_report(path: Path) -> list[dict]:
    """Lines of $GPUSNAP_CUDA_REPORT as dicts: {"op": "dump"|"restore", "pid": int, ...}."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        op, *kv = line.split()
        d = {"op": op, **dict(x.split("=", 1) for x in kv)}
        d["pid"] = int(d["pid"])
        d["tid"] = int(d["tid"])
        out.append(d)
    return out


def hook_timings(log: str) -> list[tuple[str, int, float, float, float]]:
    """(hook, pid, total ms, driver ms, plugin ms) from the plugin's 'took' lines."""
    import re
    pat = re.compile(r"gpusnap_cuda: (\w+) pid=(\d+) took ([\d.]+) ms \(driver ([\d.]+) ms, plugin ([\d.]+) ms\)")
    return [(m[1], int(m[2]), float(m[3]), float(m[4]), float(m[5])) for m in pat.finditer(log)]
