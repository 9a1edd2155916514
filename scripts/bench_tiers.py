"""`make bench`'s tiered measurement: how long a job waits per snapshot with `dump --copy-to`
against without. A real sample job (gpusnap.samples.job, MB of memory changing every step) is
dumped N times into a local repository, alternately plain and with --copy-to a second one;
the job's wait is the dump's frozen_seconds (CRIU's figure: the job is stopped only then), the
dump's own time ends at the local commit, and the copy runs after it (copy.seconds)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPUSNAP = [sys.executable, "-m", "gpusnap"]


def gs(*args) -> dict:
    p = subprocess.run([*GPUSNAP, *map(str, args), "--json"], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if p.returncode:
        raise SystemExit(f"gpusnap {' '.join(map(str, args))}: exit {p.returncode}\n{p.stderr}")
    return json.loads(p.stdout)


def main() -> int:
    mb, n = int(os.environ.get("BENCH_TIERS_MB", "64")), int(os.environ.get("BENCH_TIERS_N", "5"))
    with tempfile.TemporaryDirectory(prefix="gpusnap-bench-tiers-") as tmp:
        t = Path(tmp)
        for r in ("local", "shared"):
            gs("init", "--repo", t / r)
        job = subprocess.Popen([sys.executable, "-m", "gpusnap.samples.job", str(t / "out"), "--steps", "100000",
                                "--mb", str(mb), "--threads", "2", "--step-ms", "20"], cwd=ROOT,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
        try:
            time.sleep(2)
            rows: dict[str, list[dict]] = {"plain": [], "copy-to": []}
            gs("dump", job.pid, "--repo", t / "local", "--name", "b")     # a first, full one: not counted
            for _ in range(n):
                rows["plain"].append(gs("dump", job.pid, "--repo", t / "local", "--name", "b"))
                rows["copy-to"].append(gs("dump", job.pid, "--repo", t / "local", "--name", "b",
                                          "--copy-to", t / "shared"))
        finally:
            job.kill()
            job.wait()
    med = statistics.median
    print(f"tiered dumps, job of {mb} MiB, {n} dumps each (medians):")
    for k, rs in rows.items():
        copy = f", copy after the commit {med(r['copy']['seconds'] for r in rs):.3f} s" if k == "copy-to" else ""
        print(f"  {k:8s} job waits (frozen) {med(r['frozen_seconds'] for r in rs):.3f} s, "
              f"dump until the local commit {med(r['seconds'] for r in rs):.3f} s{copy}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
