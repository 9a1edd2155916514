"""A container engine's command line (podman, docker) run the way a checkpoint needs it: in a
session of its own, so that a Ctrl-C meant for gpusnap never reaches it, and waited for even
when gpusnap is interrupted. Killed in the middle of a checkpoint, an engine could leave the
container frozen; ended, it leaves it running (or stopped, as asked). The environment passes
through unchanged: DOCKER_HOST, CONTAINER_HOST and the engines' contexts pick the daemon.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gpusnap.errors import ContainerEngineFailed, UsageError


def executable(program: str, install: str) -> str:
    exe = shutil.which(program)
    if not exe:
        raise UsageError(f"`{program}` is not installed: `gpusnap dump --container` drives its checkpoint",
                         hint=f"install it ({install}), or dump the job by PID if it runs outside a container")
    return exe


def run(argv: list[str], what: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """argv (the engine first), waited for; a failure raises ContainerEngineFailed with the
    engine's last line."""
    program = argv[0].rsplit("/", 1)[-1]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ContainerEngineFailed(f"{program} did not finish {what} within {timeout:.0f} s (it goes on)") from None
    except BaseException:
        while p.poll() is None:
            try:
                p.wait()
            except BaseException:   # (a second signal while waiting: still never kill it)
                pass
        raise
    r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise ContainerEngineFailed(f"{program} could not {what}: {last}")
    return r


def query(argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess | None:
    """A quick question to the engine (inspect, exists, info); None when it did not answer."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None


def inspect(exe: str, engine: str, ref: str, image: Callable[[dict], object],
            missing: Callable[[str], Exception]) -> dict:
    """`ENGINE container inspect REF` as every engine module answers it: {engine, id, name,
    image, running, pid}. `image` picks the image's name from the engine's JSON; `missing`
    makes the error for no such container from what the engine said."""
    r = query([exe, "container", "inspect", ref])
    if r is None:
        raise ContainerEngineFailed(f"{engine} did not answer `container inspect` within 60 s")
    if r.returncode != 0:
        raise missing(r.stderr)
    try:
        c = json.loads(r.stdout)[0]
        state = c.get("State") or {}
        cid = str(c["Id"])
        if not re.fullmatch(r"[0-9a-f]{64}", cid):
            raise ValueError(f"id {cid!r}")
        return {"engine": engine, "id": cid, "name": str(c["Name"]).lstrip("/"), "image": str(image(c) or ""),
                "running": bool(state.get("Running")), "pid": int(state.get("Pid") or 0)}
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        raise ContainerEngineFailed(f"{engine}'s `container inspect {ref}` gave no container: {e}") from None


def criu_errors(log: str, limit: int = 3) -> list[str]:
    """The last error lines of a CRIU log the engine left (dump.log, criu-dump.log)."""
    try:
        with open(log, errors="replace") as f:
            return [ln.strip() for ln in f if "Error" in ln][-limit:]
    except OSError:
        return []


@dataclass
class Capture:
    """A checkpoint the engine wrote: an archive (`tar`, a file) or CRIU's image directory
    (`dir`); release() removes what the engine keeps of it (its own copy of a directory)."""
    kind: str
    path: Path
    release: Callable[[], None] = lambda: None
