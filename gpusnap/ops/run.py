"""`gpusnap run [--name N] -- CMD ...`: start a job the way that snapshots best.

The job gets a PID namespace, an IPC namespace and a session of its own: a minimal init (PID
1 of the new namespace) starts CMD, forwards signals to it, reaps orphans and exits with
CMD's status. CRIU then dumps the whole namespace from its init, and a restore recreates it,
so a snapshot restores beside a still-running original (a fork) and its PIDs never clash with
processes in use. The IPC namespace holds the job's SysV shared memory, semaphores and
message queues: CRIU dumps it with the tree and recreates it, which it cannot do for the
host's (gpusnap/system/sysvipc.py); the price is that the job cannot reach SysV objects of
programs outside it. stdin is /dev/null and stdout/stderr go to files in the job directory
REPO/jobs/N/ (not a terminal, so no --shell-job). job.json there records the name, so
`gpusnap dump --name N`, `gpusnap schedule add --name N` and `gpusnap restore N` find it
(gpusnap/ops/identity.py: the name follows the job through restores). The init shows as
`gpusnap-init N` in ps.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

from gpusnap.ops import identity
from gpusnap.ops.identity import Job, jobs_dir  # noqa: F401 - callers use run_op.Job, run_op.jobs_dir
from gpusnap.errors import NotRoot, UsageError
from gpusnap.repo import fsutil


# The namespace's init. Run with `python3 -I -S` so that it maps no gpusnap file: a snapshot
# then depends only on the system's Python, not on this checkout or its virtualenv. It gets
# the job's files as descriptors (argv: name, ready fd, exit fd, stdout fd, stderr fd, CMD...): its own
# stdio is /dev/null, so nothing of its own (nor of unshare's) lands in the job's stderr.log,
# and a fork restored from a snapshot gets files of its own through CRIU's --inherit-fd.
INIT = r"""
import os, signal, sys
name, ready_fd, exit_fd, out_fd, err_fd = sys.argv[1], *map(int, sys.argv[2:6])
cmd = sys.argv[6:]
with open("/proc/self/stat", "rb") as f:   # /proc is the machine's: its PIDs, not the namespace's
    stat = f.read()
rest = stat.rsplit(b")", 1)[1].split()
def title(text):
    # one short line in ps, pgrep -f and inspect instead of this script: a rewritten argument
    # area whose last byte is not NUL is read up to its first NUL (the kernel's setproctitle rule)
    try:
        start, end = int(rest[45]), int(rest[46])   # arg_start, arg_end
        raw = text.encode()[:end - start - 2] + b"\0"
        mem = os.open("/proc/self/mem", os.O_RDWR)
        try:
            os.pwrite(mem, raw + b" " * (end - start - len(raw)), start)
        finally:
            os.close(mem)
        with open("/proc/self/comm", "w") as f:
            f.write("gpusnap-init")
    except (OSError, ValueError, IndexError):
        pass
