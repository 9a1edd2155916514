"""A deterministic sample job, shaped like a long-running training process, for the demo
and the tests.

It holds `--mb` MiB of patterned memory (a quarter random, a quarter repetitive, a quarter
written then zeroed, a quarter counters), runs `--threads` worker threads that each rewrite
a page of their own slice on every step, and a child process connected by pipes that
answers a question per step. It appends a progress line per step to `<out>/job.log`
(opened O_APPEND, growing while snapshots are taken) and finally writes `<out>/result`
with a digest over memory and answers, identical for every run with the same arguments,
however often it is snapshotted, killed and restored in between.

    python -m gpusnap.samples.job OUT [--steps N] [--mb M] [--threads T] [--step-ms MS]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import struct
import sys
import threading
import time

PAGE = 4096


def steps_done(out) -> int:
    """How many steps the job writing into directory `out` has logged (its job.log's last
    line, "step N/TOTAL"); 0 before the first."""
    try:
        lines = open(os.path.join(out, "job.log")).read().splitlines()
    except FileNotFoundError:
        return 0
    return int(lines[-1].split()[1].split("/")[0]) if lines else 0


def make_memory(mb: int, seed: int) -> bytearray:
    size = mb << 20
    quarter = (size // 4) // PAGE * PAGE
    mem = bytearray(size)
    rng = random.Random(seed)
    mem[0:quarter] = rng.randbytes(quarter)                                   # incompressible
    pattern = b"gpusnap-sample-" + bytes(range(241))
    mem[quarter:2 * quarter] = (pattern * (quarter // len(pattern) + 1))[:quarter]  # compressible
    mem[2 * quarter:3 * quarter] = b"\xff" * quarter                          # written ...
    mem[2 * quarter:3 * quarter] = bytes(quarter)                             # ... then zeroed
    view = memoryview(mem)[3 * quarter:]
    for i in range(0, len(view) - 8, PAGE):                                   # sparse counters
        view[i:i + 8] = struct.pack("<Q", i)
    return mem


def child_loop(rfd: int, wfd: int) -> None:
    """The child: read a step number, answer with a hash of it, until the pipe closes."""
    with os.fdopen(rfd, "rb", buffering=0) as r, os.fdopen(wfd, "wb", buffering=0) as w:
        while True:
            data = r.read(8)
            if len(data) < 8:
                break
            (step,) = struct.unpack("<Q", data)
            w.write(hashlib.sha256(b"child-%d" % step).digest())
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="directory for job.log, pid and result")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--threads", type=int, default=3)
    ap.add_argument("--step-ms", type=int, default=20, help="pause per step, so a dump lands mid-run")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)

    # Fork before any thread exists; the child only talks through its two pipes.
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(to_child_w)
        os.close(from_child_r)
        child_loop(to_child_r, from_child_w)
    os.close(to_child_r)
    os.close(from_child_w)
    to_child = os.fdopen(to_child_w, "wb", buffering=0)
    from_child = os.fdopen(from_child_r, "rb", buffering=0)

    mem = make_memory(args.mb, args.seed)
    nthreads = max(1, args.threads)
    slice_len = len(mem) // nthreads // PAGE * PAGE
    start_step = threading.Barrier(nthreads + 1)
    end_step = threading.Barrier(nthreads + 1)
    state = {"step": 0, "stop": False}

    def worker(idx: int) -> None:
        base = idx * slice_len
        pages = slice_len // PAGE
        while True:
            start_step.wait()
            if state["stop"]:
                return
            step = state["step"]
            off = base + ((step * 7919 + idx * 104729) % pages) * PAGE
            block = hashlib.sha256(b"%d-%d" % (idx, step)).digest() * (PAGE // 32)
            mem[off:off + PAGE] = bytes(a ^ b for a, b in zip(mem[off:off + 64], block[:64])) + block[64:]
            end_step.wait()

    workers = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(nthreads)]
    for t in workers:
        t.start()
    with open(os.path.join(args.out, "pid"), "w") as f:
        f.write(f"{os.getpid()} {pid}\n")

    answers = hashlib.sha256()
    with open(os.path.join(args.out, "job.log"), "a") as log:  # O_WRONLY|O_APPEND
        for step in range(args.steps):
            state["step"] = step
            start_step.wait()
            to_child.write(struct.pack("<Q", step))
            reply = from_child.read(32)
            if len(reply) != 32:
                print("child went away", file=sys.stderr)
                return 1
            answers.update(reply)
            end_step.wait()
            log.write(f"step {step + 1}/{args.steps}\n")
            log.flush()
            time.sleep(args.step_ms / 1000)
        state["stop"] = True
        start_step.wait()
    to_child.close()
    os.waitpid(pid, 0)

    digest = hashlib.sha256(mem)
    digest.update(answers.digest())
    tmp = os.path.join(args.out, "result.tmp")
    with open(tmp, "w") as f:
        f.write(digest.hexdigest() + "\n")
    os.rename(tmp, os.path.join(args.out, "result"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
