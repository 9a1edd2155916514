"""The copy protocol's frames (docs/format.md §13): what `gpusnap copy` and `gpusnap serve`
say to each other over a pipe (a local child's, or ssh's). Every frame has the export file's
12-byte record head (repo/format/export.py RECORD); each side reads only the tags it expects
at that point, each no longer than the limit for that point, and treats everything it reads
as untrusted: a malformed frame ends the conversation with CopyFailed (exit 34)."""

from __future__ import annotations

import json

from gpusnap.errors import CopyFailed, GpusnapError, all_error_classes
from gpusnap.repo.format.export import RECORD, TAG_DATA, TAG_MANIFEST, TAG_PAGELIST

PROTOCOL = "gpusnap-copy"
VERSION = 1
# tags 1-3 are the export file's (manifest, page list, data: the same payloads); the rest
# are the conversation's own
MANIFEST, PAGELIST, DATA = TAG_MANIFEST, TAG_PAGELIST, TAG_DATA
HELLO, READY, STATE, NEXT, WANT, COMMIT, DONE, BYE, ERROR = 0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x1F
JSON_MAX = 1 << 20          # a JSON frame (hello, state, result, error)


class Channel:
    """Frames over a pair of binary files (read side, write side), bytes counted each way.
    `what` names the other end in errors ("the destination", "the copying gpusnap")."""

    def __init__(self, rfile, wfile, what: str):
        self.r = rfile
        self.w = wfile
        self.what = what
        self.sent = 0
        self.received = 0

    def bad(self, what: str) -> CopyFailed:
        return CopyFailed(f"copy: {self.what} broke the protocol: {what}",
                          hint="nothing of the snapshot in progress was committed; run the same copy again")

    # -- sending ------------------------------------------------------------------------
    def record(self, tag: int, payload=b"", codec: int = 0, raw_len: int | None = None) -> None:
        """One frame (the signature of ops/export.py's writer: its data records go out here)."""
        n = len(payload)
        self.w.write(RECORD.pack(tag, codec, 0, n if raw_len is None else raw_len, n))
        if n:
            self.w.write(payload)
        self.sent += RECORD.size + n

    def send_json(self, tag: int, obj: dict) -> None:
        self.record(tag, json.dumps(obj, separators=(",", ":")).encode())

    def flush(self) -> None:
        self.w.flush()

    def send_error(self, e: GpusnapError) -> None:
        self.send_json(ERROR, {"error": e.title, "message": e.message, "hint": e.hint, "exit_code": e.exit_code})
        self.flush()

    # -- receiving ----------------------------------------------------------------------
    def exact(self, n: int, what: str) -> bytes:
        parts, left = [], n
        while left:
            b = self.r.read(min(left, 1 << 20))
            if not b:
                e = CopyFailed(f"copy: the connection to {self.what} closed (in {what})",
                               hint="nothing of the snapshot in progress was committed; run the same copy again")
                e.closed = True         # (copy asks the other end's exit status then: Peer.gone)
                raise e
            parts.append(b)
            left -= len(b)
        self.received += n
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def head(self, want, limit: int, what: str) -> tuple[int, int, int, int]:
        """The next frame's head -> (tag, codec, raw_len, stored_len). An ERROR frame from the
        other end raises the error it carries; a tag not in `want` or over `limit`, CopyFailed."""
        tag, codec, reserved, raw_len, stored_len = RECORD.unpack(self.exact(RECORD.size, what))
        if tag == ERROR and ERROR not in want and stored_len <= JSON_MAX:
            raise remote_error(self._json(self.exact(stored_len, what), what))
        if tag not in want or reserved or stored_len > limit or raw_len > limit:
            raise self.bad(f"unexpected frame (tag {tag}, {stored_len} bytes) where {what} belongs")
        if tag == DATA:
            if not 0 < stored_len <= raw_len:       # as an export's data record (§11)
                raise self.bad(f"data frame of {what}: stored length {stored_len} for {raw_len} bytes")
        elif codec or raw_len != stored_len:
            raise self.bad(f"frame head of {what} malformed")
        return tag, codec, raw_len, stored_len

    def record_in(self, want: int, limit: int, what: str) -> tuple[int, int, bytes]:
        """-> (codec, raw_len, payload) of a frame of tag `want` (import_stream.DataRecords reads this)."""
        _, codec, raw_len, stored_len = self.head((want,), limit, what)
        return codec, raw_len, self.exact(stored_len, what)

    def recv(self, want, limit: int, what: str) -> tuple[int, bytes]:
        tag, _, _, stored_len = self.head(want, limit, what)
        return tag, self.exact(stored_len, what)

    def recv_json(self, want: int, what: str) -> dict:
        _, payload = self.recv((want,), JSON_MAX, what)
        return self._json(payload, what)

    def _json(self, payload: bytes, what: str) -> dict:
        try:
            obj = json.loads(payload)
        except (UnicodeDecodeError, ValueError):
            obj = None
        if not isinstance(obj, dict):
            raise self.bad(f"{what} is not a JSON object")
        return obj


def remote_error(obj: dict) -> GpusnapError:
    """The error the other end reported, as the class of its exit code (its own title and
    hint): `copy` exits as the failing command there would have."""
    code = obj.get("exit_code")
    cls = next((c for c in all_error_classes() if c.exit_code == code and c is not GpusnapError
                and c.__init__ is GpusnapError.__init__), CopyFailed)
    hint = obj.get("hint")
    return cls(f"destination: {str(obj.get('message'))[:4000]}", None if hint is None else str(hint)[:4000])


# one byte of bits <-> its 8 units as 0/1 bytes (bit k of the byte is unit k)
_UNITS = [bytes((b >> k) & 1 for k in range(8)) for b in range(256)]
_BITS = {u: b for b, u in enumerate(_UNITS)}


def bitmap(flags: bytearray) -> bytes:
    """flags (one 0/1 byte per unit) -> the WANT frame's bits: unit i is bit i % 8 of byte i // 8."""
    padded = bytes(flags) + bytes(-len(flags) % 8)
    return bytes(_BITS[padded[i:i + 8]] for i in range(0, len(padded), 8))


def unbitmap(bits: bytes, n: int) -> bytearray:
    """The WANT frame's bits (exactly (n + 7) // 8 bytes) -> one 0/1 byte per unit; a bit set
    past the last unit is malformed (ValueError)."""
    if len(bits) != (n + 7) // 8:
        raise ValueError(f"{len(bits)} bytes of bits for {n} units")
    flags = bytearray(b"".join(_UNITS[b] for b in bits))
    if any(flags[n:]):
        raise ValueError("bits set past the last unit")
    del flags[n:]
    return flags
