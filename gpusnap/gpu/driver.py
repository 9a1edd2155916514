"""The NVIDIA driver as gpusnap sees it: version, GPUs, checkpoint API, per-process state.

Built on cuda-python (`cuda.bindings.driver`), with a ctypes fallback over `libcuda.so.1`
for drivers (or test doubles) that cuda-python's loader refuses. Nothing here ever raises
because a driver is missing: every public function degrades to "no NVIDIA driver".

By default the probing runs in a short-lived child process (`python -m gpusnap.gpu.driver`):

- `cuInit` opens /dev/nvidia* and starts driver threads; gpusnap itself then would hold GPU
  device files (and show up in `gpusnap ps`) and fork CRIU from a CUDA-initialised process;
- a wedged GPU can hang `cuInit`; a child can be timed out;
- the child runs with CUDA_DEVICE_ORDER=PCI_BUS_ID and without CUDA_VISIBLE_DEVICES, so GPU
  indices are the ones nvidia-smi shows and every GPU of the machine is listed.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

# CUprocessState (cuda.h, CUDA >= 12.8)
STATE_NAMES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}
CHECKPOINT_FUNCTIONS = (
    "cuCheckpointProcessGetRestoreThreadId",
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
)
# The driver checkpoint API appeared with CUDA 12.8 (driver r570).
MIN_CHECKPOINT_CUDA = 12080
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
    backend: str | None = None              # 'cuda-python' | 'ctypes'
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
            backend=d.get("backend"),
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


def _is_lib_not_found(exc: BaseException) -> bool:
    name = type(exc).__name__
    return name in ("DynamicLibNotFoundError",) or "libcuda" in str(exc) and "not found" in str(exc).lower()


# ---------------------------------------------------------------- backends

class _Unavailable(Exception):
    pass


class _CudaPythonBackend:
    name = "cuda-python"

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver as cu  # type: ignore[import-not-found]
        except Exception as e:  # ImportError, or a broken install
            raise RuntimeError(f"cuda-python unusable: {e}") from e
        self.cu = cu
        try:
            (err,) = cu.cuInit(0)
        except Exception as e:
            if _is_lib_not_found(e):
                raise _Unavailable(f"{NO_DRIVER} (libcuda.so.1 not found)") from e
            raise
        self.init_error = None if err == cu.CUresult.CUDA_SUCCESS else self._errname(err)

    def _errname(self, err: Any) -> str:
        try:
            e2, s = self.cu.cuGetErrorName(err)
            if e2 == self.cu.CUresult.CUDA_SUCCESS and s:
                return s.decode() if isinstance(s, bytes) else str(s)
        except Exception:
            pass
        return getattr(err, "name", str(err))

    def _ok(self, err: Any) -> bool:
        return err == self.cu.CUresult.CUDA_SUCCESS

    def version(self) -> int | None:
        err, v = self.cu.cuDriverGetVersion()
        return int(v) if self._ok(err) else None

    def devices(self) -> list[dict[str, Any]]:
        cu = self.cu
        err, n = cu.cuDeviceGetCount()
        if not self._ok(err):
            raise RuntimeError(f"cuDeviceGetCount: {self._errname(err)}")
        out = []
        for i in range(int(n)):
            err, dev = cu.cuDeviceGet(i)
            if not self._ok(err):
                raise RuntimeError(f"cuDeviceGet({i}): {self._errname(err)}")
            err, name = cu.cuDeviceGetName(256, dev)
            name = name.split(b"\0", 1)[0].decode(errors="replace") if self._ok(err) else "?"
            err, uuid = cu.cuDeviceGetUuid(dev)
            uuid_s = format_uuid(uuid.bytes) if self._ok(err) else f"GPU-unknown-{i}"
            err, mem = cu.cuDeviceTotalMem(dev)
            mem = int(mem) if self._ok(err) else None
            err, bus = cu.cuDeviceGetPCIBusId(64, dev)
            bus = normalize_bus_id(bus.split(b"\0", 1)[0].decode()) if self._ok(err) else None
            out.append({"uuid": uuid_s, "name": name, "memory_bytes": mem, "pci_bus_id": bus})
        return out

    def has_checkpoint_api(self) -> bool:
        try:
            self.cu.cuCheckpointProcessGetState(os.getpid())
        except RuntimeError:  # 'Function "cuCheckpointProcessGetState" not found'
            return False
        return True

    def restore(self, pid: int) -> str | None:
        (err,) = self.cu.cuCheckpointProcessRestore(int(pid), None)
        return None if self._ok(err) else self._errname(err)

    def unlock(self, pid: int) -> str | None:
        (err,) = self.cu.cuCheckpointProcessUnlock(int(pid), None)
        return None if self._ok(err) else self._errname(err)

    def state(self, pid: int) -> str | None:
        try:
            err, st = self.cu.cuCheckpointProcessGetState(int(pid))
        except RuntimeError:
            return None
        if not self._ok(err):
            return None
        return STATE_NAMES.get(int(st), f"unknown({int(st)})")


class _CtypesBackend:
    name = "ctypes"

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise _Unavailable(f"{NO_DRIVER} (libcuda.so.1 not found: {e})") from e
        err = self._call("cuInit", ctypes.c_uint(0))
        self.init_error = None if err == 0 else self._errname(err)

    def _fn(self, name: str) -> Any:
        return getattr(self.lib, name)  # AttributeError when the symbol is missing

    def _call(self, name: str, *args: Any) -> int:
        f = self._fn(name)
        f.restype = ctypes.c_int
        return int(f(*args))

    def _errname(self, err: int) -> str:
        s = ctypes.c_char_p()
        try:
            f = self._fn("cuGetErrorName")
            f.restype = ctypes.c_int
            if f(ctypes.c_int(err), ctypes.byref(s)) == 0 and s.value:
                return s.value.decode()
        except AttributeError:
            pass
        return f"CUresult {err}"

    def version(self) -> int | None:
        v = ctypes.c_int(0)
        return v.value if self._call("cuDriverGetVersion", ctypes.byref(v)) == 0 else None

    def devices(self) -> list[dict[str, Any]]:
        n = ctypes.c_int(0)
        err = self._call("cuDeviceGetCount", ctypes.byref(n))
        if err:
            raise RuntimeError(f"cuDeviceGetCount: {self._errname(err)}")
        out = []
        for i in range(n.value):
            dev = ctypes.c_int(0)
            err = self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(i))
            if err:
                raise RuntimeError(f"cuDeviceGet({i}): {self._errname(err)}")
            buf = ctypes.create_string_buffer(256)
            name = buf.value.decode(errors="replace") \
                if self._call("cuDeviceGetName", buf, ctypes.c_int(256), dev) == 0 else "?"
            raw = ctypes.create_string_buffer(16)
            fn = "cuDeviceGetUuid_v2" if hasattr(self.lib, "cuDeviceGetUuid_v2") else "cuDeviceGetUuid"
            uuid_s = format_uuid(raw.raw) if self._call(fn, raw, dev) == 0 else f"GPU-unknown-{i}"
            mem = ctypes.c_size_t(0)
            memv = mem.value if self._call("cuDeviceTotalMem_v2", ctypes.byref(mem), dev) == 0 else None
            bbuf = ctypes.create_string_buffer(64)
            bus = normalize_bus_id(bbuf.value.decode()) \
                if self._call("cuDeviceGetPCIBusId", bbuf, ctypes.c_int(64), dev) == 0 else None
            out.append({"uuid": uuid_s, "name": name, "memory_bytes": memv, "pci_bus_id": bus})
        return out

    def has_checkpoint_api(self) -> bool:
        return all(hasattr(self.lib, f) for f in CHECKPOINT_FUNCTIONS)

    def restore(self, pid: int) -> str | None:
        err = self._call("cuCheckpointProcessRestore", ctypes.c_int(int(pid)), ctypes.c_void_p(None))
        return None if err == 0 else self._errname(err)

    def unlock(self, pid: int) -> str | None:
        err = self._call("cuCheckpointProcessUnlock", ctypes.c_int(int(pid)), ctypes.c_void_p(None))
        return None if err == 0 else self._errname(err)

    def state(self, pid: int) -> str | None:
        st = ctypes.c_int(-1)
        try:
            err = self._call("cuCheckpointProcessGetState", ctypes.c_int(int(pid)), ctypes.byref(st))
        except AttributeError:
            return None
        if err:
            return None
        return STATE_NAMES.get(st.value, f"unknown({st.value})")


def _open_backend() -> tuple[Any | None, str | None]:
    """(backend, None) or (None, reason). Never raises."""
    reasons = []
    if os.environ.get("GPUSNAP_CUDA_BACKEND", "") != "ctypes":
        try:
            return _CudaPythonBackend(), None
        except _Unavailable as e:
            return None, str(e)
        except Exception as e:  # cuda-python present but refuses this libcuda: try ctypes
            reasons.append(f"cuda-python: {e}")
    try:
        return _CtypesBackend(), None
    except _Unavailable as e:
        return None, str(e)
    except Exception as e:
        reasons.append(f"ctypes: {e}")
    return None, "NVIDIA driver unusable: " + "; ".join(reasons)


# ---------------------------------------------------------------- in-process probe

def probe_inprocess(pids: Iterable[int] = ()) -> DriverProbe:
    """Probe the driver in this process (cuInit happens here). Never raises."""
    pids = [int(p) for p in pids]
    backend, reason = _open_backend()
    if backend is None:
        return DriverProbe(available=False, reason=reason or NO_DRIVER,
                           states={p: None for p in pids})
    p = DriverProbe(available=True, reason=None, backend=backend.name,
                    driver_version=kernel_driver_version())
    problems = []
    try:
        p.cuda_version_int = backend.version()
        p.cuda_version = format_cuda_version(p.cuda_version_int)
    except Exception as e:
        problems.append(f"cuDriverGetVersion: {e}")
    if backend.init_error:
        problems.append(f"cuInit failed: {backend.init_error}")
    else:
        try:
            devs = backend.devices()
            # indices in PCI bus order, as nvidia-smi numbers them
            devs.sort(key=lambda d: (d["pci_bus_id"] is None, d["pci_bus_id"] or ""))
            p.gpus = [GpuInfo(index=i, **d) for i, d in enumerate(devs)]
        except Exception as e:
            problems.append(f"listing GPUs: {e}")
    try:
        p.checkpoint_api = bool(backend.has_checkpoint_api())
    except Exception as e:
        problems.append(f"checkpoint API: {e}")
    for pid in pids:
        try:
            p.states[pid] = backend.state(pid) if p.checkpoint_api else None
        except Exception:
            p.states[pid] = None
    if problems:
        p.reason = "; ".join(problems)
    return p


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
        isolated = os.environ.get("GPUSNAP_GPU_PROBE", "") != "inprocess"
    if not isolated:
        return probe_inprocess(pids)
    cmd = [sys.executable, "-m", "gpusnap.gpu.driver", *map(str, pids)]
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


def resume_inprocess(pid: int, target: str = "running") -> dict[str, Any]:
    """Bring `pid` back to RUNNING in this process: restore if CHECKPOINTED, then unlock if
    LOCKED (unless `target` is 'locked': a process someone else had locked stays so).
    {pid, before, after, error}. Never raises."""
    res: dict[str, Any] = {"pid": int(pid), "before": None, "after": None, "error": None}
    backend, reason = _open_backend()
    if backend is None:
        res["error"] = reason
        return res
    try:
        if not backend.has_checkpoint_api():
            res["error"] = "the driver has no CUDA checkpoint API"
            return res
        res["before"] = st = backend.state(pid)
        errs = []
        if st == "checkpointed":
            e = backend.restore(pid)
            if e:
                errs.append(f"cuCheckpointProcessRestore: {e}")
            st = backend.state(pid)
        if st == "locked" and target == "running":
            e = backend.unlock(pid)
            if e:
                errs.append(f"cuCheckpointProcessUnlock: {e}")
        res["after"] = backend.state(pid)
        res["error"] = "; ".join(errs) or None
    except Exception as e:  # pragma: no cover - defensive: never raise from a recovery path
        res["error"] = f"{type(e).__name__}: {e}"
    return res


def resume_process(pid: int, *, timeout: float | None = None, target: str = "running") -> dict[str, Any]:
    """Best-effort recovery after a failed dump: make `pid` RUNNING again on the GPU
    (cuCheckpointProcessRestore if it is checkpointed, then Unlock if locked). The target must
    not be frozen (SIGCONT it first: the driver's restore thread inside it does the work).
    Returns {pid, before, after, error}; never raises. Runs in a child process like probe()."""
    if timeout is None:  # restore copies GPU memory back: as long as the plugin would wait
        from gpusnap.gpu import limits
        timeout = limits.call_timeout_ms() / 1000 * 2 + 30
    cmd = [sys.executable, "-m", "gpusnap.gpu.driver", "--resume", str(int(pid))]
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


def main(argv: list[str] | None = None) -> int:
    """`python -m gpusnap.gpu.driver [PID...]`: one JSON DriverProbe on stdout.
    `python -m gpusnap.gpu.driver --resume PID`: resume_inprocess(PID) as JSON."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--resume"] and len(args) in (2, 3):
        print(json.dumps(resume_inprocess(int(args[1]), *(args[2:3]))))
        return 0
    pids = [int(a) for a in args if a.lstrip("-").isdigit()]
    print(json.dumps(probe_inprocess(pids).to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
