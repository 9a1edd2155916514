"""The `gpusnap` command line: parse, call the library, print. No logic lives here.

Errors from the library (gpusnap.errors) are turned into a message and an exit code in one
place, `main()`. `--json` prints exactly one JSON object on stdout (an error object on failure).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from gpusnap import __version__
from gpusnap.errors import CriuFailed, GpusnapError, UsageError

app = typer.Typer(
    name="gpusnap",
    help="Transparent snapshots of running processes, GPU state included, with CRIU.\n\n"
         "Dump a running job (it keeps running), restore it after a crash, reboot or preemption, "
         "and keep a deduplicated history of snapshots in one repository.",
    no_args_is_help=True,
    add_completion=False,  # completions: the shipped scripts in completions/ (gpusnap/completion.py)
    context_settings={"help_option_names": ["-h", "--help"]},
    rich_markup_mode="rich",
    pretty_exceptions_show_locals=False,  # locals may hold job memory: never print them
)
schedule_app = typer.Typer(help="Periodic snapshots from cron, with retention.", no_args_is_help=True)
app.add_typer(schedule_app, name="schedule")

out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False, soft_wrap=True)
_json_mode = False
_json_emitted = False

# readable=False: gpusnap checks access itself (access.py), with its own error and hint
RepoOpt = typer.Option(None, "--repo", metavar="DIR", envvar="GPUSNAP_REPO", show_envvar=True, readable=False,
                       help="Repository directory (default /var/lib/gpusnap).")
JsonOpt = typer.Option(False, "--json", help="Print one JSON object on stdout, nothing else.")


def _emit_json(obj) -> None:
    global _json_emitted
    if _json_emitted:  # one object per command, whatever happens after the first
        return
    _json_emitted = True
    sys.stdout.write(json.dumps(obj, indent=None, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def _human(n: float) -> str:
    from gpusnap.render import human_bytes

    return human_bytes(n)


def _repo_root(repo: Optional[Path], write: bool = False) -> Path:
    """The repository directory, after checking that this user may read (or change) it."""
    from gpusnap.system import access
    from gpusnap.repo import locate

    root = locate.repo_path(repo)
    access.check_repo(root, write=write)
    return root


def _open_repo(repo: Optional[Path], write: bool = False):
    from gpusnap.repo.repository import Repository

    return Repository.open(_repo_root(repo, write=write))


def _open_snapshot(ref: str, repo: Optional[Path]):
    from gpusnap.system import access
    from gpusnap.repo import locate

    access.check_snapshot_ref(ref, locate.repo_path(repo))
    return locate.open_snapshot(ref, repo)


def _progress(label: str, enabled: bool):
    """A rich progress bar on a terminal; a no-op callback otherwise."""
    if not enabled or not err.is_terminal:
        return None, None
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                               TransferSpeedColumn)

    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeElapsedColumn(), console=err, transient=True)
    task = bar.add_task(label, total=None)
    shown = [None]

    def update(done: int, total: int, phase: str | None = None) -> None:
        if phase != shown[0]:      # dump: "frozen" (staging), then "storing" (the job runs again)
            shown[0] = phase
            desc = {"frozen": f"{label}: job frozen, staging",
                    "storing": f"{label}: job running, storing"}.get(phase or "", label)
            bar.update(task, description=desc, completed=0)
        bar.update(task, completed=done, total=max(total, done) or None)

    return bar, update


def _resolve_pid(pid: Optional[int], match: Optional[str], pidfile: Optional[Path],
                 user: Optional[str] = None, name: Optional[str] = None, repo: Optional[Path] = None) -> int:
    given = [x is not None for x in (pid, match, pidfile)]
    if sum(given) == 0 and name:  # a job started with `gpusnap run --name NAME`
        from gpusnap.ops import jobrun
        from gpusnap.repo import locate

        return jobrun.find(name, locate.repo_path(repo)).pid
    if sum(given) != 1:
        raise UsageError("give exactly one of PID, --match PATTERN or --pidfile FILE "
                         "(or --name N of a job started with `gpusnap run`)")
    if pidfile is not None:
        try:
            return int(pidfile.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            raise UsageError(f"--pidfile {pidfile}: no PID could be read from it") from None
    if match is not None:
        from gpusnap.ops import validate

        return validate.find_job(match, None if user is None else validate.resolve_user(user))
    return pid  # type: ignore[return-value]


@app.command()
def dump(
    pid: Optional[int] = typer.Argument(None, help="Root of the process tree to snapshot."),
    match: Optional[str] = typer.Option(None, "--match", metavar="PATTERN",
                                        help="Find the job by a regular expression on its command line."),
    pidfile: Optional[Path] = typer.Option(None, "--pidfile", metavar="FILE", readable=False,
                                            help="Read the PID from FILE."),
    user: Optional[str] = typer.Option(None, "--user", metavar="USER|UID",
                                       help="With --match: only this user's processes."),
    repo: Optional[Path] = RepoOpt,
    name: Optional[str] = typer.Option(None, "--name", help="Snapshot name (default: the job's command name)."),
    exit_: bool = typer.Option(False, "--exit", help="Stop the job once the snapshot is safely stored."),
    compress: str = typer.Option("auto", "--compress", metavar="auto|lz4|zstd|none",
                                 help="Codec for new pages (auto: lz4, or byte-shuffled zstd for float data)."),
    keep_last: Optional[int] = typer.Option(None, "--keep-last", metavar="N", min=1,
                                            help="Afterwards, keep only the newest N snapshots of this name."),
    lock_timeout: Optional[int] = typer.Option(None, "--gpu-lock-timeout", metavar="MS", min=1,
                                               help="How long to wait for running GPU work to drain."),
    tcp_established: bool = typer.Option(False, "--tcp-established",
                                         help="Dump established TCP connections (restore needs the same IPs)."),
    json_: bool = JsonOpt,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the snapshot directory."),
    staging_budget: Optional[str] = typer.Option(
        None, "--staging-budget", metavar="SIZE",
        help="Memory for CRIU's bytes while the job is frozen (e.g. 512M); beyond it they spill to a "
             "file in the repository. Default: a quarter of the available memory, at most 2G."),
) -> None:
    """Snapshot a running process tree. The job keeps running unless --exit.

    Prints the snapshot directory. Every dump is incremental: pages already in the
    repository, from any earlier snapshot, are not stored again.
    """
    global _json_mode
    _json_mode = json_
    from gpusnap.repo import locate
    from gpusnap.ops.dump import DumpRequest, dump as do_dump

    if user is not None and match is None:
        raise UsageError("--user only narrows --match")
    target = _resolve_pid(pid, match, pidfile, user, name, repo)
    budget = None
    if staging_budget is not None:
        from gpusnap.repo.pipeline.staging import parse_size

        try:
            budget = parse_size(staging_budget)
        except ValueError as e:
            raise UsageError(f"--staging-budget: {e}") from None
    req = DumpRequest(pid=target, repo=locate.repo_path(repo), name=name, leave_running=not exit_,
                      compress=compress, lock_timeout_ms=lock_timeout, tcp_established=tcp_established,
                      keep_last=keep_last, staging_budget=budget)
    bar, update = _progress(f"dumping {target}", not (json_ or quiet))
    if bar:
        with bar:
            result = do_dump(req, progress=update)
    else:
        result = do_dump(req)
    data = result.to_dict()
    from gpusnap.ops.dump import retention_error

    failed = retention_error(result)
    if json_:
        if failed is not None:
            data.update({"error": failed.title, "message": failed.message, "exit_code": failed.exit_code,
                         "hint": failed.hint})
        _emit_json(data)
        if failed is not None:
            raise typer.Exit(failed.exit_code)
        return
    out.print(result.snapshot, markup=False)
    for w in result.prune_warnings:   # stderr even with --quiet: a cron log must show it
        err.print(f"gpusnap: warning: retention: {w}", style="yellow", markup=False)
    if failed is not None:
        raise failed
    if not quiet and err.is_terminal:
        ratio = result.bytes_stored / result.bytes_raw if result.bytes_raw else 0
        err.print(f"[green]snapshot {result.name} ({result.id})[/]: {result.pages_total} pages "
                  f"({result.pages_zero} zero, {result.pages_dedup} already stored), "
                  f"{_human(result.bytes_raw)} from CRIU, {_human(result.bytes_stored)} stored "
                  f"({ratio:.1%}), {result.seconds:.2f} s"
                  + (f" (job frozen {result.frozen_seconds:.2f} s)" if result.frozen_seconds is not None else "")
                  + "; job "
                  f"{'still running' if result.job_running else 'stopped'}")


@app.command()
def restore(
    snapshot: str = typer.Argument(..., metavar="DIR|NAME", help="Snapshot directory, or a name/id in --repo."),
    repo: Optional[Path] = RepoOpt,
    gpu_map: Optional[str] = typer.Option(None, "--gpu-map", metavar="OLD=NEW[,...]",
                                          help="Put the snapshot's GPUs on other GPUs (indices or UUIDs)."),
    json_: bool = JsonOpt,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the PID."),
    via: str = typer.Option("auto", "--via", metavar="auto|stream|files",
                            help="How CRIU reads the images: through a stream, or from image files written "
                                 "to tmpfs or the repository's disk (auto: the stream, unless files "
                                 "are needed: huge pages)."),
    tcp_close: bool = typer.Option(False, "--tcp-close",
                                   help="Restore established TCP connections closed (the job sees a reset "
                                        "and reconnects); the default when their peer is gone."),
) -> None:
    """Restore a snapshot, detached. Prints the restored root PID.

    Every page is checked against its checksum; a damaged snapshot is refused before the
    job runs.
    """
    global _json_mode
    _json_mode = json_
    from gpusnap.ops.restore import restore as do_restore

    bar, update = _progress("restoring", not (json_ or quiet))
    if bar:
        with bar:
            result = do_restore(snapshot, repo=repo, gpu_map=gpu_map, progress=update, tcp_close=tcp_close,
                                via=via)
    else:
        result = do_restore(snapshot, repo=repo, gpu_map=gpu_map, tcp_close=tcp_close, via=via)
    if json_:
        _emit_json(result.to_dict())
    else:
        for note in result.notes:
            err.print(f"[yellow]note:[/] {note}")
        out.print(result.pid)
        if result.tcp_closed and not quiet:
            err.print(f"TCP connections restored closed ({result.tcp_closed}): the job sees a reset")


@app.command("ls")
def ls_cmd(
    repo: Optional[Path] = RepoOpt,
    name: Optional[str] = typer.Option(None, "--name", help="Only snapshots with this name."),
    json_: bool = JsonOpt,
) -> None:
    """List snapshots with their unique and shared sizes, and the repository's totals."""
    global _json_mode
    _json_mode = json_
    from gpusnap.repo.maint import usage as repo_inspect
    from gpusnap.repo.repository import Repository

    root = _repo_root(repo)
    rows = []
    totals = {"snapshots": 0, "names": 0, "bytes_raw": 0, "bytes_stored": 0, "ratio": None}
    if os.path.lexists(root):     # a file, or a directory that is no repository: an error, not "empty"
        repository = Repository.open(root)
        usage = repository.usage()
        totals = repo_inspect.repo_totals(repository, usage)
        for dirname, row in usage.items():
            if name is None or row.get("name") == name:
                rows.append({"dir": dirname, "path": str(root / "snapshots" / dirname), **row})
        rows.sort(key=lambda r: (r.get("created", 0), r["dir"]))
    if json_:
        _emit_json({"repository": str(root), "snapshots": rows, "totals": totals})
        return
    if not rows:
        err.print(f"no snapshots{f' named {name!r}' if name else ''} in {root}", markup=False)
    else:
        from gpusnap.render import plain, utc

        table = Table(box=None)
        for col in ("snapshot", "name", "id", "created (UTC)", "from CRIU", "unique", "shared"):
            table.add_column(col, justify="right" if col in ("from CRIU", "unique", "shared") else "left")
        for r in rows:
            table.add_row(plain(r["dir"]), plain(r.get("name", "")), str(r.get("id", ""))[:12],
                          utc(r.get("created", 0)), _human(r.get("bytes_raw", 0)),
                          _human(r.get("bytes_unique", 0)), _human(r.get("bytes_shared", 0)))
        out.print(table)
    if totals["snapshots"]:
        ratio = f" ({totals['ratio']:.1%} of what CRIU produced)" if totals.get("ratio") else ""
        err.print(f"{totals['snapshots']} snapshot(s) of {totals['names']} name(s): "
                  f"{_human(totals['bytes_raw'])} from CRIU, {_human(totals['bytes_stored'])} "
                  f"in the repository{ratio}", markup=False)


