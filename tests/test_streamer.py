"""The image streamer on its own: a peer speaking CRIU's side of the stream protocol (the
framing and fd passing of criu/img-streamer.c) against the real capture and serve servers."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from gpusnap.criu import protocol
from gpusnap.criu.streamer import CaptureServer, ServeServer
from gpusnap.errors import NoSpace, StreamProtocolError
from gpusnap.repo.format import names as F


class MemorySink:
    def __init__(self, store, name):
        self.store, self.name, self.parts, self.closed = store, name, [], False

    def write(self, data):
        self.parts.append(bytes(data))

    def close(self):
        self.closed = True
        self.store[self.name] = b"".join(self.parts)


def criu_side(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(path))
    return s


def open_for_dump(sock, name):
    """What CRIU does per image on dump: request, then pass the pipe's read end."""
    protocol.send_message(sock, protocol.encode_request(name))
    r, w = os.pipe()
    protocol.send_fd(sock, r)
    os.close(r)
    return w


def open_for_restore(sock, name):
    protocol.send_message(sock, protocol.encode_request(name))
    exists = protocol.decode_reply(protocol.recv_message(sock))
    if not exists:
        return None
    r, w = os.pipe()
    protocol.send_fd(sock, w)
    os.close(w)
    return r


def test_capture_several_images_open_at_once(tmp_path):
    store = {}
    srv = CaptureServer(tmp_path, lambda n: MemorySink(store, n), F).start()
    sock = criu_side(srv.path)
    # Open three images, then write to them interleaved, each larger than a pipe buffer:
    # a streamer that drained one image before taking the next request would deadlock here.
    payloads = {f"pages-{i}.img": os.urandom(3 << 20) for i in range(3)}
    fds = {name: open_for_dump(sock, name) for name in payloads}
    writers = [threading.Thread(target=lambda n=n: (os.write(fds[n], payloads[n][: 1 << 20]),))
               for n in payloads]
    for t in writers:
        t.start()
    for t in writers:
        t.join(10)
    for name, data in payloads.items():
        view = memoryview(data)[1 << 20:]
        while view:
            view = view[os.write(fds[name], view):]
        os.close(fds[name])
    sock.close()
    srv.finish(timeout=10)
    assert store == payloads
    assert srv.bytes == sum(map(len, payloads.values()))


def test_capture_rejects_path_traversal(tmp_path):
    store = {}
    srv = CaptureServer(tmp_path, lambda n: MemorySink(store, n), F).start()
    sock = criu_side(srv.path)
    protocol.send_message(sock, protocol.encode_request("../../etc/passwd"))
    # the server must hang up on us rather than open anything
    sock.settimeout(5)
    assert sock.recv(1) == b""
    with pytest.raises(StreamProtocolError, match="unsafe image name"):
        srv.finish(timeout=5)
    assert store == {}
    assert not any(p.name == "passwd" for p in tmp_path.parent.rglob("passwd"))


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "x\0y", "tab\there", "z" * 256])
def test_bad_names_are_refused(name):
    with pytest.raises(StreamProtocolError):
        protocol.check_filename(name, F)


def test_oversized_message_is_refused(tmp_path):
    srv = CaptureServer(tmp_path, lambda n: MemorySink({}, n), F).start()
    sock = criu_side(srv.path)
    sock.sendall((1 << 30).to_bytes(4, "little"))
    with pytest.raises(StreamProtocolError, match="larger than any valid"):
        srv.finish(timeout=5)


def test_peer_disconnects_mid_image(tmp_path):
    store = {}
    sinks = []

    def factory(n):
        sinks.append(MemorySink(store, n))
        return sinks[-1]

    srv = CaptureServer(tmp_path, factory, F).start()
    sock = criu_side(srv.path)
    w = open_for_dump(sock, "pages-1.img")
    os.write(w, b"x" * 5000)
    # CRIU dies: its socket and pipe close half-way through the image
    sock.close()
    os.close(w)
    srv.finish(timeout=5)
    # the streamer ends cleanly; the partial image is there, but the dump's fate is decided
    # by CRIU's exit status, which is what gpusnap.ops.dump checks before committing anything
    assert store["pages-1.img"] == b"x" * 5000


def test_peer_disconnects_mid_message(tmp_path):
    srv = CaptureServer(tmp_path, lambda n: MemorySink({}, n), F).start()
    sock = criu_side(srv.path)
    sock.sendall((20).to_bytes(4, "little") + b"\x0a\x05ab")
    sock.close()
    with pytest.raises(StreamProtocolError, match="middle of a message"):
        srv.finish(timeout=5)


