"""The pieces of a dump that gpusnap/ops/dump.py's DumpSession puts in order: the look at the
job (the preflight and what the snapshot records), CRIU's command line and environment, CRIU's own figures (the frozen time in its stats-dump), the CUDA plugin's
report, the most useful error of a failed run, which snapshot a signal left committed and what
the dump then says, handing the job back (resume, kill, GPU processes settled), the storing
phase's progress, and the test hold points (the staging's budget, early arena and
throughput: dump_staging.py).
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from gpusnap.criu import config as criu_config
from gpusnap.criu import images
from gpusnap.criu import runner
from gpusnap.errors import CriuFailed, GpuCheckpointFailed, GpusnapError, NoSpace
from gpusnap.ops import restore_needs, validate
from gpusnap.ops import preflight
from gpusnap.system import paths, proc
from gpusnap import settings

if TYPE_CHECKING:
    from gpusnap.criu.streamer import CaptureServer
    from gpusnap.ops.dump import DumpRequest

# (bytes so far, expected total, phase): phase "frozen" while the job stands frozen and CRIU's
# bytes are staged, then "storing" (the job runs again) while the page pipeline stores them
Progress = Callable[[int, int, str], None]


def free_bytes(path: Path) -> int:
    p = path
    while not p.exists():
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def gpu_facts(pids: list[int]) -> dict | None:
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


def cuda_report_pids(path: Path) -> list[int]:
    pids: list[int] = []
    try:
        for line in path.read_text().splitlines():
            m = re.search(r"\bpid=(\d+)", line)
            if line.startswith("dump") and m:
                pids.append(int(m.group(1)))
    except OSError:
        pass
    return sorted(set(pids))


def criu_frozen_seconds(workdir: Path) -> float | None:
    """frozen_time from CRIU's stats-dump (written locally even with --stream): seconds from
    the moment the tree was frozen to the moment it was resumed (criu/images.py)."""
    try:
        raw = (workdir / "stats-dump").read_bytes()
    except OSError:
        return None
    return images.frozen_seconds(raw)


def test_hold(point: str, info: dict) -> None:
    """Test hook (GPUSNAP_TEST_HOLD=point:FILE): at `point`, write `info` as JSON to FILE and
    wait there until killed, so a test can kill -9 the dump at a precise moment."""
    spec = settings.get("GPUSNAP_TEST_HOLD", "")
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



def criu_args(req: DumpRequest, workdir: Path, log: Path, options: list[str], n_gpu: int = 0) -> list[str]:
    from gpusnap.gpu import limits

    # no CRIU configuration file adds options unseen (gpusnap/criu/config.py)
    args = ["dump", *criu_config.ARGS, "-t", str(req.pid), "-D", str(workdir), "--stream",
            "--libdir", str(paths.plugin_dir()), "-o", str(log), "-v4",
            # CRIU's freeze deadline covers the plugin's locks (one setting: the lock timeout)
            "--timeout", str(limits.criu_freeze_timeout_s(limits.lock_timeout_ms(req.lock_timeout_ms), n_gpu))]
    # --exit: leave the tree stopped and kill it only once the snapshot is committed, so a
    # failure while storing can still hand the job back.
    args.append("--leave-running" if req.leave_running else "--leave-stopped")
    args += options  # decided by the preflight: --shell-job, --tcp-established, --file-locks, ...
    return args


def criu_env(req: DumpRequest, workdir: Path) -> dict[str, str]:
    env = criu_config.environ()
    env["GPUSNAP_LEAVE_RUNNING"] = "1" if req.leave_running else "0"
    env["GPUSNAP_CUDA_REPORT"] = str(workdir / "cuda-report")
    from gpusnap.gpu import limits

    env.update(limits.plugin_env(limits.lock_timeout_ms(req.lock_timeout_ms)))
    return env


def gpu_candidates(gpu: dict | None) -> list[int]:
    """PIDs the GPU facts recorded as using a GPU (for when the plugin leaves no report)."""
    try:
        return sorted({int(p["pid"]) for p in (gpu or {}).get("processes", []) if "pid" in p})
    except (TypeError, ValueError, KeyError):
        return []


def settle_gpu(workdir: Path, candidates: list[int], failed_only: bool) -> list[str]:
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


def failure(stream_err: GpusnapError | None, rc: int | None, log: Path, kept: str | None) -> GpusnapError:
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



def kill_tree(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def resume_tree(pids: list[int], tcp: list[dict] | None = None, criu_log: Path | None = None,
                error: BaseException | None = None) -> None:
    """SIGCONT the tree CRIU left stopped; the GPU side is settled from the plugin's report.
    CRIU's network lock on the tree's connections goes first (a stopped dump keeps it for a
    restore; a job that runs on needs its connections); what it could not free is added to
    `error`, the dump's failure."""
    if tcp:
        from gpusnap.criu import netlock_rules

        failed = netlock_rules.lift(tcp)
        netlock_rules.lift_table(netlock_rules.run_id(criu_log) if criu_log else None)
        netlock_rules.repair_off(pids)
        if failed and isinstance(error, GpusnapError):
            error.message += (f"; CRIU's network lock on {', '.join(failed)} could not be lifted "
                              "(`gpusnap doctor --unlock-network`)")
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def finish_with_progress(server: CaptureServer, progress: Progress) -> None:
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


class WaitingNotice:
    """What a dump says (and does) when it must wait for the repository: the line on the
    progress bar, else on stderr; its staging memory given back meanwhile. `waited`: it did."""

    def __init__(self, progress, arena: EarlyArena):
        self.progress, self.arena = progress, arena
        self.waited = False

    def __call__(self, text: str) -> None:
        if text.startswith("waiting"):
            self.waited = True
            self.arena.release()
        if self.progress is not None:
            self.progress(0, 0, text)
        else:
            from gpusnap.repo.recovery import warn

            warn("gpusnap: %s", text)


class AtFreeze:
    """What gpusnap records itself at the post-dump gate, inside the freeze: the sizes of the
    files the job appends to (system/appendfiles.py) and CRIU's link-remap files
    (system/linkremap.py, for the files the preflight found linked through a removed name)."""

    def __init__(self, pids: list[int], linked: list):
        from gpusnap.system import appendfiles, linkremap

        self.appending = appendfiles.Recorder(appendfiles.scan(pids))
        self.remaps = linkremap.Keeper(linked) if linked else None

    def at_freeze(self) -> None:
        self.appending.at_freeze()
        if self.remaps is not None:
            self.remaps.at_freeze()

    def meta(self, writer) -> dict:
        """The manifest's meta keys from the freeze; the kept link-remap files are stored as
        images of the snapshot now (the caller commits next)."""
        out: dict = {}
        if self.appending.files is not None:
            out["append_files"] = self.appending.files
        if self.remaps is not None and self.remaps.kept:
            out["link_remaps"] = self.remaps.store(writer)
        return out


def look(req: DumpRequest):
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
        # a network namespace not gpusnap's: its bind mount, joined again on restore (system/netns.py)
        "netns": plan.netns.to_meta() if plan.netns is not None else None,
    }
    gpu = gpu_facts(pids)
    if gpu:
        meta["gpu"] = gpu
    return plan, meta, gpu


def default_name(pid: int) -> str:
    """The job's command name, made a valid snapshot name."""
    st = proc.read_stat(pid)
    return validate.default_name(st.comm if st else "job")


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


def interrupted_after_commit(req: DumpRequest, snap, retention_started: bool) -> GpusnapError:
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