@app.command()
def inspect(
    snapshot: str = typer.Argument(..., metavar="DIR|NAME"),
    repo: Optional[Path] = RepoOpt,
    images: bool = typer.Option(False, "--images", help="Also list CRIU's image files with their page statistics."),
    json_: bool = JsonOpt,
) -> None:
    """Show a snapshot: processes with command lines and cwd, open files (do they still match
    the disk?), sockets, memory, page statistics, sizes, GPU information."""
    global _json_mode
    _json_mode = json_
    from gpusnap.ops import describe

    repository, snap = _open_snapshot(snapshot, repo)
    report = describe.describe(repository, snap)
    if json_:
        _emit_json(report)
        return
    describe.render(report, out, images=images)


@app.command()
def verify(
    snapshot: Optional[str] = typer.Argument(None, metavar="[DIR|NAME]", help="Only this snapshot."),
    repo: Optional[Path] = RepoOpt,
    structure_only: bool = typer.Option(False, "--structure-only", help="Skip reading back every stored byte."),
    json_: bool = JsonOpt,
) -> None:
    """Check every checksum. Exit 0 only when all holds; otherwise name what is damaged."""
    global _json_mode
    _json_mode = json_
    from gpusnap.errors import CorruptSnapshot
    from gpusnap.repo.maint import verify as verify_mod

    if snapshot:
        repository, snap = _open_snapshot(snapshot, repo)
        refs = [str(snap.path)]
    else:
        repository, refs = _open_repo(repo), None
    # a prune deleting snapshots while verify reads them must not look like damage: wait for it
    with repository.readers_lock():
        report = verify_mod.verify(repository, refs, read_data=not structure_only)
    data = report.to_dict()
    failure = None
    if not report.ok:
        failure = CorruptSnapshot(report.summary(), hint="restore from an intact snapshot; "
                                                         "`gpusnap forget` the damaged ones, then `gpusnap prune`")
        data.update({"error": failure.title, "message": failure.message, "exit_code": failure.exit_code,
                     "hint": failure.hint})
    if json_:
        _emit_json(data)  # the report carries the error: still one object
    else:
        for line in report.lines():
            (out if report.ok else err).print(line, markup=False)
    if failure is not None:
        raise failure


