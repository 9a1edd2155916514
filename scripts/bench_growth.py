#!/usr/bin/env python3
"""How gpusnap's cost grows with the job, against raw CRIU's (issue 33). Needs root.

    python scripts/bench.py --sizes 0.5,1,2,4,8 [--kinds random,fp32] [--reps 1]
                            [--growth-chart docs/benchmark-growth.png] [--json FILE]
    python scripts/bench_growth.py ...      (the same, on its own)

For every size (GiB) and workload (tests/jobs/workloads.py, a job ticking every 2 ms), on
one fresh job: raw `criu dump --leave-running` and `gpusnap dump` (the order alternating
from one size to the next), each followed by `sync` ("until committed"), the freeze being
the longest gap the job saw between two ticks; the job killed; then, each from a cold page
cache (`drop_caches`), raw `criu restore -d -D` and `gpusnap restore` (auto). Ratios are
gpusnap / raw CRIU of the same job in the same run, so the machine's load moves both sides
(it moves their ratio less than their seconds; the load average is printed with each row).

Before the job is killed, CRIU's --stream mode alone freezes it once more: the dump into a
capture server that drops every byte (scripts/stream_floor.py). The job's longest gap then
is the freeze floor: what any dump through `criu --stream` freezes the job for on this
machine, however fast the pipeline behind it ("floor" in the freeze column, as a ratio to
raw CRIU's freeze; a freeze ratio target below it cannot be met through CRIU's stream mode).
Likewise after the cold restores: `criu restore --stream` fed the raw images unchanged (no
check, no decode), from a cold cache, is the floor under gpusnap's default restore ("floor"
in the restore column).

On a VM that hands freed memory back to its host (free page reporting), the run holds that
off and faults the free memory in once (scripts/host_memory.py, put back at the end): raw
CRIU's images land in the page cache while the job is frozen, and memory the host took back
made that freeze 3-5x longer whenever gpusnap had run just before (--leave-page-reporting
measures the VM as it is).

Also measured, as the bounds every figure is read against: memcpy (one thread), blake3 per
thread, the disk's O_DIRECT write, its buffered write + fsync and its read from a cold
cache, each in GB/s; and gpusnap storing a job of --taskset-mb MiB random under `taskset`
with 1 and with 2 cores (its `storing` phase's MB/s from --json: how the page pipeline
scales with cores).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
import host_memory  # noqa: E402

TARGETS = {"freeze": 0.5, "committed_random": 1.2, "committed_fp32": 1.0, "restore_cold": 0.8}
# the floor drawn under a measure's ratio: CRIU's --stream mode alone, same job, same run
FLOORS = {"freeze_ratio": "floor_freeze_ratio", "restore_cold_ratio": "floor_restore_cold_ratio"}


def machine_limits(workdir: Path) -> dict:
    """memcpy and blake3 per thread (GB/s, 512 MiB in memory), the disk's write speeds and
    its read speed from a cold cache."""
    import blake3

    n = 512 << 20
    src = os.urandom(1 << 20) * 512
    dst = memoryview(bytearray(n))     # (a bytearray's own slice assignment ran at 1.4 GB/s here, a view's at 12)
    dst[:] = src                # (faulted in first: the copy alone is timed)
    t = time.perf_counter()
    dst[:] = src
    memcpy = n / (time.perf_counter() - t) / 1e9
    t = time.perf_counter()
    blake3.blake3(src).digest()
    b3 = n / (time.perf_counter() - t) / 1e9
    del dst
    f = workdir / "limits.bin"
    workdir.mkdir(parents=True, exist_ok=True)
    out = {"memcpy_gb_s": round(memcpy, 2), "blake3_gb_s_per_thread": round(b3, 2)}
    for key, flags in (("disk_direct_write_gb_s", ["oflag=direct"]), ("disk_write_fsync_gb_s", ["conv=fsync"])):
        bench.settle()
        t = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=4M", "count=256", *flags],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out[key] = round((1 << 30) / (time.perf_counter() - t) / 1e9, 2)
        f.unlink()
    # what any restore from a cold cache reads its images at (buffered, the kernel's read-ahead)
    subprocess.run(["dd", "if=/dev/urandom", f"of={f}", "bs=4M", "count=256", "conv=fsync"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    bench.settle()
    bench.drop_caches()
    t = time.perf_counter()
    subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=4M"], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    out["disk_read_cold_gb_s"] = round((1 << 30) / (time.perf_counter() - t) / 1e9, 2)
    f.unlink()
    return out


def _restore_cold(cmd: list[str], pid: int) -> dict:
    r = bench.restore_timed(cmd, cold=True, cwd=bench.ROOT)
    if not bench.pid_alive(pid):
        raise RuntimeError(f"{' '.join(cmd[:3])} did not bring the job back")
    bench.kill(pid)
    return r


def floor_restore_cold(raw: Path, pid: int) -> float:
    """CRIU's seconds restoring the raw images through --stream from a cold cache, fed
    unchanged (no check, no decode): the floor under gpusnap's default (stream) restore."""
    criu_s = bench.stream_floor("restore", str(raw), cold=True)
    if not bench.pid_alive(pid):
        raise RuntimeError("criu restore --stream did not bring the job back")
    bench.kill(pid)
    return criu_s


