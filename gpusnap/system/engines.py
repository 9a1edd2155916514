"""Which container engine knows a container: `--container NAME|ID` goes to the engine that has
one by that name or id (Podman, Docker), `--engine` forces one. Each engine module offers the
same few calls (inspect, exists, capture; NAME and TITLE), so the dump and the schedule drive
any of them alike; the restore differs (Podman makes the container from its archive, Docker
starts an existing one from a checkpoint: ops/restore_container.py).
"""

from __future__ import annotations

import shutil
from types import ModuleType

from gpusnap.errors import ProcessNotFound, UsageError
from gpusnap.system import docker, podman

ENGINES: dict[str, ModuleType] = {"podman": podman, "docker": docker}


def title(engine) -> str:
    """The engine's name as written in messages (Podman, Docker)."""
    return ENGINES[engine].TITLE if engine in ENGINES else str(engine)


def get(engine: str) -> ModuleType:
    if engine not in ENGINES:
        raise UsageError(f"--engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    return ENGINES[engine]


def find(ref: str, engine: str | None = None) -> ModuleType:
    """The engine that has container `ref` (`engine` when given: its own lookup then says
    when it has none)."""
    if engine is not None:
        return get(engine)
    installed = [m for m in ENGINES.values() if shutil.which(m.NAME)]
    if not installed:
        raise UsageError("neither `podman` nor `docker` is installed: `gpusnap dump --container` drives their checkpoint",
                         hint="install one, or dump the job by PID if it runs outside a container")
    having = [m for m in installed if m.exists(ref)]
    if len(having) > 1:
        raise UsageError(f"both {' and '.join(m.TITLE for m in having)} have a container {ref!r}",
                         hint="say which with --engine " + "|".join(m.NAME for m in having))
    if not having:
        raise ProcessNotFound(f"no {' or '.join(m.TITLE for m in installed)} container {ref!r}",
                              hint=" or ".join(f"`{m.NAME} ps -a`" for m in installed) + " lists them")
    return having[0]