KeepLastHelp = ("Keep the newest N snapshots of each name (only of --name NAME when given); "
                "0 deletes them all and needs --name and --all.")


@app.command()
def repair(
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="Say what would change; change nothing."),
    read_data: bool = typer.Option(False, "--read-data",
                                   help="Decompress and check every blob, not only the packs' names."),
    repo: Optional[Path] = RepoOpt,
    json_: bool = JsonOpt,
) -> None:
    """Rebuild the index from the packs; set aside index files that name missing data.

    The packs are the truth: what they hold is indexed again, index files that are damaged
    or name data in no pack go to REPO/quarantine/. No pack is deleted. Exit 19 when some
    snapshot still needs data that no pack holds.
    """
    global _json_mode
    _json_mode = json_
    from gpusnap.repo import locate
    from gpusnap.errors import DamageRemains
    from gpusnap.repo.maint import repair as repair_mod
    from gpusnap.repo.repository import Repository

    report = repair_mod.repair(Repository.open(locate.repo_path(repo)), dry_run=dry_run, read_data=read_data)
    if json_:
        _emit_json(report.to_dict())      # one object: the report says what is damaged
        if not report.ok:
            raise typer.Exit(DamageRemains.exit_code)
        return
    for line in report.lines():
        (out if report.ok else err).print(line)
    if not report.ok:
        raise DamageRemains(f"snapshots still damaged: {', '.join(sorted(report.snapshots_damaged))}",
                            hint="their data is in no pack; restore another snapshot, or prune them")


