#!/usr/bin/env python3
"""Concurrent writers into one repository (issue 35 item 1, docs/format.md §6). Needs root.

    python scripts/bench_writers.py [--writers 1,2,4,8] [--mb 32] [--dir /var/tmp/gpusnap-writers]
                                    [--json FILE] [--no-restore]

For each N: N different jobs (gpusnap.samples.job, --mb each, different seeds) run; one
repository is made; N `gpusnap dump PID --repo R --json --lock-wait 0` start at the same moment.
Reported: total wall time, dumps per minute (N / wall), each dump's own time, and that nothing
was lost (every dump exits 0, N snapshots listed, `verify` clean); then each job is killed and
its snapshot restored (it must come back under its PID and keep running).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from gpusnap.samples.job import steps_done  # noqa: E402 (the checkout's, as the gpusnap it runs)

PY = sys.executable
GPUSNAP = [PY, "-m", "gpusnap"]


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_writers: {what}")
        time.sleep(0.05)


def _start_jobs(base: Path, n: int, mb: int) -> list[tuple[subprocess.Popen, Path]]:
    jobs = []
    for k in range(n):
        out = base / f"job{k}"
        out.mkdir(parents=True)
        p = subprocess.Popen([PY, "-m", "gpusnap.samples.job", str(out), "--steps", "1000000", "--mb", str(mb),
                              "--threads", "1", "--step-ms", "20", "--seed", str(k + 1)], cwd=ROOT,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        jobs.append((p, out))
    for _, out in jobs:
        _wait(lambda: steps_done(out) >= 2, 120, "a job did not start")
    return jobs


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def one_round(base: Path, n: int, mb: int, restore: bool) -> dict:
    jobs = _start_jobs(base, n, mb)
    repo = base / "repo"
    subprocess.run([*GPUSNAP, "init", "--repo", str(repo)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    try:
        t0 = time.monotonic()
        ps = [(subprocess.Popen([*GPUSNAP, "dump", str(p.pid), "--repo", str(repo), "--name", f"w{k}", "--json",
                                 "--lock-wait", "0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True), time.monotonic()) for k, (p, _) in enumerate(jobs)]
        done: dict[int, tuple] = {}

        def wait(k, d, started):             # each dump's own end, not the order they are read in
            out, err = d.communicate()
            done[k] = (out, err, round(time.monotonic() - started, 2))
        ts = [threading.Thread(target=wait, args=(k, d, st)) for k, (d, st) in enumerate(ps)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        each, snaps, codes = [], [], []
        for k, (d, _) in enumerate(ps):
            out, err, took = done[k]
            each.append(took)
            codes.append(d.returncode)
            if d.returncode == 0:
                snaps.append(json.loads(out)["snapshot"])
            else:
                print(err, file=sys.stderr)
        wall = time.monotonic() - t0
        listed = json.loads(subprocess.run([*GPUSNAP, "ls", "--repo", str(repo), "--json"], cwd=ROOT,
                                           capture_output=True, text=True, check=True).stdout)["snapshots"]
        ver = subprocess.run([*GPUSNAP, "verify", "--repo", str(repo)], cwd=ROOT, capture_output=True)
        restored = 0
        if restore:
            for (p, out), snap in zip(jobs, snaps):
                pids = [int(x) for x in (out / "pid").read_text().split()]
                _kill(pids)
                p.wait()
                _wait(lambda: not any(Path(f"/proc/{x}").exists() for x in pids), 30, "a job did not die")
                r = subprocess.run([*GPUSNAP, "restore", snap, "--repo", str(repo), "--json"], cwd=ROOT,
                                   capture_output=True, text=True)
                if r.returncode == 0 and json.loads(r.stdout)["pid"] == p.pid:
                    s = steps_done(out)
                    _wait(lambda: steps_done(out) > s, 60, "a restored job does not run")
                    restored += 1
                _kill(pids)
        return {"writers": n, "wall_s": round(wall, 2), "dumps_per_min": round(60 * n / wall, 1),
                "dump_s": each, "exit_codes": codes, "snapshots_listed": len(listed),
                "verify_clean": ver.returncode == 0, "restored": restored if restore else None}
    finally:
        for p, out in jobs:
            try:
                _kill([int(x) for x in (out / "pid").read_text().split()])
            except (OSError, ValueError):
                pass
            _kill([p.pid])
            p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--writers", default="1,2,4,8")
    ap.add_argument("--mb", type=int, default=32)
    ap.add_argument("--dir", default="/var/tmp/gpusnap-writers")
    ap.add_argument("--json")
    ap.add_argument("--no-restore", action="store_true")
    a = ap.parse_args()
    rows = []
    print(f"{'writers':>7} {'wall s':>7} {'dumps/min':>9} {'per-dump s (min..max)':>22}  lost  verify  restored")
    for n in map(int, a.writers.split(",")):
        base = Path(a.dir) / f"n{n}"
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        r = one_round(base, n, a.mb, not a.no_restore)
        shutil.rmtree(base, ignore_errors=True)
        rows.append(r)
        lost = n - r["snapshots_listed"]
        print(f"{n:>7} {r['wall_s']:>7} {r['dumps_per_min']:>9} {min(r['dump_s']):>10}..{max(r['dump_s']):<10}  "
              f"{lost:>4}  {'clean' if r['verify_clean'] else 'FAIL':>6}  {r['restored']}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["verify_clean"] and r["snapshots_listed"] == r["writers"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
