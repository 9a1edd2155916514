"""scripts/bench.py --sizes (scripts/bench_growth.py, issue 33): the growth-curve mode is
reached through bench.py, and its table puts gpusnap's and raw CRIU's seconds and their
ratio side by side for every size. (The measurements themselves need root and minutes:
`make bench-growth`; speed is reported there, never asserted.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


def test_sizes_option_runs_the_growth_curve():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--sizes", "0.5", "--help"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "How gpusnap's cost grows with the job" in out.stdout and "--taskset-mb" in out.stdout


def test_table_has_both_sides_and_the_ratio_per_size():
    import bench_growth

    row = {"kind": "random", "gib": 4.0, "gs_freeze": 2.0, "raw_freeze": 8.0, "freeze_ratio": 0.25,
           "gs_committed": 9.0, "raw_committed": 9.0, "committed_ratio": 1.0, "gs_restore_cold": 3.0,
           "raw_restore_cold": 4.0, "restore_cold_ratio": 0.75, "size_ratio": 1.006, "gs_hwm_mib": 2101,
           "budget_mib": 2048, "spilled_mib": 2068, "loadavg": 1.2}
    text = bench_growth.table([row, {**row, "kind": "fp32", "gib": 0.5, "floor_freeze_ratio": 0.653,
                                     "floor_restore_cold_ratio": 1.287}])
    lines = text.splitlines()
    assert len(lines) == 4
    assert "| random | 4 | 2.00 / 8.00 (0.25) | 9.00 / 9.00 (1.00) | 3.00 / 4.00 (0.75) | 1.006 | 2101 / 2048 | 2068 |" in lines[2]
    # CRIU's --stream mode alone, as a ratio to raw CRIU's freeze, beside gpusnap's ratio
    assert lines[3].startswith("| fp32 | 0.5 | 2.00 / 8.00 (0.25; 0.65) |")
    # and under the cold restore, `criu restore --stream` fed the raw images unchanged
    assert "| 3.00 / 4.00 (0.75; 1.29) |" in lines[3]


def test_a_freeze_is_in_the_report_taken_right_after_it(tmp_path):
    """The benchmark's freeze is the longest gap the job's ticker saw (tests/jobs/workloads.py).
    After a freeze the job's main thread may answer the request before the ticker thread has
    woken to record the gap: the report must count the gap still open, not leave it to the
    next one (a raw CRIU dump once read 0.01 s so). Forced here: the ticker sleeps 2 s, the job
    is stopped for 0.3 s, and the request is answered as soon as it resumes."""
    import json
    import os
    import signal
    import time

    out = tmp_path / "job"
    job = subprocess.Popen([sys.executable, str(ROOT / "tests" / "jobs" / "workloads.py"), str(out),
                            "--kind", "random", "--mb", "1", "--tick-ms", "2000", "--poll-ms", "5"])

    def gap(n: int) -> float:
        (out / f"gap.{n}").touch()
        deadline = time.monotonic() + 30
        while not (out / f"gapped.{n}").exists():
            assert time.monotonic() < deadline and job.poll() is None
            time.sleep(0.01)
        return json.loads((out / f"gapped.{n}").read_text())["max_gap"]

    try:
        deadline = time.monotonic() + 30
        while not (out / "ready").exists():
            assert time.monotonic() < deadline and job.poll() is None
            time.sleep(0.01)
        gap(1)
        os.kill(job.pid, signal.SIGSTOP)
        time.sleep(0.3)
        (out / "gap.2").touch()
        os.kill(job.pid, signal.SIGCONT)
        assert gap(2) >= 0.3
        assert gap(3) < 0.3     # and that gap is not reported twice
    finally:
        job.kill()
        job.wait()
