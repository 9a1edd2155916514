"""The three ways CRIU gets a snapshot's images on restore, and running `criu restore` itself.

stream: `criu restore --stream`, fed by the serve streamer; files: image files written into a
private directory for a plain `criu restore -D` (gpusnap/repo/materialize.py); lazy: those
files less the lazy pages, `criu restore --lazy-pages`, and the lazy pages filled in while the
job already runs (gpusnap/criu/lazypages.py). gpusnap/ops/restore.py checks everything
first and decides (a RestorePlan); each path here runs that plan and returns what it did
(the restored root PID, its phases), or raises with nothing running. After CRIU, the CUDA plugin's report is read: CRIU ignores a failed GPU restore.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from gpusnap.criu import config as criu_config
from gpusnap.criu import runner
from gpusnap.ops import restore_interrupt
from gpusnap.system.faults import fault
from gpusnap.criu.streamer import ServeServer
from gpusnap.errors import CriuFailed, GpuRestoreFailed, GpusnapError, PidsInUse
from gpusnap.repo import logs as repo_logs, parallel_read
from gpusnap.repo.format import names as image_names
from gpusnap.system import paths, proc, tmpdirs
from gpusnap.system.access import read_only_reason
from gpusnap import settings


@dataclass(frozen=True)
class RestorePlan:
    """One restore, decided before CRIU starts (gpusnap/ops/restore.py makes it; each path
    here runs it): what (the snapshot, its repository, this CRIU), where (the PIDs it
    recreates, or a PID namespace of its own), and how (the path, CRIU's flags and
    environment, the zero runs left out, the terminal to hand over)."""
    repository: Any
    snap: Any
    criu: Any                       # runner.criu_info()
    env: Mapping[str, str]
    flags: tuple[str, ...]
    pids: tuple[int, ...]           # as recorded: the original's, when own_pidns
    own_pidns: bool
    via: str                        # stream, files or lazy
    via_asked: str                  # what the user asked for (auto may fall back to files)
    sparse: Any = None              # criu/sparse.py's plan, or None
    tty: int | None = None          # our terminal's fd, to be the job's
    t0: float = 0.0
    notes: tuple[str, ...] = ()     # for the result, decided with the plan (a namespace made again)

    @property
    def race_pids(self) -> list[int] | None:
        """PIDs a failed CRIU may have lost a race for (none in a PID namespace of its own)."""
        return None if self.own_pidns else list(self.pids)

    @property
    def total(self) -> int:
        return int(self.snap.manifest.get("stats", {}).get("bytes_raw", 0))


@dataclass
class PathOutcome:
    """What a path did: the restored root PID (None: CRIU wrote no PID file), where image
    files were written, wall seconds per phase, and for lazy: until the tree ran, the fill."""
    pid: int | None
    where: str | None = None
    phases: dict[str, float] = field(default_factory=dict)
    running: float | None = None
    lazy: dict | None = None


# what CRIU's log says when it could not have a PID (criu/cr-restore.c)
PID_RACE = ("do not match expected", "Can't fork for")


def _pids_taken_meanwhile(pids: list[int], kept, lines: list[str]) -> None:
    """CRIU lost a race for the snapshot's PIDs (another restore of the same job started at
    the same moment): that is PidsInUse, not a CRIU failure. Only when CRIU's log says so:
    after any other failure, the processes CRIU had begun to restore (and killed) may still
    hold those PIDs for a moment, as zombies not yet reaped."""
    if not any(needle in ln for ln in lines for needle in PID_RACE):
        return
    busy = [p for p in pids if proc.read_stat(p) is not None]
    if busy:
        raise PidsInUse(f"PID(s) needed by the snapshot were taken while it was restoring: "
                        f"{', '.join(map(str, busy[:5]))} (another restore of the same job?)",
                        hint=f"the job is probably running again already; check it (CRIU log kept at {kept})")


def _gpu_report_env(workdir: Path) -> dict[str, str]:
    from gpusnap.gpu import limits

    return {"GPUSNAP_CUDA_REPORT": str(workdir / "cuda-report"),
            "GPUSNAP_CALL_TIMEOUT_MS": str(limits.call_timeout_ms())}


def check_gpu_restore(workdir: Path, snap, root: int | None, pids: list[int], log: str | None,
                      same_pids: bool = True) -> None:
    """CRIU ignores a failed GPU restore (RESUME_DEVICES_LATE): read the plugin's report, and
    when a CUDA process was not brought back to RUNNING kill the restored tree (it would
    hang on its next CUDA call) and raise GpuRestoreFailed. `same_pids`: the restored tree
    has the snapshot's PIDs (not so in a PID namespace of its own: then only counted)."""
    from gpusnap.gpu import report

    expected = [int(p) for p in snap.manifest.get("meta", {}).get("cuda_pids") or [] if str(p).isdigit()]
    problems = report.restore_failures(report.read(workdir / "cuda-report"), expected, same_pids=same_pids)
    if not problems:
        return
    tree = list(dict.fromkeys([root, *proc.tree(root), *pids])) if root and proc.exists(root) else list(pids)
    killed = []
    for pid in tree:
        try:
            os.kill(pid, 9)
            killed.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait_gone(killed, 10)
    raise GpuRestoreFailed(
        "CRIU restored the job but its GPU state could not be brought back: " + "; ".join(problems)
        + f"; the half-restored job was killed (PIDs {', '.join(map(str, killed)) or 'none left'}), nothing runs",
        hint="see the CUDA plugin's lines in " + (log or "the CRIU log")
             + "; the snapshot itself is unchanged: fix the cause (driver, GPU, --gpu-map) and restore again")



