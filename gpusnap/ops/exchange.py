"""gpusnap export / import: one snapshot as one self-contained, checksummed stream
(docs/format.md §11), written and read strictly in order so that it goes through a pipe.

Export reads the snapshot through the repository's one reader (every page checked against its
id on the way out) and writes only what the snapshot needs: its manifest, its page lists, and
the bytes of its images with zero pages left out, compressed. Import reads the whole file
and checks everything against the manifest without a lock (ops/import_stream.py), then, for
a new snapshot, reads it again under the writer lock into an ordinary snapshot writer of
the receiving repository (which deduplicates against what is already there) and commits
only after the file's trailing checksum holds: a damaged or truncated file leaves nothing
behind.
"""

from __future__ import annotations

import errno
import os
import sys

import blake3

from gpusnap.errors import GpusnapError, NoSpace, UsageError
from gpusnap.ops.import_stream import CheckOnly, Stream, bad, read_head, read_images
from gpusnap.repo.format.export import (DATA_RAW_MAX, HEADER, MAGIC, READER_DATA_MAX, RECORD, TAG_DATA,  # noqa: F401
                                        TAG_END, TAG_MANIFEST, TAG_PAGELIST, VERSION)



# -- export ---------------------------------------------------------------------------------

class _Out:
    """Counts and hashes everything written."""

    def __init__(self, f):
        self.f = f
        self.h = blake3.blake3()
        self.n = 0

    def write(self, b) -> None:
        self.f.write(b)
        self.h.update(b)
        self.n += len(b)

    def record(self, tag: int, payload, codec: int = 0, raw_len: int | None = None) -> None:
        self.write(RECORD.pack(tag, codec, 0, len(payload) if raw_len is None else raw_len, len(payload)))
        self.write(payload)