@app.command()
def prune(
    keep_last: Optional[int] = typer.Option(None, "--keep-last", metavar="N", min=0, help=KeepLastHelp),
    name: Optional[str] = typer.Option(None, "--name", help="Only snapshots with this name."),
    all_: bool = typer.Option(False, "--all", help="Allow --keep-last 0: delete every snapshot of --name."),
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="Say what would go; change nothing."),
    repo: Optional[Path] = RepoOpt,
    json_: bool = JsonOpt,
) -> None:
    """Free the stored data no snapshot needs; with --keep-last, first delete old snapshots.

    `gpusnap forget` drops chosen snapshots; prune then frees their data.
    """
    global _json_mode
    _json_mode = json_
    from gpusnap.ops import forget as forget_mod
    from gpusnap.repo.maint import prune as prune_mod

    forget_mod.check_retention(keep_last, name, all_, "prune")
    if all_ and keep_last not in (None, 0):
        raise UsageError("--all goes with --keep-last 0 (or without --keep-last): it deletes every snapshot of --name")
    if all_ and keep_last is None:
        keep_last = 0
        forget_mod.check_retention(keep_last, name, all_, "prune")
    result = prune_mod.run(_open_repo(repo, write=not dry_run), keep_last=keep_last, name=name, dry_run=dry_run)
    data = result.to_dict()
    if json_:
        _emit_json(data)
        return
    for line in result.lines():
        out.print(line, markup=False)
    for why in data.get("unreadable", []):
        err.print(f"gpusnap: warning: left alone: {why}", style="yellow", markup=False)
    if data.get("data_kept"):
        err.print(f"gpusnap: warning: {data['data_kept']} (`gpusnap forget DIR` drops a snapshot beyond repair)",
                  style="yellow", markup=False)


