"""Commands that make and use snapshots of jobs: dump, restore, export, import, copy (and serve,
its other end), run, slurm-run.

Each parses, calls one library operation (gpusnap.ops), and hands the result to
render.snapshots / render.machine through the one output (render.output.OUTPUT).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Optional

import typer

from gpusnap.cli.common import (CopyKeepLastOpt, CopyToOpt, JsonOpt, LockWaitOpt, PruneUncopiedOpt, RepoOpt, repo_path,
                                open_snapshot, resolve_pid, with_progress)
from gpusnap.errors import UsageError
from gpusnap.render.output import OUTPUT


def dump(
    pid: Optional[int] = typer.Argument(None, help="Root of the process tree to snapshot."),
    container: Optional[str] = typer.Option(None, "--container", metavar="NAME|ID",
                                            help="Snapshot a Podman or Docker container through its engine's checkpoint."),
    engine: Optional[str] = typer.Option(None, "--engine", metavar="podman|docker",
                                         help="With --container: the engine that has it (default: the one that knows it)."),
    match: Optional[str] = typer.Option(None, "--match", metavar="PATTERN",
                                        help="Find the job by a regular expression on its command line."),
    pidfile: Optional[Path] = typer.Option(None, "--pidfile", metavar="FILE", readable=False,
                                            help="Read the PID from FILE."),
    user: Optional[str] = typer.Option(None, "--user", metavar="USER|UID",
                                       help="With --match: only this user's processes."),
    repo: Optional[Path] = RepoOpt,
    name: Optional[str] = typer.Option(None, "--name", help="Snapshot name (default: the job's command name)."),
    exit_: bool = typer.Option(False, "--exit", help="Stop the job once the snapshot is safely stored."),
    compress: str = typer.Option("auto", "--compress", metavar="auto|lz4|zstd|shuffle4-zstd|shuffle2-zstd|none",  # = codec.CHOICES (a test checks)
                                 help="Codec for new pages (auto: lz4, or byte-shuffled zstd for float data)."),
    keep_last: Optional[int] = typer.Option(None, "--keep-last", metavar="N", min=1,
                                            help="Afterwards, keep only the newest N snapshots of this name."),
    lock_timeout: Optional[int] = typer.Option(None, "--gpu-lock-timeout", metavar="MS", min=1,
                                               help="How long to wait for running GPU work to drain."),
    tcp_established: bool = typer.Option(False, "--tcp-established",
                                         help="Dump established TCP connections (restore needs the same IPs)."),
    tcp_close: bool = typer.Option(False, "--tcp-close",
                                   help="Do not dump TCP connections: the job keeps them (no network lock), "
                                        "the restored job finds them closed and must reconnect."),
    json_: bool = JsonOpt,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the snapshot directory."),
    staging_budget: Optional[str] = typer.Option(
        None, "--staging-budget", metavar="SIZE",
        help="Memory for CRIU's bytes while the job is frozen (e.g. 512M); beyond it they spill to a "
             "file in the repository. Default: half the available memory (or of what gpusnap's "
             "memory cgroup leaves, where that is less), "
             "at most the job's memory (the choice is in --json's staging.budget_choice)."),
    lock_wait: Optional[float] = LockWaitOpt,
    copy_to: Optional[str] = CopyToOpt,
    copy_keep_last: Optional[int] = CopyKeepLastOpt,
    prune_uncopied: bool = PruneUncopiedOpt,
) -> None:
    """Snapshot a running process tree. The job keeps running unless --exit.

    Prints the snapshot directory. Every dump is incremental: pages already in the
    repository, from any earlier snapshot, are not stored again. With --copy-to the snapshot
    is then copied to a second repository (and every one an earlier dump could not copy);
    an unreachable one is a warning, not a failure (exit 0: the snapshot is kept, marked
    not copied yet).
    """
    from gpusnap.ops.dump import DumpRequest, dump as do_dump, retention_error
    from gpusnap.render import snapshots as show

    if user is not None and match is None:
        raise UsageError("--user only narrows --match")
    if tcp_close and tcp_established:
        raise UsageError("--tcp-close and --tcp-established contradict each other", hint="give one of them")
    if engine is not None and container is None:
        raise UsageError("--engine only says whose --container it is")
    tier = _tier(copy_to, copy_keep_last)
    if container is not None:
        from gpusnap.ops.dump_container import dump_container

        if tier is not None:
            raise UsageError("--container takes no --copy-to yet", hint="dump it, then `gpusnap copy NAME --to REPO`")
        given = [o for o, v in (("PID", pid), ("--match", match), ("--pidfile", pidfile), ("--tcp-close", tcp_close),
                                ("--tcp-established", tcp_established), ("--staging-budget", staging_budget),
                                ("--gpu-lock-timeout", lock_timeout)) if v]
        if given:
            raise UsageError(f"--container takes no {', '.join(given)}: the engine's checkpoint decides them")
        req = DumpRequest(pid=0, repo=repo_path(repo), name=name, leave_running=not exit_, compress=compress,
                          keep_last=keep_last, lock_wait=lock_wait)
        result = with_progress(f"dumping container {container}", not (json_ or quiet),
                               lambda **kw: dump_container(req, container, engine=engine, **kw))
        OUTPUT.emit(result, lambda: show.dump(result, OUTPUT, quiet=quiet), failure=retention_error(result))
        return
    target = resolve_pid(pid, match, pidfile, user, name, repo)
    budget = None
    if staging_budget is not None:
        from gpusnap.staging import parse_size

        try:
            budget = parse_size(staging_budget)
        except ValueError as e:
            raise UsageError(f"--staging-budget: {e}") from None
    req = DumpRequest(pid=target, repo=repo_path(repo), name=name, leave_running=not exit_,
                      compress=compress, lock_timeout_ms=lock_timeout, tcp_established=tcp_established,
                      tcp_close=tcp_close,
                      keep_last=keep_last, staging_budget=budget, lock_wait=lock_wait, prune_uncopied=prune_uncopied)
    if tier is not None:
        from gpusnap.ops import tiers

        do_dump = partial(tiers.dump, tier=tier)
    result = with_progress(f"dumping {target}", not (json_ or quiet), lambda **kw: do_dump(req, **kw))
    OUTPUT.emit(result, lambda: show.dump(result, OUTPUT, quiet=quiet), failure=retention_error(result))


def _tier(copy_to: Optional[str], copy_keep_last: Optional[int]):
    """--copy-to (and --copy-keep-last, which needs it) as an ops.tiers.Tier, or None."""
    from gpusnap.ops.tiers import Tier

    if copy_to is None:
        if copy_keep_last is not None:
            raise UsageError("--copy-keep-last is the retention of --copy-to's repository", hint="give --copy-to REPO")
        return None
    return Tier(to=copy_to, keep_last=copy_keep_last)


def restore(
    snapshot: str = typer.Argument(..., metavar="DIR|NAME", help="Snapshot directory, or a name/id in --repo."),
    repo: Optional[Path] = RepoOpt,
    gpu_map: Optional[str] = typer.Option(None, "--gpu-map", metavar="OLD=NEW[,...]",
                                          help="Put the snapshot's GPUs on other GPUs (indices or UUIDs)."),
    json_: bool = JsonOpt,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the PID."),
    via: str = typer.Option("auto", "--via", metavar="auto|stream|files|lazy",
                            help="How CRIU reads the images: through a stream, or from image files written "
                                 "to tmpfs or the repository's disk (auto: the stream, unless files "
                                 "are needed: huge pages); lazy: the job runs at once and its memory is "
                                 "filled in while it runs (no GPU state; the command returns once every "
                                 "page is in place)."),
    tcp_close: bool = typer.Option(False, "--tcp-close",
                                   help="Restore established TCP connections closed (the job sees a reset "
                                        "and reconnects); the default when their peer is gone."),
    cgroups: Optional[str] = typer.Option(None, "--cgroups", metavar="none|props|soft|full|strict|ignore",
                                          help="How CRIU restores the job's cgroups (its --manage-cgroups "
                                               "mode; default: CRIU's, soft). ignore: the job stays in the "
                                               "cgroups gpusnap restore runs in, none of its own are restored "
                                               "or required (a job that made and moved itself into cgroups "
                                               "of its own)."),
    copy_to: Optional[str] = typer.Option(None, "--copy-to", metavar="REPO|ssh://[USER@]HOST[:PORT]/PATH",
                                          help="Also look in the repository dumps copy to: restore the newest "
                                               "snapshot of NAME that verifies, in either (one on another "
                                               "machine is copied here first)."),
    remote_gpusnap: Optional[str] = typer.Option(None, "--remote-gpusnap", metavar="PATH",
                                                 help="The gpusnap program at an ssh:// --copy-to's end "
                                                      "(default: gpusnap)."),
    lock_wait: Optional[float] = LockWaitOpt,
) -> None:
    """Restore a snapshot, detached. Prints the restored root PID.

    A job that had a terminal (a tmux or screen pane, ssh, a shell's `&` job) gets this
    terminal when run from one (restore then waits until the job ends), else a new tmux
    session gpusnap-NAME (`tmux attach -t gpusnap-NAME`).

    Every page is checked against its checksum; a damaged snapshot is refused before the
    job runs.
    """
    from gpusnap.ops import restore_interrupt
    from gpusnap.ops.restore import note_interrupt, restore as do_restore
    from gpusnap.render import snapshots as show
    from gpusnap.system.faults import fault

    skipped: list[dict] = []
    if copy_to is not None:     # which snapshot, in which repository: the newest that verifies
        from gpusnap.ops import tiers

        repo, snapshot, skipped = tiers.choose(snapshot, repo_path(repo), copy_to, remote_gpusnap, lock_wait)
    with restore_interrupt.guard() as held:    # once the job runs, a signal waits until its PID is out
        result = with_progress("restoring", not (json_ or quiet),
                               lambda **kw: do_restore(snapshot, repo=repo, gpu_map=gpu_map, tcp_close=tcp_close,
                                                       via=via, terminal_want="new" if json_ else "auto",
                                                       cgroups=cgroups, **kw))
        result.notes[:0] = [f"skipped {s['snapshot']}: {s['reason']}" for s in skipped]
        fault("restore:report")
        note_interrupt(held, result)
        OUTPUT.emit(result, lambda: show.restore(result, OUTPUT, quiet=quiet))
    if (result.terminal or {}).get("mode") == "here":   # the job runs in our terminal: wait, as a shell would
        from gpusnap.ops import restore_terminal

        show.restore_ended(result, restore_terminal.stay(result.pid), OUTPUT, quiet=quiet)


def export_cmd(
    snapshot: str = typer.Argument(..., metavar="DIR|NAME", help="The snapshot to export."),
    output: str = typer.Option(..., "--output", "-o", metavar="FILE|-", help="Where to write it ('-': stdout)."),
    repo: Optional[Path] = RepoOpt,
    json_: bool = JsonOpt,
) -> None:
    """Write one snapshot as one self-contained, checksummed file (or to stdout with -o -)."""
    from gpusnap.ops import export as export_op
    from gpusnap.render import snapshots as show

    if output == "-" and json_:
        raise UsageError("--json and -o - both want stdout", hint="write the export to a file, or drop --json")
    _, snap = open_snapshot(snapshot, repo)
    result = export_op.export_snapshot(snap, output)
    OUTPUT.emit(result, lambda: show.exported(result, OUTPUT, to_stdout=output == "-"))


def import_cmd(
    file: str = typer.Argument(..., metavar="FILE|-", help="An export file ('-': stdin)."),
    repo: Optional[Path] = RepoOpt,
    json_: bool = JsonOpt,
    lock_wait: Optional[float] = LockWaitOpt,
) -> None:
    """Add an exported snapshot to this repository (deduplicated). Checks every checksum
    first: a damaged or truncated file is refused and nothing of it is kept."""
    from gpusnap.ops import import_ as import_op
    from gpusnap.render import snapshots as show

    result = import_op.import_file(file, repo_path(repo), lock_wait=lock_wait)
    OUTPUT.emit(result, lambda: show.imported(result, OUTPUT))


def copy_cmd(
    snapshots: Optional[list[str]] = typer.Argument(None, metavar="[SNAP...]", help="Snapshots to copy."),
    to: str = typer.Option(..., "--to", metavar="REPO|ssh://[USER@]HOST[:PORT]/PATH",
                           help="The repository to copy to: a path, or one on another machine through ssh "
                                "('-': speak the copy protocol on stdin and stdout, for a receiver at the "
                                "other end of a pipe)."),
    name: Optional[str] = typer.Option(None, "--name", help="Copy every snapshot of this name."),
    all_: bool = typer.Option(False, "--all", help="Copy every snapshot."),
    pending: bool = typer.Option(False, "--pending",
                                 help="Copy every snapshot a `dump --copy-to` could not copy to --to yet."),
    remote_gpusnap: Optional[str] = typer.Option(None, "--remote-gpusnap", metavar="PATH",
                                                 help="The gpusnap program at the other end (default: gpusnap)."),
    repo: Optional[Path] = RepoOpt,
    json_: bool = JsonOpt,
    lock_wait: Optional[float] = LockWaitOpt,
) -> None:
    """Copy snapshots to another repository, sending only the data it lacks.

    Every page and blob is checked as it arrives; each snapshot is committed there atomically
    and keeps its name and time. Snapshots already there are skipped; an interrupted copy
    resumes without sending again what arrived.
    """
    from gpusnap.ops.copy import CopyRequest, copy
    from gpusnap.render import snapshots as show

    req = CopyRequest(refs=list(snapshots or []), repo=repo_path(repo), to=to, name=name, all=all_,
                      remote_gpusnap=remote_gpusnap, lock_wait=lock_wait, pending=pending)
    if to == "-":       # the sending half on stdin/stdout: a pull from this machine (restore --copy-to ssh://)
        from gpusnap.ops.copy import send_stdio

        raise typer.Exit(send_stdio(req))
    result = with_progress(f"copying to {to}", not json_, lambda **kw: copy(req, **kw))
    OUTPUT.emit(result, lambda: show.copied(result, OUTPUT))


def serve_cmd(
    repo: Optional[Path] = RepoOpt,
    lock_wait: Optional[float] = LockWaitOpt,
) -> None:
    """The receiving end of `gpusnap copy`, on stdin and stdout (copy starts it, also through ssh)."""
    from gpusnap.ops.serve import serve

    raise typer.Exit(serve(repo_path(repo), lock_wait))


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
    from gpusnap.ops import run as run_op
    from gpusnap.render import machine as show

    job = run_op.start(command, repo_path(repo), name=name)
    OUTPUT.emit(job, lambda: show.job_started(job, OUTPUT))


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
    copy_to: Optional[str] = typer.Option(None, "--copy-to", metavar="REPO|ssh://[USER@]HOST[:PORT]/PATH",
                                          help="Copy each snapshot to this (shared) repository after the job "
                                               "runs again; after a requeue, resume from the newest snapshot "
                                               "that verifies here or there (there: a path only)."),
    copy_keep_last: Optional[int] = CopyKeepLastOpt,
) -> None:
    """Run a batch job that survives preemption, time limits and node failures (inside sbatch).

    Starts the job (or, after a requeue, restores its newest snapshot); on USR1/TERM (use
    `#SBATCH --signal=B:USR1@120`) takes a final snapshot and requeues. Exits with the job's status.
    """
    from gpusnap.ops import slurm_run

    if resume not in ("auto", "always", "never"):
        raise UsageError(f"--resume {resume!r}: use auto, always or never")
    tier = _tier(copy_to, copy_keep_last)
    opts = slurm_run.Options(name=name, repo=repo_path(repo), command=command,
                             every_s=slurm_run.parse_interval(every) if every else None, keep_last=keep_last,
                             resume=resume, requeue=requeue, copy_to=tier and tier.destination(),
                             copy_keep_last=copy_keep_last)
    raise typer.Exit(slurm_run.Supervisor(opts).run())
