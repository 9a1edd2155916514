"""Bringing a snapshot back: checks first, then CRIU fed by the image streamer, detached.

Before CRIU starts, the snapshot's structure is checked and its PIDs must be free; while
CRIU reads, every page is checked against its checksum, and a bad one breaks the stream so
CRIU fails before the restored tree ever runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from gpusnap import locate, netlock, paths, proc
from gpusnap.criu import runner
from gpusnap.criu.streamer import ServeServer
from gpusnap.errors import CorruptSnapshot, CriuFailed, GpusnapError, PidsInUse

# A PID still held by a process that is exiting (or a zombie about to be reaped) frees up
# within moments; wait this long before declaring it taken.
PID_WAIT_SECONDS = 5.0


@dataclass
class RestoreResult:
    pid: int
    snapshot: str
    seconds: float
    pids: list[int]
    # wall seconds: preflight (snapshot checks, PIDs, GPUs), criu (CRIU restoring while the
    # images stream out of the repository)
    phases: dict[str, float] = field(default_factory=dict)
    # established TCP connections in the snapshot came back closed (--tcp-close), and why
    tcp_closed: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def snapshot_pids(snap) -> list[int]:
    """The PIDs (and thread ids) the snapshot will recreate: recorded at dump time, or else
    read from its pstree image (pycriu is slow to import: 0.1 s of a restore)."""
    meta = snap.manifest.get("meta", {})
    pids, tids = meta.get("pids"), meta.get("tids")
    if (isinstance(pids, list) and isinstance(tids, list) and pids
            and all(type(x) is int and 0 < x < 1 << 22 for x in pids + tids)):
        return list(dict.fromkeys(pids + tids))
    import pycriu.images

    raw = b"".join(snap.read_image("pstree.img"))
    try:
        entries = pycriu.images.loads(raw)["entries"]
    except Exception as e:  # noqa: BLE001 - anything malformed is a corrupt snapshot
        raise CorruptSnapshot(f"snapshot {snap.path} has an unreadable process tree: {e}") from None
    pids: list[int] = []
    for e in entries:
        pids.append(int(e["pid"]))
        pids.extend(int(t) for t in e.get("threads", []) if int(t) != int(e["pid"]))
    return pids


def _check_pids_free(pids: list[int], snap_path) -> None:
    busy = [p for p in pids if proc.read_stat(p) is not None]
    if not busy:
        return
    busy = proc.wait_gone(busy, PID_WAIT_SECONDS)
    if busy:
        desc = ", ".join(f"{p} ({proc.cmdline(p)[:60] or proc.read_stat(p).comm})" for p in busy[:5]
                         if proc.read_stat(p))
        raise PidsInUse(f"PID(s) needed by the snapshot are in use: {desc}",
                        hint="the original job is probably still running; stop it first (or restore "
                             "on another machine or in a PID namespace)")


def _pids_taken_meanwhile(pids: list[int], snap_path, kept) -> None:
    """CRIU lost a race for the snapshot's PIDs (another restore of the same job started at
    the same moment): that is PidsInUse, not a CRIU failure."""
    busy = [p for p in pids if proc.read_stat(p) is not None]
    if busy:
        raise PidsInUse(f"PID(s) needed by the snapshot were taken while it was restoring: "
                        f"{', '.join(map(str, busy[:5]))} (another restore of the same job?)",
                        hint=f"the job is probably running again already; check it (CRIU log kept at {kept})")


def _gpu_env(snap, gpu_map: str | None) -> dict[str, str]:
    meta = snap.manifest.get("meta", {})
    recorded = meta.get("gpu")
    if not recorded and not gpu_map and not meta.get("cuda_pids"):
        return {}
    from gpusnap.gpu import driver as gpu_driver, remap

    pairs = remap.check_restore_compat(recorded, gpu_driver.driver_info(), gpu_map,
                                       cuda_pids=meta.get("cuda_pids") or [])
    return {"GPUSNAP_GPU_MAP": ",".join(f"{a}={b}" for a, b in pairs)} if pairs else {}


def restore(ref: str, repo: str | os.PathLike | None = None, gpu_map: str | None = None,
            progress: Callable[[int, int], None] | None = None, tcp_close: bool = False) -> RestoreResult:
    t0 = time.monotonic()
    runner.require_privileges("restore")
    info = runner.criu_info()
    repository, snap = locate.open_snapshot(ref, repo)
    with repository.readers_lock():
        return _restore(repository, snap, info, gpu_map, progress, t0, tcp_close)


def _restore(repository, snap, info, gpu_map, progress, t0, tcp_close=False) -> RestoreResult:
    snap.check_structure()
    env = dict(os.environ)
    env.update(_gpu_env(snap, gpu_map))
    pids = snapshot_pids(snap)
    own_pidns = snap.manifest.get("meta", {}).get("own_pid_namespace") is True
    if not own_pidns:  # a PID namespace of its own is recreated fresh: nothing can clash
        _check_pids_free(pids, snap.path)
    total = int(snap.manifest.get("stats", {}).get("bytes_raw", 0))
    flags = list(snap.manifest.get("meta", {}).get("restore_flags", []))
    allowed = {"--shell-job", "--tcp-established", "--file-locks"}
    if not set(flags) <= allowed:  # the manifest is data, not a command line
        raise CorruptSnapshot(f"snapshot {snap.path} asks for unexpected CRIU flags {flags}")
    conns = [c for c in snap.manifest.get("meta", {}).get("tcp") or [] if isinstance(c, dict)]
    closed, why = netlock.restore_tcp_close(conns, tcp_close)
    if closed:
        flags.append("--tcp-close")

    workdir = Path(tempfile.mkdtemp(prefix="gpusnap-restore-"))
    log = workdir / "criu.log"
    pidfile = workdir / "restored.pid"

    def source(name: str):
        return snap.read_image(name) if snap.has_image(name) else None

    server = ServeServer(workdir, source).start()
    t_criu = time.monotonic()
    try:
        criu = subprocess.Popen(
            [info.path, "restore", "-D", str(workdir), "--stream", "--restore-detached",
             "--pidfile", str(pidfile), "--libdir", str(paths.plugin_dir()), "-o", str(log), "-v4", *flags],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
            start_new_session=True)
        runner.supervise(criu, server, progress, total)
        if criu.returncode != 0 or server.failed:
            server.abort()
            kept = runner.keep_log(repository.path, log, f"failed-restore-{Path(snap.path).name}-"
                                                    f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}")
            err = server.error()
            if isinstance(err, GpusnapError):
                err.hint = (err.hint + " " if err.hint else "") + f"(CRIU log kept at {kept})"
                raise err
            lines = runner.log_errors(log)
            _pids_taken_meanwhile(pids, snap.path, kept)
            raise CriuFailed(f"criu restore failed (exit status {criu.returncode})", log_path=kept,
                             last_lines=lines, hint=runner.explain(lines))
        server.finish(timeout=30)
        t_end = time.monotonic()
        if progress:
            progress(total, total)
        try:
            pid = int(pidfile.read_text().split()[0])
            if own_pidns:  # the recorded PIDs are the original's; the restored tree has new ones
                pids = proc.tree(pid)
        except (OSError, ValueError, IndexError):
            pid = pids[0]
            if own_pidns:  # never hand back the original's PIDs as the restored ones
                raise CriuFailed("criu restore left no PID file; the restored job's PID is unknown",
                                 log_path=str(log)) from None
        runner.keep_log(repository.path, log, f"{Path(snap.path).name}-restore")
        if closed:
            netlock.unlock_closed(conns)
    finally:
        server.abort()
        shutil.rmtree(workdir, ignore_errors=True)
    return RestoreResult(pid=pid, snapshot=str(snap.path), seconds=round(time.monotonic() - t0, 3), pids=pids,
                         phases={"preflight": round(t_criu - t0, 3), "criu": round(t_end - t_criu, 3)},
                         tcp_closed=why if closed else None)