@app.command()
def forget(
    snapshots: Optional[list[str]] = typer.Argument(None, metavar="[SNAP]...",
                                                    help="Snapshot directories, directory names or ids."),
    name: Optional[str] = typer.Option(None, "--name", help="With --keep-last: only snapshots of this name."),
    keep_last: Optional[int] = typer.Option(None, "--keep-last", metavar="N", min=0, help=KeepLastHelp),
    all_: bool = typer.Option(False, "--all", help="Forget every snapshot of --name."),
    prune_: bool = typer.Option(False, "--prune", help="Then free the data nothing needs any more."),
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="Say what would go; change nothing."),
    repo: Optional[Path] = RepoOpt,
    json_: bool = JsonOpt,
) -> None:
    """Drop snapshots: the named ones, or all but the newest N of each name.

    Their data stays in the repository until `gpusnap prune` (or `--prune`) frees what no
    remaining snapshot needs.
    """
    global _json_mode
    _json_mode = json_
    from gpusnap.ops import forget as forget_mod

    repository = _open_repo(repo, write=not dry_run)
    result = forget_mod.forget(repository, list(snapshots or []), name=name, keep_last=keep_last, all_=all_,
                               dry_run=dry_run, prune=prune_)
    if json_:
        _emit_json(result.to_dict())
        return
    for line in result.lines():
        out.print(line, markup=False)