def _criu_restore(plan: RestorePlan, images: Path, workdir: Path, server, progress: Callable | None,
                  lazy=None) -> int | None:
    """Run `criu restore` on an images directory (with a serve streamer when `server`; with
    --lazy-pages, served by the criu/lazypages.py daemon `lazy`, when given); the restored
    root PID, or CriuFailed / the streamer's error. `tty`: our controlling terminal's fd, to
    be the job's terminal (ops/restore_terminal.py)."""
    repository, snap, info, flags, tty, total = plan.repository, plan.snap, plan.criu, list(plan.flags), plan.tty, plan.total
    pids = plan.race_pids
    log = workdir / "criu.log"
    pidfile = workdir / "restored.pid"
    stream = ["--stream"] if server is not None else []
    env = {**plan.env, **_gpu_report_env(workdir)}   # the CUDA plugin's report, read below
    if lazy is not None:
        stream = ["--lazy-pages"]
    # Its own session, so a Ctrl-C meant for gpusnap never reaches it; with a terminal to give
    # the job, our session (CRIU hands the job its stdin and that terminal's foreground) but a
    # process group of its own, with SIGTTOU ignored (inherited through exec) so that it may
    # set the terminal from the background.
    where = {"start_new_session": True} if tty is None else {"process_group": 0}
    old_ttou = signal.signal(signal.SIGTTOU, signal.SIG_IGN) if tty is not None else None
    try:
        criu = subprocess.Popen(
            criu_config.argv(info.path, "restore", "-D", str(images), *stream, "--restore-detached",
             "--pidfile", str(pidfile), "--libdir", str(paths.plugin_dir()), "-o", str(log), "-v4", *flags),
            stdin=subprocess.DEVNULL if tty is None else tty, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, env=criu_config.environ(env), pass_fds=inherited_fds(flags), **where)
    finally:
        if old_ttou is not None:
            signal.signal(signal.SIGTTOU, old_ttou)
    # from here a signal is held, and cuts the image stream at once (restore_interrupt.py)
    restore_interrupt.criu_started(cut=server.cut if server is not None else None)
    fault("restore:criu-started")
    if lazy is not None:
        lazy.criu_started(criu.pid)
    if server is not None:
        runner.supervise(criu, server, progress, total, stop=restore_interrupt.stop_requested)
    else:
        try:
            criu.wait()
        except BaseException:
            criu.wait()      # interrupted: let CRIU finish before its images directory goes
            raise
    cut = server is not None and restore_interrupt.stop_requested()     # the stream was cut for a signal
    ok = criu.returncode == 0 and (server is None or not server.failed or cut)
    if ok:   # --restore-detached: CRIU exits 0 once the restored tree runs
        restore_interrupt.job_running()
        fault("restore:criu-exited")
    else:
        _failed(plan, criu.returncode, log, server, lazy, cut)
    if server is not None:
        if cut:
            server.abort()     # the job runs; what the cut stream recorded is no error of the restore
        else:
            server.finish(timeout=30)
    # a read-only repository keeps no log of a restore that worked (a copy in $TMPDIR would stay)
    kept = None if read_only_reason(repository.path) else \
        repo_logs.keep_log(repository.path, log, f"{Path(snap.path).name}-restore")
    try:
        pid = int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pid = None
    check_gpu_restore(workdir, snap, pid, list(pids or []), kept, same_pids=pids is not None)
    return pid


