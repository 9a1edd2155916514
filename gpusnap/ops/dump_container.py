"""`gpusnap dump --container NAME|ID`: a Podman container snapshotted through its engine.

Podman checkpoints the container (CRIU run inside the container's view of mounts and
namespaces), leaving it running unless --exit, into an uncompressed archive in a private
work directory of gpusnap's (never in the repository's tmp/: Podman writes the file by its
path, as root, and the repository may belong to a user who could put a link there). gpusnap stores the archive in a snapshot (repo/archive.py): its pages
images through the page pipeline, so a container's memory deduplicates across snapshots and
with other jobs; the rest as data. Nothing is visible before the snapshot's commit, and the
archive file is removed on every way out. `gpusnap restore` of such a snapshot hands the
rebuilt archive back to Podman (ops/restore_container.py).
"""

from __future__ import annotations

import shutil
import time

from gpusnap.errors import ContainerEngineFailed, Interrupted, InterruptedAfterCommit, UsageError
from gpusnap.ops import prune, validate
from gpusnap.ops.dump import DumpRequest, DumpResult
from gpusnap.repo import archive
from gpusnap.system import interrupt, podman, tmpdirs


def dump_container(req: DumpRequest, container: str, progress=None) -> DumpResult:
    """Snapshot the container `container` into the repository at req.repo. Interrupted
    (Ctrl-C, SIGTERM, SIGHUP) before the commit, nothing is kept and the container is as
    Podman leaves it; after the commit, the snapshot is kept and the dump says so."""
    try:
        return _dump_container(req, container, progress)
    except (KeyboardInterrupt, interrupt.Terminated):
        raise Interrupted("dump interrupted; the container was left to Podman and no snapshot was kept") from None


def _dump_container(req: DumpRequest, container: str, progress=None) -> DumpResult:
    from gpusnap.repo import locate, lockwait

    t0 = time.monotonic()
    validate.check_compress(req.compress)
    if req.name:
        validate.check_name(req.name)
    info = podman.inspect(container)
    if not info["running"]:
        raise UsageError(f"container {info['name']} is not running: nothing to checkpoint",
                         hint="start it (`podman start`), or restore one of its snapshots")
    name = req.name or validate.default_name(info["name"])
    repo = locate.open_repository(req.repo, create_at_default=True).wait_for_locks(lockwait.seconds(req.lock_wait))
    meta = {"container": {k: info[k] for k in ("engine", "id", "name", "image")}, "pid": info["pid"],
            "leave_running": req.leave_running, "compress": req.compress}
    phases: dict[str, float] = {}
    with interrupt.as_exception(), repo.writer_lock(what="dump"):
        writer = repo.new_snapshot(name, compress=req.compress, meta=meta)
        snap = None
        work = tmpdirs.make(tmpdirs.DUMP)
        path = work / "checkpoint.tar"
        try:
            t = time.monotonic()
            if progress:
                progress(0, 0, "frozen")
            try:
                podman.checkpoint(info["id"], str(path), req.leave_running)
            except ContainerEngineFailed:
                # runc's checkpoint failed here now and then under load (about 1 in 100, its
                # dump.log gone with it); CRIU resumed the container, so once more is safe
                if not podman.inspect(info["id"])["running"]:
                    raise
                podman.checkpoint(info["id"], str(path), req.leave_running)
            phases["checkpoint"] = round(time.monotonic() - t, 3)
            t = time.monotonic()
            size = path.stat().st_size
            with open(path, "rb") as f:
                archive.store(writer, f, (lambda n: progress(n, size, "storing")) if progress else None)
            phases["storing"] = round(time.monotonic() - t, 3)
            snap = writer.commit(extra_meta={"dump_seconds": time.monotonic() - t0})
        finally:
            if snap is None:
                writer.abort()
            shutil.rmtree(work, ignore_errors=True)
        try:
            pruned, warnings, prune_error = prune.retain_after_commit(repo, snap.name, req.keep_last)
        except (KeyboardInterrupt, interrupt.Terminated):
            raise InterruptedAfterCommit(f"dump interrupted after the commit: snapshot {snap.path} is kept "
                                         "(listed and restorable); --keep-last retention did not finish",
                                         hint=f"prune with `gpusnap prune --keep-last {req.keep_last} --name {snap.name}`",
                                         snapshot=str(snap.path)) from None
    stats = writer.stats
    return DumpResult(snapshot=str(snap.path), id=snap.id, name=snap.name, pid=info["pid"],
                      pages_total=stats["pages_total"], pages_zero=stats["pages_zero"],
                      pages_dedup=stats["pages_dedup"], bytes_raw=stats["bytes_raw"],
                      bytes_stored=stats["bytes_stored"], seconds=round(time.monotonic() - t0, 3),
                      job_running=req.leave_running, pruned=pruned, prune_error=prune_error,
                      prune_warnings=warnings, phases=phases)