@app.command("export")
def export_cmd(
    snapshot: str = typer.Argument(..., metavar="DIR|NAME", help="The snapshot to export."),
    output: str = typer.Option(..., "--output", "-o", metavar="FILE|-", help="Where to write it ('-': stdout)."),
    repo: Optional[Path] = RepoOpt,
    json_: bool = JsonOpt,
) -> None:
    """Write one snapshot as one self-contained, checksummed file (or to stdout with -o -)."""
    global _json_mode
    _json_mode = json_
    from gpusnap.ops import exchange

    if output == "-" and json_:
        raise UsageError("--json and -o - both want stdout", hint="write the export to a file, or drop --json")
    _, snap = _open_snapshot(snapshot, repo)
    result = exchange.export_snapshot(snap, output)
    if json_:
        _emit_json(result)
    elif output != "-":
        out.print(f"{result['file']}: {result['name']} ({result['id']}), {_human(result['bytes'])} "
                  f"for {_human(result['bytes_raw'])} from CRIU", markup=False)


@app.command("import")
def import_cmd(
    file: str = typer.Argument(..., metavar="FILE|-", help="An export file ('-': stdin)."),
    repo: Optional[Path] = RepoOpt,
    json_: bool = JsonOpt,
) -> None:
    """Add an exported snapshot to this repository (deduplicated). Checks every checksum
    first: a damaged or truncated file is refused and nothing of it is kept."""
    global _json_mode
    _json_mode = json_
    from gpusnap.system import access
    from gpusnap.ops import exchange
    from gpusnap.repo import locate
    from gpusnap.repo.repository import Repository

    if file != "-":
        access.check_readable_file(Path(file), "export file")
    root = locate.repo_path(repo)
    access.check_repo(root, write=True)
    result = exchange.import_snapshot(lambda: Repository.open(root, create=True), file)
    if json_:
        _emit_json(result)
    else:
        out.print(result["snapshot"], markup=False)


@app.command()
def doctor(
    pid: Optional[int] = typer.Argument(None, help="Also say what would stop a dump of this job."),
    repo: Optional[Path] = RepoOpt,
    json_: bool = JsonOpt,
) -> None:
    """Check CRIU, the kernel, permissions, the plugin, the CUDA driver and the repository's filesystem."""
    global _json_mode
    _json_mode = json_
    from gpusnap.ops import doctor as doctor_mod
    from gpusnap.repo import locate

    report = doctor_mod.run_doctor(pid, repo=locate.repo_path(repo))
    if json_:
        _emit_json(report.to_dict())
    else:
        doctor_mod.render(report, out)
    if not report.ok:
        raise typer.Exit(1)


@app.command()
def ps(json_: bool = JsonOpt) -> None:
    """List processes using NVIDIA GPUs and their CUDA checkpoint state."""
    global _json_mode
    _json_mode = json_
    from gpusnap.gpu import procs

    listing = procs.gpu_processes()
    data = listing.to_dict() if hasattr(listing, "to_dict") else listing
    if json_:
        _emit_json(data)
    else:
        procs.render(listing, out)


@schedule_app.command("add")
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
    repo: Optional[Path] = RepoOpt,
    json_: bool = JsonOpt,
) -> None:
    """Snapshot a job periodically (a systemd timer, or a file in /etc/cron.d), keeping the newest N."""
    global _json_mode
    _json_mode = json_
    from gpusnap.ops import schedule

    s = schedule.add(name, match, every=every, cron=cron, keep_last=keep_last, repo=repo, user=user,
                     replace=replace)
    moved = getattr(s, "replaced_repo", None)
    if json_:
        _emit_json({**s.to_dict(), "replaced_repo": moved})
        return
    out.print(f"{s.name}: {s.when}, job {s.match!r} of user {s.user}, repository {s.repo}, keep {s.keep_last}")
    out.print(f"  {s.backend}: {', '.join(s.files)}; log {s.log}")
    if moved:
        err.print(f"[yellow]note: this schedule used repository {moved} before[/]")