def _failed(plan: RestorePlan, rc: int, log: Path, server, lazy, cut: bool):
    """CRIU failed (or its stream was cut for a signal): stop the feeders, keep the log, and
    raise the most useful error (the streamer's, PIDs lost to a race, CRIU's own, explained)."""
    if server is not None:
        server.abort()
    if lazy is not None:
        lazy.abort()
    kept = repo_logs.keep_log(plan.repository.path, log, f"failed-restore-{Path(plan.snap.path).name}-"
                                                     f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}")
    if cut:
        raise restore_interrupt.interrupted_error(kept)
    err = server.error() if server is not None else None
    if isinstance(err, GpusnapError):
        err.hint = (err.hint + " " if err.hint else "") + f"(CRIU log kept at {kept})"
        raise err
    lines = runner.log_errors(log)
    if plan.race_pids:
        _pids_taken_meanwhile(plan.race_pids, kept, lines)
    hint = runner.explain_restore(lines)
    peers = [p for p in plan.snap.manifest.get("meta", {}).get("unix_peers") or [] if isinstance(p, str)]
    if peers and any("unix: Can't connect" in ln for ln in lines):
        hint += f" (the job's daemon socket{'s' if len(peers) > 1 else ''}: {', '.join(peers[:5])})"
    raise CriuFailed(f"criu restore failed (exit status {rc})", log_path=kept, last_lines=lines, hint=hint)


def inherited_fds(flags: list[str]) -> list[int]:
    """The descriptors `--inherit-fd fd[N]:KEY` flags hand to CRIU (a fork's own files)."""
    return [int(f.split("]")[0][3:]) for i, f in enumerate(flags) if i and flags[i - 1] == "--inherit-fd"]


WORK_PREFIX = tmpdirs.RESTORE


def _workdir(repo_path) -> Path:
    """A private directory for CRIU's side of one restore (its pidfile, sockets). What a
    SIGKILLed gpusnap left (these, image files, dumps' work directories) is removed first."""
    tmpdirs.sweep(repo_path)
    return tmpdirs.make(WORK_PREFIX)


def restore_threads(stream: bool) -> int:
    """Decoding workers: $GPUSNAP_RESTORE_THREADS, else the cores (up to 8), one fewer for the
    stream path, where CRIU reads at the same time."""
    env = settings.get("GPUSNAP_RESTORE_THREADS", "")
    if env.isdigit() and 0 < int(env) <= 64:
        return int(env)
    cores = proc.usable_cores()
    return max(1, min(8, cores - 1 if stream else cores))


def via_stream(plan: RestorePlan, progress: Callable | None) -> PathOutcome:
    snap, sp, total = plan.snap, plan.sparse, plan.total
    workdir = _workdir(plan.repository.path)
    threads = restore_threads(stream=True)

    def source(name: str):
        if not snap.has_image(name):
            return None
        if sp is not None and name in sp.pagemaps:
            return (b for b in (sp.pagemaps[name],))
        drop = sp.drop.get(name) if sp is not None else None
        if threads > 1 and parallel_read.parallel_ok(snap, name):
            return parallel_read.iter_image_parallel(snap, name, threads, drop)
        return snap.read_image(name, drop)

    server = ServeServer(workdir, source, image_names).start()
    t = time.monotonic()
    try:
        pid = _criu_restore(plan, workdir, workdir, server, progress)
        if progress:
            progress(total, total)
    finally:
        server.abort()
        shutil.rmtree(workdir, ignore_errors=True)
    return PathOutcome(pid, phases={"criu": round(time.monotonic() - t, 3)})


