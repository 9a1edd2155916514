"""Docker, driven through its own command line: a container looked up, checkpointed (`docker
checkpoint create`, which needs the daemon's experimental mode), and started again from a
checkpoint (`docker start --checkpoint`). Docker's runc runs CRIU (the first `criu` on the
daemon's PATH) inside the container's view of mounts and namespaces.

Docker's checkpoint is a directory of CRIU's images, not an archive, and it lives in the
daemon's own data root: DOCKER_ROOT/containers/ID/checkpoints/NAME. gpusnap reads it from there
and writes one there for a restore, because `docker start --checkpoint-dir` is refused by every
Docker since 17.12 ("custom checkpointdir is not supported", moby/moby#37344), and newer ones
ignore `checkpoint create --checkpoint-dir` (docker/cli#4245); the default place works with
20.10 and the newer ones alike. The checkpoint gets a name of gpusnap's own and is removed
(`docker checkpoint rm`) once stored or started. So the daemon must be this machine's (its data
root readable here): DOCKER_HOST, which passes through, may name any socket of it.

Docker cannot make a container out of a checkpoint: a restore goes into an existing, stopped
container (ops/restore_container.py says what to do when there is none).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from pathlib import Path

from gpusnap.errors import ContainerEngineFailed, GpusnapError, ProcessNotFound, UsageError
from gpusnap.system import engine_cli

CHECKPOINT_TIMEOUT = 3600.0
NAME, TITLE = "docker", "Docker"
_HEX_ID = re.compile(r"[0-9a-f]{64}")


def _docker() -> str:
    return engine_cli.executable("docker", "`apt install docker.io`, its daemon in experimental mode")


def inspect(ref: str) -> dict:
    """`docker container inspect REF`: id, name, image, whether it runs, and its root PID."""
    return engine_cli.inspect(_docker(), NAME, ref, lambda c: (c.get("Config") or {}).get("Image") or c.get("Image"),
                              lambda err: _missing(ref, "Cannot connect to the Docker daemon" in err))


def _missing(ref: str, unreachable: bool) -> ProcessNotFound:
    if unreachable:
        return ProcessNotFound(f"no Docker container {ref!r} (no Docker daemon answers)",
                               hint="start dockerd, or set DOCKER_HOST to its socket")
    return ProcessNotFound(f"no Docker container {ref!r}", hint="list them with `docker ps -a`")


def exists(ref: str) -> bool:
    r = engine_cli.query([_docker(), "container", "inspect", "-f", "{{.Id}}", ref])
    return r is not None and r.returncode == 0


def _root() -> Path:
    """The daemon's data root, once its experimental mode (which checkpoints need) is known on."""
    r = engine_cli.query([_docker(), "info", "-f", "{{json .DockerRootDir}} {{json .ExperimentalBuild}}"])
    if r is None or r.returncode != 0:
        raise ContainerEngineFailed("docker did not say where its daemon keeps containers (`docker info`): "
                                    + ((r.stderr.strip().splitlines() or ["no answer"])[-1] if r else "no answer"))
    try:
        root, experimental = (json.loads(w) for w in r.stdout.split())
    except ValueError:
        raise ContainerEngineFailed(f"docker info said {r.stdout.strip()!r}, not a data root") from None
    if experimental is not True:
        raise UsageError("Docker's checkpoint needs its daemon's experimental mode, which is off",
                         hint='put "experimental": true in /etc/docker/daemon.json and restart dockerd '
                              "(or start it with --experimental)")
    if not isinstance(root, str) or not os.path.isdir(f"{root}/containers"):
        raise UsageError(f"the Docker daemon keeps its containers in {root!r}, which is not on this machine",
                         hint="run gpusnap where the daemon runs (its checkpoints are read from its data root)")
    return Path(root)


def checkpoint_dir(cid: str, name: str) -> Path:
    """Where the daemon keeps checkpoint `name` of container `cid` (a full id)."""
    if not _HEX_ID.fullmatch(cid) or not re.fullmatch(r"gpusnap-[0-9a-f]{16}", name):
        raise ContainerEngineFailed(f"no checkpoint path for container {cid!r}, checkpoint {name!r}")
    return _root() / "containers" / cid / "checkpoints" / name


def new_checkpoint_name() -> str:
    return f"gpusnap-{secrets.token_hex(8)}"


def capture(cid: str, work: Path, leave_running: bool) -> engine_cli.Capture:
    """The container checkpointed (stopped unless leave_running) into the daemon's directory for
    it; release() removes it. A failure says what CRIU said, from the log Docker names."""
    name = new_checkpoint_name()
    path = checkpoint_dir(cid, name)
    try:
        engine_cli.run([_docker(), "checkpoint", "create", *(["--leave-running"] if leave_running else []), cid, name],
                       "checkpoint the container", CHECKPOINT_TIMEOUT)
    except ContainerEngineFailed as e:
        m = re.search(r"path= ?(\S+\.log)", e.message)
        errs = engine_cli.criu_errors(m.group(1)) if m else []
        if errs:
            e.message += "; CRIU: " + " | ".join(errs)
        remove_checkpoint(cid, name)
        raise
    except BaseException:       # interrupted: docker was waited for; what it wrote goes
        remove_checkpoint(cid, name)
        raise
    if not path.is_dir():
        raise ContainerEngineFailed(f"docker said it checkpointed the container, but {path} is no directory")
    return engine_cli.Capture("dir", path, lambda: remove_checkpoint(cid, name))


def start_from(cid: str, name: str) -> None:
    """`docker start --checkpoint NAME CID`: the stopped container runs on from the checkpoint."""
    engine_cli.run([_docker(), "start", "--checkpoint", name, cid], "restore the container", CHECKPOINT_TIMEOUT)


def remove_checkpoint(cid: str, name: str) -> None:
    """Docker's own removal; where it cannot (a half-written checkpoint it does not list), the
    directory goes anyway: it is gpusnap's, named by it."""
    engine_cli.query([_docker(), "checkpoint", "rm", cid, name])
    try:
        shutil.rmtree(checkpoint_dir(cid, name), ignore_errors=True)
    except GpusnapError:
        pass
