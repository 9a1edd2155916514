"""GPU time limits, from one place: the CUDA lock timeout and what follows from it.

The lock timeout (`dump --gpu-lock-timeout`) is how long the driver waits for GPU work in
flight to drain. CRIU's own freeze deadline (`criu --timeout`) must cover every lock of
the tree plus the freezing itself, so it is derived from it, as are the plugin's bounds
on every other driver call (native/gpusnap_cuda.c bounds each call in a thread of its own).
"""

from __future__ import annotations

import math

from gpusnap import settings

DEFAULT_LOCK_TIMEOUT_MS = 5000
# checkpoint / restore / unlock copy GPU memory: minutes for 80 GB at worst
DEFAULT_CALL_TIMEOUT_MS = 600_000
# CRIU's default --timeout, the floor for a job without GPU processes
CRIU_FREEZE_FLOOR_S = 10


def lock_timeout_ms(requested: int | None) -> int:
    return int(requested) if requested else DEFAULT_LOCK_TIMEOUT_MS


def call_timeout_ms() -> int:
    """$GPUSNAP_CALL_TIMEOUT_MS (tests, slow machines) or the default."""
    v = settings.get("GPUSNAP_CALL_TIMEOUT_MS", "")
    return int(v) if v.isdigit() and int(v) > 0 else DEFAULT_CALL_TIMEOUT_MS


def criu_freeze_timeout_s(lock_ms: int, n_gpu_procs: int) -> int:
    """`criu --timeout`: every CUDA process is locked before the freeze, one after another."""
    return max(CRIU_FREEZE_FLOOR_S, math.ceil(lock_ms * max(1, n_gpu_procs) / 1000) + CRIU_FREEZE_FLOOR_S)


def plugin_env(lock_ms: int) -> dict[str, str]:
    return {"GPUSNAP_LOCK_TIMEOUT_MS": str(lock_ms), "GPUSNAP_CALL_TIMEOUT_MS": str(call_timeout_ms())}
