"""`gpusnap restore` of a container snapshot (`dump --container`): the engine's checkpoint rebuilt
from the snapshot (every page checked against its checksum on the way, as on every restore
path) and handed to the engine that took it (meta.container.engine).

Podman (`podman container restore --import`) makes the container from the archive, written to
a private work directory: it comes back under its own name when no container holds that name;
beside a container that still does (the original, running on), it is a fork named
NAME-forkK, as a restored job is (ops/identity.py).

Docker cannot make a container from a checkpoint (`docker start --checkpoint` starts an
existing one), so the checkpoint directory goes into the daemon's place for it and the
stopped container of the recorded name starts from it: the one dumped (after `--exit`, a
crash or `docker stop`), or one the user made again like it (`docker create` of the same
image, command and options) after it was removed. A container that runs is not replaced
(stopping it is the user's choice: its run since would be lost), and none at all is refused
with the command that makes one; recreating it from the recorded image alone would silently
drop its options, mounts and environment, which the checkpoint needs as they were.
"""

from __future__ import annotations

import re
import shutil
import time

from gpusnap.errors import CorruptSnapshot, UsageError
from gpusnap.ops import validate
from gpusnap.ops.restore import RestoreResult
from gpusnap.repo import archive
from gpusnap.system import docker, engines, podman, tmpdirs


def restore_container(repository, snap, t0: float, progress=None) -> RestoreResult:
    meta = (snap.manifest.get("meta") or {}).get("container") or {}
    original = meta.get("name")
    if meta.get("engine") not in engines.ENGINES or not isinstance(original, str) or not original:
        raise CorruptSnapshot(f"snapshot {snap.path} is of a container, but names no Podman or Docker container")
    snap.check_structure()
    archive.layout(snap)        # a damaged layout fails here, before anything is written
    if progress:
        progress(0, 0, "handover")
    phases: dict[str, float] = {}
    if meta["engine"] == "docker":
        name, info = _restore_docker(snap, meta, phases)
    else:
        name = _restore_podman(snap, original, phases)
        info = podman.inspect(name)
    return RestoreResult(pid=info["pid"], snapshot=str(snap.path), seconds=round(time.monotonic() - t0, 3),
                         pids=[info["pid"]], phases=phases, via=meta["engine"], job=name,
                         fork_of=original if name != original else None,
                         bytes_raw=int(snap.manifest.get("stats", {}).get("bytes_raw", 0) or 0))


def _restore_podman(snap, original: str, phases: dict) -> str:
    name = original
    k = 0
    while podman.exists(name):
        k += 1
        name = f"{original}-fork{k}"
    work = tmpdirs.make(tmpdirs.RESTORE)
    try:
        t = time.monotonic()
        path = work / "checkpoint.tar"
        with open(path, "wb") as f:
            archive.write(snap, f)
        phases["materialize"] = round(time.monotonic() - t, 3)
        t = time.monotonic()
        podman.restore(str(path), None if name == original else name)
        phases["engine"] = round(time.monotonic() - t, 3)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return name


def _docker_target(meta: dict) -> dict:
    """The stopped container the checkpoint goes into: the one dumped (by its id), else the
    one now under its name, made from the same image."""
    name, image = validate.check_container_ref(meta["name"]), meta.get("image") or "IMAGE"
    cid = meta.get("id")
    ref = cid if isinstance(cid, str) and re.fullmatch(r"[0-9a-f]{64}", cid) and docker.exists(cid) else name
    if not docker.exists(ref):
        raise UsageError(f"Docker has no container {name} to restore into (Docker starts an existing container "
                         "from a checkpoint; it cannot make one)",
                         hint=f"make it again as it was made, stopped: `docker create --name {name} [its options] "
                              f"{image} [its command]`, then restore again")
    info = docker.inspect(ref)
    if info["running"]:
        raise UsageError(f"Docker container {info['name']} is running: a restore replaces a stopped container's run",
                         hint=f"stop it (`docker stop {info['name']}`; its run since is lost), then restore again")
    if meta.get("image") and info["image"] != meta["image"]:
        raise UsageError(f"Docker container {info['name']} is of image {info['image']}, the snapshot of {meta['image']}",
                         hint=f"restore into a container made from {meta['image']}")
    return info


def _restore_docker(snap, meta: dict, phases: dict) -> tuple[str, dict]:
    info = _docker_target(meta)
    cp = docker.new_checkpoint_name()
    t = time.monotonic()
    try:
        path = docker.checkpoint_dir(info["id"], cp)
        path.parent.mkdir(mode=0o700, exist_ok=True)       # (a container never started has none yet)
        archive.write_dir(snap, path)
        phases["materialize"] = round(time.monotonic() - t, 3)
        t = time.monotonic()
        docker.start_from(info["id"], cp)
        phases["engine"] = round(time.monotonic() - t, 3)
    finally:
        docker.remove_checkpoint(info["id"], cp)
    return info["name"], docker.inspect(info["id"])
