#!/usr/bin/env python3
"""A small deterministic training job for scripts/gpu-e2e.sh.

    gpu_train.py [--device cuda|cpu] [--steps N] [--step-sleep S] [--out FILE] [--pidfile FILE]
                 [--ballast-gb G] [--long-kernel-at STEP --long-kernel-secs S]

Prints `READY pid=… device=… gpu_mem=…`, then `step i/N loss=… t=<monotonic>` per step,
finally `DONE hash=<sha256 of the weights>` (also written as JSON to --out). The same
arguments always give the same hash and the same `step i/N loss=…` lines, whether the run
was uninterrupted or dumped and restored (t= is wall time: it shows how long a freeze was).

--ballast-gb: a seeded random tensor of that size on the device, summed on the device at
the start and at the end (`BALLAST sum=…`, ballast_sum_start/_end in --out): the GPU memory
a dump must carry and a restore must bring back bit for bit.
--long-kernel-at: at that step, one GPU kernel that spins for --long-kernel-secs
(`LONGKERNEL start` / `LONGKERNEL end`): a lock with a shorter timeout must fail there.

With PyTorch: an MLP trained with Adam on synthetic data (a few hundred MB of GPU memory),
fixed seeds, torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG set.
Without PyTorch (only allowed with --device cpu): a pure-Python stand-in loop, so the script's
plumbing can be exercised on machines without torch.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


LOG_FILE: str | None = None


def log(msg: str) -> None:
    """To --log, opened and closed for every line: the job holds no log file open, so a
    snapshot can be restored after the log grew (CRIU checks the size of open files)."""
    if LOG_FILE is None:
        print(msg, flush=True)
        return
    fd = os.open(LOG_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (msg + "\n").encode())
    finally:
        os.close(fd)


def torch_job(a: argparse.Namespace) -> tuple[str, int]:
    import torch

    torch.manual_seed(a.seed)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available to PyTorch")
    layers = []
    for i in range(a.layers):
        layers += [torch.nn.Linear(a.hidden, a.hidden), torch.nn.GELU()]
    layers.append(torch.nn.Linear(a.hidden, 16))
    model = torch.nn.Sequential(*layers).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator(device=dev)
    g.manual_seed(a.seed)
    # a fixed data set on the device, drawn once (its contents are part of the state dumped)
    data = torch.randn(a.batches, a.batch, a.hidden, generator=g, device=dev)
    target = torch.randn(a.batches, a.batch, 16, generator=g, device=dev)
    ballast = None
    if a.ballast_gb > 0:
        n = int(a.ballast_gb * (1 << 30)) // 4
        gb = torch.Generator(device=dev)
        gb.manual_seed(a.seed + 1)
        ballast = torch.randint(-(1 << 31), (1 << 31) - 1, (n,), generator=gb, device=dev, dtype=torch.int32)
        a.ballast_sum_start = int(ballast.sum(dtype=torch.int64).item())  # on the device
        log(f"BALLAST gb={a.ballast_gb} sum={a.ballast_sum_start}")
    mem = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    ready(a, dev.type, mem)
    for step in range(1, a.steps + 1):
        if step == a.long_kernel_at:
            long_kernel(a, torch, dev)
        i = step % a.batches
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(data[i]), target[i])
        loss.backward()
        opt.step()
        if dev.type == "cuda":
            mem = max(mem, torch.cuda.max_memory_allocated(dev))
        log(f"step {step}/{a.steps} loss={loss.item():.6f} t={time.monotonic():.3f}")
        time.sleep(a.step_sleep)
    if ballast is not None:
        a.ballast_sum_end = int(ballast.sum(dtype=torch.int64).item())
        log(f"BALLAST end sum={a.ballast_sum_end}")
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        t = p.detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return h.hexdigest(), mem


def long_kernel(a: argparse.Namespace, torch, dev) -> None:
    """One kernel that keeps the GPU busy for about --long-kernel-secs (no state changes)."""
    if dev.type != "cuda":
        log(f"LONGKERNEL start secs={a.long_kernel_secs} (cpu: a sleep)")
        time.sleep(a.long_kernel_secs)
        log("LONGKERNEL end")
        return
    # calibrate cycles per second with a short spin
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    torch.cuda._sleep(50_000_000)
    e.record()
    torch.cuda.synchronize()
    per_s = 50_000_000 / max(s.elapsed_time(e) / 1000, 1e-6)
    log(f"LONGKERNEL start secs={a.long_kernel_secs}")
    torch.cuda._sleep(int(per_s * a.long_kernel_secs))
    torch.cuda.synchronize()
    log("LONGKERNEL end")


def pure_job(a: argparse.Namespace) -> tuple[str, int]:
    """No torch: a deterministic stand-in with some tens of MB of state."""
    import array
    import random

    rng = random.Random(a.seed)
    w = array.array("d", (rng.uniform(-1, 1) for _ in range(a.hidden * 64)))
    ballast = bytearray(rng.randbytes(1 << 20)) * 32   # 32 MiB of non-zero state
    ready(a, "cpu", 0)
    n = len(w)
    for step in range(1, a.steps + 1):
        if step == a.long_kernel_at:
            long_kernel(a, None, type("D", (), {"type": "cpu"})())
        lr = 1e-3
        acc = 0.0
        for k in range(0, n, 7):
            grad = w[k] - (rng.random() - 0.5)
            w[k] -= lr * grad
            acc += grad * grad
        ballast[step % len(ballast)] ^= 0xFF
        log(f"step {step}/{a.steps} loss={acc / (n / 7):.6f} t={time.monotonic():.3f}")
        time.sleep(a.step_sleep)
    h = hashlib.sha256(w.tobytes())
    h.update(hashlib.sha256(ballast).digest())
    return h.hexdigest(), 0


def ready(a: argparse.Namespace, device: str, mem: int) -> None:
    if a.pidfile:
        with open(a.pidfile + ".tmp", "w") as f:
            f.write(f"{os.getpid()}\n")
        os.replace(a.pidfile + ".tmp", a.pidfile)
    log(f"READY pid={os.getpid()} device={device} gpu_mem={mem}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--step-sleep", type=float, default=0.02)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", help="write {hash, steps, device, gpu_mem_bytes} here at the end")
    ap.add_argument("--pidfile")
    ap.add_argument("--ballast-gb", type=float, default=0.0)
    ap.add_argument("--long-kernel-at", type=int, default=0)
    ap.add_argument("--long-kernel-secs", type=float, default=20.0)
    ap.add_argument("--no-torch", action="store_true", help="use the pure-Python stand-in")
    ap.add_argument("--log", help="append every line here instead of stdout (no file held open)")
    a = ap.parse_args()
    global LOG_FILE
    LOG_FILE = a.log
    if a.log:
        import traceback

        sys.excepthook = lambda t, v, tb: log("".join(traceback.format_exception(t, v, tb)).rstrip())
    try:
        if a.no_torch:
            raise ImportError
        import torch  # noqa: F401
        job = torch_job
    except ImportError:
        if a.device != "cpu":
            log("PyTorch is required for --device cuda")
            return 2
        job = pure_job
    t0 = time.time()
    digest, mem = job(a)
    res = {"hash": digest, "steps": a.steps, "device": a.device, "gpu_mem_bytes": mem,
           "impl": job.__name__, "seconds": round(time.time() - t0, 3),
           "ballast_gb": a.ballast_gb, "ballast_sum_start": getattr(a, "ballast_sum_start", None),
           "ballast_sum_end": getattr(a, "ballast_sum_end", None)}
    if a.out:
        with open(a.out + ".tmp", "w") as f:
            json.dump(res, f)
        os.replace(a.out + ".tmp", a.out)
    log(f"DONE hash={digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
