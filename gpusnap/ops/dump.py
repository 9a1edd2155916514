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
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from gpusnap.system import paths, preflight, proc
from gpusnap.system import appendfiles
from gpusnap.ops import restore_needs, validate
from gpusnap.criu import runner
from gpusnap.criu.gate import PostDumpGate
from gpusnap.criu.streamer import CaptureServer
from gpusnap.errors import CriuFailed, GpuCheckpointFailed, GpusnapError, Interrupted, NoSpace
from gpusnap.repo.pipeline import staging as staging_mod

# Below this much free space a dump is refused outright; running out later is caught too.
MIN_FREE_BYTES = 64 << 20

# (bytes so far, expected total, phase): phase "frozen" while the job stands frozen and CRIU's
# bytes are staged, then "storing" (the job runs again) while the page pipeline stores them
Progress = Callable[[int, int, str], None]
# Stage images entirely before the page pipeline starts (the ingest waits for the gate), unless
# there are cores enough for CRIU, the drain and the pipeline at once; on 2 cores running
# the pipeline during the freeze lengthened it (docs/benchmark.md). GPUSNAP_INGEST_OVERLAP=0/1.
OVERLAP_MIN_CPUS = 4


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
    staging_budget: int | None = None  # bytes of memory staging may use (None: staging.default_budget())


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
    # how long the job stood frozen: CRIU's own figure (its stats-dump: from the end of the
    # freeze to the resume), or, when CRIU wrote none, from CRIU's start to the gate opening
    frozen_seconds: float | None = None
    cuda_pids: list[int] = field(default_factory=list)
    log: str | None = None
    pruned: list[str] = field(default_factory=list)
    prune_error: str | None = None
    prune_warnings: list[str] = field(default_factory=list)
    # wall seconds per phase: preflight, staging (the staging memory faulted in), criu (CRIU
    # running: the freeze, pages streaming into staging), storing (the page pipeline and pack
    # writes finishing after CRIU exits), commit (index, manifest, fsyncs, rename), retention
    phases: dict[str, float] = field(default_factory=dict)
    criu_options: list[str] = field(default_factory=list)  # what the preflight chose (--file-locks, ...)
    # budget, arena_bytes, staged_bytes, memory_peak, spilled_bytes, spill_peak, overlap
    staging: dict = field(default_factory=dict)
    peak_rss_bytes: int | None = None   # this process's VmHWM at the end

    def to_dict(self) -> dict:
        return asdict(self)


def default_name(pid: int) -> str:
    """The job's command name, made a valid snapshot name."""
    st = proc.read_stat(pid)
    return validate.default_name(st.comm if st else "job")


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


