"""Deterministic memory workloads for the dedup end-to-end tests and the benchmark.

    python tests/jobs/workloads.py OUT --kind fp32|inference|random|relocate --mb M [--seed S]

The job builds `--mb` MiB of memory of the given kind (every page resident: CRIU dumps
only pages that exist), writes OUT/pid ("<pid>") and then OUT/ready (JSON: pid, bytes,
buffer addresses), and idles, polling OUT for control files every `--poll-ms`:

  OUT/relocate.N   (N = 1, 2, ... in order; relocate kind only) copy the frozen weights into
                   a freshly mmap'ed buffer at a new address, unmap the old one, and rewrite
                   the small trainable part for generation N, as a CUDA checkpoint puts GPU
                   memory at new host addresses every time. Acknowledged by OUT/relocated.N
                   (JSON: old and new address of the weights).
  OUT/gap.N        (with --tick-ms) write OUT/gapped.N: JSON with the longest gap in seconds
                   between two ticks of the job's ticker thread since the previous request,
                   and the number of ticks; the freeze a dump imposes, as the job saw it
  OUT/finish       write the sha256 of all the job's buffers (and its generation) to
                   OUT/result, then exit 0.

Memory changes only on those events, never with time, so the digest of a run that was
dumped, killed and restored in between equals the digest of an uninterrupted run with the
same arguments and the same events (`expected_digest()` recomputes it without a process).

Kinds (sizes are fractions of --mb, rounded to whole pages):
  fp32       training-like fp32 state: weights N(0, 0.02) 1/3, Adam first moment
             N(0, 1e-3) 1/3, second moment 1/3 (no zero pages): v = s^2 * G with a
             per-parameter gradient scale s = 1e-3 * exp(N(0, 0.75)) (log-normal, as gradient
             magnitudes are) and G ~ Gamma(8, 1/8) (an average of squared gradients), so v is
             non-negative and spans several orders of magnitude like a real Adam state
  inference  fp16 weights 10 %, used KV cache (fp16 N(0, 1)) 5 %, the rest of the KV cache
             allocated, written once and zeroed (resident zero pages) 85 %
  random     incompressible bytes
  relocate   frozen fp32 weights N(0, 0.02) 98 %, trainable part 2 % (changes per generation)

Buffers are anonymous mmaps (page aligned), filled through numpy views.
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

try:
    import ctypes
    _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):  # not glibc
    _malloc_trim = None

PAGE = 4096
KINDS = ("fp32", "inference", "random", "relocate")


def _trim() -> None:
    """Give freed temporaries back to the kernel, so the job's memory is what it declares
    (freed heap garbage would otherwise be dumped along with it)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def _pages(nbytes: float) -> int:
    return max(PAGE, int(nbytes) // PAGE * PAGE)


def _alloc(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _f32(buf) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.float32)


def _addr(buf) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def _trainable(buf, seed: int, gen: int) -> None:
    rng = np.random.default_rng([seed, 7, gen])
    a = _f32(buf)
    a[:] = rng.normal(0, 0.02, a.size).astype(np.float32)


def build(kind: str, mb: int, seed: int) -> dict[str, mmap.mmap]:
    """The job's named buffers, in digest order."""
    size = mb << 20
    rng = np.random.default_rng(seed)
    bufs: dict[str, mmap.mmap] = {}
    if kind == "fp32":
        third = _pages(size / 3)
        for name, gen in (("weights", lambda n: rng.normal(0, 0.02, n)),
                          ("exp_avg", lambda n: rng.normal(0, 1e-3, n)),
                          ("exp_avg_sq", lambda n: (1e-3 * np.exp(rng.normal(0, 0.75, n))) ** 2
                                                   * rng.gamma(8, 1 / 8, n))):
            b = bufs[name] = _alloc(third)
            a = _f32(b)
            step = 1 << 22
            for i in range(0, a.size, step):      # bounded temporaries
                n = min(step, a.size - i)
                a[i:i + n] = gen(n).astype(np.float32)
    elif kind == "inference":
        w = bufs["weights"] = _alloc(_pages(size * 0.10))
        np.frombuffer(w, dtype=np.float16)[:] = rng.normal(0, 0.02, len(w) // 2).astype(np.float16)
        kv_used = _pages(size * 0.05)
        kv = bufs["kv_cache"] = _alloc(_pages(size * 0.90))
        view = np.frombuffer(kv, dtype=np.uint8)
        view[:] = 0xFF                               # touched (resident) ...
        view[:] = 0                                  # ... then zeroed, like a cleared cache
        np.frombuffer(kv, dtype=np.float16)[:kv_used // 2] = rng.normal(0, 1, kv_used // 2).astype(np.float16)
    elif kind == "random":
        r = bufs["data"] = _alloc(_pages(size))
        view = np.frombuffer(r, dtype=np.uint8)
        step = 64 << 20
        for i in range(0, len(view), step):
            n = min(step, len(view) - i)
            view[i:i + n] = np.frombuffer(rng.bytes(n), dtype=np.uint8)
    elif kind == "relocate":
        w = bufs["weights"] = _alloc(_pages(size * 0.98))
        a = _f32(w)
        step = 1 << 22
        for i in range(0, a.size, step):
            n = min(step, a.size - i)
            a[i:i + n] = rng.normal(0, 0.02, n).astype(np.float32)
        t = bufs["trainable"] = _alloc(_pages(size * 0.02))
        _trainable(t, seed, 0)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    _trim()
    return bufs


def relocate(bufs: dict[str, mmap.mmap], seed: int, gen: int) -> tuple[int, int]:
    """Move the weights to a new mapping (old one unmapped), update the trainable part."""
    old = bufs["weights"]
    new = _alloc(len(old))
    new[:] = old                                     # copy to the fresh allocation
    old_addr, new_addr = _addr(old), _addr(new)
    bufs["weights"] = new
    old.close()                                      # munmap: the old address is gone
    _trainable(bufs["trainable"], seed, gen)
    _trim()
    return old_addr, new_addr


def digest(bufs: dict[str, mmap.mmap], kind: str, gen: int) -> str:
    h = hashlib.sha256(f"{kind}/{gen}".encode())
    for name in sorted(bufs):
        h.update(name.encode())
        h.update(bufs[name])
    return h.hexdigest()


def expected_digest(kind: str, mb: int, seed: int = 1, relocations: int = 0) -> str:
    """The result of an uninterrupted run that saw `relocations` relocate events."""
    bufs = build(kind, mb, seed)
    for gen in range(1, relocations + 1):
        relocate(bufs, seed, gen)
    d = digest(bufs, kind, relocations)
    for b in bufs.values():
        b.close()
    return d


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, path)


class _Ticker:
    """A thread that wakes every `period` seconds and keeps the longest gap between two
    wake-ups (its state lives outside the digested buffers). A report counts the gap still
    open too, and closes it: after a freeze the main thread may see the request before the
    ticker has woken, and the freeze must be in that report, not the next one."""

    def __init__(self, period: float):
        import threading

        self.period = period
        self.lock = threading.Lock()
        self.max_gap = 0.0
        self.ticks = 0
        self.last = time.monotonic()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(self.period)
            now = time.monotonic()
            with self.lock:
                self.max_gap = max(self.max_gap, now - self.last)
                self.ticks += 1
                self.last = now

    def report(self) -> dict:
        with self.lock:
            now = time.monotonic()
            r = {"max_gap": round(max(self.max_gap, now - self.last), 4), "ticks": self.ticks}
            self.max_gap, self.ticks, self.last = 0.0, 0, now
        return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--kind", choices=KINDS, required=True)
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--poll-ms", type=int, default=10)
    ap.add_argument("--tick-ms", type=float, default=0, help="tick every MS in a thread and record the longest gap")
    args = ap.parse_args(argv)
    out = args.out
    os.makedirs(out, exist_ok=True)

    bufs = build(args.kind, args.mb, args.seed)
    gen = 0
    _write_atomic(os.path.join(out, "pid"), f"{os.getpid()}\n")
    _write_atomic(os.path.join(out, "ready"), json.dumps({
        "pid": os.getpid(), "bytes": sum(len(b) for b in bufs.values()),
        "addresses": {k: _addr(b) for k, b in bufs.items()}}) + "\n")

    ticker = _Ticker(args.tick_ms / 1000) if args.tick_ms > 0 else None
    gaps = 0
    while True:
        if os.path.exists(os.path.join(out, "finish")):
            break
        if ticker is not None and os.path.exists(os.path.join(out, f"gap.{gaps + 1}")):
            gaps += 1
            _write_atomic(os.path.join(out, f"gapped.{gaps}"), json.dumps(ticker.report()) + "\n")
            continue
        if args.kind == "relocate" and os.path.exists(os.path.join(out, f"relocate.{gen + 1}")):
            gen += 1
            old, new = relocate(bufs, args.seed, gen)
            _write_atomic(os.path.join(out, f"relocated.{gen}"), json.dumps({"old": old, "new": new}) + "\n")
            continue
        time.sleep(args.poll_ms / 1000)

    _write_atomic(os.path.join(out, "result"), digest(bufs, args.kind, gen) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
