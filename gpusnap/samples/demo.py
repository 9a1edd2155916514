"""`make demo`: snapshot a running sample job, kill it, restore it, and show that it finishes
with exactly the result of an uninterrupted run, with the snapshots' figures.

    python -m gpusnap.samples.demo [--mb 256] [--repo DIR] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gpusnap.ops.dump import DumpRequest, dump
from gpusnap.errors import GpusnapError
from gpusnap.ops.restore import restore
from gpusnap.repo.repository import Repository
from gpusnap.samples.job import steps_done

console = Console(highlight=False)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def _job_cmd(out: Path, args) -> list[str]:
    return [sys.executable, "-m", "gpusnap.samples.job", str(out), "--steps", str(args.steps),
            "--mb", str(args.mb), "--threads", "3"]


def _wait_for(path: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text().strip()
        time.sleep(0.1)
    raise SystemExit(f"demo: {path} did not appear within {timeout:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=int, default=256, help="memory the sample job holds")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--repo", type=Path, help="repository to use [default: a fresh temporary one]")
    ap.add_argument("--keep", action="store_true", help="keep the temporary repository")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="gpusnap-demo-"))
    repo = args.repo or work / "repo"
    try:
        # the demo's own repository, made here as `gpusnap init` would (dump makes none outside
        # the default location, so that a mistyped --repo is an error)
        Repository.open(repo, create=True)
        console.rule("[bold]gpusnap demo")
        console.print(f"sample job: {args.mb} MiB of memory (random, repetitive, zeroed, sparse), "
                      f"3 threads, a child over pipes, a growing log; {args.steps} steps")
        t = time.monotonic()
        subprocess.run(_job_cmd(work / "reference", args) + ["--step-ms", "0"], check=True,
                       stdin=subprocess.DEVNULL)
        expected = (work / "reference" / "result").read_text().strip()
        console.print(f"1. uninterrupted run: result [cyan]{expected[:16]}…[/] ({time.monotonic() - t:.1f} s)")

        out = work / "job"
        out.mkdir()
        with open(out / "stdio.txt", "wb") as stdio:
            job = subprocess.Popen(_job_cmd(out, args) + ["--step-ms", "15"], stdin=subprocess.DEVNULL,
                                   stdout=stdio, stderr=stdio, start_new_session=True)
        while steps_done(out) < args.steps // 5:
            if job.poll() is not None:
                raise SystemExit("demo: the sample job died early: " + (out / "stdio.txt").read_text())
            time.sleep(0.05)
        pids = [int(x) for x in (out / "pid").read_text().split()]
        console.print(f"2. job running as PID {job.pid}, at step {steps_done(out)}")

        first = dump(DumpRequest(pid=job.pid, repo=repo, name="demo"))
        at = steps_done(out)
        console.print(f"3. dumped at step ~{at} in {first.seconds:.2f} s → {first.snapshot}")
        time.sleep(0.5)
        second = dump(DumpRequest(pid=job.pid, repo=repo, name="demo"))
        console.print(f"4. dumped again (incremental by content) in {second.seconds:.2f} s; "
                      f"job still running: {second.job_running}, now at step {steps_done(out)}")

        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        job.wait()
        console.print("5. [red]killed[/] the job (parent and child), as a crash would")
        time.sleep(0.2)

        restored = restore(second.snapshot)
        console.print(f"6. restored the second snapshot in {restored.seconds:.2f} s as PID {restored.pid}")
        got = _wait_for(out / "result", timeout=600)
        ok = got == expected
        console.print(f"7. restored job finished: result [cyan]{got[:16]}…[/] "
                      + ("[bold green]identical to the uninterrupted run[/]" if ok else "[bold red]DIFFERENT[/]"))

        table = Table(title="snapshots", show_lines=False)
        for col in ("", "pages", "zero", "dedup", "from CRIU", "stored", "stored/CRIU", "time"):
            table.add_column(col, justify="right")
        for label, r in (("first", first), ("second", second)):
            table.add_row(label, f"{r.pages_total:,}", f"{r.pages_zero:,}", f"{r.pages_dedup:,}",
                          _mib(r.bytes_raw), _mib(r.bytes_stored),
                          f"{r.bytes_stored / r.bytes_raw:.1%}" if r.bytes_raw else "-", f"{r.seconds:.2f} s")
        console.print(table)
        where = (f"repository: {repo}" if (args.keep or args.repo)
                 else "the temporary repository is removed now (--keep keeps it)")
        console.print(f"restore: {restored.seconds:.2f} s; {where}")
        return 0 if ok else 1
    except GpusnapError as e:
        console.print(f"[bold red]demo failed: {e.message}[/]")
        if e.hint:
            console.print(f"hint: {e.hint}")
        return e.exit_code
    finally:
        if not args.keep and not args.repo:
            shutil.rmtree(work, ignore_errors=True)
        elif args.keep:
            console.print(f"kept {work}")


if __name__ == "__main__":
    sys.exit(main())
