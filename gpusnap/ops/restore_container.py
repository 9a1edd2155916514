"""`gpusnap restore` of a container snapshot (`dump --container`): the engine's archive rebuilt
from the snapshot (every page checked against its checksum on the way, as on every restore
path) into a private work directory, and handed to Podman (`podman container restore
--import`). The container comes back under its own name when no container holds that name;
beside a container that still does (the original, running on), it is a fork named NAME-forkK,
as a restored job is (ops/identity.py).
"""

from __future__ import annotations

import shutil
import time

from gpusnap.errors import CorruptSnapshot
from gpusnap.ops.restore import RestoreResult
from gpusnap.repo import archive
from gpusnap.system import podman, tmpdirs


def restore_container(repository, snap, t0: float, progress=None) -> RestoreResult:
    meta = (snap.manifest.get("meta") or {}).get("container") or {}
    original = meta.get("name")
    if meta.get("engine") != "podman" or not isinstance(original, str) or not original:
        raise CorruptSnapshot(f"snapshot {snap.path} is of a container, but names no Podman container")
    snap.check_structure()
    archive.layout(snap)        # a damaged layout fails here, before anything is written
    name = original
    k = 0
    while podman.exists(name):
        k += 1
        name = f"{original}-fork{k}"
    phases: dict[str, float] = {}
    work = tmpdirs.make(tmpdirs.RESTORE)
    try:
        t = time.monotonic()
        if progress:
            progress(0, 0, "handover")
        path = work / "checkpoint.tar"
        with open(path, "wb") as f:
            archive.write(snap, f)
        phases["materialize"] = round(time.monotonic() - t, 3)
        t = time.monotonic()
        podman.restore(str(path), None if name == original else name)
        phases["engine"] = round(time.monotonic() - t, 3)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info = podman.inspect(name)
    return RestoreResult(pid=info["pid"], snapshot=str(snap.path), seconds=round(time.monotonic() - t0, 3),
                         pids=[info["pid"]], phases=phases, via="podman", job=name,
                         fork_of=original if name != original else None,
                         bytes_raw=int(snap.manifest.get("stats", {}).get("bytes_raw", 0) or 0))