def _varint(b: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        c = b[i]
        i += 1
        n |= (c & 0x7F) << shift
        shift += 7
        if c < 0x80:
            return n, i


def criu_frozen_seconds(workdir: Path) -> float | None:
    """frozen_time from CRIU's stats-dump (written locally even with --stream): microseconds
    from the moment the tree was frozen to the moment it was resumed. The image is 8 bytes of
    magic, a u32 length, then StatsEntry{dump = 1: DumpStatsEntry{frozen_time = 2}}."""
    try:
        b = (workdir / "stats-dump").read_bytes()
        size = int.from_bytes(b[8:12], "little")
        msg = b[12:12 + size]
        i = 0
        while i < len(msg):
            key, i = _varint(msg, i)
            if key == (1 << 3 | 2):
                ln, i = _varint(msg, i)
                sub, j = msg[i:i + ln], 0
                while j < len(sub):
                    k, j = _varint(sub, j)
                    if k & 7 == 0:
                        v, j = _varint(sub, j)
                        if k >> 3 == 2:
                            return v / 1e6
                    elif k & 7 == 2:
                        ln2, j = _varint(sub, j)
                        j += ln2
                    else:
                        return None
                return None
            if key & 7 == 0:
                _, i = _varint(msg, i)
            elif key & 7 == 2:
                ln, i = _varint(msg, i)
                i += ln
            else:
                return None
    except (OSError, IndexError, ValueError):
        return None
    return None


def _anon_bytes(pids: list[int]) -> int:
    """RssAnon + RssShmem of the tree: about what CRIU will stream (file-backed pages that were
    never written are not dumped; a job that maps gigabytes of model files must not size the
    staging arena by them)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith(("RssAnon:", "RssShmem:")):
                    total += int(line.split()[1]) << 10
        except (OSError, ValueError):
            continue
    return total


def _vm_hwm() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    except (OSError, ValueError):
        pass
    return None


def _test_hold(point: str, info: dict) -> None:
    """Test hook (GPUSNAP_TEST_HOLD=point:FILE): at `point`, write `info` as JSON to FILE and
    wait there until killed, so a test can kill -9 the dump at a precise moment."""
    spec = os.environ.get("GPUSNAP_TEST_HOLD", "")
    if not spec.startswith(point + ":"):
        return
    import json

    path = Path(spec.split(":", 1)[1])
    path.with_suffix(".tmp").write_text(json.dumps(info))
    os.rename(path.with_suffix(".tmp"), path)
    while True:
        time.sleep(1)


def _plugin_failure(log: Path) -> list[str]:
    try:
        return [ln.strip() for ln in log.read_text(errors="replace").splitlines()
                if "gpusnap_cuda" in ln and "Error" in ln]
    except OSError:
        return []



def _criu_args(req: DumpRequest, workdir: Path, log: Path, options: list[str], n_gpu: int = 0) -> list[str]:
    from gpusnap.gpu import limits

    args = ["dump", "-t", str(req.pid), "-D", str(workdir), "--stream",
            "--libdir", str(paths.plugin_dir()), "-o", str(log), "-v4",
            # CRIU's freeze deadline covers the plugin's locks (one setting: the lock timeout)
            "--timeout", str(limits.criu_freeze_timeout_s(limits.lock_timeout_ms(req.lock_timeout_ms), n_gpu))]
    # --exit: leave the tree stopped and kill it only once the snapshot is committed, so a
    # failure while storing can still hand the job back.
    args.append("--leave-running" if req.leave_running else "--leave-stopped")
    args += options  # decided by the preflight: --shell-job, --tcp-established, --file-locks, ...
    return args


def _criu_env(req: DumpRequest, workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["GPUSNAP_LEAVE_RUNNING"] = "1" if req.leave_running else "0"
    env["GPUSNAP_CUDA_REPORT"] = str(workdir / "cuda-report")
    from gpusnap.gpu import limits

    env.update(limits.plugin_env(limits.lock_timeout_ms(req.lock_timeout_ms)))
    return env


def _gpu_candidates(gpu: dict | None) -> list[int]:
    """PIDs the GPU facts recorded as using a GPU (for when the plugin leaves no report)."""
    try:
        return sorted({int(p["pid"]) for p in (gpu or {}).get("processes", []) if "pid" in p})
    except (TypeError, ValueError, KeyError):
        return []


def _settle_gpu(workdir: Path, candidates: list[int], failed_only: bool) -> list[str]:
    """After a failed dump (or a success whose undo failed): every CUDA process back as found."""
    from gpusnap.gpu import report

    lines = report.read(workdir / "cuda-report")
    if failed_only:
        lines = [x for x in lines if x.result != "ok"]
        candidates = []
    if not lines and not candidates:
        return []
    try:
        return report.settle_after_failed_dump(lines, candidates)
    except Exception as e:  # noqa: BLE001 - never let recovery mask the dump's own error
        return [f"{type(e).__name__}: {e}"]


def _failure(stream_err: GpusnapError | None, rc: int | None, log: Path, kept: str | None) -> GpusnapError:
    """The most useful error for a failed dump: the disk, the GPU, the stream, or CRIU itself."""
    where = f" (CRIU log kept at {kept})" if kept else ""
    if isinstance(stream_err, NoSpace):
        return stream_err
    gpu_lines = _plugin_failure(log)
    if gpu_lines:
        return GpuCheckpointFailed(
            "the CUDA plugin could not checkpoint a GPU process; the job was left running and unlocked",
            hint=gpu_lines[0] + where)  # the first error is the cause, the rest follow from it
    if stream_err is not None:
        stream_err.hint = (stream_err.hint + " " if stream_err.hint else "") + where.strip()
        return stream_err
    lines = runner.log_errors(log)
    return CriuFailed(f"criu dump failed (exit status {rc}); the job was left running",
                      log_path=kept, last_lines=lines, hint=runner.explain_dump(lines))


def _retain(repo, name: str, keep_last: int) -> tuple[list[str], list[str]]:
    """Keep the newest `keep_last` snapshots of `name` (the caller holds the writer lock).
    Returns (snapshot ids deleted, warnings: entries of snapshots/ that could not be read and
    were skipped, data kept because of them). Raises on failure."""
    from gpusnap.repo.maint import prune as prune_mod

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


def _resume_tree(pids: list[int]) -> None:
    """SIGCONT the tree CRIU left stopped; the GPU side is settled from the plugin's report."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def committed_snapshot(repo, writer):
    """The snapshot `writer` committed, or None. The directory decides, not the writer's
    state: a signal can land between the commit's rename and the writer's bookkeeping. We
    hold the writer lock, so a directory of this name with this creation time is ours."""
    snaps = Path(repo.path) / "snapshots"
    try:
        entries = sorted(d for d in snaps.iterdir() if d.name.startswith(writer.name + "-"))
    except OSError:
        return None
    for d in entries:
        try:
            snap = repo.snapshot_at(d)
        except (GpusnapError, OSError, ValueError, KeyError):
            continue
        if snap.created == writer.created and snap.name == writer.name:
            return snap
    return None


def _interrupted_after_commit(req: DumpRequest, snap, retention_started: bool) -> GpusnapError:
    """What a signal after the commit point ends the dump with: the truth (exit 27)."""
    from gpusnap.errors import InterruptedAfterCommit

    job = "the job keeps running" if req.leave_running else "the job was stopped, as --exit asked"
    parts = [f"dump interrupted after the commit: snapshot {snap.path} is kept (listed and restorable)", job]
    hint = f"restore it with `gpusnap restore {Path(snap.path).name}`"
    if req.keep_last:
        parts.append("--keep-last retention did not finish" if retention_started
                     else "--keep-last retention did not run")
        hint += f"; prune with `gpusnap prune --keep-last {req.keep_last} --name {snap.name}`"
    return InterruptedAfterCommit("; ".join(parts), hint=hint)


class _Terminate(BaseException):
    """Raised in the main thread by SIGTERM/SIGHUP so a dump unwinds like on Ctrl-C."""


def _on_term(signum, frame):  # noqa: ARG001
    raise _Terminate()


def dump(req: DumpRequest, progress: Progress | None = None) -> DumpResult:
    """Snapshot the process tree rooted at req.pid into the repository at req.repo."""
    from gpusnap.repo.repository import Repository

    t0 = time.monotonic()
    validate.check_compress(req.compress)
    if req.name:
        validate.check_name(req.name)
    plan = preflight.check(req.pid, tcp_established=req.tcp_established).require()
    name = req.name or default_name(req.pid)
    pids = plan.pids
    estimate = proc.rss_bytes(pids)
    from gpusnap.gpu import procs as gpu_procs

    gpu_procs.refuse_devices_without_context(pids)
    if _free_bytes(req.repo) < MIN_FREE_BYTES:
        raise NoSpace(f"less than {MIN_FREE_BYTES >> 20} MiB free where the repository lives ({req.repo})",
                      hint="free some space or run `gpusnap prune`, then dump again")

    repo = Repository.open(req.repo, create=True)
    restore_flags = list(plan.restore_flags)
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
        # restore needs image files, not a stream, for huge-page mappings (restore_needs.py)
        "hugetlb_bytes": restore_needs.hugetlb_bytes(pids),
        # what restore needs to judge the connections (peer still there?) and name the locks
        "tcp": [{"local": c["local"], "remote": c["remote"], "state": c["state"]} for c in plan.tcp],
        "file_locks": [{"kind": lk["kind"], "path": lk["path"]} for lk in plan.locks],
        # restored into a new PID namespace: its PIDs never clash with running processes
        "own_pid_namespace": plan.own_pid_namespace,
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

    budget = req.staging_budget if req.staging_budget is not None else staging_mod.default_budget()
    env_overlap = os.environ.get("GPUSNAP_INGEST_OVERLAP", "")
    overlap = env_overlap == "1" if env_overlap in ("0", "1") else (os.cpu_count() or 1) >= OVERLAP_MIN_CPUS

    with repo.writer_lock():
        writer = repo.new_snapshot(name, compress=req.compress, meta=meta)
        workdir = Path(tempfile.mkdtemp(prefix="gpusnap-dump-"))
        log = workdir / "criu.log"
        server: CaptureServer | None = None
        gate: PostDumpGate | None = None
        criu: subprocess.Popen | None = None
        staging: staging_mod.Staging | None = None
        stopped = False  # --exit: CRIU left the tree SIGSTOPped for us to kill after the commit
        guardian = None
        gpu_problems: list[str] = []
        old_handlers = {s: signal.signal(s, _on_term) for s in (signal.SIGTERM, signal.SIGHUP)}
        snap = None
        retention_started = False
        try:
            if not req.leave_running:
                # resumes the job should gpusnap die between CRIU and the commit (SIGKILL, OOM)
                from gpusnap.ops.guardian import Guardian

                guardian = Guardian(pids, workdir / "cuda-report", _gpu_candidates(gpu),
                                    log=Path(repo.path) / "logs" / "guardian.log")
            phase("preflight")
            spill_dir = repo.path / "tmp"
            staging_mod.sweep(spill_dir)      # spill files of dumps that were SIGKILLed
            # the arena covers what CRIU is expected to stream (the tree's anonymous memory)
            staging = staging_mod.Staging(spill_dir, budget, prealloc=_anon_bytes(pids) + (16 << 20))
            if overlap:
                staging.go.set()
            server = CaptureServer(workdir, writer.image_sink, staging=staging).start()
            # sizes of the files the job appends to, as of the freeze (gpusnap/system/appendfiles.py)
            appending = appendfiles.Recorder(appendfiles.scan(pids))
            gate = PostDumpGate(workdir, server, at_freeze=appending.at_freeze)
            phase("staging")

            def criu_progress(done: int, total: int) -> None:
                if progress is None:
                    return
                if gate.opened.is_set():
                    progress(server.ingested, server.bytes, "storing")
                else:
                    progress(done, total, "frozen")

            t_criu = time.monotonic()
            criu = subprocess.Popen(
                [runner.criu_info().path,
                 *_criu_args(req, workdir, log, plan.dump_options, len(_gpu_candidates(gpu))),
                 "--action-script", str(gate.script)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env={**_criu_env(req, workdir), **gate.env}, start_new_session=True)
            if guardian:
                guardian.criu(criu.pid)
            runner.supervise(criu, server, criu_progress, estimate)
            phase("criu")
            if criu.returncode != 0 or server.failed:
                server.abort()
                raise _failure(server.error(), criu.returncode, log,
                               runner.keep_log(repo.path, log, f"failed-dump-{name}-{stamp}-{os.getpid()}"))
            stopped = not req.leave_running
            frozen = criu_frozen_seconds(workdir)
            if frozen is None and gate.opened_at is not None:
                frozen = gate.opened_at - t_criu
            frozen = round(frozen, 3) if frozen is not None else None
            _test_hold("after-gate", {"pid": os.getpid(), "staging": staging.stats()})
            if progress:
                _finish_with_progress(server, progress)
            else:
                server.finish(timeout=30)
            phase("storing")
            cuda_pids = _read_cuda_report(workdir / "cuda-report")
            extra = {"append_files": appending.files} if appending.files is not None else {}
            snap = writer.commit(extra_meta={"cuda_pids": cuda_pids, "dump_seconds": time.monotonic() - t0,
                                             "frozen_seconds": frozen, **extra})
            kept = runner.keep_log(repo.path, log, f"{Path(snap.path).name}-dump")
            phase("commit")
            if stopped:
                if guardian:
                    guardian.committed()
                _test_hold("after-commit", {"pid": os.getpid()})
                _kill_tree(pids)
                stopped = False
            elif req.leave_running:
                # CRIU succeeded, but the plugin may have failed to hand a process back
                gpu_problems = _settle_gpu(workdir, [], failed_only=True)
            pruned: list[str] = []
            prune_error = None
            prune_warnings: list[str] = []
            if req.keep_last:
                retention_started = True
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
            snap = snap or committed_snapshot(repo, writer)
            if snap is not None:   # past the commit point: the snapshot stays; say so
                if stopped:        # it is safe: end the job as --exit asked (as the guardian would)
                    _kill_tree(pids)
                    stopped = False
                raise _interrupted_after_commit(req, snap, retention_started) from None
            raise Interrupted("dump interrupted; the job was left running and no snapshot was kept") from None
        finally:
            for s, h in old_handlers.items():
                signal.signal(s, h)
            if snap is None:
                writer.abort()
            if stopped:  # CRIU succeeded but storing failed: give the job back
                _resume_tree(pids)
            if snap is None and criu is not None and criu.returncode is not None:
                # CRIU does not tell the plugin of every failure (a failed post-dump gate
                # reaches it as success): whatever the plugin says, settle the GPU side here
                gpu_problems = _settle_gpu(workdir, _gpu_candidates(gpu), failed_only=False)
                exc = sys.exc_info()[1]
                if gpu_problems and isinstance(exc, GpusnapError):
                    exc.message += "; but a GPU process could not be brought back: " + "; ".join(gpu_problems)
            if guardian:
                guardian.done()
            if gate is not None:
                gate.close()
            if server is not None:
                server.abort()
            if staging is not None:
                staging.close()
            shutil.rmtree(workdir, ignore_errors=True)

    if gpu_problems:
        raise GpuCheckpointFailed(
            f"snapshot {snap.path} was saved, but a GPU process could not be handed back: "
            + "; ".join(gpu_problems), hint="see the CUDA plugin's lines in " + (kept or "the CRIU log"))
    stats = writer.stats
    return DumpResult(
        snapshot=str(snap.path), id=snap.id, name=snap.name, pid=req.pid,
        pages_total=stats["pages_total"], pages_zero=stats["pages_zero"], pages_dedup=stats["pages_dedup"],
        bytes_raw=stats["bytes_raw"], bytes_stored=stats["bytes_stored"],
        seconds=round(time.monotonic() - t0, 3), job_running=req.leave_running and proc.exists(req.pid),
        cuda_pids=cuda_pids, log=kept, pruned=pruned, prune_error=prune_error,
        prune_warnings=prune_warnings, phases=phases, frozen_seconds=frozen, staging={**staging.stats(), "overlap": overlap}, peak_rss_bytes=_vm_hwm(),
        criu_options=list(plan.dump_options))


def _finish_with_progress(server: CaptureServer, progress: Progress) -> None:
    """server.finish() in a helper thread while the storing phase's progress is shown."""
    import threading

    done = threading.Event()
    err: list[BaseException] = []

    def run() -> None:
        try:
            server.finish(timeout=30)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            err.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="gpusnap-finish", daemon=True).start()
    while not done.wait(0.1):
        progress(server.ingested, server.bytes, "storing")
    progress(server.bytes, server.bytes, "storing")
    if err:
        raise err[0]
