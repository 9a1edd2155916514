"""Taking a snapshot: preflight, CRIU through the image streamer into the repository, commit.

The job is protected first: CRIU runs in its own session (a Ctrl-C meant for gpusnap never
reaches it), and an interrupted or failed dump is unwound by breaking the image stream, so
CRIU fails cleanly, removes its parasite and resumes the tree; the CUDA plugin unlocks and
restores any GPU process on that path. Nothing becomes visible in the repository before the
snapshot's atomic commit; a signal after it ends the dump saying the snapshot is kept (exit 28).

Here: the request and result types and the order of a dump; the pieces of the CRIU session
(command line, CRIU's figures, errors, handing the job back) are in dump_session.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpusnap.system import hostlock, preflight, proc, tmpdirs
from gpusnap.ops import dump_session as session, identity, restore_needs, validate
from gpusnap.criu import runner
from gpusnap.criu.gate import PostDumpGate, native_gate
from gpusnap.criu.streamer import CaptureServer
from gpusnap.errors import GpuCheckpointFailed, GpusnapError, Interrupted, NoSpace
from gpusnap.repo.faults import fault
from gpusnap.repo.pipeline import staging as staging_mod

# Below this much free space a dump is refused outright; running out later is caught too.
MIN_FREE_BYTES = 64 << 20

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
    tcp_close: bool = False  # CRIU's --tcp-close: connections not dumped, restored closed
    keep_last: int | None = None  # retention for this name, applied right after the commit
    staging_budget: int | None = None  # bytes of memory staging may use (None: staging.default_budget())
    lock_wait: float | None = None  # seconds to wait for the repository's locks (None: repo/lockwait.py's default)


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
    # wall seconds per phase: preflight, staging (set up, and the arena's faulting-in, begun with
    # the preflight, finished), criu (CRIU running: the freeze, pages streaming into staging),
    # storing (the page pipeline and pack writes finishing after CRIU exits), commit (index,
    # manifest, fsyncs, rename), retention
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


def _retain(repo, name: str, keep_last: int) -> tuple[list[str], list[str]]:
    """Keep the newest `keep_last` snapshots of `name` (the caller holds the writer lock;
    prune.retain takes the rest through prune's one lock policy). Returns (snapshot ids
    deleted, warnings: unreadable entries skipped, data kept because of them). Raises on failure."""
    from gpusnap.ops import prune

    return prune.retain(repo, name, keep_last)


def retention_error(result: "DumpResult") -> GpusnapError | None:
    """The error a dump whose retention failed ends with (its snapshot stays committed)."""
    from gpusnap.errors import RetentionFailed

    if result.prune_error is None:
        return None
    return RetentionFailed(
        f"snapshot {result.snapshot} is committed, but --keep-last retention failed: {result.prune_error}",
        hint="older snapshots of this name were not pruned; run `gpusnap verify`, fix what it names, "
             "then `gpusnap prune --keep-last N --name NAME`")


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
    """What a signal after the commit point ends the dump with: the truth (exit 28)."""
    from gpusnap.errors import InterruptedAfterCommit

    job = "the job keeps running" if req.leave_running else "the job was stopped, as --exit asked"
    parts = [f"dump interrupted after the commit: snapshot {snap.path} is kept (listed and restorable)", job]
    hint = f"restore it with `gpusnap restore {Path(snap.path).name}`"
    if req.keep_last:
        parts.append("--keep-last retention did not finish" if retention_started
                     else "--keep-last retention did not run")
        hint += f"; prune with `gpusnap prune --keep-last {req.keep_last} --name {snap.name}`"
    return InterruptedAfterCommit("; ".join(parts), hint=hint, snapshot=str(snap.path))


class _Terminate(BaseException):
    """Raised in the main thread by SIGTERM/SIGHUP so a dump unwinds like on Ctrl-C."""


def _on_term(signum, frame):  # noqa: ARG001
    raise _Terminate()


def dump(req: DumpRequest, progress: session.Progress | None = None) -> DumpResult:
    """Snapshot the process tree rooted at req.pid into the repository at req.repo."""
    t0 = time.monotonic()
    from gpusnap.repo import lockwait

    validate.check_compress(req.compress)
    if req.name:
        validate.check_name(req.name)
    wait = lockwait.seconds(req.lock_wait)
    budget = req.staging_budget if req.staging_budget is not None else staging_mod.default_budget()
    # the staging memory is faulted in by its own thread while the preflight runs (arena.py);
    # the staging takes it over, and whatever path this dump ends on, it is freed here
    arena = session.EarlyArena(req.pid, budget)
    try:
        return _dump(req, progress, t0, budget, arena, wait)
    finally:
        arena.release(final=True)


def _dump(req: DumpRequest, progress, t0: float, budget: int, arena: session.EarlyArena, wait: float) -> DumpResult:
    """One dump of a job at a time on this machine (another gpusnap may be dumping it into
    another repository): wait for it, then look at the job afresh. Without the privileges or
    a valid PID (the preflight says so, in its words) there is nothing to lock."""
    if req.pid <= 0 or preflight.privileges().status == "fail":
        return _dump_held(req, progress, t0, budget, arena, wait)

    def waiting() -> None:
        arena.release()
        if progress is not None:
            progress(0, 0, "waiting")

    with hostlock.held(f"dump-pid-{req.pid}", waiting):
        arena.again()
        return _dump_held(req, progress, t0, budget, arena, wait)


def _look(req: DumpRequest):
    """The preflight, and what the snapshot records of the job: (plan, meta, gpu facts). Again
    after a wait for the repository's writer lock: the tree may have changed meanwhile."""
    plan = preflight.check(req.pid, tcp_established=req.tcp_established, tcp_close=req.tcp_close).require()
    pids = plan.pids
    from gpusnap.gpu import procs as gpu_procs

    gpu_procs.refuse_devices_without_context(pids)
    meta = {
        "pid": req.pid,
        "pids": pids,
        # every thread id too, so restore can check they are free without decoding images
        "tids": sorted({t for p in pids for t in proc.threads(p)}),
        "cmdline": proc.cmdline(req.pid),
        "hostname": os.uname().nodename,
        "kernel": os.uname().release,
        "criu_version": runner.criu_info().version_str,
        "restore_flags": list(plan.restore_flags),
        "leave_running": req.leave_running,
        "compress": req.compress,
        # restore needs image files, not a stream, for huge-page mappings (restore_needs.py)
        "hugetlb_bytes": restore_needs.hugetlb_bytes(pids),
        # what restore needs to judge the connections (peer still there?), name the locks and daemons
        "tcp": [{"local": c["local"], "remote": c["remote"], "state": c["state"]} for c in plan.tcp],
        "file_locks": [{"kind": lk["kind"], "path": lk["path"]} for lk in plan.locks],
        # own PID namespace: restored into a new one, its PIDs never clash with running processes
        "unix_peers": plan.unix_peers, "own_pid_namespace": plan.own_pid_namespace,
    }
    gpu = session.gpu_facts(pids)
    if gpu:
        meta["gpu"] = gpu
    return plan, meta, gpu


