"""The NVIDIA driver, asked in this process through cuda-python (`cuda.bindings.driver`), the
one CUDA backend: version, GPUs, whether the checkpoint API is there, per-process checkpoint
state, and the recovery of a process left checkpointed or locked.

cuInit happens here, so gpusnap runs this module in a short-lived child
(`python -m gpusnap.gpu.probe`, started by gpusnap.gpu.driver), never in itself. Nothing
here raises because a driver is missing: a machine without one gets "no NVIDIA driver".
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Iterable

from gpusnap.gpu.driver import (NO_DRIVER, STATE_NAMES, DriverProbe, GpuInfo, format_cuda_version,
                                format_uuid, kernel_driver_version, normalize_bus_id)


class _Unavailable(Exception):
    """No usable driver; the message says why."""


class Cuda:
    """cuda.bindings.driver after cuInit; init_error: cuInit's error name, or None."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver as cu  # type: ignore[import-not-found]
            from cuda.pathfinder import DynamicLibNotFoundError  # type: ignore[import-not-found]
        except Exception as e:  # ImportError, or a broken install
            raise _Unavailable(f"cuda-python unusable ({e}): run `make setup`") from e
        self.cu = cu
        try:
            (err,) = cu.cuInit(0)
        except DynamicLibNotFoundError as e:
            raise _Unavailable(f"{NO_DRIVER} (libcuda.so.1 not found)") from e
        except RuntimeError as e:       # a libcuda cuda-python cannot load (no cuGetProcAddress_v2)
            raise _Unavailable(f"NVIDIA driver unusable: {e}") from e
        self.init_error = None if self._ok(err) else self._errname(err)

    def _ok(self, err: Any) -> bool:
        return err == self.cu.CUresult.CUDA_SUCCESS

    def _errname(self, err: Any) -> str:
        e2, s = self.cu.cuGetErrorName(err)
        if self._ok(e2) and s:
            return s.decode() if isinstance(s, bytes) else str(s)
        return getattr(err, "name", str(err))

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
        err, st = self.cu.cuCheckpointProcessGetState(int(pid))
        if not self._ok(err):
            return None
        return STATE_NAMES.get(int(st), f"unknown({int(st)})")


def _open() -> tuple[Cuda | None, str | None]:
    """(driver, None) or (None, why not). Never raises."""
    try:
        return Cuda(), None
    except _Unavailable as e:
        return None, str(e)
    except Exception as e:
        return None, f"NVIDIA driver unusable: {type(e).__name__}: {e}"


def probe_inprocess(pids: Iterable[int] = ()) -> DriverProbe:
    """Probe the driver in this process (cuInit happens here). Never raises."""
    pids = [int(p) for p in pids]
    drv, reason = _open()
    if drv is None:
        return DriverProbe(available=False, reason=reason or NO_DRIVER, states={p: None for p in pids})
    p = DriverProbe(available=True, reason=None, driver_version=kernel_driver_version())
    problems = []
    try:
        p.cuda_version_int = drv.version()
        p.cuda_version = format_cuda_version(p.cuda_version_int)
    except Exception as e:
        problems.append(f"cuDriverGetVersion: {e}")
    if drv.init_error:
        problems.append(f"cuInit failed: {drv.init_error}")
    else:
        try:
            devs = drv.devices()
            # indices in PCI bus order, as nvidia-smi numbers them
            devs.sort(key=lambda d: (d["pci_bus_id"] is None, d["pci_bus_id"] or ""))
            p.gpus = [GpuInfo(index=i, **d) for i, d in enumerate(devs)]
        except Exception as e:
            problems.append(f"listing GPUs: {e}")
    try:
        p.checkpoint_api = drv.has_checkpoint_api()
    except Exception as e:
        problems.append(f"checkpoint API: {e}")
    for pid in pids:
        try:
            p.states[pid] = drv.state(pid) if p.checkpoint_api else None
        except Exception:
            p.states[pid] = None
    if problems:
        p.reason = "; ".join(problems)
    return p


def resume_inprocess(pid: int, target: str = "running") -> dict[str, Any]:
    """Bring `pid` back to RUNNING in this process: restore if CHECKPOINTED, then unlock if
    LOCKED (unless `target` is 'locked': a process someone else had locked stays so).
    {pid, before, after, error}. Never raises."""
    res: dict[str, Any] = {"pid": int(pid), "before": None, "after": None, "error": None}
    drv, reason = _open()
    if drv is None:
        res["error"] = reason
        return res
    try:
        if not drv.has_checkpoint_api():
            res["error"] = "the driver has no CUDA checkpoint API"
            return res
        res["before"] = st = drv.state(pid)
        errs = []
        if st == "checkpointed":
            e = drv.restore(pid)
            if e:
                errs.append(f"cuCheckpointProcessRestore: {e}")
            st = drv.state(pid)
        if st == "locked" and target == "running":
            e = drv.unlock(pid)
            if e:
                errs.append(f"cuCheckpointProcessUnlock: {e}")
        res["after"] = drv.state(pid)
        res["error"] = "; ".join(errs) or None
    except Exception as e:  # never raise from a recovery path
        res["error"] = f"{type(e).__name__}: {e}"
    return res


def main(argv: list[str] | None = None) -> int:
    """`python -m gpusnap.gpu.probe [PID...]`: one JSON DriverProbe on stdout.
    `python -m gpusnap.gpu.probe --resume PID [locked]`: resume_inprocess(PID) as JSON."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--resume"] and len(args) in (2, 3):
        print(json.dumps(resume_inprocess(int(args[1]), *(args[2:3]))))
        return 0
    pids = [int(a) for a in args if a.lstrip("-").isdigit()]
    print(json.dumps(probe_inprocess(pids).to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
