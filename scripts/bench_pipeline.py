#!/usr/bin/env python3
"""Micro-benchmark of gpusnap's page pipeline (gpusnap/repo): write and restore speed, sizes.

Usage: python scripts/bench_pipeline.py [--mib 128] [--dir /tmp] [--groups 1,16,64] [--threads 2]
                                       [--reps 5]

Each data set is written as one pages-*.img (in 1 MiB chunks, as the streamer would), into
a fresh repository, then read back with Snapshot.read_image. Prints MB/s (1 MB = 1e6 bytes)
and stored bytes / raw bytes (everything the dump added: packs, index, page lists, manifest).
Times are the median of --reps runs (the machine may be shared); "CPU us/page" is user+system
CPU of the whole process (all threads) per 4 KiB page of the first dump, median; "restore
CPU us/page" the same for reading the snapshot back.
The page hot loop is the native library (build/lib/libgpusnap_pages.so), the only one gpusnap has.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpusnap.repo import Repository, native

PAGE = 4096


def gen_random(n):
    return os.urandom(n)


def gen_fp32(n):
    """Training-like fp32: normal weights (std 0.02), Adam-like moments (tiny, positive)."""
    try:
        import numpy as np
    except ImportError:
        import random, struct
        return b"".join(struct.pack("<f", random.gauss(0, 0.02)) for _ in range(n // 4))
    rng = np.random.default_rng(1)
    a = rng.normal(0, 0.02, n // 4 // 3).astype(np.float32)
    m = (rng.normal(0, 1e-3, n // 4 // 3)).astype(np.float32)
    v = (rng.random(n // 4 - 2 * (n // 4 // 3)) * 1e-6).astype(np.float32)
    return (a.tobytes() + m.tobytes() + v.tobytes())[:n]


def gen_zero_heavy(n):
    """Inference-like: 85 % zero pages, the rest half text-like, half random."""
    import random
    rnd = random.Random(2)
    words = [bytes(rnd.choices(b"abcdefghijklmnopqrstuvwxyz_", k=rnd.randint(2, 12))) for _ in range(500)]
    out = bytearray()
    while len(out) < n:
        r = rnd.random()
        if r < 0.85:
            out += bytes(PAGE)
        elif r < 0.93:
            s = b" ".join(rnd.choices(words, k=900))[:PAGE]
            out += s.ljust(PAGE, b"\0")
        else:
            out += os.urandom(PAGE)
    return bytes(out[:n])


def write_snapshot(repo, name, images, compress="lz4", group=16, threads=1):
    """images: {filename: bytes}. -> (seconds, stats, snapshot)"""
    with repo.writer_lock():
        w = repo.new_snapshot(name, compress=compress, group_pages=group)
        t0 = time.perf_counter()
        c0 = time.process_time()

        def feed(fn, data):
            s = w.image_sink(fn)
            mv = memoryview(data)
            for i in range(0, len(data), 1 << 20):
                s.write(mv[i:i + (1 << 20)])
            s.close()

        if threads > 1:
            ths = [threading.Thread(target=feed, args=kv) for kv in images.items()]
            [t.start() for t in ths]
            [t.join() for t in ths]
        else:
            for kv in images.items():
                feed(*kv)
        snap = w.commit()
        dt = time.perf_counter() - t0
        w.stats["cpu_s"] = time.process_time() - c0
    return dt, w.stats, snap


def read_snapshot(snap, threads=1):
    names = [n for n in snap.image_names()]
    t0 = time.perf_counter()
    c0 = time.process_time()
    total = [0]

    def rd(n):
        k = 0
        for chunk in snap.read_image(n):
            k += len(chunk)
        total[0] += k

    if threads > 1:
        ths = [threading.Thread(target=rd, args=(n,)) for n in names]
        [t.start() for t in ths]
        [t.join() for t in ths]
    else:
        for n in names:
            rd(n)
    read_snapshot.cpu_s = time.process_time() - c0
    return time.perf_counter() - t0, total[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--groups", default="16")
    ap.add_argument("--codecs", default="lz4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sets", default="random,zero-heavy,fp32")
    ap.add_argument("--reps", type=int, default=5, help="median of N (the box may be shared)")
    a = ap.parse_args()
    n = a.mib << 20
    gens = {"random": gen_random, "zero-heavy": gen_zero_heavy, "fp32": gen_fp32}
    base = Path(tempfile.mkdtemp(prefix="gsbench-", dir=a.dir))
    try:
        print(f"# {a.mib} MiB per data set, 1 MB = 1e6 B; stored = packs+index+page lists+manifest")
        native.load()
        print(f"# native library: {native.lib_path}")
        print(f"{'impl':<7}{'data':<11}{'codec':<6}{'group':>6}{'thr':>4} {'write MB/s':>11}{'stored/raw':>11}"
              f"{'restore MB/s':>13}{'  2nd dump MB/s':>15}{'2nd stored/raw':>15}{'CPU us/page':>12}"
              f"{'restore CPU us/page':>20}")
        sets = [(s, gens[s](n)) for s in a.sets.split(",")]
        impl = "native"
        for setname, data in sets:
          for codec in a.codecs.split(","):
              for g in (int(x) for x in a.groups.split(",")):
                  for thr in sorted({1, a.threads}):
                      if thr > 1:
                          k = n // thr // PAGE * PAGE
                          images = {f"pages-{i + 1}.img": data[i * k:(i + 1) * k] for i in range(thr)}
                      else:
                          images = {"pages-1.img": data}
                      raw = sum(len(v) for v in images.values())
                      runs = []
                      for rep in range(a.reps):
                          rp = base / f"r-{setname}-{codec}-{g}-{thr}-{rep}"
                          repo = Repository.open(rp, create=True)
                          dt, st, snap = write_snapshot(repo, "b", images, codec, g, thr)
                          rt, got = read_snapshot(snap, thr)
                          rcpu = read_snapshot.cpu_s
                          assert got == raw, (got, raw)
                          dt2, st2, _ = write_snapshot(repo, "b", images, codec, g, thr)
                          shutil.rmtree(rp)
                          runs.append((dt, st, rt, dt2, st2, rcpu))
                      med = lambda k: sorted(r[k] for r in runs)[len(runs) // 2]  # noqa: E731
                      dt, rt, dt2 = med(0), med(2), med(3)
                      st, st2 = runs[-1][1], runs[-1][4]
                      cpu = sorted(r[1]["cpu_s"] for r in runs)[len(runs) // 2]
                      rcpu = med(5)
                      pages = raw / PAGE
                      print(f"{impl:<7}{setname:<11}{codec:<6}{g:>6}{thr:>4} {raw / dt / 1e6:>11.0f}"
                            f"{st['bytes_stored'] / raw:>11.4f}{raw / rt / 1e6:>13.0f}"
                            f"{raw / dt2 / 1e6:>15.0f}{st2['bytes_stored'] / raw:>15.4f}"
                            f"{cpu / pages * 1e6:>12.2f}{rcpu / pages * 1e6:>20.2f}", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
