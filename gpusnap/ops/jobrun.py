"""`gpusnap run [--name N] -- CMD ...`: start a job the way that snapshots best.

The job gets a PID namespace and a session of its own: a minimal init (PID 1 of the new
namespace) starts CMD, forwards signals to it, reaps orphans and exits with CMD's status.
CRIU then dumps the whole namespace from its init, and a restore recreates it, so a
snapshot restores beside a still-running original (a fork) and its PIDs never clash with
processes in use. stdin is /dev/null and stdout/stderr go to files in the job directory
REPO/jobs/N/ (not a terminal, so no --shell-job). job.json there records the name, so
`gpusnap dump --name N`, `gpusnap schedule add --name N` and `gpusnap restore N` find it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gpusnap.system import proc
from gpusnap.errors import ProcessNotFound, UsageError


# The namespace's init. Run with `python3 -I -S` so that it maps no gpusnap file: a snapshot
# then depends only on the system's Python, not on this checkout or its virtualenv.
INIT = r"""
import os, signal, sys
exit_file, cmd = sys.argv[2], sys.argv[3:]  # argv[1] is the "gpusnap run init" tag
os.setsid()  # a session of its own, led inside the namespace (CRIU recreates it)
child = os.fork()
if child == 0:
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        sys.stderr.write(f"gpusnap run: cannot start {cmd[0]}: {e}\n")
        os._exit(127)
def forward(sig, frame):
    try:
        os.kill(child, sig)
    except ProcessLookupError:
        pass
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(s, forward)
code = 0
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        break
    except InterruptedError:
        continue
    if pid == child:
        code = os.waitstatus_to_exitcode(status)
        code = 128 - code if code < 0 else code
with open(exit_file, "a") as f:
    f.write(f"{code}\n")
sys.exit(code)
"""


@dataclass
class Job:
    name: str
    pid: int          # the namespace's init, as this machine sees it
    dir: str
    cmd: list[str]
    cwd: str
    started: float

    @property
    def stdout(self) -> Path:
        return Path(self.dir) / "stdout.log"

    @property
    def stderr(self) -> Path:
        return Path(self.dir) / "stderr.log"

    def to_dict(self) -> dict:
        return dict(asdict(self), stdout=str(self.stdout), stderr=str(self.stderr))


def jobs_dir(repo: Path) -> Path:
    return Path(repo) / "jobs"


def _system_python() -> str:
    for p in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(p, os.X_OK):
            return p
    return sys.executable


def _load(path: Path) -> Job | None:
    try:
        d = json.loads(path.read_text())
        return Job(name=d["name"], pid=int(d["pid"]), dir=d["dir"], cmd=list(d["cmd"]), cwd=d["cwd"],
                   started=float(d["started"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _running(job: Job) -> bool:
    """The recorded init still runs (and is ours: same command line, not a recycled PID)."""
    return proc.exists(job.pid) and "gpusnap run init" in proc.cmdline(job.pid)


def start(cmd: list[str], repo: Path, name: str | None = None, cwd: str | None = None) -> Job:
    if not cmd:
        raise UsageError("nothing to run", hint="gpusnap run [--name N] -- CMD [ARGS...]")
    unshare = shutil.which("unshare") or ("/usr/bin/unshare" if os.access("/usr/bin/unshare", os.X_OK) else None)
    if not unshare:
        raise UsageError("`unshare` (util-linux) is needed to start a job in its own PID namespace",
                         hint="apt-get install util-linux")
    from gpusnap.ops import validate

    name = validate.check_name(name or validate.default_name(os.path.basename(cmd[0])), "job name")
    from gpusnap.repo.repository import Repository

    Repository.open(repo, create=True)  # the job directory lives in the repository it is dumped to
    d = jobs_dir(repo) / name
    old = _load(d / "job.json")
    if old and _running(old):
        raise UsageError(f"a job named {name!r} is already running (PID {old.pid})",
                         hint="pick another --name, or stop that job first")
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    cwd = cwd or os.getcwd()
    stdout = open(d / "stdout.log", "ab")
    stderr = open(d / "stderr.log", "ab")
    try:
        # --fork: unshare's child is PID 1 of the new namespace (our init); unshare waits for it
        launcher = subprocess.Popen(
            [unshare, "--pid", "--fork", _system_python(), "-I", "-S", "-c", INIT, "gpusnap run init",
             str(d / "exit"), *cmd],
            stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, cwd=cwd, start_new_session=True)
    except OSError as e:
        raise UsageError(f"cannot start {cmd[0]}: {e}") from None
    finally:
        stdout.close()
        stderr.close()
    deadline = time.monotonic() + 30
    while not (kids := proc.children(launcher.pid)):
        if launcher.poll() is not None:
            raise UsageError(f"the job could not start in a PID namespace of its own (unshare exited "
                             f"{launcher.returncode}); see {d / 'stderr.log'}")
        if time.monotonic() > deadline:
            raise UsageError("the job's init did not appear within 30 s")
        time.sleep(0.01)
    job = Job(name=name, pid=kids[0], dir=str(d), cmd=list(cmd), cwd=cwd, started=time.time())
    tmp = d / "job.json.tmp"
    tmp.write_text(json.dumps(asdict(job), indent=1) + "\n")
    os.replace(tmp, d / "job.json")
    return job


def find(name: str, repo: Path) -> Job:
    """The running job started as `gpusnap run --name NAME` with this repository."""
    job = _load(jobs_dir(repo) / name / "job.json")
    if job is None:
        raise ProcessNotFound(f"no job named {name!r} was started with `gpusnap run` (looked in "
                              f"{jobs_dir(repo) / name})", hint="give the PID, or --match PATTERN")
    if not _running(job):
        raise ProcessNotFound(f"job {name!r} (PID {job.pid}) is not running any more",
                              hint=f"its output is in {job.dir}; `gpusnap restore {name}` brings back "
                                   "its last snapshot")
    return job


def list_jobs(repo: Path) -> list[tuple[Job, bool]]:
    out = []
    d = jobs_dir(repo)
    if d.is_dir():
        for p in sorted(d.iterdir()):
            job = _load(p / "job.json")
            if job:
                out.append((job, _running(job)))
    return out