@schedule_app.command("ls")
def schedule_ls(json_: bool = JsonOpt) -> None:
    """List schedules: when, last run, result, next run; a job gone for runs in a row."""
    global _json_mode
    _json_mode = json_
    from gpusnap.ops import schedule

    items = [schedule.status(s) for s in schedule.list_schedules()]
    if json_:
        _emit_json({"schedules": items})
        return
    if not items:
        err.print("no schedules")
        return
    table = Table(box=None)
    for col in ("name", "when", "user", "last run (UTC)", "result", "next run (UTC)", "repository"):
        table.add_column(col)
    for st in items:
        result = st["result"] or "-"
        if st["job_gone"]:
            result = f"JOB GONE ({st['runs_without_job']} runs)"
        elif not st["installed"]:
            result += " (NOT INSTALLED)"
        table.add_row(st["name"], st["when"], st["user"], st["last_run"] or "never", result,
                      st["next_run"] or "-", st["repo"])
    out.print(table)


@schedule_app.command("rm")
def schedule_rm(name: str = typer.Argument(...), json_: bool = JsonOpt) -> None:
    """Remove a schedule (its snapshots stay)."""
    global _json_mode
    _json_mode = json_
    from gpusnap.ops import schedule

    s = schedule.remove(name)
    if json_:
        _emit_json(s.to_dict())
    else:
        out.print(f"removed schedule {s.name} ({', '.join(s.files)})")


@schedule_app.command("run")
def schedule_run(
    name: str = typer.Argument(...),
    config_dir: Optional[Path] = typer.Option(None, "--config-dir", metavar="DIR",
                                              help="Where the schedule's record is (default /etc/gpusnap/schedules)."),
    json_: bool = JsonOpt,
) -> None:
    """Run a schedule once, as its timer or cron line does; logs one JSON line."""
    global _json_mode
    _json_mode = json_
    from gpusnap.ops import schedule

    rec = schedule.run(name, config_dir)
    for w in rec.get("warnings", []):
        err.print(f"[yellow]gpusnap: warning: retention: {w}[/]")
    if json_:
        _emit_json(rec)
    else:
        out.print(rec.get("snapshot", ""))


@app.command(context_settings={"allow_interspersed_args": False})
def run(
    command: list[str] = typer.Argument(..., metavar="-- CMD [ARGS...]", help="The job's command line."),
    name: Optional[str] = typer.Option(None, "--name", help="Job name (default: the command's name); "
                                                             "`dump --name N` and `restore N` find it."),
    repo: Optional[Path] = RepoOpt,
    json_: bool = JsonOpt,
) -> None:
    """Start a job the way that snapshots best (the recommended way to start one).

    The job gets its own session and PID namespace (so a snapshot restores beside the running
    original, without PID clashes); stdout and stderr go to files in REPO/jobs/NAME/.
    Prints the job's PID.
    """
    global _json_mode
    _json_mode = json_
    from gpusnap.ops import jobrun
    from gpusnap.repo import locate

    job = jobrun.start(command, locate.repo_path(repo), name=name)
    if json_:
        _emit_json(job.to_dict())
        return
    out.print(job.pid)
    err.print(f"job {job.name} started (PID {job.pid}); output in {job.dir}; "
              f"snapshot it with `gpusnap dump --name {job.name}`")


