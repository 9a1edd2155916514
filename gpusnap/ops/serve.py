"""`gpusnap serve`: the receiving end of `gpusnap copy` (docs/format.md §13), on stdin and
stdout, started by `copy` as a local child or through ssh. It checks every frame it reads:
the manifest as an import does, each page list against its digest, every page against its
id, every data blob against its blake3, every blob image against its digest. It answers which
pages and blobs its repository lacks and stores the snapshot through an ordinary snapshot
writer, which commits it atomically (§5.3). Packs that fill up on the way are named by an
index file at once (SnapshotWriter.checkpoint), so an interrupted copy keeps them and the
next one does not send them again; the snapshot itself is visible only after its commit."""

from __future__ import annotations

import io
import sys

import blake3

from gpusnap.errors import CorruptSnapshot, GpusnapError
from gpusnap.ops.copy_wire import (BYE, COMMIT, DONE, HELLO, MANIFEST, NEXT, PAGELIST, PROTOCOL, READY, STATE,
                                   VERSION, WANT, Channel, bitmap)
from gpusnap.ops.import_stream import IMPORT_MANIFEST_MAX, DataRecords, pagelist_max, check_manifest


def serve(root, lock_wait: float | None = None, rfile=None, wfile=None) -> int:
    """Serve one copy conversation on rfile/wfile (default stdin/stdout) for the repository at
    `root`; -> the exit status. A failure is sent to the other end as an error frame (its exit
    code travels with it); whatever ends the conversation aborts the snapshot in progress."""
    from gpusnap.ops.export import widen_pipe
    from gpusnap.system import interrupt

    if rfile is None:
        rfile, wfile = sys.stdin.buffer, sys.stdout.buffer
        sys.stdout = sys.stderr         # stdout carries frames only: nothing else may print there
        for f in (rfile, wfile):
            widen_pipe(f.fileno())
    ch = Channel(rfile, wfile, "the copying gpusnap")
    with interrupt.as_exception():
        try:
            conversation(ch, root, lock_wait, [])
        except GpusnapError as e:
            try:
                ch.send_error(e)
            except OSError:             # the other end is gone: nobody to tell
                pass
            return e.exit_code
        except (KeyboardInterrupt, interrupt.Terminated):
            return 130
    return 0


def conversation(ch: Channel, root, lock_wait, received: list) -> None:
    """The receiving side of one conversation on `ch`; raises what ends it (serve() reports
    it to the other end). `received` gets the path of each snapshot committed or found here."""
    from gpusnap.repo import locate, lockwait
    from gpusnap.system import access

    hello = ch.recv_json(HELLO, "the greeting")
    if hello.get("protocol") != PROTOCOL or hello.get("version") != VERSION:
        raise ch.bad(f"it speaks {str(hello.get('protocol'))[:40]} version {str(hello.get('version'))[:20]}, "
                     f"this gpusnap {PROTOCOL} version {VERSION}")
    access.check_repo(root, write=True)
    repo = locate.open_repository(root).wait_for_locks(lockwait.seconds(lock_wait))
    ch.send_json(READY, {"protocol": PROTOCOL, "version": VERSION, "repo_id": repo.config["id"],
                         "path": str(repo.path)})
    ch.flush()
    while True:
        tag, payload = ch.recv((MANIFEST, BYE), IMPORT_MANIFEST_MAX, "the next snapshot")
        if tag == BYE:
            return
        received.append(_receive_snapshot(ch, repo, payload))


def _receive_snapshot(ch: Channel, repo, mbytes: bytes) -> str:
    """One snapshot: already here (said, nothing more), or received under the writer lock
    and committed once the other end says it is complete."""
    from gpusnap.ops.import_ import present

    m, src_id = check_manifest(mbytes, ch.bad)
    origin = (m["meta"].get("imported_from") or {}).get("id")     # a copy of a copy: its origin counts too
    got = present(repo, src_id, origin)
    if got is None:
        with repo.writer_lock(what="copy"):
            got = present(repo, src_id, origin)
            if got is None:
                return _store(ch, repo, m, src_id, origin)
    ch.send_json(STATE, {"present": True, "snapshot": str(got.path), "id": got.id, "name": got.name})
    ch.flush()
    return str(got.path)


def _store(ch: Channel, repo, m: dict, src_id: str, origin: str | None) -> str:
    from gpusnap.ops.import_ import commit_once, received_as

    compress, meta = received_as(m, src_id, via="copy")
    w = repo.new_snapshot(m["name"], compress=compress, meta=meta)
    w.created = float(m["created"])     # the snapshot keeps the time its dump started (and so its dir name)
    try:
        w.wait_index()
        ch.send_json(STATE, {"present": False})
        ch.flush()
        for im in m["images"]:
            _receive_image(ch, w, im)
        ch.recv((COMMIT,), 0, "the commit")
        snap, there = commit_once(repo, w, src_id, origin)
    except BaseException:
        w.abort()
        raise
    st = {} if there else w.stats
    ch.send_json(DONE, {"snapshot": str(snap.path), "id": snap.id, "name": snap.name, "present": there,
                        **{k: st.get(k, 0) for k in ("bytes_raw", "bytes_stored", "pages_total", "pages_dedup")}})
    ch.flush()
    return str(snap.path)


