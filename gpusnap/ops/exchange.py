"""gpusnap export / import: one snapshot as one self-contained, checksummed stream
(docs/format.md §11), written and read strictly in order so that it goes through a pipe.

Export reads the snapshot through the repository's one reader (every page checked against its
id on the way out) and writes only what the snapshot needs: its manifest, its page lists, and
the bytes of its images with zero pages left out, compressed. Import checks everything against
the manifest while it feeds the images to an ordinary snapshot writer of the receiving
repository (which deduplicates against what is already there) and commits only after the
file's trailing checksum holds: a damaged or truncated file leaves nothing behind.
"""

from __future__ import annotations

import errno
import io
import os
import struct
import sys

import blake3

from gpusnap.errors import BadExportFile, GpusnapError, NoSpace, UsageError

MAGIC = b"GSNEXP\0\0"
VERSION = 1
HEADER = struct.Struct("<8sHHI")          # magic, version, flags, reserved
RECORD = struct.Struct("<BBHII")          # tag, codec, reserved, raw_len, stored_len
TAG_MANIFEST, TAG_PAGELIST, TAG_DATA, TAG_END = 1, 2, 3, 0xFF
DATA_RAW_MAX = 1 << 20                    # raw bytes per data record (the writer's; a reader allows 4 MiB)
READER_DATA_MAX = 4 << 20


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
#
# What an import accepts (docs/format.md §11, "Limits"): the work and memory of an import
# follow the bytes the file carries, and what the file declares is held to what a real
# snapshot can reach, so a few bytes cannot ask for terabytes of work.
IMPORT_MANIFEST_MAX = 16 << 20    # bytes of the manifest record (a 1,000-process job: ~6 MiB)
IMPORT_META_MAX = 4 << 20         # bytes of its meta as JSON (its longest item, the command line: <= ~2 MiB)
IMPORT_IMAGES_MAX = 1 << 16       # images of one snapshot (CRIU writes ~7-15 per process)
SNAPSHOT_BYTES_MAX = 64 << 40     # sum of the images' sizes: more than RAM + swap of any one machine
PAGELIST_IN_MEMORY = 1 << 20      # a longer page list waits in an anonymous file in REPO/tmp


