"""The post-dump gate: CRIU must not resume the job before every page is out of the pipes.

CRIU moves page data into the stream pipes with splice(), so pages still sitting in a pipe
buffer are references to the job's own memory, not copies; once the job resumes and writes
to them, the snapshot would record the new contents. CRIU runs its `post-dump` action
script after the last image is closed and before the plugins' exit hook and the resume, so
gpusnap installs a tiny action script that blocks until the streamer has drained every
pipe. If gpusnap dies, the script's connection fails, it exits non-zero, and CRIU resumes
the job anyway: the gate can delay the job, never keep it frozen.

The script runs inside the freeze, so its start-up counts: it is the small native gate
(native/gate/gs_gate.c, build/bin/gpusnap-gate, built by `make setup`; CRIU's `sh -c` execs
it, and it finds the socket in CRIU's environment, `env`): 3-19 ms from CRIU's post-dump to
the unfreeze, where a Python script took 69-87 ms. It is the one gate: without it a dump is
refused before the job is touched (exit 27), like without the page library.

"Drained" means copied out into staging (gpusnap/staging/), not stored: the gate
opens as soon as every byte is staged, and then lets the ingest start if it was held back
(`staging.go`), so the page pipeline never competes with the freeze for the CPU.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

from gpusnap.criu.streamer import CaptureServer
from gpusnap import settings

def native_gate() -> Path:
    """$GPUSNAP_GATE, else <source tree>/build/bin/gpusnap-gate, else the installed one.
    Raises NativeLibraryMissing when none is there."""
    from gpusnap.errors import NativeLibraryMissing
    from gpusnap.system import paths

    env = settings.get("GPUSNAP_GATE")
    cands = [Path(env)] if env else [paths.source_root() / "build" / "bin" / "gpusnap-gate",
                                     Path("/usr/local/lib/gpusnap/bin/gpusnap-gate")]
    for c in cands:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise NativeLibraryMissing(
        "gpusnap's post-dump gate is missing (looked for " + ", ".join(map(str, cands)) + ")",
        hint="run `make setup` in the gpusnap checkout (it builds build/bin/gpusnap-gate)")


class PostDumpGate:
    def __init__(self, workdir: Path, server: CaptureServer, timeout: float = 600.0, at_freeze=None):
        self.server = server
        self.at_freeze = at_freeze    # called once CRIU reaches post-dump: the job is still frozen
        self.timeout = timeout
        self.sock_path = workdir / "gate.sock"
        self.script = workdir / "gpusnap-post-dump"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self.sock_path))
        os.chmod(self.sock_path, 0o600)
        self._listener.listen(4)
        self._listener.settimeout(0.2)
        self._stop = threading.Event()
        self.opened = threading.Event()  # CRIU reached post-dump: the job is fully dumped
        self.opened_at: float | None = None   # time.monotonic() when the gate let CRIU go on
        # what CRIU's environment must add for the script (the native gate reads it there)
        self.env = {"GPUSNAP_GATE_SOCK": str(self.sock_path), "GPUSNAP_GATE_TIMEOUT": str(int(timeout))}
        gate = native_gate()
        if " " in str(gate):            # CRIU runs `sh -c <path>`: reach it by a plain name
            os.symlink(gate, self.script)
        else:
            self.script = gate
        self._thread = threading.Thread(target=self._serve, name="post-dump-gate", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with conn:
                if self.at_freeze is not None:
                    try:
                        self.at_freeze()
                    except Exception:   # noqa: BLE001 - a failed measure must not keep the job frozen
                        pass
                ok = self.server.wait_drained(self.timeout)
                if settings.get("GPUSNAP_TEST_HOOK") == "gate-fails":  # tests: a failed post-dump
                    ok = False
                try:
                    conn.sendall(b"1" if ok else b"0")
                except OSError:
                    pass
                if ok:
                    self.opened_at = time.monotonic()
                    self.opened.set()
                staging = getattr(self.server, "staging", None)
                if staging is not None:
                    if ok:
                        staging.seal()
                    staging.go.set()    # the job resumes now: the pipeline may use the CPU

    def close(self) -> None:
        self._stop.set()
        try:
            # wakes the thread's accept() at once (closing alone leaves it in its 0.2 s poll:
            # ~0.1 s added to every dump's wall time)
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._listener.close()
        except OSError:
            pass
        self._thread.join(1)
