"""Human text of the machine and job commands: doctor, ps, run, and the schedules.

The reports (ops.doctor.DoctorReport, gpu.procs.GpuProcessList, ops.schedule's records)
keep only their data; the tables are made here.
"""

from __future__ import annotations

from typing import Any

from gpusnap.render import human_bytes, plain

STATUS_STYLE = {"ok": "green", "info": "cyan", "warn": "yellow", "fail": "bold red"}


# ---------------------------------------------------------------- doctor

def doctor_table(report) -> Any:
    """A rich Table of every check."""
    from rich.table import Table
    from rich.text import Text

    title = "gpusnap doctor" + (f" — PID {report.pid}" if report.pid is not None else "")
    t = Table(title=title, show_lines=False, expand=False)
    t.add_column("", no_wrap=True)
    t.add_column("check", no_wrap=True)
    t.add_column("detail", overflow="fold")
    t.add_column("fix", style="dim", overflow="fold")
    for c in report.checks:
        t.add_row(Text(c.status, style=STATUS_STYLE[c.status]), c.name, plain(c.detail), plain(c.fix or ""))
    return t


def doctor_text(report) -> str:
    """Every check as plain lines (for logs and test messages)."""
    lines = []
    for c in report.checks:
        lines.append(f"[{c.status:>4}] {c.name}: {c.detail}")
        if c.fix:
            lines.append(f"       fix: {c.fix}")
    return "\n".join(lines)


def doctor(report, o) -> None:
    """What `gpusnap doctor` shows: the table, then the verdict."""
    o.out.print(doctor_table(report))
    counts = {s: sum(1 for c in report.checks if c.status == s) for s in report.STATUSES}
    verdict = ("[bold red]a dump will fail until the 'fail' items are fixed[/]" if not report.ok
               else "[green]ready[/]" if counts["warn"] == 0 else "[yellow]ready, with warnings[/]")
    o.out.print(f"{verdict} ({counts['ok']} ok, {counts['info']} info, {counts['warn']} warn, "
                f"{counts['fail']} fail)")


# ---------------------------------------------------------------- ps

def gpu_processes(listing, o) -> None:
    """`gpusnap ps`: the driver, then one row per process using a GPU."""
    from rich.table import Table

    console = o.out
    drv = getattr(listing, "driver", None)
    if drv is not None:
        console.print(plain(drv.summary()) if drv.available else f"[yellow]{drv.summary()}[/]")
    if not listing:
        console.print("no process uses an NVIDIA GPU")
        return
    t = Table(show_header=True, header_style="bold")
    for col in ("PID", "user", "GPUs", "GPU memory", "CUDA state", "notes", "command"):
        t.add_column(col, overflow="fold")
    for g in listing:
        gpus = ", ".join(f"#{x['index']}" if x.get("index") is not None else f"/dev/nvidia{x['minor']}"
                         for x in g.gpus) or ("(driver only)" if g.uses_gpu else "-")
        notes = [n for n, on in (("MIG", g.mig), ("NCCL", g.nccl), ("NVML", g.nvml)) if on]
        if g.libcuda and not g.uses_gpu:
            notes.append("libcuda loaded, no device open")
        state = g.state or ("-" if not g.uses_gpu else "unknown")
        t.add_row(str(g.pid), g.user or "?", gpus, human_bytes(g.memory_bytes), state,
                  ", ".join(notes), plain((g.cmdline or g.comm)[:80]))
    console.print(t)


# ---------------------------------------------------------------- run and schedules

def job_started(job, o) -> None:
    o.out.print(job.pid)
    o.err.print(f"job {job.name} started (PID {job.pid}); output in {job.dir}; "
                f"snapshot it with `gpusnap dump --name {job.name}`", markup=False)


def schedule_added(s, o) -> None:
    o.out.print(f"{s.name}: {s.when}, {s.job} (user {s.user}), repository {s.repo}, "
                f"keep {s.keep_last}", markup=False)
    o.out.print(f"  {s.backend}: {', '.join(s.files)}; log {s.log}", markup=False)
    moved = getattr(s, "replaced_repo", None)
    if moved:
        o.err.print(f"[yellow]note: this schedule used repository {moved} before[/]")


def schedules(items: list[dict[str, Any]], o) -> None:
    """`gpusnap schedule ls`: when, last run, result, next run; a job gone for runs in a row."""
    if not items:
        o.err.print("no schedules")
        return
    from rich.table import Table

    table = Table(box=None)
    for col in ("name", "when", "user", "job PID", "last run (UTC)", "result", "next run (UTC)", "repository"):
        table.add_column(col)
    for st in items:
        result = st["result"] or "-"
        if st["job_gone"]:
            result = f"JOB GONE ({st['runs_without_job']} runs)"
        elif not st["installed"]:
            result += " (NOT INSTALLED)"
        if st.get("running_since"):
            result += f" (a run under way since {st['running_since']})"
        table.add_row(st["name"], st["when"], st["user"], str(st.get("job_pid") or "-"), st["last_run"] or "never", result,
                      st["next_run"] or "-", plain(st["repo"]))
    o.out.print(table)


def schedule_removed(s, o) -> None:
    o.out.print(f"removed schedule {s.name} ({', '.join(s.files)})", markup=False)


def schedule_ran(rec: dict[str, Any], o) -> None:
    o.out.print(rec.get("snapshot", ""), markup=False)
