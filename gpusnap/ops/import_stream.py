"""Reading an export file (docs/format.md §11) strictly in order, every check and limit
applied: the header and manifest (read_head), then every image against the manifest into
a sink, the end record and the end of the file (read_images). ops/import_.py runs it
twice per import: once to check, once to store."""

from __future__ import annotations

import io

import blake3

from gpusnap.errors import BadExportFile
from gpusnap.repo.format.export import (DATA_RAW_MAX, HEADER, MAGIC, READER_DATA_MAX, RECORD, TAG_DATA, TAG_END,
                                        TAG_MANIFEST, TAG_PAGELIST, VERSION)

# What an import accepts (docs/format.md §11, "Limits"): the work and memory of an import
# follow the bytes the file carries, and what the file declares is held to what a real
# snapshot can reach, so a few bytes cannot ask for terabytes of work.
IMPORT_MANIFEST_MAX = 16 << 20    # bytes of the manifest record (a 1,000-process job: ~6 MiB)
IMPORT_META_MAX = 4 << 20         # bytes of its meta as JSON (its longest item, the command line: <= ~2 MiB)
IMPORT_IMAGES_MAX = 1 << 16       # images of one snapshot (CRIU writes ~7-15 per process)
SNAPSHOT_BYTES_MAX = 64 << 40     # sum of the images' sizes: more than RAM + swap of any one machine
PAGELIST_IN_MEMORY = 1 << 20      # a longer page list waits in an anonymous file in REPO/tmp


