#!/usr/bin/env python3
"""What CRIU's --stream mode costs by itself, without gpusnap's repository (for bench.py).

    python scripts/stream_floor.py dump PID        criu dump --stream --leave-running into
                                                   gpusnap's capture server, every byte dropped
    python scripts/stream_floor.py restore RAWDIR  criu restore --stream -d, the images served
                                                   unchanged from RAWDIR (a raw `criu dump` -D)

Prints one JSON object: {"criu_s": seconds from CRIU's start to its exit, "bytes": streamed}.
These are the floors under `gpusnap dump` (its 'criu' phase) and `gpusnap restore`: the part
of their time that no change to gpusnap's page pipeline can remove. Needs root.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpusnap.criu import runner
from gpusnap.criu.streamer import CaptureServer, ServeServer
from gpusnap.repo.format import names as image_names


class _Drop:
    def __init__(self, name: str):
        self.name = name

    def write(self, data) -> None:
        pass

    def close(self) -> None:
        pass


def _files(raw: Path):
    def source(name: str):
        p = raw / name
        if "/" in name or not p.is_file():
            return None

        def chunks():
            with open(p, "rb") as f:
                while b := f.read(1 << 20):
                    yield b
        return chunks()
    return source


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] not in ("dump", "restore"):
        print(__doc__, file=sys.stderr)
        return 2
    mode, arg = sys.argv[1], sys.argv[2]
    wd = Path(tempfile.mkdtemp(prefix="gpusnap-floor-"))
    try:
        if mode == "dump":
            server = CaptureServer(wd, _Drop, image_names).start()
            cmd = ["dump", "-t", arg, "--leave-running"]
        else:
            server = ServeServer(wd, _files(Path(arg)), image_names).start()
            cmd = ["restore", "--restore-detached"]
        t0 = time.monotonic()
        criu = subprocess.Popen([runner.criu_info().path, *cmd, "-D", str(wd), "--stream",
                                 "-o", str(wd / "criu.log"), "-v1"],
                                stdin=subprocess.DEVNULL, start_new_session=True)
        runner.supervise(criu, server)
        took = time.monotonic() - t0
        server.finish(timeout=30)
        if criu.returncode != 0 or server.failed:
            print((wd / "criu.log").read_text()[-2000:], file=sys.stderr)
            return 1
        print(json.dumps({"criu_s": round(took, 4), "bytes": server.bytes}))
        return 0
    finally:
        shutil.rmtree(wd, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
