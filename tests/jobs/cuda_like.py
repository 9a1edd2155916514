"""A stand-in for a CUDA job, for the gpusnap plugin tests (no GPU needed).

Each process of the job starts an idle thread that plays the CUDA restore
thread (the fake libcuda is told its tid) and writes
``<dir>/info.<role>.json`` = {"pid", "tid", "role"}. The root then computes a
deterministic hash chain, one step every few milliseconds, until
``<dir>/finish`` appears; it then writes ``<dir>/result.json`` =
{"steps", "digest"}; ``expected_digest(steps)`` recomputes it.

``--tree`` makes the root fork two children: ``cuda-child`` (with its own
restore-thread stand-in) and ``plain-child`` (no such thread); both idle until
the root finishes.
"""

import argparse
import hashlib
import json
import os
import sys
import threading
import time


def expected_digest(steps: int) -> str:
    h = b"gpusnap"
    for i in range(steps):
        h = hashlib.sha256(h + i.to_bytes(8, "little")).digest()
    return h.hex()


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.rename(tmp, path)


def start_restore_thread() -> int:
    ready = threading.Event()
    box = {}

    def idle():
        box["tid"] = threading.get_native_id()
        ready.set()
        threading.Event().wait()  # blocks for ever in a futex

    threading.Thread(target=idle, name="cuda-restore", daemon=True).start()
    ready.wait()
    return box["tid"]


def announce(d: str, role: str, tid) -> None:
    write_json(os.path.join(d, f"info.{role}.json"), {"pid": os.getpid(), "tid": tid, "role": role})


def child(d: str, role: str, cuda: bool) -> None:
    tid = start_restore_thread() if cuda else None
    announce(d, role, tid)
    while not os.path.exists(os.path.join(d, "finish")):
        time.sleep(0.01)
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--tree", action="store_true")
    a = ap.parse_args()
    d = a.dir

    kids = []
    if a.tree:
        for role, cuda in (("cuda-child", True), ("plain-child", False)):
            pid = os.fork()
            if pid == 0:
                child(d, role, cuda)
            kids.append(pid)

    tid = start_restore_thread()
    announce(d, "root", tid)

    h = b"gpusnap"
    steps = 0
    while not os.path.exists(os.path.join(d, "finish")):
        h = hashlib.sha256(h + steps.to_bytes(8, "little")).digest()
        steps += 1
        time.sleep(0.002)
    for pid in kids:
        os.waitpid(pid, 0)
    write_json(os.path.join(d, "result.json"), {"steps": steps, "digest": h.hex()})
    sys.exit(0)


if __name__ == "__main__":
    main()
