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

import io
import os
import struct
import sys

import blake3

from gpusnap.errors import BadExportFile, GpusnapError, UsageError

MAGIC = b"GSNEXP\0\0"
VERSION = 1
HEADER = struct.Struct("<8sHHI")          # magic, version, flags, reserved
RECORD = struct.Struct("<BBHII")          # tag, codec, reserved, raw_len, stored_len
TAG_MANIFEST, TAG_PAGELIST, TAG_DATA, TAG_END = 1, 2, 3, 0xFF
DATA_RAW_MAX = 1 << 20                    # raw bytes per data record (the writer's; a reader allows 4 MiB)
READER_DATA_MAX = 4 << 20
MANIFEST_MAX = 256 << 20
PAGELIST_MAX = 1 << 30


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

class _In:
    """Reads the stream strictly in order, hashing every byte before the end record."""

    def __init__(self, f):
        self.f = f
        self.h = blake3.blake3()
        self.n = 0

    def exact(self, n: int, what: str) -> bytes:
        parts = []
        left = n
        while left:
            b = self.f.read(min(left, 1 << 20))
            if not b:
                raise BadExportFile(f"export file is truncated (in {what}, after {self.n} bytes)",
                                    hint="copy the file again; nothing was imported")
            parts.append(b)
            left -= len(b)
            self.n += len(b)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        self.h.update(data)
        return data

    def record(self, want: int, limit: int, what: str) -> tuple[int, int, bytes]:
        tag, codec, reserved, raw_len, stored_len = RECORD.unpack(self.exact(RECORD.size, what))
        if tag != want or reserved or stored_len > limit or raw_len > limit:
            raise BadExportFile(f"export file is damaged: unexpected record (tag {tag}) where {what} belongs",
                                hint="copy the file again; nothing was imported")
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
                if not self.buf:
                    raise _bad(f"empty data record in {what}")
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


def _feed_pages(sink, im: dict, pl: bytes, data: _Data) -> None:
    from gpusnap.repo import native
    from gpusnap.repo.format import PAGE_SIZE, FormatError, iter_pagelist

    name = im["name"]
    zeros = bytes(DATA_RAW_MAX)
    try:
        for rec in iter_pagelist(io.BytesIO(pl).read, im["size"]):
            if rec[0] == "zero":
                left = rec[1] * PAGE_SIZE
                while left:
                    k = min(left, len(zeros))
                    sink.write(zeros if k == len(zeros) else zeros[:k])
                    left -= k
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


def read_import(repo, f) -> dict:
    """Stage the export read from `f` in a snapshot writer of `repo`, check every checksum,
    then commit. Any failure aborts the writer (nothing of the file stays). `repo` may be a
    callable returning the repository: it is called once the header and manifest are read
    (a file that is no export never creates a repository)."""
    from gpusnap.repo.codec import codec_id
    from gpusnap.repo.format import FormatError, parse_manifest

    src = _In(f)
    head = src.exact(HEADER.size, "the header")
    magic, version, flags, reserved = HEADER.unpack(head)
    if magic != MAGIC:
        raise BadExportFile("not a gpusnap export file (bad magic)",
                            hint="give a file written by `gpusnap export`; nothing was imported")
    if version != VERSION or flags or reserved:
        raise BadExportFile(f"export file version {version} is not supported (this gpusnap reads {VERSION})",
                            hint="import it with a gpusnap that reads it (a newer one); nothing was imported")
    _, _, mbytes = src.record(TAG_MANIFEST, MANIFEST_MAX, "the manifest")
    try:
        m, src_id = parse_manifest(mbytes)
    except FormatError as e:
        raise _bad(f"manifest: {e}") from None
    try:
        created = float(m["created"])
    except (TypeError, ValueError, KeyError):
        created = -1.0
    if not 0 <= created < 2 ** 33:      # it names the snapshot directory (a UTC time stamp)
        raise _bad("the manifest's creation time is out of range")
    compress = m.get("compress", "auto")
    try:
        codec_id(compress)
    except ValueError:
        compress = "auto"
    meta = dict(m.get("meta") or {})
    meta["imported_from"] = {"id": src_id, "repo_id": m.get("repo_id"), "created": m.get("created")}
    if callable(repo):
        repo = repo()
    with repo.writer_lock():
        for s in repo.snapshots():   # importing the same snapshot twice keeps one copy
            if s.id == src_id or (s.meta.get("imported_from") or {}).get("id") == src_id:
                while f.read(1 << 20):   # let a writer at the other end of a pipe finish
                    pass
                return {"snapshot": str(s.path), "id": s.id, "name": s.name, "source_id": src_id,
                        "already_present": True, "bytes_read": src.n, "bytes_stored": 0}
        w = repo.new_snapshot(m["name"], compress=compress, meta=meta)
        w.created = created   # the snapshot keeps the time its dump started
        try:
            data = _Data(src)
            for im in m["images"]:
                sink = w.image_sink(im["name"])
                if im["type"] == "pages":
                    _, _, pl = src.record(TAG_PAGELIST, PAGELIST_MAX, f"the page list of {im['name']}")
                    if len(pl) != im["pagelist_size"] or blake3.blake3(pl).hexdigest() != im["digest"]:
                        raise _bad(f"the page list of {im['name']} does not match its checksum")
                    _feed_pages(sink, im, pl, data)
                else:
                    _feed_blob(sink, im, data)
                data.at_boundary(im["name"])
                sink.close()
            expect = src.h.digest()
            _, _, trailer = src.record(TAG_END, 32, "the trailer")
            if trailer != expect:
                raise _bad("the file's checksum does not match its contents")
            if f.read(1):
                raise _bad("bytes follow the trailer")
            snap = w.commit()
        except BaseException:
            w.abort()
            raise
    st = w.stats
    return {"snapshot": str(snap.path), "id": snap.id, "name": snap.name, "source_id": src_id,
            "already_present": False, "bytes_read": src.n, "bytes_raw": st.get("bytes_raw", 0),
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
