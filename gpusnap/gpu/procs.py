"""Which processes use NVIDIA GPUs, and which GPUs: read from /proc, no driver needed.

A process "uses" a GPU when it holds /dev/nvidiaN open (or mapped); N is the device minor,
which /proc/driver/nvidia/gpus/<bus>/information maps to the GPU's UUID and PCI bus id.
The driver probe (gpusnap.gpu.driver) adds the index nvidia-smi shows and the CUDA
checkpoint state; without a driver those stay unknown and everything else still works.
The tables of `gpusnap ps` and of a snapshot's GPUs are made in render (machine, snapshots).
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from gpusnap.gpu import driver as _driver

PROC = Path("/proc")
NVIDIA_GPUS_DIR = Path("/proc/driver/nvidia/gpus")
_DEV_MINOR = re.compile(r"^/dev/nvidia(\d+)$")


# ---------------------------------------------------------------- /proc/driver/nvidia

def parse_gpu_information(text: str) -> dict[str, Any]:
    """Parse /proc/driver/nvidia/gpus/<bus>/information ('Key:  value' lines)."""
    kv: dict[str, str] = {}
    for line in text.splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            kv[k.strip().lower()] = v.strip()
    minor = kv.get("device minor")
    return {
        "minor": int(minor) if minor and minor.isdigit() else None,
        "uuid": kv.get("gpu uuid") or None,
        "name": kv.get("model") or None,
        "pci_bus_id": _driver.normalize_bus_id(kv.get("bus location")),
    }


def proc_gpus(gpus_dir: Path = NVIDIA_GPUS_DIR) -> list[dict[str, Any]]:
    """Every GPU the loaded kernel module knows: [{minor, uuid, name, pci_bus_id}], by bus id."""
    out = []
    try:
        entries = sorted(gpus_dir.iterdir())
    except OSError:
        return []
    for d in entries:
        try:
            info = parse_gpu_information((d / "information").read_text())
        except OSError:
            continue
        if info["pci_bus_id"] is None:
            info["pci_bus_id"] = _driver.normalize_bus_id(d.name)
        out.append(info)
    out.sort(key=lambda g: g["pci_bus_id"] or "")
    return out


def machine_gpus(probe: "_driver.DriverProbe | None" = None,
                 gpus_dir: Path = NVIDIA_GPUS_DIR) -> list[dict[str, Any]]:
    """The machine's GPUs as [{index, uuid, name, memory_bytes, pci_bus_id, minor}].

    From the driver when it answers, joined with /proc for the device minor; from /proc
    alone (indices in bus order, memory unknown) when only the kernel module is there.
    """
    from_proc = proc_gpus(gpus_dir)
    by_bus = {g["pci_bus_id"]: g for g in from_proc}
    by_uuid = {g["uuid"]: g for g in from_proc if g["uuid"]}
    if probe is not None and probe.available and probe.gpus:
        out = []
        for g in probe.gpus:
            d = g.to_dict()
            p = by_uuid.get(g.uuid) or by_bus.get(g.pci_bus_id) or {}
            d["minor"] = p.get("minor")
            out.append(d)
        return out
    return [{"index": i, "uuid": g["uuid"], "name": g["name"], "memory_bytes": None,
             "pci_bus_id": g["pci_bus_id"], "minor": g["minor"]} for i, g in enumerate(from_proc)]


# ---------------------------------------------------------------- per process

@dataclass
class GpuProcess:
    pid: int
    comm: str
    cmdline: str
    uid: int | None
    user: str | None
    device_files: list[str] = field(default_factory=list)  # /dev/nvidia* held or mapped
    gpu_minors: list[int] = field(default_factory=list)
    gpus: list[dict[str, Any]] = field(default_factory=list)  # [{index, uuid, name}]
    libcuda: bool = False       # libcuda.so mapped (a CUDA driver API user)
    uvm: bool = False           # /dev/nvidia-uvm open (every CUDA runtime opens it)
    mig: bool = False           # /dev/nvidia-caps/* open (MIG)
    nccl: bool = False          # libnccl mapped
    nvml: bool = False          # libnvidia-ml mapped
    state: str | None = None    # CUDA checkpoint state, None when unknown / not CUDA
    memory_bytes: int | None = None  # GPU memory used (nvidia-smi), when known

    @property
    def uses_gpu(self) -> bool:
        return bool(self.device_files)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["uses_gpu"] = self.uses_gpu
        return d


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def _uid_of(pid: int) -> int | None:
    status = _read(PROC / str(pid) / "status") or ""
    for line in status.splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[2])  # effective uid
    return None


def _user(uid: int | None) -> str | None:
    if uid is None:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def fd_targets(pid: int) -> list[str]:
    """readlink of every /proc/PID/fd/* (empty when unreadable or gone)."""
    d = PROC / str(pid) / "fd"
    out = []
    try:
        names = os.listdir(d)
    except OSError:
        return []
    for n in names:
        try:
            out.append(os.readlink(d / n))
        except OSError:
            continue
    return out


def mapped_paths(pid: int) -> set[str]:
    """Pathnames mapped in /proc/PID/maps."""
    text = _read(PROC / str(pid) / "maps") or ""
    out = set()
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            out.add(parts[5].removesuffix(" (deleted)"))
    return out


def scan_process(pid: int, minor_map: dict[int, dict[str, Any]] | None = None) -> GpuProcess | None:
    """GPU facts about one process, or None when it is gone or touches nothing NVIDIA."""
    base = PROC / str(pid)
    comm = _read(base / "comm")
    if comm is None:
        return None
    fds = fd_targets(pid)
    maps = mapped_paths(pid)
    devs = sorted({p for p in list(fds) + list(maps) if p.startswith("/dev/nvidia")})
    libs = [os.path.basename(p) for p in maps]
    libcuda = any(b.startswith("libcuda.so") for b in libs)
    if not devs and not libcuda:
        return None
    cmd = (_read(base / "cmdline") or "").replace("\0", " ").strip()
    uid = _uid_of(pid)
    gp = GpuProcess(pid=pid, comm=comm.strip(), cmdline=cmd, uid=uid, user=_user(uid),
                    device_files=devs, libcuda=libcuda)
    gp.gpu_minors = sorted({int(m.group(1)) for p in devs if (m := _DEV_MINOR.match(p))})
    gp.uvm = "/dev/nvidia-uvm" in devs
    gp.mig = any(p.startswith("/dev/nvidia-caps") for p in devs)
    gp.nccl = any(b.startswith("libnccl") for b in libs)
    gp.nvml = any(b.startswith("libnvidia-ml") for b in libs)
    mm = minor_map or {}
    gp.gpus = [{"index": mm.get(m, {}).get("index"), "uuid": mm.get(m, {}).get("uuid"),
                "name": mm.get(m, {}).get("name"), "minor": m} for m in gp.gpu_minors]
    return gp


def _all_pids() -> list[int]:
    return sorted(int(n) for n in os.listdir(PROC) if n.isdigit())


def _minor_map(probe: "_driver.DriverProbe | None") -> dict[int, dict[str, Any]]:
    return {g["minor"]: g for g in machine_gpus(probe) if g.get("minor") is not None}


def parse_compute_apps(text: str) -> tuple[dict[int, list[str]], dict[int, int]]:
    """nvidia-smi's `--query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader,nounits`:
    (the GPU UUIDs of each process's contexts, its GPU memory in bytes summed over them). A
    memory figure that is not a number ("[N/A]" where the driver hides it) is left out."""
    gpus: dict[int, list[str]] = {}
    mem: dict[int, int] = {}
    for line in text.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].startswith("GPU-"):
            continue
        pid = int(parts[0])
        if parts[1] not in gpus.setdefault(pid, []):
            gpus[pid].append(parts[1])
        if parts[2].isdigit():
            mem[pid] = mem.get(pid, 0) + (int(parts[2]) << 20)
    return gpus, mem


def smi_compute_apps() -> tuple[dict[int, list[str]], dict[int, int]]:
    """GPU UUIDs each process has a CUDA context on (NVML's compute processes, through
    nvidia-smi), and its GPU memory; ({}, {}) when nvidia-smi is not installed. Exact where
    /dev/nvidiaN over-counts: CUDA opens every visible GPU's device file, whichever it computes on."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {}, {}
    try:
        r = subprocess.run([smi, "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return {}, {}
    return parse_compute_apps(r.stdout)


def smi_memory() -> dict[int, int]:
    """GPU memory used per pid, from nvidia-smi when it is installed (else {})."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {}
    try:
        r = subprocess.run([smi, "--query-compute-apps=pid,used_memory",
                            "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    out: dict[int, int] = {}
    for line in r.stdout.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            out[int(parts[0])] = out.get(int(parts[0]), 0) + int(parts[1]) * 1024 * 1024
    return out


class GpuProcessList(list):
    """gpu_processes()'s result: a list of GpuProcess, plus the driver it was read with."""

    def __init__(self, items: Iterable[GpuProcess] = (), driver: "_driver.DriverProbe | None" = None):
        super().__init__(items)
        self.driver = driver

    def to_dict(self) -> dict[str, Any]:
        d = self.driver
        return {
            "driver": None if d is None else {"available": d.available, "summary": d.summary(),
                                              **(d.info() or {})},
            "processes": [g.to_dict() for g in self],
        }


def gpu_processes(*, with_state: bool = True, include_self: bool = False,
                  pids: Iterable[int] | None = None) -> GpuProcessList:
    """Processes holding NVIDIA device files (or mapping libcuda), for `gpusnap ps`.

    with_state asks the driver (one probe) for each process's CUDA checkpoint state and
    nvidia-smi for its GPU memory; without a driver both stay None.
    """
    probe = _driver.probe_cached() if with_state else None
    mm = _minor_map(probe)
    me = os.getpid()
    found: list[GpuProcess] = []
    for pid in (_all_pids() if pids is None else [int(p) for p in pids]):
        if pid == me and not include_self:
            continue
        gp = scan_process(pid, mm)
        if gp is not None:
            found.append(gp)
    if with_state and found and probe is not None and probe.available and probe.checkpoint_api:
        states = _driver.checkpoint_states([g.pid for g in found if g.uses_gpu])
        mem = smi_memory()
        for g in found:
            g.state = states.get(g.pid)
            g.memory_bytes = mem.get(g.pid)
    return GpuProcessList(found, probe)


def process_gpus(pids: Iterable[int]) -> dict[int, list[str]]:
    """GPU UUIDs used by each process (minor numbers as 'minor:N' when the UUID is unknown)."""
    mm = _minor_map(_driver.probe_cached())
    out: dict[int, list[str]] = {}
    for pid in pids:
        gp = scan_process(int(pid), mm)
        out[int(pid)] = [] if gp is None else [g["uuid"] or f"minor:{g['minor']}" for g in gp.gpus]
    return out


def gpu_manifest(pids: Iterable[int]) -> dict[str, Any]:
    """The GPU section of a dump manifest, for the processes of the dumped tree.

    {
      "driver": driver_info() or None,
      "gpus": [{index, uuid, name, memory_bytes, pci_bus_id, used}],   # the whole machine
      "processes": [{pid, comm, gpus: [uuid], device_files, libcuda, uvm, nccl, memory_bytes}]
                                                         # only tree members that touch NVIDIA
    }
    Call it before CRIU runs (while the tree is alive and not yet checkpointed: after a CUDA
    checkpoint the process releases the GPU and its device files).
    This is the `recorded` argument of gpusnap.gpu.remap.check_restore_compat.
    """
    probe = _driver.probe_cached()
    gpus = machine_gpus(probe)
    mm = {g["minor"]: g for g in gpus if g.get("minor") is not None}
    apps, mem = smi_compute_apps() if probe.available else ({}, {})
    procs = []
    for pid in pids:
        gp = scan_process(int(pid), mm)
        if gp is None:
            continue
        from_files = [g["uuid"] or f"minor:{g['minor']}" for g in gp.gpus]
        procs.append({"pid": gp.pid, "comm": gp.comm,
                      # NVML knows where the process has a context; its device files over-count
                      "gpus": apps.get(gp.pid, from_files),
                      "gpus_from": "nvml" if gp.pid in apps else "device-files",
                      "device_files": gp.device_files, "libcuda": gp.libcuda,
                      "uvm": gp.uvm, "nccl": gp.nccl,
                      # what a CUDA checkpoint moves into host memory, about (the arena's size)
                      "memory_bytes": mem.get(gp.pid)})
    used = {u for p in procs for u in p["gpus"]}
    return {
        "driver": probe.info(),
        "gpus": [{k: g.get(k) for k in ("index", "uuid", "name", "memory_bytes", "pci_bus_id")}
                 | {"used": g.get("uuid") in used} for g in gpus],
        "processes": procs,
    }


def describe_recorded(recorded: dict[str, Any] | None) -> dict[str, Any] | None:
    """The GPU section of a snapshot's manifest, normalised for `gpusnap inspect`:
    {driver_version, cuda_version, gpus: [{index, uuid, name, memory_bytes, pci_bus_id, used}],
     processes: [{pid, gpus: [uuid]}]}; None for a snapshot without GPU information.
    Accepts gpu_manifest()'s shape and {driver: driver_info(), processes: {pid: [uuid]}}."""
    if not recorded:
        return None
    drv = recorded.get("driver") or {}
    gpus = recorded.get("gpus")
    if gpus is None:
        gpus = drv.get("gpus") or []
    procs_ = recorded.get("processes") or []
    if isinstance(procs_, dict):
        procs_ = [{"pid": int(k), "gpus": list(v or [])} for k, v in procs_.items()]
    used = {u for p in procs_ for u in (p.get("gpus") or [])}
    return {
        "driver_version": drv.get("driver_version"),
        "cuda_version": drv.get("cuda_version"),
        "gpus": [{k: g.get(k) for k in ("index", "uuid", "name", "memory_bytes", "pci_bus_id")}
                 | {"used": bool(g.get("used")) or g.get("uuid") in used} for g in gpus],
        "processes": [{"pid": p.get("pid"), "gpus": list(p.get("gpus") or [])} for p in procs_],
    }


# ---------------------------------------------------------------- device files without a CUDA context

NO_CONTEXT_HINT = ("a process that maps /dev/nvidia* without a CUDA context (a DataLoader worker "
                   "forked after CUDA was initialised, an NVML-only monitor such as a GPU-usage "
                   "logger) cannot be checkpointed by the driver, and CRIU cannot dump its device "
                   "mapping: start such workers with the 'spawn' start method or num_workers=0, run "
                   "monitors outside the job's process tree, or dump a subtree without them")


def devices_without_context(pids: Iterable[int],
                            probe: "_driver.DriverProbe | None" = None) -> list[GpuProcess]:
    """Processes among `pids` that hold or map /dev/nvidia* but which the driver does not
    know as CUDA processes. [] when no process touches the devices, or when no driver with
    the checkpoint API can tell (other checks report that)."""
    touching = [gp for pid in pids if (gp := scan_process(int(pid))) is not None and gp.device_files]
    if not touching:
        return []
    p = probe if probe is not None else _driver.probe_with_states([gp.pid for gp in touching])
    if not p.available or not p.checkpoint_api:
        return []
    out = []
    for gp in touching:
        gp.state = p.states.get(gp.pid)
        if gp.state is None and scan_process(gp.pid) is not None:
            out.append(gp)
    return out


def describe_without_context(bad: list[GpuProcess]) -> str:
    items = [f"PID {g.pid} ({g.comm}: {', '.join(g.device_files[:3])}"
             + (", ..." if len(g.device_files) > 3 else "") + ")" for g in bad[:6]]
    more = f" and {len(bad) - 6} more" if len(bad) > 6 else ""
    return "; ".join(items) + more


def refuse_devices_without_context(pids: Iterable[int]) -> None:
    """Raise GpuUnsupportedProcess, naming them, when any process of the tree maps NVIDIA
    device files without a CUDA context (found before the job is touched)."""
    from gpusnap.errors import GpuUnsupportedProcess

    bad = devices_without_context(pids)
    if bad:
        raise GpuUnsupportedProcess(
            f"process(es) of the job use NVIDIA device files without a CUDA context: "
            f"{describe_without_context(bad)}; the job was not touched", hint=NO_CONTEXT_HINT)
