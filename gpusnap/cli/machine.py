"""Commands about this machine and its timers: doctor, ps, and the schedule group.

Each parses, calls one library operation, and hands the result to render.machine through
the one output (render.output.OUTPUT).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from gpusnap.cli.common import CopyKeepLastOpt, CopyToOpt, JsonOpt, RepoOpt, repo_path
from gpusnap.render.output import OUTPUT


def doctor(
    pid: Optional[int] = typer.Argument(None, help="Also say what would stop a dump of this job."),
    repo: Optional[Path] = RepoOpt,
    unlock_network: bool = typer.Option(False, "--unlock-network",
                                        help="Lift CRIU network-lock rules that no snapshot of the repository needs."),
    json_: bool = JsonOpt,
) -> None:
    """Check CRIU, the kernel, permissions, the plugin, the CUDA driver and the repository's filesystem."""
    from gpusnap.ops import doctor as doctor_mod
    from gpusnap.render import machine as show

    report = doctor_mod.run_doctor(pid, repo=repo_path(repo), unlock_network=unlock_network)
    OUTPUT.emit(report, lambda: show.doctor(report, OUTPUT))
    if not report.ok:
        raise typer.Exit(1)


def ps(json_: bool = JsonOpt) -> None:
    """List processes using NVIDIA GPUs and their CUDA checkpoint state."""
    from gpusnap.gpu import procs
    from gpusnap.render import machine as show

    listing = procs.gpu_processes()
    OUTPUT.emit(listing, lambda: show.gpu_processes(listing, OUTPUT))


def schedule_add(
    match: Optional[str] = typer.Option(None, "--match", metavar="PATTERN",
                                        help="Regular expression on the job's command line (default: the "
                                             "job started with `gpusnap run --name NAME`)."),
    name: str = typer.Option(..., "--name", help="Schedule name, also the snapshot name ([A-Za-z0-9_-])."),
    every: Optional[str] = typer.Option(None, "--every", metavar="30m|2h|1d", help="How often."),
    cron: Optional[str] = typer.Option(None, "--cron", metavar="'M H DOM MON DOW'", help="Or a cron expression."),
    keep_last: int = typer.Option(4, "--keep-last", metavar="N", min=1, help="Snapshots of this name to keep."),
    user: Optional[str] = typer.Option(None, "--user", metavar="USER|UID",
                                       help="Owner of the job (default: whoever owns what --match finds now); "
                                            "only this user's processes are ever dumped."),
    replace: bool = typer.Option(False, "--replace", help="Overwrite an existing schedule of this name."),
    container: Optional[str] = typer.Option(None, "--container", metavar="NAME|ID",
                                            help="Snapshot a Podman or Docker container (as `dump --container`)."),
    engine: Optional[str] = typer.Option(None, "--engine", metavar="podman|docker",
                                         help="With --container: the engine that has it (default: the one that knows it)."),
    repo: Optional[Path] = RepoOpt,
    copy_to: Optional[str] = CopyToOpt,
    copy_keep_last: Optional[int] = CopyKeepLastOpt,
    json_: bool = JsonOpt,
) -> None:
    """Snapshot a job periodically (a systemd timer, or a file in /etc/cron.d), keeping the newest N."""
    from gpusnap.ops import schedule
    from gpusnap.render import machine as show

    s = schedule.add(name, match, every=every, cron=cron, keep_last=keep_last, repo=repo, user=user,
                     replace=replace, container=container, engine=engine, copy_to=copy_to,
                     copy_keep_last=copy_keep_last)
    OUTPUT.emit({**s.to_dict(), "replaced_repo": getattr(s, "replaced_repo", None)},
                lambda: show.schedule_added(s, OUTPUT))


def schedule_ls(json_: bool = JsonOpt) -> None:
    """List schedules: when, last run, result, next run; a job gone for runs in a row."""
    from gpusnap.ops import ls
    from gpusnap.render import machine as show

    items = ls.schedules()
    OUTPUT.emit({"schedules": items}, lambda: show.schedules(items, OUTPUT))


def schedule_rm(name: str = typer.Argument(...), json_: bool = JsonOpt) -> None:
    """Remove a schedule (its snapshots stay)."""
    from gpusnap.ops import schedule
    from gpusnap.render import machine as show

    s = schedule.remove(name)
    OUTPUT.emit(s, lambda: show.schedule_removed(s, OUTPUT))


def schedule_run(
    name: str = typer.Argument(...),
    config_dir: Optional[Path] = typer.Option(None, "--config-dir", metavar="DIR",
                                              help="Where the schedule's record is (default /etc/gpusnap/schedules)."),
    json_: bool = JsonOpt,
) -> None:
    """Run a schedule once, as its timer or cron line does; logs one JSON line."""
    from gpusnap.ops import schedule
    from gpusnap.render import machine as show

    rec = schedule.run(name, config_dir)
    for w in rec.get("warnings", []):
        OUTPUT.warn(f"retention: {w}")
    OUTPUT.emit(rec, lambda: show.schedule_ran(rec, OUTPUT))