@app.command("slurm-run", context_settings={"allow_interspersed_args": False})
def slurm_run(
    command: list[str] = typer.Argument(..., metavar="-- CMD [ARGS...]", help="The job's command line."),
    name: str = typer.Option(..., "--name", help="Job and snapshot name (one per job in the repository)."),
    repo: Optional[Path] = RepoOpt,
    every: Optional[str] = typer.Option(None, "--every", metavar="INTERVAL",
                                        help="Also snapshot periodically (e.g. 10m), so a node failure loses "
                                             "at most one interval."),
    keep_last: Optional[int] = typer.Option(None, "--keep-last", metavar="N", min=1,
                                            help="Keep only the newest N snapshots of this name."),
    resume: str = typer.Option("auto", "--resume", metavar="auto|always|never",
                               help="Restore the newest snapshot of the name: after a Slurm requeue (auto), "
                                    "always, or never."),
    requeue: bool = typer.Option(True, "--requeue/--no-requeue",
                                 help="After the final snapshot, ask Slurm to requeue the job."),
) -> None:
    """Run a batch job that survives preemption, time limits and node failures (inside sbatch).

    Starts the job (or, after a requeue, restores its newest snapshot); on USR1/TERM (use
    `#SBATCH --signal=B:USR1@120`) takes a final snapshot and requeues. Exits with the job's status.
    """
    from gpusnap.repo import locate
    from gpusnap.ops import slurm

    if resume not in ("auto", "always", "never"):
        raise UsageError(f"--resume {resume!r}: use auto, always or never")
    opts = slurm.Options(name=name, repo=locate.repo_path(repo), command=command,
                         every_s=slurm.parse_interval(every) if every else None, keep_last=keep_last,
                         resume=resume, requeue=requeue)
    code = slurm.Supervisor(opts).run()
    raise typer.Exit(code)


@app.callback(invoke_without_command=True)
def _root(
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True),
) -> None:
    if version:
        out.print(f"gpusnap {__version__}")
        raise typer.Exit(0)


def report_error(e: GpusnapError, force_json: bool = False, code: int | None = None) -> None:
    if _json_mode or force_json:
        obj = {"error": e.title, "message": e.message, "exit_code": code or e.exit_code}
        if e.hint:
            obj["hint"] = e.hint
        if isinstance(e, CriuFailed):
            obj["criu_log"] = e.log_path
            obj["criu_errors"] = e.last_lines
        _emit_json(obj)
        return
    from rich.text import Text

    err.print(Text(f"gpusnap: {e.message}", style="bold red"))
    if isinstance(e, CriuFailed):
        for line in e.last_lines:
            err.print(Text(f"  {line}", style="dim"))
        if e.log_path:
            err.print(f"  full CRIU log: {e.log_path}", markup=False)
    if e.hint:
        err.print(Text.assemble(("hint:", "yellow"), " ", e.hint))


def _json_requested(argv: list[str] | None) -> bool:
    args = sys.argv[1:] if argv is None else argv
    return "--json" in args[: args.index("--")] if "--" in args else "--json" in args


def main(argv: list[str] | None = None) -> None:
    """Entry point: the one place where errors become exit codes. With --json every path,
    a bad command line included, prints exactly one JSON object."""
    try:
        from typer._click import exceptions as click_exc    # typer >= 0.22 vendors click
    except ImportError:                                      # pragma: no cover - older typer
        from click import exceptions as click_exc

    try:
        rv = app(args=argv, prog_name="gpusnap", standalone_mode=False)
        if isinstance(rv, int) and rv:
            sys.exit(rv)
    except GpusnapError as e:
        report_error(e)
        sys.exit(e.exit_code)
    except click_exc.ClickException as e:
        if _json_mode or _json_requested(argv):
            report_error(UsageError(e.format_message()), force_json=True)
        else:
            from typer import rich_utils

            rich_utils.rich_format_error(e)
        sys.exit(UsageError.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        if _json_mode:
            report_error(GpusnapError("interrupted"), force_json=True, code=130)
        else:
            err.print("gpusnap: interrupted")
        sys.exit(130)
    except PermissionError as e:  # a last net: never a traceback for a permission problem
        from gpusnap.errors import AccessDenied

        what = e.filename or str(e)
        ad = AccessDenied(f"permission denied: {what}",
                          hint=f"run gpusnap as root (`sudo gpusnap ...`) or as the owner of {what}")
        report_error(ad)
        sys.exit(ad.exit_code)
    except Exception as e:  # a bug: with --json still one object on stdout; the traceback on stderr
        if not (_json_mode or _json_requested(argv)):
            raise
        import traceback

        traceback.print_exc(file=sys.stderr)
        report_error(GpusnapError(f"internal error: {type(e).__name__}: {e}",
                                  hint="please report this with the command and the traceback above"),
                     force_json=True)
        sys.exit(GpusnapError.exit_code)