def test_sink_failure_breaks_the_stream(tmp_path):
    class FullDisk(MemorySink):
        def write(self, data):
            raise OSError(28, "No space left on device")

    srv = CaptureServer(tmp_path, lambda n: FullDisk({}, n), F).start()
    sock = criu_side(srv.path)
    w = open_for_dump(sock, "pages-1.img")
    with pytest.raises(BrokenPipeError):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            os.write(w, b"y" * 65536)  # CRIU's writes fail once the streamer gives up
    os.close(w)
    with pytest.raises(NoSpace):
        srv.finish(timeout=5)


def test_serve_a_missing_image_answers_no(tmp_path):
    srv = ServeServer(tmp_path, lambda name: None, F).start()
    sock = criu_side(srv.path)
    assert open_for_restore(sock, "missing.img") is None
    sock.close()
    srv.finish(timeout=10)


def test_serve_round_trip(tmp_path):
    images = {"core-1.img": os.urandom(100), "pages-1.img": os.urandom(5 << 20)}

    def source(name):
        if name not in images:
            return None
        data = images[name]
        return (data[i:i + 65536] for i in range(0, len(data), 65536))

    srv = ServeServer(tmp_path, source, F).start()
    sock = criu_side(srv.path)
    fds = {n: open_for_restore(sock, n) for n in images}
    got = {}
    for name, fd in fds.items():
        with os.fdopen(fd, "rb") as f:
            got[name] = f.read()
    sock.close()
    srv.finish(timeout=10)
    assert got == images


def test_serve_source_error_cuts_the_image_short(tmp_path):
    from gpusnap.errors import CorruptSnapshot

    def source(name):
        def gen():
            yield b"a" * 4096
            raise CorruptSnapshot("page 2 of pages-1.img does not match its checksum")
        return gen()

    srv = ServeServer(tmp_path, source, F).start()
    sock = criu_side(srv.path)
    fd = open_for_restore(sock, "pages-1.img")
    with os.fdopen(fd, "rb") as f:
        data = f.read()
    assert data == b"a" * 4096  # CRIU sees a short image and fails; no zeros are made up
    with pytest.raises(CorruptSnapshot):
        srv.finish(timeout=5)


def test_serve_cut_stops_the_feeders_before_their_next_chunk(tmp_path):
    """A restore interrupted while CRIU reads (ops/restore_interrupt.py): the cut must leave
    CRIU a short image, however many chunks its feeder had left, and answer no new image."""
    asked, go_on = threading.Event(), threading.Event()

    def source(name):
        def gen():
            yield b"a" * 4096
            asked.set()
            go_on.wait(5)
            yield b"b" * 4096       # past the cut: never written
        return gen()

    srv = ServeServer(tmp_path, source, F).start()
    sock = criu_side(srv.path)
    fd = open_for_restore(sock, "pages-1.img")
    assert asked.wait(5)
    srv.cut()
    go_on.set()
    with os.fdopen(fd, "rb") as f:
        assert f.read() == b"a" * 4096
    # the next image CRIU asks for gets no answer: its request loop stopped
    protocol.send_message(sock, protocol.encode_request("core-1.img"))
    sock.settimeout(1)
    with pytest.raises((socket.timeout, ConnectionError, StreamProtocolError)):
        if protocol.recv_message(sock) is None:
            raise ConnectionError("closed")
    srv.abort()
    assert not srv.failed


def test_a_signal_while_criu_runs_cuts_the_stream_from_the_handler():
    """The guard calls the stream's cut inside the signal handler, not when the supervising
    loop next wakes; before CRIU starts a signal raises, and once the job runs it cuts nothing."""
    import signal

    from gpusnap.ops import restore_interrupt

    cuts = []
    with restore_interrupt.guard() as g:
        restore_interrupt.criu_started(cut=lambda: cuts.append(1))
        os.kill(os.getpid(), signal.SIGHUP)
        assert cuts == [1] and g.caught == [signal.SIGHUP] and restore_interrupt.stop_requested()
        restore_interrupt.job_running()
        os.kill(os.getpid(), signal.SIGTERM)
        assert cuts == [1] and not restore_interrupt.stop_requested()
    with pytest.raises(restore_interrupt.Terminated):
        with restore_interrupt.guard():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)


@pytest.mark.parametrize("name", ["pages-1.img", "core-123.img", "é.img"])
def test_request_roundtrip_encoding(name):
    assert protocol.decode_request(protocol.encode_request(name), F) == name


def test_reply_roundtrip_encoding():
    assert protocol.decode_reply(protocol.encode_reply(True)) is True
    assert protocol.decode_reply(protocol.encode_reply(False)) is False
    with pytest.raises(StreamProtocolError):
        protocol.decode_request(b"\x0a\xff\xff\xff\xff\x0f", F)  # length past the end
    with pytest.raises(StreamProtocolError):
        protocol.decode_request(b"\x08\x01", F)  # no filename