def _receive_image(ch: Channel, w, im: dict) -> None:
    name = im["name"]

    def frame(tag, limit, what):
        w.checkpoint()      # packs finished meanwhile are named now: they survive an interruption
        return ch.record_in(tag, limit, what)

    data = DataRecords(ch, read=frame, error=ch.bad)
    sink = w.image_sink(name)
    if im["type"] == "pages":
        _receive_pages(ch, w, sink, im, data)
    else:
        _receive_blobs(ch, w, sink, im, data)
    data.at_boundary(name)
    sink.close()
    got = w.images[name]
    if got["size"] != im["size"] or (im["type"] != "pages" and got["digest"] != im["digest"]):
        raise ch.bad(f"image {name} does not match its checksum")
    w.checkpoint()


def _want_pages(w, ids: bytes) -> bytearray:
    """One 0/1 byte per page id: 1 for a page neither the repository nor this snapshot so far
    holds (the first of equal ones only)."""
    loc = w.known_pages.get_many(ids)
    if w.claimed_pages.fill(ids, loc) == 0:
        return bytearray(len(loc))
    flags = bytearray(len(loc))
    seen: set = set()
    for i in [i for i, v in enumerate(loc) if v < 0]:
        pid = ids[i * 16:(i + 1) * 16]
        if pid not in seen:
            seen.add(pid)
            flags[i] = 1
    return flags


def _receive_pages(ch: Channel, w, sink, im: dict, data: DataRecords) -> None:
    from gpusnap.repo.format import FormatError, iter_pagelist

    name = im["name"]
    _, pl = ch.recv((PAGELIST,), pagelist_max(im["size"]), f"the page list of {name}")
    if len(pl) != im["pagelist_size"] or blake3.blake3(pl).hexdigest() != im["digest"]:
        raise ch.bad(f"the page list of {name} does not match its checksum")
    try:
        recs = list(iter_pagelist(io.BytesIO(pl).read, im["size"]))
    except FormatError as e:
        raise ch.bad(f"page list of {name}: {e}") from None
    ids = b"".join(r[1] for r in recs if r[0] == "pages")
    flags = _want_pages(w, ids)
    ch.record(WANT, bitmap(flags))
    ch.flush()
    pos = 0
    for rec in recs:
        if rec[0] == "zero":
            sink.write(b"", zero_pages=rec[1])
        elif rec[0] == "pages":
            end = pos + len(rec[1]) // 16
            _pages_run(ch, sink, name, ids, flags, pos, end, data)
            pos = end
        else:
            tail = data.take(rec[1], name)     # a partial last page always travels (< 4 KiB)
            if blake3.blake3(tail).digest() != rec[2]:
                raise ch.bad(f"the last partial page of {name} does not match its checksum")
            sink.write(tail)


def _pages_run(ch: Channel, sink, name: str, ids: bytes, flags: bytearray, pos: int, end: int,
               data: DataRecords) -> None:
    """Pages pos..end of the image's non-zero pages: the wanted ones from the stream, each
    checked against its id; the others by id alone."""
    from gpusnap.repo import native
    from gpusnap.repo.format import PAGE_SIZE

    j = pos
    while j < end:
        want = flags[j]
        r = flags.find(0 if want else 1, j, end)
        r = end if r < 0 else r
        if not want:
            sink.write_known(ids[j * 16:r * 16])
        for a in range(j, r, 256) if want else ():
            k = min(256, r - a)
            pages = data.take(k * PAGE_SIZE, name)
            if native.verify(pages, k, ids[a * 16:(a + k) * 16], b"\x01" * k) >= 0:
                raise ch.bad(f"a page of {name} does not match its checksum")
            sink.write(pages)
        j = r


def _receive_blobs(ch: Channel, w, sink, im: dict, data: DataRecords) -> None:
    """A blob image: its 1 MiB blobs the repository lacks from the stream, the others read
    here (the image's digest covers every byte); each checked against its blob id."""
    from gpusnap.repo.pipeline.sinks import DATA_CHUNK
    from gpusnap.repo.store import BlobReader

    name, size = im["name"], im["size"]
    ch.recv((NEXT,), 0, f"image {name}")
    try:
        ids = [bytes.fromhex(b) for b in im["blobs"]]
    except (TypeError, ValueError):
        ids = None
    if ids is None or len(ids) != -(-size // DATA_CHUNK) or any(len(b) != 32 for b in ids):
        raise ch.bad(f"the blob list of image {name} does not fit its size")
    known = w.known_data
    flags = bytearray(0 if b in known else 1 for b in ids)
    ch.record(WANT, bitmap(flags))
    ch.flush()
    rd = BlobReader(w.repo.path)
    try:
        for i, bid in enumerate(ids):
            n = min(DATA_CHUNK, size - i * DATA_CHUNK)
            chunk = data.take(n, name) if flags[i] else _own_blob(w, rd, bid)
            if len(chunk) != n or blake3.blake3(chunk).digest() != bid:
                if not flags[i]:
                    raise CorruptSnapshot(f"blob {bid.hex()} of this repository is damaged",
                                          hint=f"run `gpusnap verify --repo {w.repo.path}`, then `gpusnap repair`")
                raise ch.bad(f"a blob of image {name} does not match its checksum")
            sink.write(chunk)
    finally:
        rd.close()


def _own_blob(w, rd, bid: bytes) -> bytes:
    from gpusnap.repo.format import FormatError

    try:
        return rd.read_raw(w.index.blobs[w.known_data[bid]])
    except (OSError, FormatError) as e:
        raise CorruptSnapshot(f"blob {bid.hex()} of this repository cannot be read: {e}",
                              hint=f"run `gpusnap verify --repo {w.repo.path}`, then `gpusnap repair`") from None
