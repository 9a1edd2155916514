"""The post-dump gate: CRIU must not resume the job before every page is out of the pipes.

CRIU moves page data into the stream pipes with splice(), so pages still sitting in a pipe
buffer are references to the job's own memory, not copies; once the job resumes and writes
to them, the snapshot would record the new contents. CRIU runs its `post-dump` action
script after the last image is closed and before the plugins' exit hook and the resume, so
gpusnap installs a tiny action script that blocks until the streamer has drained every
pipe. If gpusnap dies, the script's connection fails, it exits non-zero, and CRIU resumes
the job anyway: the gate can delay the job, never keep it frozen.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from pathlib import Path

from gpusnap.criu.streamer import CaptureServer

HOOK = """#!{python} -IS
# gpusnap post-dump gate (generated): wait until the image streamer has drained every pipe.
import os, socket, sys
if os.environ.get("CRTOOLS_SCRIPT_ACTION") != "post-dump":
    sys.exit(0)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.settimeout({timeout})
    s.connect({sock!r})
    sys.exit(0 if s.recv(1) == b"1" else 1)
except OSError:
    sys.exit(1)
"""


class PostDumpGate:
    def __init__(self, workdir: Path, server: CaptureServer, timeout: float = 600.0):
        self.server = server
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
        self.script.write_text(HOOK.format(python=sys.executable, timeout=timeout, sock=str(self.sock_path)))
        os.chmod(self.script, 0o700)
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
                ok = self.server.wait_drained(self.timeout)
                if os.environ.get("GPUSNAP_TEST_HOOK") == "gate-fails":  # tests: a failed post-dump
                    ok = False
                try:
                    conn.sendall(b"1" if ok else b"0")
                except OSError:
                    pass
                if ok:
                    self.opened.set()

    def close(self) -> None:
        self._stop.set()
        try:
            self._listener.close()
        except OSError:
            pass
        self._thread.join(1)
