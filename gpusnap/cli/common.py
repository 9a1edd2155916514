"""What every command shares: the typer apps' settings, the --repo and --json options, the output, and
turning the command line's ways of naming a job or a repository into library arguments.

`--json` sets the output mode as soon as it is parsed (an eager option callback), so an error
raised afterwards, by option checks or by the library, prints as one JSON object too.
Nothing here imports the repository, numpy or CUDA: each command imports what it uses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from gpusnap.errors import UsageError
from gpusnap.render.output import OUTPUT

# the typer apps' settings: cli.build_app() makes the apps from them
APP = dict(
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
SCHEDULE_APP = dict(help="Periodic snapshots from cron, with retention.", no_args_is_help=True)


def _json_mode(value: bool) -> bool:
    OUTPUT.json = bool(value)
    return value


# readable=False: gpusnap checks access itself (access.py), with its own error and hint
RepoOpt = typer.Option(None, "--repo", metavar="DIR", envvar="GPUSNAP_REPO", show_envvar=True, readable=False,
                       help="Repository directory (default /var/lib/gpusnap); also accepted before the "
                            "command: gpusnap --repo DIR COMMAND.")
JsonOpt = typer.Option(False, "--json", help="Print one JSON object on stdout, nothing else.",
                       callback=_json_mode, is_eager=True)
LockWaitOpt = typer.Option(None, "--lock-wait", metavar="SECONDS", min=0.0,
                          help="Wait up to SECONDS for another gpusnap writing to the repository, then exit 10 "
                               "(default: $GPUSNAP_LOCK_WAIT, else 600; 0: fail at once).")
CopyToOpt = typer.Option(None, "--copy-to", metavar="REPO|ssh://[USER@]HOST[:PORT]/PATH",
                         help="Then copy the snapshot to this repository (a shared one), after the job runs "
                              "again; and every snapshot an earlier dump could not copy there.")
CopyKeepLastOpt = typer.Option(None, "--copy-keep-last", metavar="N", min=1,
                               help="After the copy, keep only the newest N snapshots of each name copied "
                                    "in --copy-to's repository.")
PruneUncopiedOpt = typer.Option(False, "--prune-uncopied",
                                help="Let --keep-last delete snapshots not yet copied to their --copy-to "
                                     "repository (kept otherwise).")
KeepLastHelp = ("Keep the newest N snapshots of each name (only of --name NAME when given); "
                "0 deletes them all and needs --name and --all.")


def repo_root(repo: Optional[Path], write: bool = False, create: bool = False) -> Path:
    """The repository directory, after checking that this user may read (or change, or make) it."""
    from gpusnap.repo import locate
    from gpusnap.system import access

    root = locate.repo_path(repo)
    access.check_repo(root, write=write or create, create=create)
    return root


def open_repo(repo: Optional[Path], write: bool = False):
    from gpusnap.repo.repository import Repository

    return Repository.open(repo_root(repo, write=write))


def open_writer_repo(repo: Optional[Path], lock_wait: Optional[float], dry_run: bool = False):
    """open_repo() for a command that changes the repository: it waits for the locks another
    gpusnap holds (--lock-wait, repo/lockwait.py)."""
    from gpusnap.repo import lockwait

    wait = lockwait.seconds(lock_wait)
    return open_repo(repo, write=not dry_run).wait_for_locks(wait)


def open_snapshot(ref: str, repo: Optional[Path]):
    """(repository, snapshot) for a directory, name or id, after checking this user may read it."""
    from gpusnap.repo import locate
    from gpusnap.system import access

    access.check_snapshot_ref(ref, locate.repo_path(repo))
    return locate.open_snapshot(ref, repo)


def repo_path(repo: Optional[Path]) -> Path:
    from gpusnap.repo import locate

    return locate.repo_path(repo)


def progress(label: str, enabled: bool):
    """(a rich progress bar, its update callback) on a terminal; (None, None) otherwise."""
    if not enabled or not OUTPUT.err.is_terminal:
        return None, None
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from gpusnap.render.progress import BytesColumn, SpeedColumn   # binary units, as every summary

    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), BytesColumn(), SpeedColumn(),
                   TimeElapsedColumn(), console=OUTPUT.err, transient=True)
    task = bar.add_task(label, total=None)
    shown = [None]

    def update(done: int, total: int, phase: str | None = None) -> None:
        if phase == "handover":    # a restored job is about to get this terminal: the bar goes
            bar.stop()
            return
        if phase != shown[0]:      # dump: "frozen" (staging), then "storing" (the job runs again)
            shown[0] = phase
            desc = {"frozen": f"{label}: job frozen, staging",
                    "storing": f"{label}: job running, storing",
                    "filling": f"{label}: job running, filling its memory",
                    "waiting": f"{label}: waiting for another gpusnap on this job"}.get(phase or "", label)
            if phase and phase.startswith("waiting for "):      # the repository's locks
                desc = f"{label}: {phase}"
            bar.update(task, description=desc, completed=0)
        bar.update(task, completed=done, total=max(total, done) or None)

    return bar, update


def with_progress(label: str, enabled: bool, call):
    """call(progress=update) under a progress bar on a terminal, else call()."""
    bar, update = progress(label, enabled)
    if bar is None:
        return call()
    with bar:
        return call(progress=update)


def resolve_pid(pid: Optional[int], match: Optional[str], pidfile: Optional[Path],
                user: Optional[str] = None, name: Optional[str] = None, repo: Optional[Path] = None) -> int:
    """The job's PID from exactly one of PID, --match, --pidfile (or --name of a `gpusnap run` job)."""
    given = [x is not None for x in (pid, match, pidfile)]
    if sum(given) == 0 and name:  # a job started with `gpusnap run --name NAME`
        from gpusnap.ops import run as run_op

        return run_op.find(name, repo_path(repo)).pid
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