def _pages_payload(snap, im):
    """The bytes of a pages image that the page list does not already say: its non-zero pages
    and its tail, in order (from the checked reader: zero runs are skipped, not sent)."""
    from gpusnap.repo.format import PAGE_SIZE

    chunks = snap.read_image(im["name"])
    buf = memoryview(b"")

    def take(n: int):
        nonlocal buf
        parts = []
        while n:
            if not buf:
                buf = memoryview(next(chunks))
            k = min(n, len(buf))
            parts.append(buf[:k])
            buf = buf[k:]
            n -= k
        return parts

    try:
        for rec in snap.iter_page_refs(im["name"]):
            if rec[0] == "zero":
                take(rec[1] * PAGE_SIZE)
            elif rec[0] == "pages":
                yield from take(len(rec[1]) // 16 * PAGE_SIZE)
            else:
                yield from take(rec[1])
    finally:
        chunks.close()


def _data_records(out: _Out, pieces) -> None:
    from gpusnap.repo.codec import CODEC_AUTO, compress

    pending: list = []
    size = 0

    def flush():
        nonlocal pending, size
        if size:
            raw = b"".join(pending)
            codec, payload = compress(raw, CODEC_AUTO)
            out.record(TAG_DATA, payload, codec=codec, raw_len=len(raw))
        pending, size = [], 0

    for p in pieces:
        p = memoryview(p)
        while p:
            k = min(len(p), DATA_RAW_MAX - size)
            pending.append(p[:k])
            size += k
            p = p[k:]
            if size == DATA_RAW_MAX:
                flush()
    flush()


def write_export(snap, f) -> dict:
    """Write snapshot `snap` to the binary file object `f`; -> figures."""
    manifest = (snap.path / "manifest").read_bytes()
    out = _Out(f)
    out.write(HEADER.pack(MAGIC, VERSION, 0, 0))
    out.record(TAG_MANIFEST, manifest)
    for im in snap.manifest["images"]:
        if im["type"] == "pages":
            out.record(TAG_PAGELIST, snap.pagelist_bytes(im["name"]))
            _data_records(out, _pages_payload(snap, im))
        else:
            _data_records(out, snap.read_image(im["name"]))
    digest = out.h.digest()
    out.record(TAG_END, digest)
    return {"bytes": out.n, "checksum": digest.hex()}


def export_snapshot(snap, output: str) -> dict:
    """Export to the file `output` (written under a temporary name, then renamed: a failed
    export leaves no file) or to stdout ('-')."""
    import secrets

    with snap.repo.readers_lock():
        if output == "-":
            f = sys.stdout.buffer
            _big_pipe(f.fileno())
            try:
                fig = write_export(snap, f)
                f.flush()
            except BrokenPipeError:
                raise GpusnapError("export: the reader of stdout went away before the end",
                                   hint="whatever read the export got an incomplete file; import refuses it") from None
            dest = "-"
        else:
            dest = os.path.abspath(output)
            if os.path.isdir(dest):
                raise UsageError(f"-o {output} is a directory", hint="give a file name")
            tmp = f"{dest}.tmp-{secrets.token_hex(4)}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except PermissionError:
                from gpusnap.errors import AccessDenied
                raise AccessDenied(f"cannot write {output}: permission denied",
                                   hint="choose a directory you can write to") from None
            except OSError as e:
                raise UsageError(f"cannot write {output}: {e.strerror}") from None
            try:
                with os.fdopen(fd, "wb", buffering=1 << 20) as f:
                    fig = write_export(snap, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.rename(tmp, dest)
            except BaseException as e:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                if isinstance(e, OSError) and e.errno == 28:
                    from gpusnap.errors import NoSpace
                    raise NoSpace(f"no space left for {output}") from None
                raise
    st = snap.stats
    return {"file": dest, "snapshot": str(snap.path), "id": snap.id, "name": snap.name,
            "bytes": fig["bytes"], "checksum": fig["checksum"], "bytes_raw": st.get("bytes_raw", 0),
            "format_version": VERSION}


# -- import ---------------------------------------------------------------------------------

def _present(repo, src_id: str):
    """The snapshot of `repo` that is the exported one (or an import of it), or None."""
    for s in repo.snapshots():   # importing the same snapshot twice keeps one copy
        if s.id == src_id or (s.meta.get("imported_from") or {}).get("id") == src_id:
            return s
    return None


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

    from gpusnap.repo.codec import codec_id

    try:
        start = f.tell() if f.seekable() else None
    except OSError:
        start = None
    src = Stream(f)
    m, src_id, mbytes = read_head(src)
    compress = m.get("compress", "auto")
    try:
        codec_id(compress)
    except (TypeError, ValueError):
        compress = "auto"
    meta = dict(m["meta"])
    meta["imported_from"] = {"id": src_id, "repo_id": m["repo_id"], "created": m["created"]}
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
        got = _present(repo, src_id)
        if got is None:
            with repo.writer_lock():
                got = _present(repo, src_id)
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
        snap = w.commit()
    except BaseException:
        w.abort()
        raise
    st = w.stats
    return {"snapshot": str(snap.path), "id": snap.id, "name": snap.name, "source_id": src_id,
            "already_present": False, "bytes_read": nbytes, "bytes_raw": st.get("bytes_raw", 0),
            "bytes_stored": st.get("bytes_stored", 0), "pages_total": st.get("pages_total", 0),
            "pages_dedup": st.get("pages_dedup", 0)}

def _big_pipe(fd: int) -> None:
    """A 1 MiB pipe buffer (as CRIU's streamer uses): a 1 MiB record in one go, not sixteen
    64 KiB hand-overs between the two processes."""
    import fcntl
    import stat as stat_
    try:
        if stat_.S_ISFIFO(os.fstat(fd).st_mode):
            fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except OSError:
        pass      # over the user's pipe limit: the default works, only slower


def import_snapshot(repo, path: str) -> dict:
    if path == "-":
        _big_pipe(sys.stdin.fileno())
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
