"""The `gpusnap` command line: parse, call the library, print. No logic lives here.

One module per command group (cli.snapshots, cli.repo, cli.machine; shared options in
cli.common); the table below registers them, in the order `gpusnap --help` lists them.
Every result and error goes out through render.output.OUTPUT: `--json` prints exactly one
JSON object on stdout (an error object on failure). Errors from the library
(gpusnap.errors) become a message and an exit code in one place, `main()`.

Start-up matters (`dump` and `restore` pay it): importing this package loads typer and
the errors only; the repository, numpy, blake3, zstandard and CUDA load inside the
commands that use them (tests/test_cli.py checks it). Exit matters too: the process entry
point, `run()`, ends the process as soon as the command is done (see `exit_now`).
"""

from __future__ import annotations

import os
import sys
import threading

import typer

from gpusnap import __version__, settings
from gpusnap.cli import machine, repo, snapshots
from gpusnap.cli.common import APP, SCHEDULE_APP
from gpusnap.errors import GpusnapError, UsageError
from gpusnap.render.output import OUTPUT

# (group, name, function, settings): group None is the top level, "schedule" the schedule group
_COMMANDS = [
    (None, "init", repo.init_cmd, {}),
    (None, "dump", snapshots.dump, {}),
    (None, "restore", snapshots.restore, {}),
    (None, "ls", repo.ls_cmd, {}),
    (None, "inspect", repo.inspect, {}),
    (None, "verify", repo.verify, {}),
    (None, "repair", repo.repair, {}),
    (None, "prune", repo.prune, {}),
    (None, "forget", repo.forget, {}),
    (None, "export", snapshots.export_cmd, {}),
    (None, "import", snapshots.import_cmd, {}),
    (None, "copy", snapshots.copy_cmd, {}),
    (None, "serve", snapshots.serve_cmd, {"hidden": True}),
    (None, "doctor", machine.doctor, {}),
    (None, "ps", machine.ps, {}),
    ("schedule", "add", machine.schedule_add, {}),
    ("schedule", "ls", machine.schedule_ls, {}),
    ("schedule", "rm", machine.schedule_rm, {}),
    ("schedule", "run", machine.schedule_run, {}),
    (None, "run", snapshots.run, {"context_settings": {"allow_interspersed_args": False}}),
    (None, "slurm-run", snapshots.slurm_run, {"context_settings": {"allow_interspersed_args": False}}),
]
_TOP_LEVEL = {group or name for group, name, _, _ in _COMMANDS}


def _root(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True),
    repo: str = typer.Option(None, "--repo", metavar="DIR",
                             help="Repository directory, for the command that follows (as after it: "
                                  "gpusnap --repo DIR ls = gpusnap ls --repo DIR)."),
) -> None:
    if version:
        sys.stdout.write(f"gpusnap {__version__}\n")
        raise typer.Exit(0)
    if repo is not None and ctx.invoked_subcommand is None:
        raise UsageError("--repo DIR needs a command after it", hint="e.g. gpusnap --repo DIR ls")


def hoist_repo(args: list[str]) -> list[str]:
    """`gpusnap --repo DIR CMD ...` as `gpusnap CMD --repo DIR ...` (restic's `-r` comes first):
    the option moves right after the command (after `schedule SUB` for the schedule group),
    where every command that uses a repository declares it; one given after it too wins."""
    rest, repo = list(args), []
    i = 0
    while i < len(rest) and rest[i].startswith("-") and rest[i] != "--":
        if rest[i] == "--repo" and i + 1 < len(rest):
            repo = rest[i:i + 2]
            del rest[i:i + 2]
        elif rest[i].startswith("--repo="):
            repo = ["--repo", rest[i][len("--repo="):]]
            del rest[i]
        else:
            i += 1
    if not repo or i >= len(rest) or rest[i] not in _TOP_LEVEL:
        return list(args)               # nothing to move, or no command: typer says what is wrong
    at = i + 1
    if rest[i] == "schedule" and at < len(rest) and not rest[at].startswith("-"):
        at += 1
    return rest[:at] + repo + rest[at:]