def pagelist_max(size: int) -> int:
    """The longest page list an image of `size` bytes can have: a record per page at worst
    (21 bytes for a one-page run), and a tail record."""
    from gpusnap.repo.format import PAGE_SIZE

    return 21 * -(-size // PAGE_SIZE) + 5 + 32


class Stream:
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
                raise bad(f"data record of {what}: stored length {stored_len} for {raw_len} bytes")
        elif codec or raw_len != stored_len:
            raise bad(f"record head of {what} malformed")
        return codec, raw_len, stored_len

    def record(self, want: int, limit: int, what: str) -> tuple[int, int, bytes]:
        codec, raw_len, stored_len = self.head(want, limit, what)
        return codec, raw_len, self.exact(stored_len, what)


class DataRecords:
    """The image bytes carried by consecutive data records, handed out in exact amounts.
    `src.record(tag, limit, what)` reads the next record (an export file's Stream, or a
    copy's frames through `read`); `error(what)` makes the error for damaged data."""

    def __init__(self, src, read=None, error=None):
        self.src = src
        self.read = read or src.record
        self.bad = error or bad
        self.buf = memoryview(b"")

    def take(self, n: int, what: str) -> bytes:
        from gpusnap.repo.codec import decompress
        from gpusnap.repo.format import FormatError

        parts = []
        while n:
            if not self.buf:
                codec, raw_len, payload = self.read(TAG_DATA, READER_DATA_MAX, what)
                try:
                    self.buf = memoryview(decompress(payload, codec, raw_len))
                except FormatError as e:
                    raise self.bad(f"{what}: {e}") from None
            k = min(n, len(self.buf))
            parts.append(self.buf[:k])
            self.buf = self.buf[k:]
            n -= k
        return b"".join(parts)

    def at_boundary(self, what: str) -> None:
        if self.buf:
            raise self.bad(f"{what} carries {len(self.buf)} bytes too many")


def bad(what: str) -> BadExportFile:
    return BadExportFile(f"export file is damaged: {what}", hint="copy the file again; nothing was imported")


class CheckOnly:
    """The sink of the first pass: every check runs, nothing is stored."""

    def write(self, data, zero_pages: int = 0) -> None:
        pass

    def close(self) -> None:
        pass


def _read_pagelist(src: Stream, im: dict, tmpdir):
    """The image's page list record, checked against the manifest (length and blake3),
    as a file object at its start: in memory when short, else in an anonymous file in
    REPO/tmp (no name: nothing to clean whatever happens)."""
    import tempfile

    name = im["name"]
    _, _, n = src.head(TAG_PAGELIST, pagelist_max(im["size"]), f"the page list of {name}")
    if n != im["pagelist_size"]:
        raise bad(f"the page list of {name} does not match its checksum")
    buf = io.BytesIO() if n <= PAGELIST_IN_MEMORY else tempfile.TemporaryFile(dir=tmpdir)
    h = blake3.blake3()
    try:
        for b in src.chunks(n, f"the page list of {name}"):
            h.update(b)
            buf.write(b)
        if h.hexdigest() != im["digest"]:
            raise bad(f"the page list of {name} does not match its checksum")
        buf.seek(0)
    except BaseException:
        buf.close()
        raise
    return buf


def _feed_pages(sink, im: dict, read, data: DataRecords) -> None:
    from gpusnap.repo import native
    from gpusnap.repo.format import PAGE_SIZE, FormatError, iter_pagelist

    name = im["name"]
    try:
        for rec in iter_pagelist(read, im["size"]):
            if rec[0] == "zero":
                sink.write(b"", zero_pages=rec[1])     # carried by no byte of the file: costs nothing
            elif rec[0] == "pages":
                ids = rec[1]
                n = len(ids) // 16
                for o in range(0, n, 256):
                    k = min(256, n - o)
                    pages = data.take(k * PAGE_SIZE, name)
                    if native.verify(pages, k, ids[o * 16:(o + k) * 16], b"\x01" * k) >= 0:
                        raise bad(f"a page of {name} does not match its checksum")
                    sink.write(pages)
            else:
                tail = data.take(rec[1], name)
                if blake3.blake3(tail).digest() != rec[2]:
                    raise bad(f"the last partial page of {name} does not match its checksum")
                sink.write(tail)
    except FormatError as e:
        raise bad(f"page list of {name}: {e}") from None


def _feed_blob(sink, im: dict, data: DataRecords) -> None:
    h = blake3.blake3()
    left = im["size"]
    while left:
        chunk = data.take(min(left, DATA_RAW_MAX), im["name"])
        h.update(chunk)
        sink.write(chunk)
        left -= len(chunk)
    if h.hexdigest() != im["digest"]:
        raise bad(f"image {im['name']} does not match its checksum")


def read_head(src: Stream) -> tuple[dict, str, bytes]:
    """Header and manifest -> (manifest, source snapshot id, manifest bytes), every declared
    size held to the limits above."""
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
    m, src_id = check_manifest(mbytes)
    return m, src_id, mbytes


def check_manifest(mbytes: bytes, bad=bad) -> tuple[dict, str]:
    """A manifest that arrived from outside (an export file, a copy's stream) -> (manifest,
    its snapshot id): its own checksum and fields, every declared size held to the limits
    above. bad(what) makes the error to raise."""
    import json

    from gpusnap.repo.format import FormatError, parse_manifest

    try:
        m, src_id = parse_manifest(mbytes)
    except FormatError as e:
        raise bad(f"manifest: {e}") from None
    if not 0 <= m["created"] < 2 ** 33:      # it names the snapshot directory (a UTC time stamp)
        raise bad("the manifest's creation time is out of range")
    if len(m["images"]) > IMPORT_IMAGES_MAX:
        raise bad(f"the manifest lists {len(m['images'])} images (a snapshot has at most {IMPORT_IMAGES_MAX})")
    if len(json.dumps(m["meta"])) > IMPORT_META_MAX:
        raise bad(f"the manifest's meta is larger than {IMPORT_META_MAX} bytes")
    total = sum(im["size"] for im in m["images"])
    if total > SNAPSHOT_BYTES_MAX:
        raise bad(f"the manifest declares {total} bytes of images (a snapshot holds at most "
                   f"{SNAPSHOT_BYTES_MAX >> 40} TiB)")
    for im in m["images"]:
        if im["type"] == "pages" and im["pagelist_size"] > pagelist_max(im["size"]):
            raise bad(f"the page list of {im['name']} is longer than an image of its size can have")
    return m, src_id


def read_images(src: Stream, m: dict, sink_for, tmpdir) -> None:
    """Every image, each checked against the manifest, into sink_for(name); then the
    trailer and the end of the file."""
    data = DataRecords(src)
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
        raise bad("the file's checksum does not match its contents")
    if src.f.read(1):
        raise bad("bytes follow the trailer")


