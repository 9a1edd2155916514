"""`gpusnap export`: one snapshot as one self-contained, checksummed stream (docs/format.md
§11, laid out in repo/format/export.py), written strictly in order so that it goes through a
pipe. It reads the snapshot through the repository's one reader (every page checked against
its id on the way out) and writes only what the snapshot needs: its manifest, its page
lists, and the bytes of its images with zero pages left out, compressed.
"""

from __future__ import annotations

import os
import sys

import blake3

from gpusnap.errors import GpusnapError, UsageError
from gpusnap.repo.format.export import (DATA_RAW_MAX, HEADER, MAGIC, RECORD, TAG_DATA, TAG_END, TAG_MANIFEST,
                                        TAG_PAGELIST, VERSION)


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


def pages_payload(snap, im):
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


def data_records(out: _Out, pieces) -> None:
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
            data_records(out, pages_payload(snap, im))
        else:
            data_records(out, snap.read_image(im["name"]))
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
            widen_pipe(f.fileno())
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


def widen_pipe(fd: int) -> None:
    """A 1 MiB pipe buffer (as CRIU's streamer uses): a 1 MiB record in one go, not sixteen
    64 KiB hand-overs between the two processes."""
    import fcntl
    import stat as stat_
    try:
        if stat_.S_ISFIFO(os.fstat(fd).st_mode):
            fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except OSError:
        pass      # over the user's pipe limit: the default works, only slower