def build_app(only: str | None = None) -> typer.Typer:
    """The `gpusnap` app with every command, or with only the top-level command (or group) `only`.

    Typer turns every registered command's signature into a click command each time the app
    runs, 10-20 ms for all of them; a run that names its command builds just that one (main())."""
    top = typer.Typer(**APP)
    top.callback(invoke_without_command=True)(_root)
    groups = {None: top}
    if only in (None, "schedule"):
        groups["schedule"] = typer.Typer(**SCHEDULE_APP)
        top.add_typer(groups["schedule"], name="schedule")
    for group, name, fn, kw in _COMMANDS:
        if only is None or (group or name) == only:
            groups[group].command(name, **kw)(fn)
    return top


app = build_app()   # every command: --help, completions, tests


def report_error(e: GpusnapError, force_json: bool = False, code: int | None = None) -> None:
    OUTPUT.error(e, force_json=force_json, code=code)


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

    OUTPUT.reset()
    settings.load()         # the GPUSNAP_* variables, read once for the whole command
    try:
        args = hoist_repo(sys.argv[1:] if argv is None else argv)
        runner = build_app(args[0]) if args and args[0] in _TOP_LEVEL else app
        rv = runner(args=args, prog_name="gpusnap", standalone_mode=False)
        if isinstance(rv, int) and rv:
            sys.exit(rv)
    except GpusnapError as e:
        report_error(e)
        sys.exit(e.exit_code)
    except click_exc.ClickException as e:
        if OUTPUT.json or _json_requested(argv):
            report_error(UsageError(e.format_message()), force_json=True)
        else:
            from typer import rich_utils

            rich_utils.rich_format_error(e)
        sys.exit(UsageError.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        if OUTPUT.json:
            report_error(GpusnapError("interrupted"), force_json=True, code=130)
        else:
            OUTPUT.err.print("gpusnap: interrupted")
        sys.exit(130)
    except PermissionError as e:  # a last net: never a traceback for a permission problem
        from gpusnap.errors import AccessDenied

        what = e.filename or str(e)
        ad = AccessDenied(f"permission denied: {what}",
                          hint=f"run gpusnap as root (`sudo gpusnap ...`) or as the owner of {what}")
        report_error(ad)
        sys.exit(ad.exit_code)
    except Exception as e:  # a bug: with --json still one object on stdout; the traceback on stderr
        if not (OUTPUT.json or _json_requested(argv)):
            raise
        import traceback

        traceback.print_exc(file=sys.stderr)
        report_error(GpusnapError(f"internal error: {type(e).__name__}: {e}",
                                  hint="please report this with the command and the traceback above"),
                     force_json=True)
        sys.exit(GpusnapError.exit_code)
    finally:
        settings.unload()   # (main() called in-process, by tests: what follows reads afresh)


def run() -> None:
    """The process's entry point (`gpusnap`, `python -m gpusnap`): main(), then `exit_now`.
    main() itself returns or raises, so it can be called in-process (tests do)."""
    try:
        main()
        code = 0
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):
            raise           # sys.exit("message"): Python prints it, as always
        code = e.code or 0
    exit_now(code)


def exit_now(code: int) -> None:
    """End the process with `code` without the interpreter's shutdown, when that is safe.

    By the time a command returns (or its error has been reported), it has cleaned up after
    itself: its `finally` blocks and context managers have waited for CRIU, removed the temp
    and staging directories, and released the repository lock. What the interpreter's shutdown
    would still do is free every module and object one by one (and run the native tables'
    __del__ that only free memory): 20-40 ms on every dump and restore, for nothing. So: run
    the atexit handlers (logging's flush, weakref finalizers such as TemporaryDirectory's),
    flush stdout and stderr, and os._exit. The ordinary exit stays where the shutdown would
    still do something: a non-daemon thread still running (shutdown waits for it, and
    concurrent.futures' exit hook joins idle pool workers), or stdout that cannot be
    flushed (a closed pipe: Python reports it and exits 120, as before).
    """
    main_thread = threading.main_thread()
    if any(t is not main_thread and not t.daemon and t.is_alive() for t in threading.enumerate()):
        sys.exit(code)
    if not _flushed():
        sys.exit(code)
    import atexit

    atexit._run_exitfuncs()   # clears them: the fallback below does not run them twice
    if not _flushed():
        sys.exit(code)
    os._exit(code)


def _flushed() -> bool:
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:      # None: started with that descriptor closed
                stream.flush()
    except (OSError, ValueError):       # a closed pipe, a closed file
        return False
    return True