null = os.open("/dev/null", os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
os.close(null)
title("gpusnap-init " + name)
os.write(ready_fd, stat.split(b" ", 1)[0] + b" " + rest[19] + b"\n")   # PID and start time, for job.json
os.close(ready_fd)
os.setsid()  # a session of its own, led inside the namespace (CRIU recreates it)
child = os.fork()
if child == 0:
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    for fd in (exit_fd, out_fd, err_fd):
        os.close(fd)
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        sys.stderr.write(f"gpusnap run: cannot start {cmd[0]}: {e}\n")
        sys.stderr.flush()
        os._exit(127)
os.close(out_fd)
os.close(err_fd)
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
os.write(exit_fd, f"{code}\n".encode())
sys.exit(code)
"""
# what unshare's command line shows instead of the script (the init takes it out of the
# environment, so the job never sees it)
BOOT = 'import os; exec(os.environ.pop("GPUSNAP_RUN_INIT"))'


def _system_python() -> str:
    for p in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(p, os.X_OK):
            return p
    return sys.executable


def require_root(command: str) -> None:
    """Before anything is made: a job's PID namespace needs root, and so does every dump of it."""
    if os.geteuid() != 0:
        raise NotRoot(f"gpusnap {command} must run as root (the job's PID namespace, and every dump of it, "
                      "need root)", hint=f"run `sudo gpusnap {command} ...`")


def start(cmd: list[str], repo: Path, name: str | None = None, cwd: str | None = None) -> Job:
    if not cmd:
        raise UsageError("nothing to run", hint="gpusnap run [--name N] -- CMD [ARGS...]")
    require_root("run")
    unshare = shutil.which("unshare") or ("/usr/bin/unshare" if os.access("/usr/bin/unshare", os.X_OK) else None)
    if not unshare:
        raise UsageError("`unshare` (util-linux) is needed to start a job in its own PID namespace",
                         hint="apt-get install util-linux")
    from gpusnap.ops import validate

    name = validate.check_name(name or validate.default_name(os.path.basename(cmd[0])), "job name")
    from gpusnap.repo import locate

    # the job directory lives in the repository it is dumped to (made only at the default location)
    locate.open_repository(repo, create_at_default=True)
    d = jobs_dir(repo) / name
    dfd = open_job_dir(repo, name)      # (checked before anything in it is read)
    try:
        old = identity.load(repo, name)
        if old and identity.alive(old):
            raise UsageError(f"a job named {name!r} is already running (PID {old.pid})",
                             hint="pick another --name, or stop that job first")
        files = [os.fdopen(fsutil.open_private_at(dfd, n, os.O_WRONLY | os.O_APPEND, d / n), "ab")
                 for n in ("exit", "stdout.log", "stderr.log")]
    finally:
        os.close(dfd)
    cwd = cwd or os.getcwd()
    ready_r, ready_w = os.pipe()
    fds = [str(ready_w)] + [str(f.fileno()) for f in files]
    try:
        # --fork: unshare's child is PID 1 of the new namespace (our init); unshare waits for it.
        # --ipc: SysV IPC the job makes is then in the snapshot (CRIU dumps a root's own IPC ns).
        # unshare's own stderr is a pipe read only if the start fails (never the job's log).
        launcher = subprocess.Popen(
            [unshare, "--pid", "--ipc", "--fork", _system_python(), "-I", "-S", "-c", BOOT, name, *fds, *cmd],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=cwd,
            env=dict(os.environ, GPUSNAP_RUN_INIT=INIT),
            start_new_session=True, pass_fds=[ready_w, *(f.fileno() for f in files)])
    except OSError as e:
        os.close(ready_r)
        raise UsageError(f"cannot start {cmd[0]}: {e}") from None
    finally:
        os.close(ready_w)
        for f in files:
            f.close()
    try:
        pid, start = _wait_for_init(launcher, ready_r)
    finally:
        os.close(ready_r)
        launcher.stderr.close()
    job = Job(name=name, pid=pid, dir=str(d), cmd=list(cmd), cwd=cwd, started=time.time(), start=start,
              boot=identity.boot_id())
    identity.save(repo, job)
    return job


def open_job_dir(repo: Path, name: str) -> int:
    """The fd of REPO/jobs/NAME: both directories private (0700 whatever the umask), reached
    from the repository's fd without following a link; an existing one that another user could
    write or replace is refused as untrusted (it may hold planted links)."""
    return fsutil.private_dirs(Path(repo), "jobs", name)


def _wait_for_init(launcher: subprocess.Popen, ready: int) -> tuple[int, int]:
    """The init's PID and start time, which it sends once it shows its short title (so ps and
    pgrep see it at once); a job that ends at once has still been recorded."""
    r, _, _ = select.select([ready], [], [], 30)
    line = os.read(ready, 100) if r else b""
    try:
        pid, start = map(int, line.split())
        return pid, start
    except ValueError:
        pass
    if not r:
        raise UsageError("the job's init did not start within 30 s")
    launcher.wait()
    err = launcher.stderr.read().decode(errors="replace").strip()[-300:]
    raise UsageError(f"the job could not start in a PID namespace of its own (unshare exited "
                     f"{launcher.returncode}{': ' + err if err else ''})")


def find(name: str, repo: Path) -> Job:
    """The running job named `name` (`gpusnap run --name`, `dump --name`, or restored under it)."""
    return identity.find(name, repo)


def list_jobs(repo: Path) -> list[tuple[Job, bool]]:
    return identity.list_jobs(repo)