def one_size(kind: str, gib: float, base: Path, first_raw: bool) -> dict:
    mb = int(gib * 1024)
    d = base / f"{kind}-{mb}"
    job = bench.Job(d / "job", kind, mb)
    raw, repo = d / "raw", d / "repo"
    s: dict = {"kind": kind, "gib": gib, "loadavg": round(os.getloadavg()[0], 2)}
    try:
        if first_raw:
            r = bench.raw_dump(job.pid, raw, job)
            g = bench.gpusnap_dump(job.pid, repo, job)
        else:
            g = bench.gpusnap_dump(job.pid, repo, job)
            r = bench.raw_dump(job.pid, raw, job)
        floor = floor_freeze(job)
        bench.kill(job.pid, job.popen)
        info = g["info"]
        s.update(raw_freeze=r["freeze"], gs_freeze=g["freeze"], raw_committed=r["committed"],
                 gs_committed=g["committed"], raw_bytes=r["bytes"], gs_bytes=info["bytes_stored"],
                 gs_hwm_mib=round((g["hwm_kib"] or 0) / 1024), budget_mib=info["staging"]["budget"] >> 20,
                 budget_choice=info["staging"].get("budget_choice"), spilled_mib=info["staging"]["spilled_bytes"] >> 20,
                 spill_mode=info["staging"].get("spill_mode"),
                 pages_pipe_kib=(info["staging"].get("pages_pipe") or 0) >> 10,
                 floor_freeze=floor["freeze"], floor_criu_s=floor["criu_s"],
                 phases=info["phases"],
                 throughput=info.get("throughput"))
        raw_cmd = [bench.criu_path(), "restore", "-d", "-D", str(raw), "-o", "restore.log", "-v2"]
        gs_cmd = [bench.PY, "-m", "gpusnap", "restore", info["snapshot"], "--repo", str(repo), "--json"]
        s["raw_restore_cold"] = _restore_cold(raw_cmd, job.pid)["wall"]
        g = _restore_cold(gs_cmd, job.pid)
        s["gs_restore_cold"] = g["wall"]
        s["gs_restore_criu_s"] = json.loads(g["stdout"].strip().splitlines()[-1]).get("phases", {}).get("criu")
        s["floor_restore_cold"] = floor_restore_cold(raw, job.pid)
    finally:
        if bench.pid_alive(job.pid):
            bench.kill(job.pid, job.popen if job.popen.poll() is None else None)
        job.popen.poll()
        job.stdio.close()
        shutil.rmtree(d, ignore_errors=True)
    for k in ("freeze", "committed", "restore_cold"):
        s[f"{k}_ratio"] = round(s[f"gs_{k}"] / s[f"raw_{k}"], 3) if s[f"raw_{k}"] else None
    s["floor_freeze_ratio"] = round(s["floor_freeze"] / s["raw_freeze"], 3) if s["raw_freeze"] else None
    s["floor_restore_cold_ratio"] = (round(s["floor_restore_cold"] / s["raw_restore_cold"], 3)
                                     if s["raw_restore_cold"] else None)
    s["size_ratio"] = round(s["gs_bytes"] / s["raw_bytes"], 3)
    s["peak_over_budget_mib"] = s["gs_hwm_mib"] - s["budget_mib"]
    return s


