"""Podman, driven through its own command line: a container looked up, checkpointed into an
uncompressed archive (its CRIU images, config, spec and root-filesystem changes), and
restored from one. Podman runs CRIU itself, inside the container's view of mounts and
namespaces, which CRIU run from outside cannot do (system/containers.py).

A restore runs the container under the runtime it was checkpointed with (Podman insists).
"""

from __future__ import annotations

import re
from pathlib import Path

from gpusnap.errors import ContainerEngineFailed, ProcessNotFound
from gpusnap.system import engine_cli

CHECKPOINT_TIMEOUT = 3600.0
NAME, TITLE = "podman", "Podman"


def _podman() -> str:
    return engine_cli.executable("podman", "`apt install podman`")


def inspect(ref: str) -> dict:
    """`podman container inspect REF`: id, name, image, whether it runs, and its root PID."""
    return engine_cli.inspect(_podman(), NAME, ref, lambda c: c.get("ImageName") or c.get("Image"),
                              lambda err: ProcessNotFound(f"no Podman container {ref!r}",
                                                          hint="list them with `podman ps`"))


def capture(ref: str, work: Path, leave_running: bool) -> engine_cli.Capture:
    """The container checkpointed into the archive work/checkpoint.tar."""
    path = work / "checkpoint.tar"
    checkpoint(ref, str(path), leave_running)
    return engine_cli.Capture("tar", path)


def checkpoint(ref: str, export: str, leave_running: bool) -> None:
    """Checkpoint the container into the archive `export` (a file or a FIFO: written once, in
    order, uncompressed, so that its pages can be deduplicated). A failure says what CRIU
    said: the last errors of the dump.log in the work path the runtime was given."""
    try:
        engine_cli.run([_podman(), "container", "checkpoint", *(["--leave-running"] if leave_running else []),
              "--compress", "none", f"--export={export}", ref], "checkpoint the container", CHECKPOINT_TIMEOUT)
    except ContainerEngineFailed as e:
        m = re.search(r"--work-path (\S+)", e.message)
        errs = engine_cli.criu_errors(f"{m.group(1)}/dump.log") if m else []
        if errs:
            e.message += "; CRIU: " + " | ".join(errs)
        raise


def restore(archive: str, name: str | None) -> str:
    """A container restored from the archive file, under `name` (None: the archive's own);
    returns its id."""
    try:
        r = engine_cli.run([_podman(), "container", "restore", f"--import={archive}", *(["--name", name] if name else [])],
                 "restore the container", CHECKPOINT_TIMEOUT)
    except ContainerEngineFailed as e:
        raise with_restore_log(e) from None
    return r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""


def with_restore_log(e: ContainerEngineFailed) -> ContainerEngineFailed:
    """Podman's failed restore names only its log ("log file: .../restore.log"), which goes
    with the container: what CRIU said is read from it at once, into the message."""
    m = re.search(r"log file: (\S+)", e.message)
    errs = engine_cli.criu_errors(m.group(1)) if m else []
    if errs:
        e.message += "; CRIU: " + " | ".join(errs)
    return e


def exists(ref: str) -> bool:
    r = engine_cli.query([_podman(), "container", "exists", ref])
    return r is not None and r.returncode == 0
