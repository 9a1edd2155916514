"""A job that forks, mremaps, munmaps and madvises its memory on request: for the lazy restore,
whose daemon must follow each of these while it still fills the job's memory.

    python tests/jobs/churn.py OUT [--mb M] [--seed S]

Builds four private anonymous buffers of pseudo-random bytes (A, B, C: M MiB each; D:
M/8 MiB) and forks a keeper child that holds its own copy-on-write view of them. Writes the
digest the job must end with to OUT/expected, its PIDs to OUT/pids, then OUT/ready, and
polls OUT every 10 ms:

  OUT/go      churn until OUT/finish, one round after another, writing OUT/rounds (the
              count) after each: fork a child that hashes A and reports it through a pipe
              (checked against the hash taken at the start); grow B by mremap to twice its
              size (it may move) and shrink it back; MADV_DONTNEED the first half of C,
              check it now reads as zeros, and write its bytes back; unmap D and map it
              anew with the same bytes
  OUT/orphan-go  once: a double fork whose middle process exits at once, so the grandchild
              leaves the tree (it is reparented); the grandchild writes its PID to OUT/orphan,
              hashes A, writes OUT/orphan-ok (1 if A hashed right, else 0) and waits for
              OUT/finish
  OUT/finish  the keeper hashes its view and exits; the job writes OUT/result: JSON with the
              digest of A, B, C, D, the keeper's digest, the rounds and every mismatch seen
              (a child's hash of A, a C that did not read as zeros), then exits 0.

Every round leaves the buffers as they were, so a correct restore ends with
result["digest"] == OUT/expected and no mismatch, however many rounds ran.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import sys
import time

import numpy as np


def _alloc(n: int) -> mmap.mmap:
    return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _write_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--mb", type=int, default=32)
    ap.add_argument("--seed", type=int, default=5)
    a = ap.parse_args(argv)
    out = a.out
    n = a.mb << 20
    rng = np.random.default_rng(a.seed)
    src = {k: rng.bytes(size) for k, size in (("A", n), ("B", n), ("C", n), ("D", max(4096, n // 8)))}
    bufs = {}
    for k, data in src.items():
        bufs[k] = _alloc(len(data))
        bufs[k][:] = data
    lens = {k: len(v) for k, v in src.items()}
    d_bytes = src["D"]
    half_c = src["C"][: n // 2]
    hash_a = hashlib.sha256(src["A"]).hexdigest()

    def digest() -> str:
        h = hashlib.sha256()
        for k in ("A", "B", "C", "D"):
            h.update(bufs[k][: lens[k]])
        return h.hexdigest()

    expected = digest()
    del src
    kr, kw = os.pipe()
    keeper = os.fork()
    if keeper == 0:                        # the keeper: a second process of the tree
        os.close(kr)
        while not os.path.exists(os.path.join(out, "finish")):
            time.sleep(0.01)
        os.write(kw, (digest() + "\n").encode())
        os._exit(0)
    os.close(kw)
    _write_atomic(os.path.join(out, "expected"), expected + "\n")
    _write_atomic(os.path.join(out, "pids"), f"{os.getpid()} {keeper}\n")
    _write_atomic(os.path.join(out, "ready"), "1\n")

    mismatches: list[str] = []
    rounds = 0
    orphaned = False
    while not os.path.exists(os.path.join(out, "finish")):
        if not orphaned and os.path.exists(os.path.join(out, "orphan-go")):
            orphaned = True
            middle = os.fork()
            if middle == 0:
                if os.fork() == 0:
                    _write_atomic(os.path.join(out, "orphan"), f"{os.getpid()}\n")
                    ok = hashlib.sha256(bufs["A"]).hexdigest() == hash_a
                    _write_atomic(os.path.join(out, "orphan-ok"), f"{int(ok)}\n")
                    while not os.path.exists(os.path.join(out, "finish")):
                        time.sleep(0.01)
                    os._exit(0)
                os._exit(0)
            os.waitpid(middle, 0)
        if not os.path.exists(os.path.join(out, "go")):
            time.sleep(0.01)
            continue
        r, w = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(r)
            os.write(w, hashlib.sha256(bufs["A"]).hexdigest().encode())
            os._exit(0)
        os.close(w)
        got = b""
        while chunk := os.read(r, 128):
            got += chunk
        os.close(r)
        os.waitpid(child, 0)
        if got.decode() != hash_a:
            mismatches.append(f"round {rounds}: a forked child hashed A as {got.decode()[:16]}")
        bufs["B"].resize(2 * n)            # mremap: may move the mapping
        bufs["B"].resize(n)
        bufs["C"].madvise(mmap.MADV_DONTNEED, 0, n // 2)
        if bufs["C"][: n // 2].count(0) != n // 2:
            mismatches.append(f"round {rounds}: C did not read as zeros after MADV_DONTNEED")
        bufs["C"][: n // 2] = half_c
        bufs["D"].close()                  # munmap
        bufs["D"] = _alloc(len(d_bytes))
        bufs["D"][:] = d_bytes
        rounds += 1
        _write_atomic(os.path.join(out, "rounds"), f"{rounds}\n")
    keeper_digest = b""
    while chunk := os.read(kr, 128):
        keeper_digest += chunk
    os.waitpid(keeper, 0)
    _write_atomic(os.path.join(out, "result"), json.dumps({
        "digest": digest(), "keeper": keeper_digest.decode().strip(), "rounds": rounds,
        "mismatches": mismatches}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
