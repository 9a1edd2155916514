"""Taking a snapshot: preflight, CRIU through the image streamer into the repository, commit.

The job is protected first: CRIU runs in its own session (a Ctrl-C meant for gpusnap never
reaches it), and an interrupted or failed dump is unwound by breaking the image stream, so
CRIU fails cleanly, removes its parasite and resumes the tree; the CUDA plugin unlocks and
restores any GPU process on that path. Nothing becomes visible in the repository before the
snapshot's atomic commit.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from gpusnap import paths, proc
from gpusnap.criu import runner
from gpusnap.criu.gate import PostDumpGate
from gpusnap.criu.streamer import CaptureServer
from gpusnap.errors import CriuFailed, GpuCheckpointFailed, GpusnapError, Interrupted, NoSpace, NotDumpable, UsageError

# Below this much free space a dump is refused outright; running out later is caught too.
MIN_FREE_BYTES = 64 << 20
COMPRESSORS = ("auto", "lz4", "zstd", "none")
NAME_RX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

Progress = Callable[[int, int], None]  # (bytes streamed so far, estimated total)


@dataclass
class DumpRequest:
    pid: int
    repo: Path
    name: str | None = None
    leave_running: bool = True
    compress: str = "auto"
    lock_timeout_ms: int | None = None
    tcp_established: bool = False
    keep_last: int | None = None  # retention for this name, applied right after the commit


@dataclass
class DumpResult:
    snapshot: str
    id: str
    name: str
    pid: int
    pages_total: int
    pages_zero: int
    pages_dedup: int
    bytes_raw: int
    bytes_stored: int
    seconds: float
    job_running: bool
    cuda_pids: list[int] = field(default_factory=list)
    log: str | None = None
    pruned: list[str] = field(default_factory=list)
    prune_error: str | None = None
    prune_warnings: list[str] = field(default_factory=list)
    # wall seconds per phase: preflight, criu (CRIU running, pages streaming in), drain (the
    # page pipeline and pack writes finishing after CRIU exits), commit (index, manifest,
    # fsyncs, rename), retention
    phases: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def default_name(pid: int) -> str:
    st = proc.read_stat(pid)
    comm = re.sub(r"[^A-Za-z0-9._-]", "-", st.comm if st else "job").strip("-.") or "job"
    return comm[:40]


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RX.fullmatch(name):  # whole: no trailing newline
        raise UsageError(f"snapshot name {name!r} is not allowed",
                         hint="use letters, digits, '.', '_' and '-' (up to 64, starting with a letter or digit)")
    return name


PF_KTHREAD = 0x00200000


def _refuse_kernel_thread(pid: int) -> None:
    """A kernel thread (kthreadd, PID 2, and its children) has no memory of its own to dump."""
    try:
        st = Path(f"/proc/{pid}/stat").read_text()
        flags = int(st[st.rindex(")") + 2:].split()[6])
    except (OSError, ValueError, IndexError):
        return
    if flags & PF_KTHREAD:
        raise NotDumpable(f"PID {pid} is a kernel thread; there is no process to snapshot",
                          hint="give the PID of a user-space process (see `ps -ef`; kernel threads are in [brackets])")


def _free_bytes(path: Path) -> int:
    p = path
    while not p.exists():
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def _gpu_facts(pids: list[int]) -> dict | None:
    """The GPU section of the manifest (machine GPUs, which process uses which), recorded
    before CRIU runs: a checkpointed process has released its device files. CPU-only trees
    skip the driver probe entirely."""
    try:
        from gpusnap.gpu import procs as gpu_procs

        if not any(gpu_procs.scan_process(pid) for pid in pids):
            return None
        return gpu_procs.gpu_manifest(pids)
    except Exception:  # noqa: BLE001 - GPU facts are informative; a dump must not fail on them
        return None


def _read_cuda_report(path: Path) -> list[int]:
    pids: list[int] = []
    try:
        for line in path.read_text().splitlines():
            m = re.search(r"\bpid=(\d+)", line)
            if line.startswith("dump") and m:
                pids.append(int(m.group(1)))
    except OSError:
        pass
    return sorted(set(pids))


def _plugin_failure(log: Path) -> list[str]:
    try:
        return [ln.strip() for ln in log.read_text(errors="replace").splitlines()
                if "gpusnap_cuda" in ln and "Error" in ln]
    except OSError:
        return []



def _criu_args(req: DumpRequest, workdir: Path, log: Path, shell_job: bool) -> list[str]:
    args = ["dump", "-t", str(req.pid), "-D", str(workdir), "--stream",
            "--libdir", str(paths.plugin_dir()), "-o", str(log), "-v4"]
    # --exit: leave the tree stopped and kill it only once the snapshot is committed, so a
    # failure while storing can still hand the job back.
    args.append("--leave-running" if req.leave_running else "--leave-stopped")
    if shell_job:
        args.append("--shell-job")
    if req.tcp_established:
        args.append("--tcp-established")
    return args


def _criu_env(req: DumpRequest, workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["GPUSNAP_LEAVE_RUNNING"] = "1" if req.leave_running else "0"
    env["GPUSNAP_CUDA_REPORT"] = str(workdir / "cuda-report")
    if req.lock_timeout_ms:
        env["GPUSNAP_LOCK_TIMEOUT_MS"] = str(req.lock_timeout_ms)
    return env


def _failure(stream_err: GpusnapError | None, rc: int | None, log: Path, kept: str | None) -> GpusnapError:
    """The most useful error for a failed dump: the disk, the GPU, the stream, or CRIU itself."""
    where = f" (CRIU log kept at {kept})" if kept else ""
    if isinstance(stream_err, NoSpace):
        return stream_err
    gpu_lines = _plugin_failure(log)
    if gpu_lines:
        return GpuCheckpointFailed(
            "the CUDA plugin could not checkpoint a GPU process; the job was left running and unlocked",
            hint=gpu_lines[-1] + where)
    if stream_err is not None:
        stream_err.hint = (stream_err.hint + " " if stream_err.hint else "") + where.strip()
        return stream_err
    lines = runner.log_errors(log)
    return CriuFailed(f"criu dump failed (exit status {rc}); the job was left running",
                      log_path=kept, last_lines=lines, hint=runner.explain(lines))


def _retain(repo, name: str, keep_last: int) -> tuple[list[str], list[str]]:
    """Keep the newest `keep_last` snapshots of `name` (the caller holds the writer lock).
    Returns (snapshot ids deleted, warnings: entries of snapshots/ that could not be read and
    were skipped, data kept because of them). Raises on failure."""
    from gpusnap.repo import prune as prune_mod

    plan = prune_mod.plan_prune(repo.snapshots(), keep_last=keep_last, name=name)
    warnings = [f"unreadable entry skipped: {w}" for w in repo.broken_snapshots().values()]
    if plan.delete:
        with repo.readers_lock(exclusive=True):
            res = prune_mod.execute_prune(repo, plan, dry_run=False)
        if res.get("data_kept"):
            warnings.append(res["data_kept"])
    return list(plan.delete), warnings


def retention_error(result: "DumpResult") -> GpusnapError | None:
    """The error a dump whose retention failed ends with (its snapshot stays committed)."""
    from gpusnap.errors import RetentionFailed

    if result.prune_error is None:
        return None
    return RetentionFailed(
        f"snapshot {result.snapshot} is committed, but --keep-last retention failed: {result.prune_error}",
        hint="older snapshots of this name were not pruned; run `gpusnap verify`, fix what it names, "
             "then `gpusnap prune --keep-last N --name NAME`")


def _kill_tree(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _resume_tree(pids: list[int], cuda_pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    if cuda_pids:
        try:
            from gpusnap.gpu import driver as gpu_driver
            for pid in cuda_pids:
                gpu_driver.resume_process(pid)
        except Exception:  # noqa: BLE001 - best effort; the plugin log tells the rest
            pass


class _Terminate(BaseException):
    """Raised in the main thread by SIGTERM/SIGHUP so a dump unwinds like on Ctrl-C."""


def _on_term(signum, frame):  # noqa: ARG001
    raise _Terminate()


def dump(req: DumpRequest, progress: Progress | None = None) -> DumpResult:
    """Snapshot the process tree rooted at req.pid into the repository at req.repo."""
    from gpusnap.repo.repository import Repository

    t0 = time.monotonic()
    if req.compress not in COMPRESSORS:
        raise UsageError(f"--compress must be one of {', '.join(COMPRESSORS)}, not {req.compress!r}")
    if req.name:
        check_name(req.name)
    runner.require_privileges("dump")
    runner.criu_info()
    proc.require_process(req.pid)
    _refuse_kernel_thread(req.pid)
    name = req.name or default_name(req.pid)
    pids = proc.tree(req.pid)
    estimate = proc.rss_bytes(pids)
    outside = [p for p in pids if proc.session_outside_namespace(p)]
    if outside:
        raise NotDumpable(
            f"the session leader of PID {outside[0]} is outside its PID namespace, "
            "so CRIU could not recreate its session on restore",
            hint="start the job in a session of its own (`setsid CMD`, or start_new_session=True "
                 "in Python); the job was not touched")
    shell_job = proc.needs_shell_job(pids)
    if _free_bytes(req.repo) < MIN_FREE_BYTES:
        raise NoSpace(f"less than {MIN_FREE_BYTES >> 20} MiB free where the repository lives ({req.repo})",
                      hint="free some space or run `gpusnap prune`, then dump again")

    repo = Repository.open(req.repo, create=True)
    restore_flags = ["--shell-job"] if shell_job else []
    if req.tcp_established:
        restore_flags.append("--tcp-established")
    meta = {
        "pid": req.pid,
        "pids": pids,
        # every thread id too, so restore can check they are free without decoding images
        "tids": sorted({t for p in pids for t in proc.threads(p)}),
        "cmdline": proc.cmdline(req.pid),
        "hostname": os.uname().nodename,
        "kernel": os.uname().release,
        "criu_version": runner.criu_info().version_str,
        "restore_flags": restore_flags,
        "leave_running": req.leave_running,
        "compress": req.compress,
    }
    gpu = _gpu_facts(pids)
    if gpu:
        meta["gpu"] = gpu

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    phases: dict[str, float] = {}
    mark = [t0]

    def phase(name: str) -> None:
        now = time.monotonic()
        phases[name] = round(now - mark[0], 3)
        mark[0] = now

    with repo.writer_lock():
        writer = repo.new_snapshot(name, compress=req.compress, meta=meta)
        workdir = Path(tempfile.mkdtemp(prefix="gpusnap-dump-"))
        log = workdir / "criu.log"
        server: CaptureServer | None = None
        gate: PostDumpGate | None = None
        criu: subprocess.Popen | None = None
        stopped = False  # --exit: CRIU left the tree SIGSTOPped for us to kill after the commit
        old_handlers = {s: signal.signal(s, _on_term) for s in (signal.SIGTERM, signal.SIGHUP)}
        snap = None
        try:
            server = CaptureServer(workdir, writer.image_sink).start()
            gate = PostDumpGate(workdir, server)
            phase("preflight")
            criu = subprocess.Popen(
                [runner.criu_info().path, *_criu_args(req, workdir, log, shell_job),
                 "--action-script", str(gate.script)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env=_criu_env(req, workdir), start_new_session=True)
            runner.supervise(criu, server, progress, estimate)
            phase("criu")
            if criu.returncode != 0 or server.failed:
                server.abort()
                raise _failure(server.error(), criu.returncode, log,
                               runner.keep_log(repo.path, log, f"failed-dump-{name}-{stamp}-{os.getpid()}"))
            stopped = not req.leave_running
            server.finish(timeout=30)
            if progress:
                progress(server.bytes, max(estimate, server.bytes))
            phase("drain")
            cuda_pids = _read_cuda_report(workdir / "cuda-report")
            snap = writer.commit(extra_meta={"cuda_pids": cuda_pids, "dump_seconds": time.monotonic() - t0})
            kept = runner.keep_log(repo.path, log, f"{Path(snap.path).name}-dump")
            phase("commit")
            if stopped:
                _kill_tree(pids)
                stopped = False
            pruned: list[str] = []
            prune_error = None
            prune_warnings: list[str] = []
            if req.keep_last:
                try:
                    pruned, prune_warnings = _retain(repo, snap.name, req.keep_last)
                except GpusnapError as e:  # the snapshot is safe: say so, and exit non-zero (cli)
                    prune_error = e.message
                except OSError as e:
                    prune_error = f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
                phase("retention")
        except (KeyboardInterrupt, _Terminate):
            if server is not None:
                server.abort()
            if criu is not None:
                criu.wait()  # CRIU unwinds on the broken stream; never kill it mid-parasite
            raise Interrupted("dump interrupted; the job was left running and no snapshot was kept") from None
        finally:
            for s, h in old_handlers.items():
                signal.signal(s, h)
            if snap is None:
                writer.abort()
            if stopped:  # CRIU succeeded but storing failed: give the job back
                _resume_tree(pids, _read_cuda_report(workdir / "cuda-report"))
            if gate is not None:
                gate.close()
            if server is not None:
                server.abort()
            shutil.rmtree(workdir, ignore_errors=True)

    stats = writer.stats
    return DumpResult(
        snapshot=str(snap.path), id=snap.id, name=snap.name, pid=req.pid,
        pages_total=stats["pages_total"], pages_zero=stats["pages_zero"], pages_dedup=stats["pages_dedup"],
        bytes_raw=stats["bytes_raw"], bytes_stored=stats["bytes_stored"],
        seconds=round(time.monotonic() - t0, 3), job_running=req.leave_running and proc.exists(req.pid),
        cuda_pids=cuda_pids, log=kept, pruned=pruned, prune_error=prune_error,
        prune_warnings=prune_warnings, phases=phases)
