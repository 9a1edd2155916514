"""CRIU's image-streamer wire protocol: framing, the two protobuf messages, file-name checks.

CRIU (criu/img-streamer.c) talks over one unix stream socket. Each message is a
little-endian u32 length followed by a protobuf message:

- request (CRIU -> us):  ``img_streamer_request_entry { required string filename = 1; }``
- reply   (us -> CRIU, restore only): ``img_streamer_reply_entry { required bool exists = 1; }``

After each request (and, on restore, a ``true`` reply) CRIU sends one end of a pipe as
SCM_RIGHTS with a single dummy data byte. The two messages are tiny, so they are encoded
at the wire level (criu/pbwire.py) rather than through generated classes; everything read
is bounds-checked.
"""

from __future__ import annotations

import array
import socket
import struct

from gpusnap.criu import pbwire
from gpusnap.criu.needs import ImageNames
from gpusnap.errors import StreamProtocolError

# CRIU image names are short (e.g. "pages-12.img", "tmpfs-dev-123.tar.gz.img"); a message
# longer than a file-name component (NAME_MAX, 255 bytes) and its framing could ever be is a
# broken or hostile peer. Which names are valid is the repository's rule (criu/needs.py).
NAME_MAX = 255
MAX_MESSAGE = NAME_MAX + 16


def check_filename(name: str, names: ImageNames) -> str:
    """Return `name` if it is a valid image name by `names` (the repository's one rule,
    repo/format/names.py); raise StreamProtocolError otherwise."""
    problem = names.image_name_problem(name)
    if problem == "length":
        raise StreamProtocolError(f"CRIU sent an image name of bad length ({len(name)})")
    if problem == "control":
        raise StreamProtocolError(f"CRIU sent an image name with control characters: {name!r}")
    if problem:
        raise StreamProtocolError(f"CRIU sent an unsafe image name: {name!r}")
    return name


def decode_request(msg: bytes, names: ImageNames) -> str:
    """Decode an img_streamer_request_entry and return its filename, checked by `names`."""
    filename: str | None = None
    try:
        for field, wire, value in pbwire.wire_fields(msg):
            if field == 1 and wire == 2:
                try:
                    filename = value.decode("utf-8")
                except UnicodeDecodeError:
                    raise StreamProtocolError("CRIU sent an image name that is not UTF-8") from None
    except ValueError as e:             # pbwire: truncated, oversized or of an unknown wire type
        raise StreamProtocolError(f"malformed CRIU message: {e}") from None
    if filename is None:
        raise StreamProtocolError("CRIU request without a file name")
    return check_filename(filename, names)


def encode_request(filename: str) -> bytes:
    raw = filename.encode()
    return b"\x0a" + pbwire.encode_varint(len(raw)) + raw


def encode_reply(exists: bool) -> bytes:
    return b"\x08" + (b"\x01" if exists else b"\x00")


def decode_reply(msg: bytes) -> bool:
    if len(msg) != 2 or msg[0] != 0x08 or msg[1] not in (0, 1):
        raise StreamProtocolError("malformed streamer reply")
    return bool(msg[1])


def frame(msg: bytes) -> bytes:
    return struct.pack("<I", len(msg)) + msg


def _recv_exact(sock: socket.socket, n: int, *, eof_ok: bool = False) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            if eof_ok and not buf:
                return None
            raise StreamProtocolError("CRIU closed the image stream in the middle of a message")
        buf += chunk
    return bytes(buf)


def recv_message(sock: socket.socket) -> bytes | None:
    """Read one length-prefixed message; None on a clean end of stream."""
    head = _recv_exact(sock, 4, eof_ok=True)
    if head is None:
        return None
    (length,) = struct.unpack("<I", head)
    if length > MAX_MESSAGE:
        raise StreamProtocolError(f"CRIU message of {length} bytes is larger than any valid one")
    return _recv_exact(sock, length)


def send_message(sock: socket.socket, msg: bytes) -> None:
    sock.sendall(frame(msg))


def recv_fd(sock: socket.socket) -> int:
    """Receive the pipe end CRIU passes after a request (one dummy byte + SCM_RIGHTS)."""
    fds = array.array("i")
    data, ancdata, flags, _ = sock.recvmsg(1, socket.CMSG_SPACE(fds.itemsize))
    if not data:
        raise StreamProtocolError("CRIU closed the image stream before sending a pipe")
    received: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(payload[: len(payload) - len(payload) % arr.itemsize])
            received.extend(arr)
    if flags & socket.MSG_CTRUNC or len(received) != 1:
        for fd in received:
            _close_quietly(fd)
        raise StreamProtocolError("CRIU did not pass exactly one pipe with its request")
    return received[0]


def send_fd(sock: socket.socket, fd: int) -> None:
    """The peer side of recv_fd (used by tests that play CRIU)."""
    sock.sendmsg([b"\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())])


def _close_quietly(fd: int) -> None:
    import os

    try:
        os.close(fd)
    except OSError:
        pass
