"""Taking a snapshot: preflight, CRIU through the image streamer into the repository, commit.

The job is protected first: CRIU runs in its own session (a Ctrl-C meant for gpusnap never
reaches it), and an interrupted or failed dump is unwound by breaking the image stream, so
CRIU fails cleanly, removes its parasite and resumes the tree; the CUDA plugin unlocks and
restores any GPU process on that path. Nothing becomes visible in the repository before the
snapshot's atomic commit; a signal after it ends the dump saying the snapshot is kept (exit 28).

Here: the request and result types, and DumpSession, one dump as an object: what it holds is
entered into one ExitStack as it is acquired, so it is released in the reverse order whatever
ends the dump. The pieces it puts in order (the look at the job, CRIU's command line and
figures, errors, handing the job back) are in dump_parts.py; its staging's budget, early
arena and throughput in dump_staging.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpusnap.system import hostlock, oom, proc, tmpdirs
from gpusnap.ops import dump_parts as parts, dump_staging, identity, preflight, prune, validate
from gpusnap.criu import runner
from gpusnap.criu.gate import PostDumpGate, native_gate
from gpusnap.criu.streamer import CaptureServer
from gpusnap.repo import logs as repo_logs
from gpusnap.repo.format import names as image_names
from gpusnap.errors import GpuCheckpointFailed, GpusnapError, Interrupted, NoSpace
from gpusnap.system.faults import fault
from gpusnap import staging as staging_mod
from gpusnap import settings

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
    staging_budget: int | None = None  # bytes of memory staging may use (None: staging.choose_budget())
    lock_wait: float | None = None  # seconds to wait for the repository's locks (None: repo/lockwait.py's default)
    prune_uncopied: bool = False  # --keep-last may delete snapshots not yet copied to their next tier
    copy_to: str | None = None  # the next tier (ops/tiers.py): the snapshot is marked pending right after its commit


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
    # budget, arena_bytes, staged_bytes, memory_peak, spilled_bytes, spill_peak, overlap,
    # oom_score_adj (the value this dump ran with, system/oom.py)
    staging: dict = field(default_factory=dict)
    peak_rss_bytes: int | None = None   # this process's VmHWM at the end
    # MB/s per phase, the staging's choices (dump_staging.throughput); also in the snapshot's meta
    throughput: dict = field(default_factory=dict)
    committed_at: float | None = None   # wall-clock time of the commit (a tiered dump's copy starts after it)
    copy: dict | None = None            # --copy-to: what ops/tiers.py catch_up did

    def to_dict(self) -> dict:
        return asdict(self)


def retention_error(result: "DumpResult") -> GpusnapError | None:
    """The error a dump whose retention failed ends with (its snapshot stays committed)."""
    from gpusnap.errors import RetentionFailed

    if result.prune_error is None:
        return None
    return RetentionFailed(
        f"snapshot {result.snapshot} is committed, but --keep-last retention failed: {result.prune_error}",
        hint="older snapshots of this name were not pruned; run `gpusnap verify`, fix what it names, "
             "then `gpusnap prune --keep-last N --name NAME`")


class _Terminate(BaseException):
    """Raised in the main thread by SIGTERM/SIGHUP so a dump unwinds like on Ctrl-C."""


def _on_term(signum, frame):  # noqa: ARG001
    raise _Terminate()


def dump(req: DumpRequest, progress: parts.Progress | None = None) -> DumpResult:
    """Snapshot the process tree rooted at req.pid into the repository at req.repo."""
    t0 = time.monotonic()
    from gpusnap.repo import lockwait

    validate.check_compress(req.compress)
    if req.name:
        validate.check_name(req.name)
    wait = lockwait.seconds(req.lock_wait)
    # should memory run out while the staging holds it, the OOM killer takes this process,
    # not the job; CRIU and the guardian are put back (system/oom.py)
    with oom.expendable():
        # the staging memory is faulted in by its own thread while the preflight runs (arena.py);
        # the staging takes it over, and whatever path this dump ends on, it is freed here
        arena = dump_staging.EarlyArena(req)
        try:
            return _dump(req, progress, t0, arena, wait)
        finally:
            arena.release(final=True)


def _dump(req: DumpRequest, progress, t0: float, arena: dump_staging.EarlyArena, wait: float) -> DumpResult:
    """One dump of a job at a time on this machine (another gpusnap may be dumping it into
    another repository): wait for it, then look at the job afresh. Without the privileges or
    a valid PID (the preflight says so, in its words) there is nothing to lock."""
    if req.pid <= 0 or preflight.privileges().status == "fail":
        return DumpSession(req, progress, t0, arena, wait).run()

    def waiting() -> None:
        arena.release()
        if progress is not None:
            progress(0, 0, "waiting")

    with hostlock.held(f"dump-pid-{req.pid}", waiting):
        arena.again()
        return DumpSession(req, progress, t0, arena, wait).run()


class DumpSession:
    """One dump, held. run() looks at the job, takes the repository's writer lock, acquires
    what the dump needs (the snapshot writer, a work directory, the guardian, the staging, the
    capture server, the post-dump gate, CRIU), each entered into one ExitStack as it is made,
    then runs CRIU, commits and applies retention. Past the commit (self.snap) nothing is
    aborted; before it, the job is handed back running and nothing stays visible."""

    def __init__(self, req: DumpRequest, progress: parts.Progress | None, t0: float,
                 arena: dump_staging.EarlyArena, wait: float):
        self.req, self.progress, self.t0, self.arena, self.wait = req, progress, t0, arena, wait
        self.phases: dict[str, float] = {}
        self._mark = t0
        self._old_handlers: dict = {}
        self.snap = None                # the committed snapshot
        self.committed_at = 0.0
        self.stopped = False            # --exit: CRIU left the tree SIGSTOPped, ours to kill after the commit
        self.retention_started = False
        self.criu: subprocess.Popen | None = None
        self.gpu_problems: list[str] = []
        self.frozen: float | None = None
        self.throughput: dict = {}
        self.cuda_pids: list[int] = []
        self.kept: str | None = None
        self.pruned: list[str] = []
        self.prune_error: str | None = None
        self.prune_warnings: list[str] = []

    def phase(self, name: str) -> None:
        now = time.monotonic()
        self.phases[name] = round(now - self._mark, 3)
        self._mark = now

    def rates(self) -> dict:
        self.throughput = dump_staging.throughput(self.staging, self.phases, self.t0)
        return self.throughput

    def run(self) -> DumpResult:
        self._open()
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(self.repo.writer_lock(what="dump", when_alone=self._sweep_repo_tmp))
                self._hold(stack)
                try:
                    self._run_criu()
                    self._commit()
                    self._retention()
                except (KeyboardInterrupt, _Terminate):
                    self._interrupted()
            return self._result()
        except (KeyboardInterrupt, _Terminate):
            if self.snap is None:   # a second signal while unwinding a dump that never committed
                raise Interrupted("dump interrupted; the job was left running and no snapshot was kept") from None
            # a signal while cleaning up or reporting, after the commit: the snapshot stays
            raise parts.interrupted_after_commit(self.req, self.snap, self.retention_started) from None
        finally:
            for s, h in self._old_handlers.items():
                signal.signal(s, h)

    def _sweep_repo_tmp(self) -> None:
        """What dead gpusnaps left in REPO/tmp (image directories, spill files), judged by
        their PIDs: only while no other writer runs (writer_lock's when_alone), since a
        writer on another machine sharing the repository has a PID that means nothing here."""
        tmpdirs.remove_dead(self.repo.path / "tmp", tmpdirs.IMAGES)
        staging_mod.sweep(self.repo.path / "tmp")

    def _open(self) -> None:
        """The preflight, the name, the repository (waiting for its locks), its free space."""
        from gpusnap.repo import locate

        req = self.req
        self.plan, self.meta, self.gpu = parts.look(req)
        self.arena.add_gpu(self.gpu)   # a CUDA checkpoint brings the device memory into the image
        native_gate()       # the gate is the one way CRIU waits for the pipes: refuse now without it
        # a named job's root is dumped under its name (identity.py), anything else under its command's
        self.name = req.name or identity.name_of(req.repo, req.pid) or parts.default_name(req.pid)
        self.notice = parts.WaitingNotice(self.progress, self.arena)
        # the repository first: a typo or a directory that is none (/proc) is that error, not "no space"
        self.repo = locate.open_repository(req.repo, create_at_default=True).wait_for_locks(self.wait, self.notice)
        if parts.free_bytes(self.repo.path) < MIN_FREE_BYTES:
            raise NoSpace(f"less than {MIN_FREE_BYTES >> 20} MiB free where the repository lives ({req.repo})",
                          hint="free some space or run `gpusnap prune`, then dump again")
        self.stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        env_overlap = settings.get("GPUSNAP_INGEST_OVERLAP", "")
        self.overlap = env_overlap == "1" if env_overlap in ("0", "1") else proc.usable_cores() >= OVERLAP_MIN_CPUS

    def _hold(self, stack: contextlib.ExitStack) -> None:
        """Under the writer lock: everything the dump holds, each released by `stack`."""
        req, repo = self.req, self.repo
        if self.notice.waited:   # another gpusnap wrote meanwhile: look at the job afresh
            self.plan, self.meta, self.gpu = parts.look(req)
            self.arena.again()   # (given back while this dump waited)
            self.arena.add_gpu(self.gpu)
        self.pids = self.plan.pids
        self.estimate = proc.rss_bytes(self.pids)
        self.writer = repo.new_snapshot(self.name, compress=req.compress, meta=self.meta)
        stack.callback(self._abort_unless_committed)
        tmpdirs.sweep()    # what SIGKILLed dumps and restores left outside the repository
        self.workdir = tmpdirs.make(tmpdirs.DUMP)
        stack.callback(shutil.rmtree, self.workdir, ignore_errors=True)
        self.log = self.workdir / "criu.log"
        self._old_handlers = {s: signal.signal(s, _on_term) for s in (signal.SIGTERM, signal.SIGHUP)}
        self.guardian = None
        if not req.leave_running:
            # resumes the job should gpusnap die between CRIU and the commit (SIGKILL, OOM)
            from gpusnap.ops.guardian import Guardian

            self.guardian = Guardian(self.pids, self.workdir / "cuda-report", parts.gpu_candidates(self.gpu),
                                     log=Path(repo.path) / "logs" / "guardian.log", tcp=self.plan.tcp,
                                     criu_log=self.log)
            stack.callback(self.guardian.done)
        self.phase("preflight")
        spill_dir = repo.path / "tmp"
        self.staging = staging_mod.Staging(spill_dir, self.arena.budget, arena=self.arena.take())
        self.staging.budget_choice = self.arena.choice
        stack.callback(self.staging.close)
        if self.overlap:
            self.staging.go.set()
        self.server = CaptureServer(self.workdir, self.writer.image_sink, image_names, staging=self.staging).start()
        stack.callback(self.server.abort)
        # append sizes and link-remap files, as of the freeze (gpusnap/system/appendfiles.py, linkremap.py)
        self.freeze = parts.AtFreeze(self.pids, self.plan.linked)
        self.gate = PostDumpGate(self.workdir, self.server, at_freeze=self.freeze.at_freeze)
        stack.callback(self.gate.close)
        # the repository's index loaded while the staging was set up (writer.py): its errors
        # stop the dump before the job freezes, and its load never competes with CRIU for a core
        self.writer.wait_index()
        self.staging.ready()     # the arena faulted in: no page fault inside the freeze
        self.phase("staging")
        stack.push(self._hand_back)

    def _run_criu(self) -> None:
        """CRIU, through the capture server, until its pages are stored."""
        req, server, gate = self.req, self.server, self.gate

        def criu_progress(done: int, total: int) -> None:
            if self.progress is None:
                return
            if gate.opened.is_set():
                self.progress(server.ingested, server.bytes, "storing")
            else:
                self.progress(done, total, "frozen")

        t_criu = time.monotonic()
        n_gpu = len(parts.gpu_candidates(self.gpu))
        self.criu = subprocess.Popen(
            [runner.criu_info().path, *parts.criu_args(req, self.workdir, self.log, self.plan.dump_options, n_gpu),
             "--action-script", str(gate.script)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**parts.criu_env(req, self.workdir), **gate.env}, start_new_session=True)
        oom.spare(self.criu.pid)     # CRIU holds the job frozen: not the OOM killer's first choice
        if self.guardian:
            self.guardian.criu(self.criu.pid)
        fault("dump:criu-running")      # (test hook: a signal while CRIU works)
        runner.supervise(self.criu, server, criu_progress, self.estimate)
        self.phase("criu")
        if self.criu.returncode != 0 or server.failed:
            server.abort()
            raise parts.failure(server.error(), self.criu.returncode, self.log,
                                repo_logs.keep_log(self.repo.path, self.log,
                                                f"failed-dump-{self.name}-{self.stamp}-{os.getpid()}"))
        self.stopped = not req.leave_running
        frozen = parts.criu_frozen_seconds(self.workdir)
        if frozen is None and gate.opened_at is not None:
            frozen = gate.opened_at - t_criu
        self.frozen = round(frozen, 3) if frozen is not None else None
        parts.test_hold("after-gate", {"pid": os.getpid(), "staging": self.staging.stats()})
        if self.progress:
            parts.finish_with_progress(server, self.progress)
        else:
            server.finish(timeout=30)
        self.phase("storing")

    def _commit(self) -> None:
        """The commit point; then the job ended (--exit) or its GPU side checked (leave-running)."""
        self.cuda_pids = parts.cuda_report_pids(self.workdir / "cuda-report")
        extra = self.freeze.meta(self.writer)
        self.snap = self.writer.commit(extra_meta={"cuda_pids": self.cuda_pids,
                                                   "dump_seconds": time.monotonic() - self.t0,
                                                   "frozen_seconds": self.frozen,
                                                   "throughput": self.rates(), **extra})
        self.committed_at = time.time()
        if self.req.copy_to:    # at once: a pending snapshot is never pruned before it is copied
            from gpusnap.repo import copies

            copies.mark_pending(self.repo.path, self.snap, self.req.copy_to)
        self.kept = repo_logs.keep_log(self.repo.path, self.log, f"{Path(self.snap.path).name}-dump")
        self.phase("commit")
        if self.stopped:
            if self.guardian:
                self.guardian.committed()
            parts.test_hold("after-commit", {"pid": os.getpid()})
            parts.kill_tree(self.pids)
            self.stopped = False
        elif self.req.leave_running:
            # CRIU succeeded, but the plugin may have failed to hand a process back
            self.gpu_problems = parts.settle_gpu(self.workdir, [], failed_only=True)

    def _retention(self) -> None:
        """--keep-last, right after the commit; its failure is reported, the snapshot stays."""
        if not self.req.keep_last:
            return
        self.retention_started = True
        # the snapshot is safe: a failure is said, and the command exits non-zero (cli)
        self.pruned, self.prune_warnings, self.prune_error = prune.retain_after_commit(
            self.repo, self.snap.name, self.req.keep_last, self.req.prune_uncopied)
        self.phase("retention")

    def _interrupted(self) -> None:
        """Ctrl-C, SIGTERM or SIGHUP while the dump held everything: what it ends with."""
        self.server.abort()
        if self.criu is not None:
            self.criu.wait()  # CRIU unwinds on the broken stream; never kill it mid-parasite
        self.snap = self.snap or parts.committed_snapshot(self.repo, self.writer)
        if self.snap is not None:   # past the commit point: the snapshot stays; say so
            if self.stopped:        # it is safe: end the job as --exit asked (as the guardian would)
                parts.kill_tree(self.pids)
                self.stopped = False
            raise parts.interrupted_after_commit(self.req, self.snap, self.retention_started) from None
        raise Interrupted("dump interrupted; the job was left running and no snapshot was kept") from None

    def _abort_unless_committed(self) -> None:
        if self.snap is None:
            self.writer.abort()

    def _hand_back(self, exc_type, exc, tb) -> bool:  # noqa: ARG002
        """The first to unwind: the job given back if storing failed after CRIU stopped it (its
        network too), and the GPU side settled if CRIU ran but nothing was committed."""
        if self.stopped:
            parts.resume_tree(self.pids, self.plan.tcp, self.log, exc)
        if self.snap is None and self.criu is not None and self.criu.returncode is not None:
            # CRIU does not tell the plugin of every failure (a failed post-dump gate reaches
            # it as success): whatever the plugin says, settle the GPU side here
            self.gpu_problems = parts.settle_gpu(self.workdir, parts.gpu_candidates(self.gpu), failed_only=False)
            if self.gpu_problems and isinstance(exc, GpusnapError):
                exc.message += "; but a GPU process could not be brought back: " + "; ".join(self.gpu_problems)
        return False

    def _result(self) -> DumpResult:
        req, snap = self.req, self.snap
        if req.name and req.leave_running:   # `dump --name N PID`: N stands for this job from now on
            identity.note_dump(req.repo, req.name, req.pid)
        if self.gpu_problems:
            raise GpuCheckpointFailed(
                f"snapshot {snap.path} was saved, but a GPU process could not be handed back: "
                + "; ".join(self.gpu_problems), hint="see the CUDA plugin's lines in " + (self.kept or "the CRIU log"))
        stats = self.writer.stats
        return DumpResult(
            snapshot=str(snap.path), id=snap.id, name=snap.name, pid=req.pid,
            pages_total=stats["pages_total"], pages_zero=stats["pages_zero"], pages_dedup=stats["pages_dedup"],
            bytes_raw=stats["bytes_raw"], bytes_stored=stats["bytes_stored"],
            seconds=round(time.monotonic() - self.t0, 3), job_running=req.leave_running and proc.exists(req.pid),
            cuda_pids=self.cuda_pids, log=self.kept, pruned=self.pruned, prune_error=self.prune_error,
            prune_warnings=self.prune_warnings, phases=self.phases, frozen_seconds=self.frozen,
            staging={**self.staging.stats(), "overlap": self.overlap, "pages_pipe": self.server.pages_pipe,
                     "oom_score_adj": oom.read()},
            peak_rss_bytes=proc.peak_rss_self(),
            throughput=self.throughput,
            criu_options=list(self.plan.dump_options), committed_at=round(self.committed_at, 3))