def floor_freeze(job: "bench.Job") -> dict:
    """The job's freeze under CRIU's --stream mode alone (every byte dropped), and CRIU's
    seconds then: the floor under gpusnap's freeze on this machine."""
    job.gap()          # (the settle before the dump only ticks: no gap of its own)
    criu_s = bench.stream_floor("dump", str(job.pid))
    return {"freeze": job.gap(), "criu_s": criu_s}


def taskset_storing(base: Path, mb: int) -> dict:
    """gpusnap's storing phase (MB/s) on 1 core and on 2 (taskset), the same random job."""
    d = base / "taskset"
    job = bench.Job(d / "job", "random", mb)
    out = {"mb": mb}
    try:
        for cores in ("0", "0,1"):
            repo = d / f"repo-{cores.replace(',', '')}"
            bench.settle()
            subprocess.run([bench.PY, "-m", "gpusnap", "init", "--repo", str(repo)], check=True,
                           stdout=subprocess.DEVNULL, cwd=bench.ROOT)
            r = bench.check(bench.timed(["taskset", "-c", cores, bench.PY, "-m", "gpusnap", "dump", str(job.pid),
                                         "--repo", str(repo), "--json"], cwd=bench.ROOT), "gpusnap dump")
            info = json.loads(r["stdout"].strip().splitlines()[-1])
            out[f"cores_{len(cores.split(','))}"] = {"storing_mb_s": (info.get("throughput") or {}).get("storing_mb_s"),
                                                    "storing_s": info["phases"]["storing"], "wall": round(r["wall"], 2)}
            shutil.rmtree(repo, ignore_errors=True)
    finally:
        bench.kill(job.pid, job.popen)
        job.stdio.close()
        shutil.rmtree(d, ignore_errors=True)
    return out


def table(rows: list[dict]) -> str:
    head = ("| workload | GiB | freeze gs / raw s (ratio; floor) | until committed gs / raw s (ratio) | "
            "restore cold gs / raw s (ratio; floor) | size | peak RSS / budget MiB | spilled MiB | pipe KiB | load |")
    lines = [head, "|" + "---|" * 10]
    for s in rows:
        floor = f"; {s['floor_freeze_ratio']:.2f}" if s.get("floor_freeze_ratio") is not None else ""
        rfloor = f"; {s['floor_restore_cold_ratio']:.2f}" if s.get("floor_restore_cold_ratio") is not None else ""
        lines.append(f"| {s['kind']} | {s['gib']:g} | {s['gs_freeze']:.2f} / {s['raw_freeze']:.2f} ({s['freeze_ratio']:.2f}{floor}) | "
                     f"{s['gs_committed']:.2f} / {s['raw_committed']:.2f} ({s['committed_ratio']:.2f}) | "
                     f"{s['gs_restore_cold']:.2f} / {s['raw_restore_cold']:.2f} ({s['restore_cold_ratio']:.2f}{rfloor}) | "
                     f"{s['size_ratio']:.3f} | {s['gs_hwm_mib']} / {s['budget_mib']} | {s['spilled_mib']} | "
                     f"{s.get('pages_pipe_kib', '')} | {s['loadavg']} |")
    return "\n".join(lines)


def _medians(rows: list[dict], kind: str, key: str) -> list[tuple[float, float]]:
    """(size, median of key over the repetitions) for one workload, by size."""
    by: dict[float, list[float]] = {}
    for s in rows:
        if s["kind"] == kind and s.get(key) is not None:
            by.setdefault(s["gib"], []).append(s[key])
    return [(g, statistics.median(v)) for g, v in sorted(by.items())]


