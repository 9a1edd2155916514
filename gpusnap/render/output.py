"""The one output path of every command: a result goes out either as exactly one JSON object
on stdout (--json) or as human text on a rich console, and an error goes out the same way
(`gpusnap.cli.main` hands it to `error()`), so no command decides this on its own.

The rich consoles are made on first use: `gpusnap --version` and `--help` never build them.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from gpusnap.errors import CriuFailed, GpusnapError


def to_data(result: Any) -> Any:
    """A result as JSON-ready data: its to_dict() when it has one, else itself."""
    return result.to_dict() if hasattr(result, "to_dict") else result


def error_fields(e: GpusnapError, code: int | None = None) -> dict[str, Any]:
    """The keys an error adds to a JSON object (the error object itself, or a report's)."""
    obj: dict[str, Any] = {"error": e.title, "message": e.message, "exit_code": code or e.exit_code}
    if e.hint:
        obj["hint"] = e.hint
    if isinstance(e, CriuFailed):
        obj["criu_log"] = e.log_path
        obj["criu_errors"] = e.last_lines
    return obj


class Output:
    """Where this command's result and errors go. `json` is set once the command's options
    are parsed (cli.common.command does it), so an error raised later is JSON too."""

    def __init__(self, out=None, err=None) -> None:
        """out, err: rich Consoles to print to (e.g. recording ones); default stdout, stderr."""
        self.reset()
        self._out, self._err = out, err

    def reset(self, json_mode: bool = False) -> None:
        self.json = json_mode
        self._emitted = False
        self._out = self._err = None

    @property
    def out(self):
        """The console for results (stdout)."""
        if self._out is None:
            from rich.console import Console

            self._out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
        return self._out

    @property
    def err(self):
        """The console for notes, warnings and errors (stderr)."""
        if self._err is None:
            from rich.console import Console

            self._err = Console(stderr=True, highlight=False, soft_wrap=True)
        return self._err

    def json_object(self, obj: Any) -> None:
        """Print one JSON object; only the first per command goes out, whatever happens after."""
        if self._emitted:
            return
        self._emitted = True
        import json

        sys.stdout.write(json.dumps(obj, indent=None, sort_keys=False, default=str) + "\n")
        sys.stdout.flush()

    def emit(self, result: Any, human: Callable[[], None] | None = None,
             failure: GpusnapError | None = None) -> None:
        """Print a command's result: its data under --json, else `human()`. A failure (a report
        that says something is wrong) is merged into the JSON object and then raised, so the
        exit code comes from the error hierarchy and the object stays the only one."""
        if self.json:
            data = to_data(result)
            if failure is not None:
                data = {**data, **error_fields(failure)}
            self.json_object(data)
        elif human is not None:
            human()
        if failure is not None:
            raise failure

    def error(self, e: GpusnapError, force_json: bool = False, code: int | None = None) -> None:
        """Print an error: one JSON object under --json, else a message, CRIU's last lines and
        the hint on stderr."""
        if self.json or force_json:
            self.json_object(error_fields(e, code))
            return
        from rich.text import Text

        err = self.err
        err.print(Text(f"gpusnap: {e.message}", style="bold red"))
        if isinstance(e, CriuFailed):
            for line in e.last_lines:
                err.print(Text(f"  {line}", style="dim"))
            if e.log_path:
                err.print(f"  full CRIU log: {e.log_path}", markup=False)
        if e.hint:
            err.print(Text.assemble(("hint:", "yellow"), " ", e.hint))

    def warn(self, text: str) -> None:
        """A warning line on stderr (also with --quiet: a cron log must show it)."""
        self.err.print(f"gpusnap: warning: {text}", style="yellow", markup=False)


OUTPUT = Output()
