"""Podman, driven through its own command line: a container looked up, checkpointed into an
uncompressed archive (its CRIU images, config, spec and root-filesystem changes), and
restored from one. Podman runs CRIU itself, inside the container's view of mounts and
namespaces, which CRIU run from outside cannot do (system/containers.py).

A restore runs the container under the runtime it was checkpointed with (Podman insists).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

from gpusnap.errors import ContainerEngineFailed, UsageError

CHECKPOINT_TIMEOUT = 3600.0


def _podman() -> str:
    exe = shutil.which("podman")
    if not exe:
        raise UsageError("`podman` is not installed: `gpusnap dump --container` drives Podman's checkpoint",
                         hint="install it (`apt install podman`), or dump the job by PID if it runs outside a container")
    return exe


def _run(args: list[str], what: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """podman ARGS, in a session of its own (a Ctrl-C meant for gpusnap never reaches it).
    Interrupted, gpusnap still waits for it: killed in the middle of a checkpoint, Podman could
    leave the container frozen; ended, it leaves it running (or as --exit asked)."""
    p = subprocess.Popen([_podman(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ContainerEngineFailed(f"podman did not finish {what} within {timeout:.0f} s (it goes on)") from None
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
        raise ContainerEngineFailed(f"podman could not {what}: {last}")
    return r


def inspect(ref: str) -> dict:
    """`podman container inspect REF`: id, name, image, whether it runs, and its root PID."""
    try:
        r = subprocess.run([_podman(), "container", "inspect", ref], capture_output=True, text=True,
                           timeout=60, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ContainerEngineFailed("podman did not answer `container inspect` within 60 s") from None
    if r.returncode != 0:
        from gpusnap.errors import ProcessNotFound

        raise ProcessNotFound(f"no Podman container {ref!r}", hint="list them with `podman ps`")
    try:
        c = json.loads(r.stdout)[0]
        state = c.get("State") or {}
        return {"engine": "podman", "id": str(c["Id"]), "name": str(c["Name"]).lstrip("/"),
                "image": str(c.get("ImageName") or c.get("Image") or ""),
                "running": bool(state.get("Running")), "pid": int(state.get("Pid") or 0)}
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ContainerEngineFailed(f"podman's `container inspect {ref}` gave no container: {e}") from None


def checkpoint(ref: str, export: str, leave_running: bool) -> None:
    """Checkpoint the container into the archive `export` (a file or a FIFO: written once, in
    order, uncompressed, so that its pages can be deduplicated). A failure says what CRIU
    said: the last errors of the dump.log in the work path the runtime was given."""
    try:
        _run(["container", "checkpoint", *(["--leave-running"] if leave_running else []),
              "--compress", "none", f"--export={export}", ref], "checkpoint the container", CHECKPOINT_TIMEOUT)
    except ContainerEngineFailed as e:
        m = re.search(r"--work-path (\S+)", e.message)
        try:
            with open(f"{m.group(1)}/dump.log", errors="replace") as f:
                errs = [ln.strip() for ln in f if "Error" in ln][-3:] if m else []
        except OSError:
            errs = []
        if errs:
            e.message += "; CRIU: " + " | ".join(errs)
        raise


def restore(archive: str, name: str | None) -> str:
    """A container restored from the archive file, under `name` (None: the archive's own);
    returns its id."""
    r = _run(["container", "restore", f"--import={archive}", *(["--name", name] if name else [])],
             "restore the container", CHECKPOINT_TIMEOUT)
    return r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""


def exists(ref: str) -> bool:
    try:
        return subprocess.run([_podman(), "container", "exists", ref], capture_output=True, timeout=60,
                              stdin=subprocess.DEVNULL).returncode == 0
    except subprocess.TimeoutExpired:
        return False