def draw(rows: list[dict], path: Path) -> bool:
    """Ratio against raw CRIU per size (the median of the repetitions), one panel per
    measure, a line per workload."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    measures = [("freeze", "freeze_ratio", [TARGETS["freeze"]]),
                ("dump until committed (+sync)", "committed_ratio", [TARGETS["committed_random"], TARGETS["committed_fp32"]]),
                ("restore, cold cache", "restore_cold_ratio", [TARGETS["restore_cold"]])]
    fig, axes = plt.subplots(1, len(measures), figsize=(4.2 * len(measures), 3.6), sharex=True)
    for ax, (title, key, targets) in zip(axes, measures):
        for kind in sorted({s["kind"] for s in rows}):
            pts = _medians(rows, kind, key)
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=kind)
            fl = _medians(rows, kind, FLOORS[key]) if key in FLOORS else []
            if fl:                        # what CRIU's --stream mode alone took
                ax.plot([p[0] for p in fl], [p[1] for p in fl], linestyle=":", color=line.get_color(),
                        label=f"{kind}: CRIU --stream alone")
        for t in targets:
            ax.axhline(t, color="grey", linestyle="--", linewidth=0.8)
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_xscale("log", base=2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("job size (GiB)")
        ax.set_ylim(bottom=0)
    axes[0].set_ylabel("gpusnap / raw CRIU")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run(sizes: list[float], kinds: list[str], reps: int, base_dir: Path, chart: Path | None,
        json_out: Path | None, taskset_mb: int, host_backed: bool = True) -> int:
    bench.compile_bytecode()
    base = base_dir / f"growth-{os.getpid()}"
    base.mkdir(parents=True)
    rows: list[dict] = []
    held = host_memory.HostBacked() if host_backed else None
    stack = contextlib.ExitStack()
    try:
        if held is not None:
            stack.enter_context(held)
            print(f"host memory: {json.dumps(held.summary)}", file=sys.stderr, flush=True)
        limits = machine_limits(base)
        print(f"machine: {json.dumps(limits)}", file=sys.stderr, flush=True)
        turn = 0
        for rep in range(reps):
            for kind in kinds:
                for gib in sizes:
                    t0 = time.monotonic()
                    s = one_size(kind, gib, base, first_raw=turn % 2 == 0)
                    turn += 1
                    s["rep"] = rep
                    rows.append(s)
                    print(f"[{kind} {gib:g} GiB, load {s['loadavg']}] freeze {s['freeze_ratio']:.2f} "
                          f"(floor {s['floor_freeze_ratio']}) "
                          f"committed {s['committed_ratio']:.2f} restore cold {s['restore_cold_ratio']:.2f} "
                          f"(floor {s['floor_restore_cold_ratio']}) "
                          f"peak {s['gs_hwm_mib']}/{s['budget_mib']} MiB ({time.monotonic() - t0:.0f}s)",
                          file=sys.stderr, flush=True)
        cores = taskset_storing(base, taskset_mb) if taskset_mb else None
    finally:
        stack.close()               # (the page reporting put back)
        shutil.rmtree(base, ignore_errors=True)
    limits["host_memory"] = held.summary if held is not None else "as the machine has it (--leave-page-reporting)"
    print(table(rows), flush=True)
    print(f"machine limits: {json.dumps(limits)}")
    if cores:
        print(f"storing with taskset: {json.dumps(cores)}")
    if chart is not None and str(chart) not in ("", "."):
        print(f"chart: {chart}" if draw(rows, chart) else "chart: skipped (no matplotlib)", file=sys.stderr)
    if json_out:
        json_out.write_text(json.dumps({"sizes_gib": sizes, "kinds": kinds, "reps": reps, "cpus": os.cpu_count(),
                                        "targets": TARGETS, "machine": limits, "taskset": cores,
                                        "samples": rows}, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0.5,1,2,4,8", help="job sizes in GiB, comma-separated")
    ap.add_argument("--kinds", default="random,fp32")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/gpusnap-bench"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--settle", type=float, default=bench.SETTLE)
    ap.add_argument("--growth-chart", type=Path, default=bench.ROOT / "docs" / "benchmark-growth.png")
    ap.add_argument("--taskset-mb", type=int, default=1024, help="job size for the 1-vs-2-core storing run (0: none)")
    ap.add_argument("--leave-page-reporting", action="store_true",
                    help="measure with the VM's free page reporting as it is (scripts/host_memory.py)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench needs root: it dumps and restores real processes with CRIU", file=sys.stderr)
        return 1
    bench.SETTLE = max(0.0, args.settle)
    sizes = [float(x) for x in args.sizes.split(",") if x]
    kinds = [k for k in args.kinds.split(",") if k]
    for k in kinds:
        if k not in bench.KINDS:
            ap.error(f"unknown kind {k!r}")
    return run(sizes, kinds, args.reps, args.dir, args.growth_chart, args.json, args.taskset_mb,
               host_backed=not args.leave_page_reporting)


if __name__ == "__main__":
    sys.exit(main())
