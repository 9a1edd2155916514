"""gpusnap's image streamer: the other end of `criu --stream`, in both directions.

Capture (dump): CRIU connects to <dir>/streamer-capture.sock, names each image it is
about to write and hands us the read end of a pipe; one thread per open image drains
that pipe into staging (gpusnap/staging/), and another feeds the image's sink (the
repository's page pipeline) from there, so the post-dump gate need not wait for the sink. Serve (restore): CRIU connects
to <dir>/streamer-serve.sock and asks for images by name; we answer whether the image
exists and feed its bytes into the pipe CRIU hands us, again one thread per image.

CRIU keeps several images open at once, so every pipe is served concurrently; reading
one image to its end before taking the next request would deadlock. Data moves in
bounded chunks: nothing ever holds a whole image in memory.

On any error the streamer records it, closes the pipe it was working on and shuts the
socket, so CRIU fails fast (and, on dump, resumes the job it froze).

(Just over 400 lines, kept whole: both servers are thin subclasses of _Server, whose
connection loop, thread accounting and error path they share.)
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import socket
import struct
import termios
import threading
import time
from pathlib import Path
from typing import Iterable

from gpusnap.criu import protocol
from gpusnap.criu.needs import ImageNames, ImageSink, ImageSource, SinkFactory
from gpusnap.errors import GpusnapError, NoSpace, StreamProtocolError
from gpusnap import settings

CAPTURE_SOCKET = "streamer-capture.sock"
SERVE_SOCKET = "streamer-serve.sock"
PIPE_SIZE = 1 << 20
# Move data in quarters of the pipe: a 1 MiB write into a 1 MiB pipe waits until the reader
# has emptied it completely, so the two sides take turns instead of overlapping (measured
# here: 1.0 GB/s with 1 MiB transfers, 2.8 GB/s with 256 KiB ones).
CHUNK = PIPE_SIZE // 4


# The pipes of pages images during a dump: CRIU's pages go through them while the job is
# frozen. 4 MiB instead of 1 MiB froze a 512 MiB job for 0.148 s instead of 0.184 s here (fewer
# hand-offs between CRIU filling the pipe and the drain emptying it; 16 and 64 MiB gained
# nothing more; docs/benchmark.md). Beyond fs.pipe-max-size a pipe needs CAP_SYS_RESOURCE: where
# root lacks it (some containers) the pipe gets the largest size the sysctl allows.
PAGES_PIPE_SIZE = 4 << 20
CAPTURE_PIPE_SIZE = int(settings.get("GPUSNAP_CAPTURE_PIPE", PAGES_PIPE_SIZE))
PIPE_MAX_SIZE_FILE = "/proc/sys/fs/pipe-max-size"


def pipe_max_size() -> int:
    """fs.pipe-max-size: the largest pipe a process without CAP_SYS_RESOURCE may ask for."""
    try:
        with open(PIPE_MAX_SIZE_FILE) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return PIPE_SIZE


def _grow_pipe(fd: int, size: int = PIPE_SIZE) -> int:
    """Make the pipe `size` bytes, or as large as allowed below that; returns its size then
    (0: unknown). Fewer, larger reads: the default 64 KiB pipe costs a syscall pair every 16
    pages."""
    try:
        return fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)
    except OSError:
        pass
    # beyond fs.pipe-max-size without CAP_SYS_RESOURCE: the largest the sysctl allows
    for want in dict.fromkeys((min(size, pipe_max_size()), min(size, PIPE_SIZE))):
        try:
            return fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, want)
        except OSError:
            continue
    try:
        return fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
    except OSError:
        return 0


def _as_gpusnap_error(exc: BaseException, image: str) -> GpusnapError:
    if isinstance(exc, GpusnapError):
        return exc
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return NoSpace(f"the repository's disk is full (while storing {image})",
                       hint="free some space, or run `gpusnap prune`, then dump again")
    err = GpusnapError(f"streaming {image} failed: {exc}")
    err.__cause__ = exc
    return err


class _Server:
    socket_name = ""

    def __init__(self, images_dir: str | os.PathLike, names: ImageNames):
        self.images_dir = Path(images_dir)
        self.names = names          # the repository's image-name rule (criu/needs.py)
        self.path = self.images_dir / self.socket_name
        if len(str(self.path).encode()) >= 108:
            raise StreamProtocolError(f"socket path too long for a unix socket: {self.path}")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self.path))
        os.chmod(self.path, 0o600)
        self._listener.listen(1)
        self._listener.settimeout(0.2)
        self._conn: socket.socket | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._errors: list[GpusnapError] = []
        self._workers: list[threading.Thread] = []
        self._main = threading.Thread(target=self._serve_connection, name=f"{self.socket_name}", daemon=True)
        self.bytes = 0
        self.images: dict[str, int] = {}
        self._busy = False  # a request is being read or handled (guarded by _lock)
        self._open = 0      # images whose pipe is still being drained or fed (guarded by _lock)
        self._changed = threading.Condition(self._lock)   # _open went down
        self._cut = False   # cut(): serve no more (a plain flag, so a signal handler may set it)

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> "_Server":
        self._main.start()
        return self

    @property
    def failed(self) -> bool:
        return bool(self._errors)

    def error(self) -> GpusnapError | None:
        with self._lock:
            return self._errors[0] if self._errors else None

    def finish(self, timeout: float | None = None) -> None:
        """Wait for the stream to end (CRIU has exited) and raise the first error seen."""
        self._stop.set()
        self._main.join(timeout)
        for t in list(self._workers):
            t.join(timeout)
        self._close()
        err = self.error()
        if err is not None:
            raise err

    def cut(self) -> None:
        """Stop the stream at the next chunk: no new image is answered and every feeder stops
        before its next write, so CRIU reads a short image and fails (a restore interrupted).
        Only sets a flag: safe inside a signal handler; abort() then closes the connection."""
        self._cut = True

    def abort(self) -> None:
        """Stop everything now (e.g. CRIU failed); errors stay readable through error()."""
        self._cut = True
        self._stop.set()
        self._shutdown_conn()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)   # wakes an accept() still waiting
        except OSError:
            pass
        self._main.join(2)
        self._close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.abort()

    # -- internals -------------------------------------------------------------------
    def _record(self, err: GpusnapError) -> None:
        with self._lock:
            self._errors.append(err)
        self._shutdown_conn()

    def _shutdown_conn(self) -> None:
        conn = self._conn
        if conn is not None:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _close(self) -> None:
        for s in (self._conn, self._listener):
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass
        try:
            self.path.unlink()
        except OSError:
            pass

    def _count(self, name: str, n: int) -> None:
        # A plain int add is atomic enough under the GIL for a progress figure.
        self.bytes += n
        self.images[name] = self.images.get(name, 0) + n

    def _serve_connection(self) -> None:
        try:
            while self._conn is None:
                try:
                    self._conn, _ = self._listener.accept()
                except socket.timeout:
                    if self._stop.is_set():
                        return
            self._conn.settimeout(None)
            poller = select.poll()
            poller.register(self._conn, select.POLLIN | select.POLLHUP)
            while not self.failed and not self._cut:
                if not poller.poll(100) or self._cut:
                    continue
                with self._lock:
                    self._busy = True
                try:
                    msg = protocol.recv_message(self._conn)
                    if msg is None:
                        return
                    self._handle(protocol.decode_request(msg, self.names))
                finally:
                    with self._lock:
                        self._busy = False
        except OSError as e:
            if not self.failed and not self._stop.is_set():
                self._record(StreamProtocolError(f"lost the connection to CRIU: {e}"))
        except GpusnapError as e:
            self._record(e)

    def drained(self) -> bool:
        """True when every image CRIU has asked for so far is completely through: no request
        unread on the socket, none being handled, no pipe still open."""
        with self._lock:
            if self._busy or self._open:
                return False
            conn = self._conn
            if conn is None:
                return True
            try:
                pending = struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.FIONREAD, b"\0" * 4))[0]
            except OSError:
                pending = 0
            return pending == 0

    def wait_drained(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.failed:
                return False
            if self.drained():
                return True
            with self._lock:        # woken when a pipe ends (the gate's wait is inside the freeze)
                self._changed.wait(0.002)
        return False

    def _spawn(self, target, *args) -> None:
        with self._lock:
            self._open += 1
        t = threading.Thread(target=self._run_worker, args=(target, *args), daemon=True)
        t.start()
        self._workers.append(t)     # only started threads: finish/abort after a signal must not join one

    def _run_worker(self, target, *args) -> None:
        try:
            target(*args)
        finally:
            with self._lock:
                self._open -= 1
                self._changed.notify_all()

    def _handle(self, name: str) -> None:
        raise NotImplementedError


class CaptureServer(_Server):
    """Receives CRIU's images during `criu dump --stream`.

    With a Staging (gpusnap/staging/), each image has two threads: the drain moves
    the pipe's bytes into staging and ends at the pipe's EOF (drained() counts only these,
    so the post-dump gate opens once everything is staged), and the ingest feeds the sink
    from staging once `staging.go` is set, releasing staging as it goes. Without one, the
    drain writes into the sink directly."""

    socket_name = CAPTURE_SOCKET

    def __init__(self, images_dir, sink_factory: SinkFactory, names: ImageNames, staging=None):
        super().__init__(images_dir, names)
        self._sink_factory = sink_factory
        self.staging = staging
        self._ingest: list[threading.Thread] = []
        self._images: list = []
        self.ingested = 0          # bytes handed to the sinks so far (progress)
        self.pages_pipe = 0        # the largest pipe a pages image came through (bytes)

    def _handle(self, name: str) -> None:
        fd = protocol.recv_fd(self._conn)
        try:
            sink = self._sink_factory(name)
        except BaseException as e:
            os.close(fd)
            raise _as_gpusnap_error(e, name)
        if self.staging is None:
            self._spawn(self._drain, name, fd, sink)
            return
        from gpusnap.staging import StagedImage

        image = StagedImage(self.staging, name)
        self._images.append(image)
        self._spawn(self._stage, name, fd, image)
        t = threading.Thread(target=self._ingest_image, args=(name, image, sink), daemon=True,
                             name=f"gpusnap-ingest-{name}")
        t.start()
        self._ingest.append(t)

    def _stage(self, name: str, fd: int, image) -> None:
        from gpusnap.staging import StagingCancelled

        pages = self.names.is_pages_image(name)
        if pages:
            got = _grow_pipe(fd, CAPTURE_PIPE_SIZE)
            with self._lock:
                self.pages_pipe = max(self.pages_pipe, got)
        else:
            _grow_pipe(fd)
        try:
            self.staging.stage_pipe(fd, image, pages, lambda n: self._count(name, n))
        except StagingCancelled:
            pass
        except BaseException as e:  # noqa: BLE001 - every failure must reach the dump
            self._record(_as_gpusnap_error(e, name))
        finally:
            os.close(fd)

    def _ingest_image(self, name: str, image, sink: ImageSink) -> None:
        from gpusnap.staging import StagingCancelled

        st = self.staging
        try:
            st.go.wait()
            while True:
                if self.failed:
                    return
                seg = image.take()
                if seg is None:
                    break
                data = st.read(seg)
                try:
                    sink.write(data, st.hold(seg))
                finally:
                    if isinstance(data, memoryview):
                        data.release()
                    st.release(seg)
                self.ingested += seg.length
            sink.close()
        except StagingCancelled:
            pass
        except BaseException as e:  # noqa: BLE001
            self._record(_as_gpusnap_error(e, name))
        finally:
            image.discard()

    def _record(self, err: GpusnapError) -> None:
        super()._record(err)
        if self.staging is not None:
            self.staging.cancel()       # wake and stop every drain and ingest

    def finish(self, timeout: float | None = None) -> None:
        """Wait for the stream to end and the ingest to finish; raise the first error seen.
        `timeout` bounds the wait for the connection and the drains only: the ingest takes
        as long as the page pipeline needs."""
        if self.staging is not None:
            self.staging.go.set()      # CRIU is done: nothing more to protect
            self._stop.set()
            self._main.join(timeout)
            for t in list(self._workers):
                t.join(timeout)
            for t in list(self._ingest):
                t.join()
        super().finish(timeout)

    def abort(self) -> None:
        if self.staging is not None:
            self.staging.cancel()
        super().abort()
        for t in list(self._ingest):
            t.join(5)

    def _drain(self, name: str, fd: int, sink: ImageSink) -> None:
        _grow_pipe(fd)
        try:
            while True:
                data = os.read(fd, CHUNK)
                if not data:
                    break
                if self.failed:
                    return  # the dump is lost anyway: stop storing, close the pipe
                sink.write(data)
                self._count(name, len(data))
            sink.close()
        except BaseException as e:  # noqa: BLE001 - every failure must reach the dump
            self._record(_as_gpusnap_error(e, name))
        finally:
            os.close(fd)


class ServeServer(_Server):
    """Answers CRIU's image requests during `criu restore --stream`."""

    socket_name = SERVE_SOCKET

    def __init__(self, images_dir, source: ImageSource, names: ImageNames):
        super().__init__(images_dir, names)
        self._source = source
        self.keep: list = []      # buffers whose pages a pipe may still reference (criu/pipefeed.py)

    def _handle(self, name: str) -> None:
        try:
            chunks = self._source(name)
        except BaseException as e:
            raise _as_gpusnap_error(e, name)
        protocol.send_message(self._conn, protocol.encode_reply(chunks is not None))
        if chunks is None:
            return
        fd = protocol.recv_fd(self._conn)
        self._spawn(self._feed, name, fd, chunks)

    def _feed(self, name: str, fd: int, chunks: Iterable[bytes]) -> None:
        from gpusnap.criu.pipefeed import Feeder

        _grow_pipe(fd)
        feeder = Feeder(fd, CHUNK)
        feeder.splice = feeder.splice and self.names.is_pages_image(name) and settings.get("GPUSNAP_SERVE_VMSPLICE") != "0"
        try:
            for chunk in chunks:
                if self.failed or self._cut:
                    return
                feeder.write(chunk)
                self._count(name, len(chunk))
        except BrokenPipeError:
            pass  # CRIU stopped reading this image; its exit status tells whether that was fine
        except BaseException as e:  # noqa: BLE001
            self._record(_as_gpusnap_error(e, name))
        finally:
            self.keep.extend(feeder.held())    # CRIU may not have read them yet: kept to the end
            os.close(fd)
