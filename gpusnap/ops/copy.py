"""`gpusnap copy SNAP... --to REPO|ssh://[user@]host[:port]/path`: snapshots sent to another
repository, only the pages and blobs it lacks (docs/format.md §13). This side reads each
snapshot through the repository's one checked reader and speaks the copy protocol
(ops/copy_wire.py) with `gpusnap serve` at the other end (ops/copy_peer.py starts it), which
checks everything again and commits each snapshot atomically. Per image: the page list (or,
for a blob image, its turn) goes over, the other end answers which pages (blobs) it lacks, and
only those travel, compressed as an export's data records (ops/export.py)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpusnap.errors import CopyFailed, Interrupted, UsageError
from gpusnap.repo import copies
from gpusnap.ops.copy_wire import (BYE, COMMIT, DONE, HELLO, MANIFEST, NEXT, PAGELIST, PROTOCOL, READY, STATE,
                                   VERSION, WANT, Channel, unbitmap)


@dataclass
class CopyRequest:
    refs: list[str]
    repo: Path                  # the source repository
    to: str                     # a repository path, or ssh://[user@]host[:port]/path
    name: str | None = None     # every snapshot of this name
    all: bool = False           # every snapshot
    remote_gpusnap: str | None = None
    lock_wait: float | None = None
    pending: bool = False       # every snapshot whose copy to `to` is pending (repo/copies.py)
    done: list = field(default_factory=list)


def select(repo, refs: list[str], name: str | None, all_: bool) -> list:
    """The snapshots to copy, oldest first (each later one then finds the earlier one's pages)."""
    if sum(map(bool, (refs, name, all_))) != 1:
        raise UsageError("give snapshots (SNAP...), --name NAME or --all", hint="one of them")
    if refs:
        snaps = [repo.snapshot(r) for r in refs]
    else:
        snaps = [s for s in repo.snapshots() if all_ or s.name == name]
        if not snaps:
            from gpusnap.errors import SnapshotNotFound
            raise SnapshotNotFound(f"no snapshot named {name} in {repo.path}" if name else f"no snapshot in {repo.path}",
                                   hint="`gpusnap ls` lists them")
    unique = {s.path: s for s in snaps}
    return sorted(unique.values(), key=lambda s: (s.created, s.path.name))


def copy(req: CopyRequest, progress=None) -> dict:
    """Copy the chosen snapshots; -> the report (one entry per snapshot, bytes sent). Ctrl-C,
    SIGTERM, SIGHUP: the pipe is closed, the other end aborts the snapshot in progress (its
    finished packs stay named there), and the copies committed before stay (exit 130)."""
    from gpusnap.ops.copy_peer import Peer, serve_command
    from gpusnap.repo import locate
    from gpusnap.system import access, interrupt

    access.check_repo(req.repo)
    repo = locate.open_repository(req.repo)
    argv, local = serve_command(req.to, req.remote_gpusnap, req.lock_wait)
    to = local or req.to                # as a tiered dump records it (ops/tiers.py destination)
    snaps = _pending(repo, req, to) if req.pending else select(repo, req.refs, req.name, req.all)
    t0 = time.monotonic()
    with interrupt.as_exception(), repo.readers_lock(), _recorded(repo, req.done, to):
        if not snaps:       # --pending with nothing pending: no connection needed
            return _report(req, t0)
        peer = Peer(argv, "the destination")
        try:
            _converse(peer.channel, repo, snaps, req.done, progress)
        except (KeyboardInterrupt, interrupt.Terminated):
            peer.close()
            raise Interrupted(f"copy interrupted after {sum(not d['already_present'] for d in req.done)} "
                              "snapshot(s): the one in progress was not committed at the destination",
                              hint="run the same copy again: what was committed is skipped, and the packs "
                                   "that arrived complete are not sent again") from None
        except (BrokenPipeError, ConnectionResetError):
            raise peer.lost() from None
        except CopyFailed as e:
            if getattr(e, "closed", False):
                raise peer.gone() from None
            raise
        finally:
            peer.close()
    return _report(req, t0)


def send_stdio(req: CopyRequest) -> int:
    """`gpusnap copy SNAP... --to -`: the sending half of the copy protocol on stdin and stdout,
    for a receiver at the other end of the pipe: a restore that pulls a snapshot back from an
    ssh:// tier runs this there through ssh (ops/tier_pull.py). Nothing is recorded in copies/
    ("-" names no repository). A failure is sent to the other end as an error frame, as serve
    does; -> the exit status."""
    import sys

    from gpusnap.errors import GpusnapError
    from gpusnap.ops.export import widen_pipe
    from gpusnap.repo import locate
    from gpusnap.system import access, interrupt

    rfile, wfile = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr             # stdout carries frames only
    for f in (rfile, wfile):
        widen_pipe(f.fileno())
    ch = Channel(rfile, wfile, "the pulling gpusnap")
    with interrupt.as_exception():
        try:
            if req.pending:
                raise UsageError("--to - sends the snapshots named (SNAP..., --name, --all), not --pending")
            access.check_repo(req.repo)
            repo = locate.open_repository(req.repo)
            snaps = select(repo, req.refs, req.name, req.all)
            with repo.readers_lock():
                _converse(ch, repo, snaps, req.done, None)
        except GpusnapError as e:
            try:
                ch.send_error(e)
                ch.flush()
            except OSError:
                pass
            return e.exit_code
        except (BrokenPipeError, ConnectionResetError):
            return CopyFailed.exit_code
        except (KeyboardInterrupt, interrupt.Terminated):
            return 130
    return 0


def _report(req: CopyRequest, t0: float) -> dict:
    return {"to": req.to, "snapshots": req.done, "copied": sum(not d["already_present"] for d in req.done),
            "skipped": sum(d["already_present"] for d in req.done),
            "bytes_sent": sum(d["bytes_sent"] for d in req.done),
            "bytes_raw": sum(d["bytes_raw"] for d in req.done), "seconds": round(time.monotonic() - t0, 3)}


def _pending(repo, req: CopyRequest, to: str) -> list:
    """--pending: the snapshots whose copy to `to` a tiered dump left pending, oldest first."""
    if req.refs or req.name or req.all:
        raise UsageError("--pending chooses the snapshots itself", hint="give it without SNAP..., --name or --all")
    snaps = [repo.snapshot(d) for d in copies.pending(repo, to)]
    return sorted(snaps, key=lambda s: (s.created, s.path.name))


@contextlib.contextmanager
def _recorded(repo, done: list, to: str):
    """Each snapshot that is at the destination (committed, or found there) recorded as copied
    to `to` (REPO/copies/, repo/copies.py), whatever ends the copy: what arrived counts."""
    try:
        yield
    finally:
        copies.note_copied(repo.path, done, to)


def _converse(ch: Channel, repo, snaps: list, done: list, progress) -> None:
    ch.send_json(HELLO, {"protocol": PROTOCOL, "version": VERSION})
    ch.flush()
    ready = ch.recv_json(READY, "the greeting")
    if ready.get("protocol") != PROTOCOL or ready.get("version") != VERSION:
        raise ch.bad(f"it speaks {str(ready.get('protocol'))[:40]} version {str(ready.get('version'))[:20]}")
    if ready.get("repo_id") == repo.config["id"]:
        raise UsageError(f"the destination is the source repository {repo.path}", hint="copy to another one")
    total = sum(im["size"] for s in snaps for im in s.manifest["images"])
    seen = [0]

    def tick(n: int) -> None:
        seen[0] += n
        if progress is not None:
            progress(seen[0], total)

    for snap in snaps:
        done.append(_send_snapshot(ch, snap, tick))
    ch.record(BYE)
    ch.flush()


def _send_snapshot(ch: Channel, snap, tick) -> dict:
    sent0 = ch.sent
    ch.record(MANIFEST, (snap.path / "manifest").read_bytes())
    ch.flush()
    state = ch.recv_json(STATE, "the snapshot's state")
    raw = sum(im["size"] for im in snap.manifest["images"])
    out = {"name": snap.name, "source": str(snap.path), "source_id": snap.id}
    if state.get("present") is True:
        tick(raw)
        return {**out, "already_present": True, "snapshot": _text(state.get("snapshot")),
                "id": _text(state.get("id")), "bytes_sent": ch.sent - sent0, "bytes_raw": 0}
    for im in snap.manifest["images"]:
        _send_image(ch, snap, im, tick)
    ch.record(COMMIT)
    ch.flush()
    r = ch.recv_json(DONE, "the commit")
    # present: another copy of the same snapshot committed there while this one was sent
    return {**out, "already_present": r.get("present") is True, "snapshot": _text(r.get("snapshot")),
            "id": _text(r.get("id")),
            "bytes_sent": ch.sent - sent0, "bytes_raw": raw,
            **{k: r.get(k) if isinstance(r.get(k), int) else 0 for k in ("bytes_stored", "pages_total", "pages_dedup")}}


def _text(v) -> str:
    """A string the other end sent, as a string of sane length (it is printed)."""
    return str(v)[:4096]


def _send_image(ch: Channel, snap, im: dict, tick) -> None:
    from gpusnap.ops.export import data_records, pages_payload
    from gpusnap.repo.format import PAGE_SIZE
    from gpusnap.repo.pipeline.sinks import DATA_CHUNK

    name = im["name"]
    if im["type"] == "pages":
        ch.record(PAGELIST, snap.pagelist_bytes(name))
        units = sum(len(r[1]) // 16 for r in snap.iter_page_refs(name) if r[0] == "pages")
        unit, pieces = PAGE_SIZE, pages_payload(snap, im)
    else:
        ch.record(NEXT)
        units, unit, pieces = len(im["blobs"]), DATA_CHUNK, snap.read_image(name)
    ch.flush()
    _, bits = ch.recv((WANT,), (units + 7) // 8, f"what it lacks of {name}")
    try:
        flags = unbitmap(bits, units)
    except ValueError as e:
        raise ch.bad(f"what it lacks of {name}: {e}") from None
    left = [im["size"]]

    def counted(pieces):
        for p in pieces:
            n = min(len(p), left[0])
            left[0] -= n
            tick(n)
            yield p

    try:
        data_records(ch, wanted(counted(pieces), flags, unit))
    finally:
        pieces.close()
    tick(left[0])     # zero runs: never read, never sent


def wanted(pieces, flags: bytearray, unit: int):
    """The bytes of a stream of pieces that belong to wanted units (unit i: bytes i*unit ..
    (i+1)*unit - 1, wanted when flags[i]), and every byte past the last unit (a pages image's
    tail, which always travels)."""
    covered = len(flags) * unit
    pos = 0
    for p in pieces:
        p = memoryview(p)
        start, pos = pos, pos + len(p)
        off = 0
        while off < len(p):
            a = start + off
            if a >= covered:
                yield p[off:]
                break
            i = a // unit
            j = flags.find(0 if flags[i] else 1, i)
            stop = min((covered if j < 0 else j * unit) - start, len(p))
            if flags[i]:
                yield p[off:stop]
            off = stop