def _pagelist_max(size: int) -> int:
    """The longest page list an image of `size` bytes can have: a record per page at worst
    (21 bytes for a one-page run), and a tail record."""
    from gpusnap.repo.format import PAGE_SIZE

    return 21 * -(-size // PAGE_SIZE) + 5 + 32


class _In:
    """Reads the stream strictly in order, hashing every byte before the end record and
    copying it to `spool` when one is set (a pipe: the commit reads it again). It reads only
    what the manifest's images need (each data record carries at least one byte of image
    in at most 13 bytes of file), then the end record and one byte more: a stream that does
    not end is cut off there."""

    def __init__(self, f):
        self.f = f
        self.h = blake3.blake3()
        self.n = 0
        self.spool = None

    def exact(self, n: int, what: str) -> bytes:
        parts = []
        for b in self.chunks(n, what):
            parts.append(b)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def chunks(self, n: int, what: str):
        """The next n bytes, in pieces of at most 1 MiB (hashed, counted, spooled)."""
        left = n
        while left:
            b = self.f.read(min(left, 1 << 20))
            if not b:
                raise BadExportFile(f"export file is truncated (in {what}, after {self.n} bytes)",
                                    hint="copy the file again; nothing was imported")
            left -= len(b)
            self.n += len(b)
            self.h.update(b)
            if self.spool is not None:
                self.spool.write(b)
            yield b

    def head(self, want: int, limit: int, what: str) -> tuple[int, int, int]:
        """A record's head -> (codec, raw_len, stored_len), checked against the record kind."""
        tag, codec, reserved, raw_len, stored_len = RECORD.unpack(self.exact(RECORD.size, what))
        if tag != want or reserved or stored_len > limit or raw_len > limit:
            raise BadExportFile(f"export file is damaged: unexpected record (tag {tag}) where {what} belongs",
                                hint="copy the file again; nothing was imported")
        if tag == TAG_DATA:
            # compress() never stores more than it saves (codec.GAIN_LIMIT): a record carries
            # at least as many bytes of image as of file, so the file bounds the work
            if not 0 < stored_len <= raw_len:
                raise _bad(f"data record of {what}: stored length {stored_len} for {raw_len} bytes")
        elif codec or raw_len != stored_len:
            raise _bad(f"record head of {what} malformed")
        return codec, raw_len, stored_len

    def record(self, want: int, limit: int, what: str) -> tuple[int, int, bytes]:
        codec, raw_len, stored_len = self.head(want, limit, what)
        return codec, raw_len, self.exact(stored_len, what)


class _Data:
    """The image bytes carried by consecutive data records, handed out in exact amounts."""

    def __init__(self, src: _In):
        self.src = src
        self.buf = memoryview(b"")

    def take(self, n: int, what: str) -> bytes:
        from gpusnap.repo.codec import decompress
        from gpusnap.repo.format import FormatError

        parts = []
        while n:
            if not self.buf:
                codec, raw_len, payload = self.src.record(TAG_DATA, READER_DATA_MAX, what)
                try:
                    self.buf = memoryview(decompress(payload, codec, raw_len))
                except FormatError as e:
                    raise BadExportFile(f"export file is damaged: {what}: {e}",
                                        hint="copy the file again; nothing was imported") from None
            k = min(n, len(self.buf))
            parts.append(self.buf[:k])
            self.buf = self.buf[k:]
            n -= k
        return b"".join(parts)

    def at_boundary(self, what: str) -> None:
        if self.buf:
            raise _bad(f"{what} carries {len(self.buf)} bytes too many")


def _bad(what: str) -> BadExportFile:
    return BadExportFile(f"export file is damaged: {what}", hint="copy the file again; nothing was imported")


class _CheckOnly:
    """The sink of the first pass: every check runs, nothing is stored."""

    def write(self, data) -> None:
        pass

    def zero_pages(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _read_pagelist(src: _In, im: dict, tmpdir):
    """The image's page list record, checked against the manifest (length and blake3),
    as a file object at its start: in memory when short, else in an anonymous file in
    REPO/tmp (no name: nothing to clean whatever happens)."""
    import tempfile

    name = im["name"]
    _, _, n = src.head(TAG_PAGELIST, _pagelist_max(im["size"]), f"the page list of {name}")
    if n != im["pagelist_size"]:
        raise _bad(f"the page list of {name} does not match its checksum")
    buf = io.BytesIO() if n <= PAGELIST_IN_MEMORY else tempfile.TemporaryFile(dir=tmpdir)
    h = blake3.blake3()
    try:
        for b in src.chunks(n, f"the page list of {name}"):
            h.update(b)
            buf.write(b)
        if h.hexdigest() != im["digest"]:
            raise _bad(f"the page list of {name} does not match its checksum")
        buf.seek(0)
    except BaseException:
        buf.close()
        raise
    return buf


def _feed_pages(sink, im: dict, read, data: _Data) -> None:
    from gpusnap.repo import native
    from gpusnap.repo.format import PAGE_SIZE, FormatError, iter_pagelist

    name = im["name"]
    try:
        for rec in iter_pagelist(read, im["size"]):
            if rec[0] == "zero":
                sink.zero_pages(rec[1])     # carried by no byte of the file: costs nothing
            elif rec[0] == "pages":
                ids = rec[1]
                n = len(ids) // 16
                for o in range(0, n, 256):
                    k = min(256, n - o)
                    pages = data.take(k * PAGE_SIZE, name)
                    if native.verify(pages, k, ids[o * 16:(o + k) * 16], b"\x01" * k) >= 0:
                        raise _bad(f"a page of {name} does not match its checksum")
                    sink.write(pages)
            else:
                tail = data.take(rec[1], name)
                if blake3.blake3(tail).digest() != rec[2]:
                    raise _bad(f"the last partial page of {name} does not match its checksum")
                sink.write(tail)
    except FormatError as e:
        raise _bad(f"page list of {name}: {e}") from None


def _feed_blob(sink, im: dict, data: _Data) -> None:
    h = blake3.blake3()
    left = im["size"]
    while left:
        chunk = data.take(min(left, DATA_RAW_MAX), im["name"])
        h.update(chunk)
        sink.write(chunk)
        left -= len(chunk)
    if h.hexdigest() != im["digest"]:
        raise _bad(f"image {im['name']} does not match its checksum")


def _read_head(src: _In) -> tuple[dict, str, bytes]:
    """Header and manifest -> (manifest, source snapshot id, manifest bytes), every declared
    size held to the limits above."""
    import json

    from gpusnap.repo.format import FormatError, parse_manifest

    magic, version, flags, reserved = HEADER.unpack(src.exact(HEADER.size, "the header"))
    if magic != MAGIC:
        raise BadExportFile("not a gpusnap export file (bad magic)",
                            hint="give a file written by `gpusnap export`; nothing was imported")
    if version != VERSION:
        raise BadExportFile(f"export file version {version} is not supported (this gpusnap reads {VERSION})",
                            hint="import it with a gpusnap that reads it (a newer one); nothing was imported")
    if flags or reserved:
        raise BadExportFile(f"export file has unknown flags ({flags:#06x}, reserved {reserved:#x}): "
                            "it needs a gpusnap that knows them",
                            hint="import it with the gpusnap that wrote it (or a newer one); nothing was imported")
    _, _, mbytes = src.record(TAG_MANIFEST, IMPORT_MANIFEST_MAX, "the manifest")
    try:
        m, src_id = parse_manifest(mbytes)
    except FormatError as e:
        raise _bad(f"manifest: {e}") from None
    if not 0 <= m["created"] < 2 ** 33:      # it names the snapshot directory (a UTC time stamp)
        raise _bad("the manifest's creation time is out of range")
    if len(m["images"]) > IMPORT_IMAGES_MAX:
        raise _bad(f"the manifest lists {len(m['images'])} images (a snapshot has at most {IMPORT_IMAGES_MAX})")
    if len(json.dumps(m["meta"])) > IMPORT_META_MAX:
        raise _bad(f"the manifest's meta is larger than {IMPORT_META_MAX} bytes")
    total = sum(im["size"] for im in m["images"])
    if total > SNAPSHOT_BYTES_MAX:
        raise _bad(f"the manifest declares {total} bytes of images (a snapshot holds at most "
                   f"{SNAPSHOT_BYTES_MAX >> 40} TiB)")
    for im in m["images"]:
        if im["type"] == "pages" and im["pagelist_size"] > _pagelist_max(im["size"]):
            raise _bad(f"the page list of {im['name']} is longer than an image of its size can have")
    return m, src_id, mbytes


def _read_images(src: _In, m: dict, sink_for, tmpdir) -> None:
    """Every image, each checked against the manifest, into sink_for(name); then the
    trailer and the end of the file."""
    data = _Data(src)
    for im in m["images"]:
        sink = sink_for(im["name"])
        if im["type"] == "pages":
            with _read_pagelist(src, im, tmpdir) as pl:
                _feed_pages(sink, im, pl.read, data)
        else:
            _feed_blob(sink, im, data)
        data.at_boundary(im["name"])
        sink.close()
    expect = src.h.digest()
    _, _, trailer = src.record(TAG_END, 32, "the trailer")
    if trailer != expect:
        raise _bad("the file's checksum does not match its contents")
    if src.f.read(1):
        raise _bad("bytes follow the trailer")


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
    src = _In(f)
    m, src_id, mbytes = _read_head(src)
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
        _read_images(src, m, lambda name: _CheckOnly(), tmpdir)
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
    src = _In(f)
    _, again, mb = _read_head(src)
    if mb != mbytes:
        raise _bad("the file changed while it was imported")
    w = repo.new_snapshot(m["name"], compress=compress, meta=meta)
    w.created = float(m["created"])   # the snapshot keeps the time its dump started
    try:
        _read_images(src, m, w.image_sink, tmpdir)
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



def import_file(path: str, root) -> dict:
    """`gpusnap import`: check that this user may read `path` ('-': stdin) and change the
    repository at `root` (made when missing), then import_snapshot()."""
    from pathlib import Path

    from gpusnap.repo.repository import Repository
    from gpusnap.system import access

    if path != "-":
        access.check_readable_file(Path(path), "export file")
    access.check_repo(root, write=True)
    return import_snapshot(lambda: Repository.open(root, create=True), path)
