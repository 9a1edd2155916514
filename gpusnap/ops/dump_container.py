"""`gpusnap dump --container NAME|ID`: a Podman or Docker container snapshotted through its engine
(system/engines.py picks the one that has the container; --engine forces one).

The engine checkpoints the container (CRIU run inside the container's view of mounts and
namespaces), leaving it running unless --exit. Podman writes an uncompressed archive into a
private work directory of gpusnap's (never in the repository's tmp/: Podman writes the file by
its path, as root, and the repository may belong to a user who could put a link there);
Docker writes CRIU's image directory into its own data root (system/docker.py). gpusnap
stores either in a snapshot in the one archive form (repo/archive.py): its pages images
through the page pipeline, so a container's memory deduplicates across snapshots and with
other jobs; the rest as data. Nothing is visible before the snapshot's commit, and the
archive file or Docker's checkpoint is removed on every way out. `gpusnap restore` of such a
snapshot hands the checkpoint back to the engine (ops/restore_container.py).
"""

from __future__ import annotations

import shutil
import time

from gpusnap.errors import ContainerEngineFailed, Interrupted, InterruptedAfterCommit, UsageError
from gpusnap.ops import prune, validate
from gpusnap.ops.dump import DumpRequest, DumpResult
from gpusnap.repo import archive
from gpusnap.system import engines, interrupt, tmpdirs


def dump_container(req: DumpRequest, container: str, progress=None, engine: str | None = None) -> DumpResult:
    """Snapshot the container `container` into the repository at req.repo. Interrupted
    (Ctrl-C, SIGTERM, SIGHUP) before the commit, nothing is kept and the container is as
    its engine leaves it; after the commit, the snapshot is kept and the dump says so."""
    validate.check_container_ref(container)
    eng = engines.find(container, engine)
    try:
        return _dump_container(req, container, eng, progress)
    except (KeyboardInterrupt, interrupt.Terminated):
        raise Interrupted(f"dump interrupted; the container was left to {eng.TITLE} and no snapshot was kept") from None


def _dump_container(req: DumpRequest, container: str, eng, progress=None) -> DumpResult:
    from gpusnap.repo import locate, lockwait

    t0 = time.monotonic()
    validate.check_compress(req.compress)
    if req.name:
        validate.check_name(req.name)
    info = eng.inspect(container)
    if not info["running"]:
        raise UsageError(f"container {info['name']} is not running: nothing to checkpoint",
                         hint=f"start it (`{eng.NAME} start`), or restore one of its snapshots")
    name = req.name or validate.default_name(info["name"])
    repo = locate.open_repository(req.repo, create_at_default=True).wait_for_locks(lockwait.seconds(req.lock_wait))
    meta = {"container": {k: info[k] for k in ("engine", "id", "name", "image")}, "pid": info["pid"],
            "leave_running": req.leave_running, "compress": req.compress}
    phases: dict[str, float] = {}
    with interrupt.as_exception(), repo.writer_lock(what="dump"):
        writer = repo.new_snapshot(name, compress=req.compress, meta=meta)
        snap = None
        work = tmpdirs.make(tmpdirs.DUMP)
        cap = None
        try:
            t = time.monotonic()
            if progress:
                progress(0, 0, "frozen")
            cap = _checkpoint(eng, info, work, req.leave_running)
            phases["checkpoint"] = round(time.monotonic() - t, 3)
            t = time.monotonic()
            _store(writer, cap, progress)
            phases["storing"] = round(time.monotonic() - t, 3)
            snap = writer.commit(extra_meta={"dump_seconds": time.monotonic() - t0})
        finally:
            if snap is None:
                writer.abort()
            if cap is not None:
                cap.release()
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


def _checkpoint(eng, info: dict, work, leave_running: bool):
    try:
        return eng.capture(info["id"], work, leave_running)
    except ContainerEngineFailed:
        # runc's checkpoint failed here now and then under load (about 1 in 100, its dump.log
        # gone with it); CRIU resumed the container, so once more is safe
        if not eng.inspect(info["id"])["running"]:
            raise
        return eng.capture(info["id"], work, leave_running)


def _store(writer, cap, progress) -> None:
    """The engine's checkpoint into the snapshot: an archive as it is, a directory as the
    archive of `checkpoint/` it would be (one format for both: docs/format.md §12)."""
    if cap.kind == "dir":
        size = sum(f.stat().st_size for f in cap.path.iterdir())
        archive.store_dir(writer, cap.path, (lambda n: progress(n, size, "storing")) if progress else None)
        return
    size = cap.path.stat().st_size
    with open(cap.path, "rb") as f:
        archive.store(writer, f, (lambda n: progress(n, size, "storing")) if progress else None)
