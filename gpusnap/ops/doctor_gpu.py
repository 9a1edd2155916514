"""The NVIDIA side of `gpusnap doctor`: the driver, its checkpoint API and GPUs (every
machine), and what in a job's process tree would stop a GPU dump (MIG, MPS, NCCL, NVML, a
device file without a CUDA context). Each check goes through `add(name, status, detail,
fix, exit_code)`, the DoctorReport's, so this module needs nothing from ops.doctor."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable

from gpusnap.errors import GpuUnsupportedProcess
from gpusnap.gpu import driver as gdriver
from gpusnap.gpu import procs as gprocs
from gpusnap.system import paths

PROC = Path("/proc")
Add = Callable[..., object]


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def _environ(pid: int) -> dict[str, str]:
    raw = _read(PROC / str(pid) / "environ") or ""
    out = {}
    for item in raw.split("\0"):
        if "=" in item:
            k, v = item.split("=", 1)
            out[k] = v
    return out


def driver_checks(add: Add, probe: gdriver.DriverProbe) -> None:
    """The driver, the checkpoint API, the GPUs and an MPS daemon: checks for every machine."""
    if not probe.available:
        kmod = gdriver.kernel_driver_version()
        if kmod:
            add("NVIDIA driver", "warn", f"kernel module {kmod} is loaded but {probe.reason}",
                  "install the matching user-space driver (libcuda.so.1)")
        else:
            add("NVIDIA driver", "info", f"{gdriver.NO_DRIVER}: CPU-only dumps and restores "
                  f"work; GPU jobs cannot be snapshotted here ({probe.reason})")
        return
    ver = f"driver {probe.driver_version or '?'}, CUDA {probe.cuda_version or '?'}"
    if probe.reason:
        add("NVIDIA driver", "warn", f"{ver}: {probe.reason}", "check nvidia-smi")
    else:
        add("NVIDIA driver", "ok", ver)
    if probe.checkpoint_api:
        add("CUDA checkpoint API", "ok", "cuCheckpointProcess* available")
    else:
        add("CUDA checkpoint API", "fail",
              f"the driver (CUDA {probe.cuda_version or '?'}) lacks cuCheckpointProcess*: GPU "
              "processes cannot be snapshotted", "update the NVIDIA driver to r570 (CUDA 12.8) or newer")
    if probe.gpus:
        add("GPUs", "ok", "; ".join(
            f"#{g.index} {g.name} {g.memory_bytes / (1 << 30):.1f} GiB {g.uuid}" for g in probe.gpus))
    elif not probe.reason:
        add("GPUs", "warn", "the driver lists no GPU", "check nvidia-smi")
    mps = [p for p in _pids_named(("nvidia-cuda-mps-control", "nvidia-cuda-mps-server"))]
    if mps:
        add("MPS", "warn", f"an MPS daemon runs (pid {', '.join(map(str, mps))}): CUDA jobs that "
              "go through MPS cannot be checkpointed", "stop MPS (echo quit | nvidia-cuda-mps-control) "
              "before starting jobs you want to snapshot")


def _pids_named(names: Iterable[str]) -> list[int]:
    names = set(names)
    out = []
    for n in os.listdir(PROC):
        if n.isdigit() and ((_read(PROC / n / "comm") or "").strip() in names):
            out.append(int(n))
    return out


def job_checks(add: Add, tree: list[int], probe: gdriver.DriverProbe) -> None:
    """What in the job's process tree would stop (or weaken) a GPU dump."""
    mm = {g["minor"]: g for g in gprocs.machine_gpus(probe) if g.get("minor") is not None}
    gps = [g for p in tree if (g := gprocs.scan_process(p, mm)) is not None]
    env_mps = [p for p in tree if "CUDA_MPS_PIPE_DIRECTORY" in _environ(p)]
    if not gps:
        if env_mps:
            add("MPS", "warn", f"CUDA_MPS_PIPE_DIRECTORY is set in {env_mps[:3]}: once it uses CUDA "
                  "it goes through MPS, which CUDA checkpoint does not support")
        add("GPU", "ok", "the job uses no NVIDIA GPU: a CPU-only dump")
        return
    users = [g for g in gps if g.uses_gpu]
    names = ", ".join(f"{g.pid} ({g.comm}): " + (", ".join(
        f"#{x['index']} {x['uuid']}" if x.get("uuid") else f"/dev/nvidia{x['minor']}" for x in g.gpus)
        or "no GPU opened") for g in gps[:6])
    if not probe.available:
        add("GPU", "fail", f"CUDA process(es) {names}, but {probe.reason or gdriver.NO_DRIVER}",
              "install the NVIDIA driver's user-space library (libcuda.so.1)")
    elif not probe.checkpoint_api:
        add("GPU", "fail", f"CUDA process(es) {names}, but the driver lacks the checkpoint API",
              "update the NVIDIA driver to r570 (CUDA 12.8) or newer")
    else:
        states = gdriver.checkpoint_states([g.pid for g in users]) if users else {}
        bad = {p: s for p, s in states.items() if s not in (None, "running")}
        if bad:
            add("GPU", "fail", f"CUDA checkpoint state not 'running': {bad}",
                  "a previous dump or cuda-checkpoint left it so; `cuda-checkpoint --toggle --pid N` "
                  "or gpusnap restore it first")
        else:
            add("GPU", "ok", f"CUDA process(es) {names}; states: "
                  + ", ".join(f"{p}={s or 'not CUDA-initialised'}" for p, s in states.items()))
        nocontext = gprocs.devices_without_context(tree)
        if nocontext:  # the same check `gpusnap dump` refuses on
            add("GPU", "fail", "NVIDIA device files without a CUDA context: "
                  + gprocs.describe_without_context(nocontext), gprocs.NO_CONTEXT_HINT,
                  GpuUnsupportedProcess.exit_code)
        if not paths.plugin_path().is_file():
            add("GPU", "fail", f"the job uses a GPU but {paths.plugin_path()} is missing",
                  "build the plugin (cmake --build build) or set GPUSNAP_PLUGIN_DIR")
    if any(g.uvm for g in gps):
        add("UVM", "info", "/dev/nvidia-uvm is open (every CUDA runtime opens it); a job that "
              "allocates managed memory (cudaMallocManaged) cannot be checkpointed — the dump "
              "would fail at the checkpoint step and the job keeps running")
    mig = [g.pid for g in gps if g.mig]
    if mig:
        add("MIG", "fail", f"{mig} hold /dev/nvidia-caps (a MIG instance): CUDA checkpoint "
              "does not support MIG", "run the job on a full GPU")
    mps_sock = [g.pid for g in gps if any("nvidia-mps" in t for t in gprocs.fd_targets(g.pid))]
    if env_mps or mps_sock:
        add("MPS", "fail", f"{sorted(set(env_mps + mps_sock))} use MPS (CUDA_MPS_PIPE_DIRECTORY "
              "or an MPS pipe): CUDA checkpoint does not support MPS", "run the job without MPS")
    nccl = [g.pid for g in gps if g.nccl]
    if nccl:
        add("NCCL", "warn", f"{nccl} load NCCL: live NCCL communicators cannot be checkpointed",
              "tear communicators down before the dump and rebuild them after (or dump between "
              "phases that hold none)")
    nvml = [g.pid for g in gps if g.nvml]
    if nvml:
        if _driver_major(probe) >= 570:
            # r570+ checkpoints processes that hold NVML handles (criu#2953): PyTorch loads it
            add("NVML", "info", f"{nvml} load NVML (libnvidia-ml); driver {probe.driver_version or '?'} "
                  "(r570 or newer) checkpoints such processes")
        else:
            add("NVML", "warn", f"{nvml} load NVML (libnvidia-ml); drivers before r570 cannot "
                  "checkpoint a process that holds NVML handles", "update the NVIDIA driver to r570 "
                  "or newer, or keep NVML (pynvml, GPU monitoring threads) out of the job")


def _driver_major(probe: gdriver.DriverProbe) -> int:
    """The driver branch (570 for 570.133.20); from the CUDA version when the module's is unknown."""
    v = probe.driver_version or ""
    if v.split(".")[0].isdigit():
        return int(v.split(".")[0])
    return 570 if (probe.cuda_version_int or 0) >= 12080 else 0
