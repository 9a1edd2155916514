"""The NVIDIA driver as gpusnap sees it: version, GPUs, checkpoint API, per-process state,
and the recovery of a process a failed dump left checkpointed or locked.

The driver is asked through cuda-python (gpusnap.gpu.probe, the one backend). Nothing here
ever raises because a driver is missing: every public function degrades to "no NVIDIA driver".

By default the probing runs in a short-lived child process (`python -m gpusnap.gpu.probe`):

- `cuInit` opens /dev/nvidia* and starts driver threads; gpusnap itself then would hold GPU
  device files (and show up in `gpusnap ps`) and fork CRIU from a CUDA-initialised process;
- a wedged GPU can hang `cuInit`; a child can be timed out;
- the child runs with CUDA_DEVICE_ORDER=PCI_BUS_ID and without CUDA_VISIBLE_DEVICES, so GPU
  indices are the ones nvidia-smi shows and every GPU of the machine is listed.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

from gpusnap import settings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

# CUprocessState (cuda.h, CUDA >= 12.8: the checkpoint API, driver r570)
STATE_NAMES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}
NO_DRIVER = "no NVIDIA driver"
PROBE_TIMEOUT_S = 30.0


@dataclass
class GpuInfo:
    index: int              # PCI bus order, the index nvidia-smi shows
    uuid: str               # 'GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx'
    name: str
    memory_bytes: int | None
    pci_bus_id: str | None  # '0000:19:00.0' (lower case)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GpuInfo":
        return cls(index=int(d.get("index", -1)), uuid=str(d.get("uuid", "")),
                   name=str(d.get("name", "")), memory_bytes=d.get("memory_bytes"),
                   pci_bus_id=d.get("pci_bus_id"))


@dataclass
class DriverProbe:
    """What the driver said. `available` is False when libcuda.so.1 cannot be loaded."""

    available: bool = False
    reason: str | None = NO_DRIVER          # why not available, or a partial failure
    driver_version: str | None = None       # kernel module release, '570.133.20'
    cuda_version: str | None = None         # CUDA driver API version, '12.8'
    cuda_version_int: int | None = None     # 12080
    checkpoint_api: bool = False
    gpus: list[GpuInfo] = field(default_factory=list)
    states: dict[int, str | None] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpus"] = [g.to_dict() for g in self.gpus]
        d["states"] = {str(k): v for k, v in self.states.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DriverProbe":
        return cls(
            available=bool(d.get("available")), reason=d.get("reason"),
            driver_version=d.get("driver_version"), cuda_version=d.get("cuda_version"),
            cuda_version_int=d.get("cuda_version_int"),
            checkpoint_api=bool(d.get("checkpoint_api")),
            gpus=[GpuInfo.from_dict(g) for g in d.get("gpus") or []],
            states={int(k): v for k, v in (d.get("states") or {}).items()},
        )

    def info(self) -> dict[str, Any] | None:
        """The `driver_info()` shape, or None without a driver."""
        if not self.available:
            return None
        return {
            "driver_version": self.driver_version,
            "cuda_version": self.cuda_version,
            "checkpoint_api": self.checkpoint_api,
            "gpus": [g.to_dict() for g in self.gpus],
        }

    def summary(self) -> str:
        if not self.available:
            return self.reason or NO_DRIVER
        parts = [f"NVIDIA driver {self.driver_version or '?'}", f"CUDA {self.cuda_version or '?'}",
                 f"{len(self.gpus)} GPU(s)",
                 "checkpoint API available" if self.checkpoint_api else "no checkpoint API"]
        return ", ".join(parts)


# ---------------------------------------------------------------- helpers

def format_uuid(raw: bytes | Iterable[int]) -> str:
    """16 raw bytes → 'GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx' (nvidia-smi's form)."""
    b = bytes((x & 0xFF) for x in raw) if not isinstance(raw, (bytes, bytearray)) else bytes(raw)
    if len(b) != 16:
        raise ValueError(f"a GPU UUID has 16 bytes, not {len(b)}")
    h = b.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def format_cuda_version(v: int | None) -> str | None:
    if not v:
        return None
    return f"{v // 1000}.{(v % 1000) // 10}"


def normalize_bus_id(bus: str | None) -> str | None:
    """'00000000:19:00.0' (CUDA, nvidia-smi) or '0000:19:00.0' (/proc) → '0000:19:00.0'."""
    if not bus:
        return None
    bus = bus.strip().lower()
    parts = bus.split(":")
    if len(parts) == 3:
        dom = parts[0][-4:].rjust(4, "0")
        return f"{dom}:{parts[1]}:{parts[2]}"
    return bus


def kernel_driver_version() -> str | None:
    """The NVIDIA kernel module's release ('570.133.20'), from /sys or /proc, if loaded."""
    try:
        return Path("/sys/module/nvidia/version").read_text().strip() or None
    except OSError:
        pass
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    for tok in text.split():
        if tok[:1].isdigit() and tok.count(".") >= 1:
            return tok
    return None


# ---------------------------------------------------------------- isolated probe (default)

def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    from gpusnap.system.paths import source_root

    root = str(source_root())
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def probe(pids: Iterable[int] = (), *, isolated: bool | None = None,
          timeout: float = PROBE_TIMEOUT_S) -> DriverProbe:
    """Probe the driver (and the checkpoint state of `pids`). Never raises.

    isolated=None follows $GPUSNAP_GPU_PROBE ('inprocess' turns isolation off).
    """
    pids = [int(x) for x in pids]
    if isolated is None:
        isolated = settings.get("GPUSNAP_GPU_PROBE", "") != "inprocess"
    if not isolated:
        from gpusnap.gpu.probe import probe_inprocess  # lazy: cuda-python loads only when asked; probe.py uses our types
        return probe_inprocess(pids)
    cmd = [sys.executable, "-m", "gpusnap.gpu.probe", *map(str, pids)]
    try:
        r = subprocess.run(cmd, env=_child_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return DriverProbe(available=False,
                           reason=f"NVIDIA driver did not answer within {timeout:.0f} s (GPU hung?)",
                           states={p: None for p in pids})
    except OSError as e:
        return DriverProbe(available=False, reason=f"could not run the driver probe: {e}",
                           states={p: None for p in pids})
    try:
        return DriverProbe.from_dict(json.loads(r.stdout))
    except (ValueError, TypeError, AttributeError):
        tail = (r.stderr or r.stdout or "").strip().splitlines()[-1:] or ["no output"]
        return DriverProbe(available=False,
                           reason=f"driver probe failed (exit {r.returncode}): {tail[0]}",
                           states={p: None for p in pids})


@functools.lru_cache(maxsize=1)
def _cached_probe() -> DriverProbe:
    return probe()


_remembered: DriverProbe | None = None


def probe_cached() -> DriverProbe:
    """probe() without per-process states, once per gpusnap run."""
    return _remembered if _remembered is not None else _cached_probe()


def probe_with_states(pids: Iterable[int]) -> DriverProbe:
    """probe(pids), remembered as this run's probe_cached() too: a dump asks for both and
    each probe is a child that initialises the driver (about a second on a GPU machine)."""
    global _remembered
    p = probe(pids)
    if p.available and _remembered is None:
        _remembered = p
    return p


def driver_info() -> dict[str, Any] | None:
    """None without a usable driver, else
    {driver_version, cuda_version, checkpoint_api, gpus: [{index, uuid, name, memory_bytes,
    pci_bus_id}]}. This is what a dump records in its manifest."""
    return probe_cached().info()


def checkpoint_state(pid: int) -> str | None:
    """'running' | 'locked' | 'checkpointed' | 'failed', or None (not a CUDA process,
    no driver, or no checkpoint API)."""
    return checkpoint_states([pid]).get(int(pid))


def checkpoint_states(pids: Iterable[int]) -> dict[int, str | None]:
    """checkpoint_state for many processes in one probe."""
    pids = [int(p) for p in pids]
    if not pids:
        return {}
    p = probe(pids)
    return {pid: p.states.get(pid) for pid in pids}


def resume_process(pid: int, *, timeout: float | None = None, target: str = "running") -> dict[str, Any]:
    """Best-effort recovery after a failed dump: make `pid` RUNNING again on the GPU
    (cuCheckpointProcessRestore if it is checkpointed, then Unlock if locked). The target must
    not be frozen (SIGCONT it first: the driver's restore thread inside it does the work).
    Returns {pid, before, after, error}; never raises. Runs in a child process like probe()."""
    if timeout is None:  # restore copies GPU memory back: as long as the plugin would wait
        from gpusnap.gpu import limits
        timeout = limits.call_timeout_ms() / 1000 * 2 + 30
    cmd = [sys.executable, "-m", "gpusnap.gpu.probe", "--resume", str(int(pid))]
    if target != "running":
        cmd.append(target)
    try:
        r = subprocess.run(cmd, env=_child_env(), capture_output=True, text=True, timeout=timeout)
        return json.loads(r.stdout)
    except subprocess.TimeoutExpired:
        return {"pid": int(pid), "before": None, "after": None,
                "error": f"the driver did not answer within {timeout:.0f} s"}
    except (OSError, ValueError) as e:
        return {"pid": int(pid), "before": None, "after": None, "error": str(e)}