def via_files(plan: RestorePlan, progress: Callable | None) -> PathOutcome:
    from gpusnap.repo import materialize

    out = PathOutcome(None)
    with materialize.images_dir(plan.snap, plan.repository.path) as (images, where):
        restore_interrupt.reinstall()     # its directory is removed on every exit all the same
        t = time.monotonic()
        materialize.write_images(plan.snap, images, threads=max(2, restore_threads(stream=False)),
                                 progress=progress, total=plan.total, sparse=plan.sparse)
        out.phases["materialize"] = round(time.monotonic() - t, 3)
        fault("restore:images-written")
        t = time.monotonic()
        workdir = _workdir(plan.repository.path)
        try:
            out.pid = _criu_restore(plan, images, workdir, None, None)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        out.phases["criu"] = round(time.monotonic() - t, 3)
    if progress:
        progress(plan.total, plan.total)
    out.where = where.where
    return out


def via_lazy(plan: RestorePlan, progress: Callable | None) -> PathOutcome:
    """Image files without the lazy pages, `criu restore --lazy-pages` on them, and the lazy
    pages filled in by criu/lazypages.py while the job already runs; returns once every page
    is in place, with the seconds until the tree ran and what the fill saw."""
    from gpusnap.criu import lazypages, lazyplan
    from gpusnap.repo import materialize

    snap, sp = plan.snap, plan.sparse
    lp = lazyplan.plan(snap, sp)
    out = PathOutcome(None)
    with materialize.images_dir(snap, plan.repository.path) as (images, where):
        restore_interrupt.reinstall()     # its directory is removed on every exit all the same
        t = time.monotonic()
        materialize.write_images(snap, images, threads=max(2, restore_threads(stream=False)),
                                 progress=progress, total=plan.total, sparse=sp, holes=lp.holes)
        out.phases["materialize"] = round(time.monotonic() - t, 3)
        fault("restore:images-written")
        workdir = _workdir(plan.repository.path)
        daemon = lazypages.LazyDaemon(snap, lp, images, workdir / "restored.pid", restore_threads(stream=False),
                                      drop=sp.drop if sp is not None else None)
        # From here until the last page is in, a signal must not end gpusnap: the job would
        # be killed (by the watcher) for nothing. It is noted, and the fill finishes.
        caught: list[int] = []
        held = restore_interrupt.active() is not None    # the restore's guard holds them (and says so)
        if held:
            restore_interrupt.criu_started()
        with contextlib.nullcontext() if held else _signals_deferred(caught):
            try:
                daemon.start()
                t = time.monotonic()
                out.pid = _criu_restore(plan, images, workdir, None, None, lazy=daemon)
                out.phases["criu"] = round(time.monotonic() - t, 3)
                out.running = round(time.monotonic() - plan.t0, 3)
                t = time.monotonic()
                daemon.wait(progress)
                out.phases["fill"] = round(time.monotonic() - t, 3)
            except BaseException:
                daemon.abort()
                raise
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
    if progress:
        progress(plan.total, plan.total)
    out.where = where.where
    out.lazy = {"bytes": lp.bytes, **daemon.events}
    deferred = len(caught) or (len(restore_interrupt.active().caught) if held else 0)
    if deferred:
        out.lazy["signals_deferred"] = deferred
    return out


PATHS = {"stream": via_stream, "files": via_files, "lazy": via_lazy}


@contextmanager
def _signals_deferred(caught: list):
    """SIGINT, SIGTERM and SIGHUP recorded in `caught` instead of acted on (main thread only)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, lambda n, f: caught.append(n)) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