def _dump_held(req: DumpRequest, progress, t0: float, budget: int, arena: session.EarlyArena, wait: float) -> DumpResult:
    from gpusnap.repo import locate

    plan, meta, gpu = _look(req)
    native_gate()       # the gate is the one way CRIU waits for the pipes: refuse now without it
    # a named job's root is dumped under its name (identity.py), anything else under its command's
    name = req.name or identity.name_of(req.repo, req.pid) or default_name(req.pid)
    notice = session.WaitingNotice(progress, arena)
    # the repository first: a typo or a directory that is none (/proc) is that error, not "no space"
    repo = locate.open_repository(req.repo, create_at_default=True).wait_for_locks(wait, notice)
    if session.free_bytes(repo.path) < MIN_FREE_BYTES:
        raise NoSpace(f"less than {MIN_FREE_BYTES >> 20} MiB free where the repository lives ({req.repo})",
                      hint="free some space or run `gpusnap prune`, then dump again")

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    phases: dict[str, float] = {}
    mark = [t0]

    def phase(name: str) -> None:
        now = time.monotonic()
        phases[name] = round(now - mark[0], 3)
        mark[0] = now

    env_overlap = os.environ.get("GPUSNAP_INGEST_OVERLAP", "")
    overlap = env_overlap == "1" if env_overlap in ("0", "1") else (os.cpu_count() or 1) >= OVERLAP_MIN_CPUS

    snap = None
    retention_started = False
    old_handlers: dict = {}
    try:
        with repo.writer_lock():
            if notice.waited:   # another gpusnap wrote meanwhile: look at the job afresh
                plan, meta, gpu = _look(req)
                arena.again()   # (given back while this dump waited)
            pids = plan.pids
            estimate = proc.rss_bytes(pids)
            writer = repo.new_snapshot(name, compress=req.compress, meta=meta)
            tmpdirs.sweep(repo.path)    # what SIGKILLed dumps and restores left outside the repository
            workdir = tmpdirs.make(tmpdirs.DUMP)
            log = workdir / "criu.log"
            server: CaptureServer | None = None
            gate: PostDumpGate | None = None
            criu: subprocess.Popen | None = None
            staging: staging_mod.Staging | None = None
            stopped = False  # --exit: CRIU left the tree SIGSTOPped for us to kill after the commit
            guardian = None
            gpu_problems: list[str] = []
            old_handlers = {s: signal.signal(s, _on_term) for s in (signal.SIGTERM, signal.SIGHUP)}
            try:
                if not req.leave_running:
                    # resumes the job should gpusnap die between CRIU and the commit (SIGKILL, OOM)
                    from gpusnap.ops.guardian import Guardian

                    guardian = Guardian(pids, workdir / "cuda-report", session.gpu_candidates(gpu),
                                        log=Path(repo.path) / "logs" / "guardian.log", tcp=plan.tcp, criu_log=log)
                phase("preflight")
                spill_dir = repo.path / "tmp"
                staging_mod.sweep(spill_dir)      # spill files of dumps that were SIGKILLed
                staging = staging_mod.Staging(spill_dir, budget, arena=arena.take())
                if overlap:
                    staging.go.set()
                server = CaptureServer(workdir, writer.image_sink, staging=staging).start()
                # append sizes and link-remap files, as of the freeze (gpusnap/system/appendfiles.py, linkremap.py)
                freeze = session.AtFreeze(pids, plan.linked)
                gate = PostDumpGate(workdir, server, at_freeze=freeze.at_freeze)
                # the repository's index loaded while the staging was set up (writer.py): its
                # errors stop the dump before the job freezes, and its load never competes
                # with CRIU for a core
                writer.wait_index()
                staging.ready()     # the arena faulted in: no page fault inside the freeze
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
                     *session.criu_args(req, workdir, log, plan.dump_options, len(session.gpu_candidates(gpu))),
                     "--action-script", str(gate.script)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    env={**session.criu_env(req, workdir), **gate.env}, start_new_session=True)
                if guardian:
                    guardian.criu(criu.pid)
                fault("dump:criu-running")      # (test hook: a signal while CRIU works)
                runner.supervise(criu, server, criu_progress, estimate)
                phase("criu")
                if criu.returncode != 0 or server.failed:
                    server.abort()
                    raise session.failure(server.error(), criu.returncode, log,
                                   runner.keep_log(repo.path, log, f"failed-dump-{name}-{stamp}-{os.getpid()}"))
                stopped = not req.leave_running
                frozen = session.criu_frozen_seconds(workdir)
                if frozen is None and gate.opened_at is not None:
                    frozen = gate.opened_at - t_criu
                frozen = round(frozen, 3) if frozen is not None else None
                session.test_hold("after-gate", {"pid": os.getpid(), "staging": staging.stats()})
                if progress:
                    session.finish_with_progress(server, progress)
                else:
                    server.finish(timeout=30)
                phase("storing")
                cuda_pids = session.cuda_report_pids(workdir / "cuda-report")
                extra = freeze.meta(writer)
                snap = writer.commit(extra_meta={"cuda_pids": cuda_pids, "dump_seconds": time.monotonic() - t0,
                                                 "frozen_seconds": frozen, **extra})
                kept = runner.keep_log(repo.path, log, f"{Path(snap.path).name}-dump")
                phase("commit")
                if stopped:
                    if guardian:
                        guardian.committed()
                    session.test_hold("after-commit", {"pid": os.getpid()})
                    session.kill_tree(pids)
                    stopped = False
                elif req.leave_running:
                    # CRIU succeeded, but the plugin may have failed to hand a process back
                    gpu_problems = session.settle_gpu(workdir, [], failed_only=True)
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
                        session.kill_tree(pids)
                        stopped = False
                    raise _interrupted_after_commit(req, snap, retention_started) from None
                raise Interrupted("dump interrupted; the job was left running and no snapshot was kept") from None
            finally:
                if snap is None:
                    writer.abort()
                if stopped:  # CRIU succeeded but storing failed: give the job back, its network too
                    session.resume_tree(pids, plan.tcp, log, sys.exc_info()[1])
                if snap is None and criu is not None and criu.returncode is not None:
                    # CRIU does not tell the plugin of every failure (a failed post-dump gate
                    # reaches it as success): whatever the plugin says, settle the GPU side here
                    gpu_problems = session.settle_gpu(workdir, session.gpu_candidates(gpu), failed_only=False)
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

        if req.name and req.leave_running:   # `dump --name N PID`: N stands for this job from now on
            identity.note_dump(req.repo, req.name, req.pid)
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
            prune_warnings=prune_warnings, phases=phases, frozen_seconds=frozen, staging={**staging.stats(), "overlap": overlap}, peak_rss_bytes=proc.peak_rss_self(),
            criu_options=list(plan.dump_options))
    except (KeyboardInterrupt, _Terminate):
        if snap is None:   # a second signal while unwinding a dump that never committed
            raise Interrupted("dump interrupted; the job was left running and no snapshot was kept") from None
        # a signal while cleaning up or reporting, after the commit: the snapshot stays
        raise _interrupted_after_commit(req, snap, retention_started) from None
    finally:
        for s, h in old_handlers.items():
            signal.signal(s, h)
