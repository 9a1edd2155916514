"""`gpusnap import`: an export file (docs/format.md §11) into a repository. It reads the whole
file and checks everything against the manifest without a lock (ops/import_stream.py), then,
for a new snapshot, reads it again under the writer lock into an ordinary snapshot writer of
the receiving repository (which deduplicates against what is already there) and commits only
after the file's trailing checksum holds: a damaged or truncated file leaves nothing behind.
(The module's name has PEP 8's trailing underscore: `import` is a keyword.)
"""

from __future__ import annotations

import errno
import sys

from gpusnap.errors import NoSpace, UsageError
from gpusnap.ops.export import widen_pipe
from gpusnap.ops.import_stream import CheckOnly, Stream, bad, read_head, read_images
from gpusnap.repo.format.export import HEADER, MAGIC, RECORD, TAG_MANIFEST, VERSION


def present(repo, *ids: str | None):
    """The snapshot of `repo` that is one of the snapshots `ids` (or an import or copy of
    one), or None."""
    want = {i for i in ids if i}
    for s in repo.snapshots():   # importing (copying) the same snapshot twice keeps one copy
        if s.id in want or (s.meta.get("imported_from") or {}).get("id") in want:
            return s
    return None


def commit_once(repo, w, *ids: str | None):
    """Commit a received snapshot (import, copy) unless one of `ids` arrived meanwhile: two
    receivers of the same snapshot both find it absent under the shared writer lock (two
    catch-ups of one tiered snapshot, an import run twice at once). The check and the commit
    run under an exclusive flock on snapshots/ (docs/format.md §6), so one of them commits and
    the other keeps what was there. -> (snapshot, True if it was already there)."""
    import fcntl
    import os

    from gpusnap.repo import fsutil

    fd = fsutil.open_dir(repo.path / "snapshots")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        got = present(repo, *ids)
        if got is not None:
            w.abort()
            return got, True
        return w.commit(), False
    finally:
        os.close(fd)        # the flock goes with it


def received_as(m: dict, src_id: str, **origin) -> tuple[str, dict]:
    """A snapshot that arrived from another repository (import, copy): -> (the codec it is
    stored with: its own, when this gpusnap knows it; its meta, with `imported_from` naming
    the source, plus `origin`)."""
    from gpusnap.repo.codec import codec_id

    compress = m.get("compress", "auto")
    try:
        codec_id(compress)
    except (TypeError, ValueError):
        compress = "auto"
    meta = dict(m["meta"])
    meta["imported_from"] = {"id": src_id, "repo_id": m["repo_id"], "created": m["created"], **origin}
    return compress, meta


def read_import(repo, f) -> dict:
    """Import the export read from `f` into `repo`, in two passes:
      1. without any lock: read the whole file and check everything (a pipe's bytes are
         kept in an anonymous file in REPO/tmp as they pass);
      2. only if the snapshot is new: under the writer lock, read it again (the file from
         its start, or the kept copy), checking everything again while an ordinary snapshot
         writer stores it, and commit.
    So a slow or endless stream never holds the lock, and "already present" is said of a
    file that was read and checked to its end. Any failure aborts the writer (nothing of
    the file stays). `repo` may be a callable returning the repository: it is called once
    the header and manifest are read (a file that is no export never creates a
    repository)."""
    try:
        return _read_import(repo, f)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise NoSpace(f"no space left while importing: {e}",
                          hint="free space or prune old snapshots, then import again; nothing was imported") from None
        raise


def _read_import(repo, f) -> dict:
    import tempfile

    try:
        start = f.tell() if f.seekable() else None
    except OSError:
        start = None
    src = Stream(f)
    m, src_id, mbytes = read_head(src)
    compress, meta = received_as(m, src_id)
    if callable(repo):
        repo = repo()
    tmpdir = repo.path / "tmp"
    spool = None
    try:
        if start is None:
            spool = tempfile.TemporaryFile(dir=tmpdir)
            spool.write(HEADER.pack(MAGIC, VERSION, 0, 0) + RECORD.pack(TAG_MANIFEST, 0, 0, len(mbytes), len(mbytes))
                        + mbytes)
            src.spool = spool
        # -- pass 1: read and check everything, store nothing, hold no lock
        read_images(src, m, lambda name: CheckOnly(), tmpdir)
        got = present(repo, src_id)
        if got is None:
            with repo.writer_lock(what="import"):
                got = present(repo, src_id)
                if got is None:
                    return _store(repo, m, src_id, mbytes, meta, compress,
                                  spool if spool is not None else f, start or 0, tmpdir, src.n)
    finally:
        if spool is not None:
            spool.close()
    return {"snapshot": str(got.path), "id": got.id, "name": got.name, "source_id": src_id,
            "already_present": True, "bytes_read": src.n, "bytes_stored": 0}


def _store(repo, m, src_id, mbytes, meta, compress, f, start, tmpdir, nbytes) -> dict:
    """Pass 2 (writer lock held): the file again from its start, every check again (a file
    may have changed since pass 1), into a snapshot writer; commit after the last check."""
    f.seek(start)
    src = Stream(f)
    _, again, mb = read_head(src)
    if mb != mbytes:
        raise bad("the file changed while it was imported")
    w = repo.new_snapshot(m["name"], compress=compress, meta=meta)
    w.created = float(m["created"])   # the snapshot keeps the time its dump started
    try:
        read_images(src, m, w.image_sink, tmpdir)
        snap, there = commit_once(repo, w, src_id)
    except BaseException:
        w.abort()
        raise
    st = {} if there else w.stats
    return {"snapshot": str(snap.path), "id": snap.id, "name": snap.name, "source_id": src_id,
            "already_present": there, "bytes_read": nbytes, "bytes_raw": st.get("bytes_raw", 0),
            "bytes_stored": st.get("bytes_stored", 0), "pages_total": st.get("pages_total", 0),
            "pages_dedup": st.get("pages_dedup", 0)}


def import_snapshot(repo, path: str) -> dict:
    if path == "-":
        widen_pipe(sys.stdin.fileno())
        return read_import(repo, sys.stdin.buffer)
    try:
        with open(path, "rb", buffering=1 << 20) as f:
            return read_import(repo, f)
    except IsADirectoryError:
        raise UsageError(f"{path} is a directory") from None
    except FileNotFoundError:
        raise UsageError(f"export file {path} does not exist") from None



def import_file(path: str, root, lock_wait: float | None = None) -> dict:
    """`gpusnap import`: check that this user may read `path` ('-': stdin) and change the
    repository at `root` (made when missing at the default location), then import_snapshot(),
    waiting up to `lock_wait` for the writer lock (repo/lockwait.py). Interrupted (Ctrl-C,
    SIGTERM, SIGHUP), it removes what it had written (the writer's abort) and says so."""
    from pathlib import Path

    from gpusnap.errors import Interrupted
    from gpusnap.repo import locate, lockwait
    from gpusnap.system import access, interrupt

    wait = lockwait.seconds(lock_wait)
    if path != "-":
        access.check_readable_file(Path(path), "export file")
    create = locate.is_default(root)        # elsewhere a missing repository is an error
    if not access.check_repo(root, write=True, create=create) and not create:
        locate.open_repository(root)        # none there: that error, before the file is read
    with interrupt.as_exception():
        try:
            return import_snapshot(lambda: locate.open_repository(root, create_at_default=create)
                                   .wait_for_locks(wait), path)
        except (KeyboardInterrupt, interrupt.Terminated):
            raise Interrupted("import interrupted: nothing was imported, and what it had written was removed") from None
