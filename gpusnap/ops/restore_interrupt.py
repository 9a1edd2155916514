"""Signals during a restore (Ctrl-C, SIGTERM, SIGHUP): the exit status tells whether the job runs.

A restore goes through three phases, and a signal means something different in each:

* checks (snapshot, PIDs, files set aside, image files written): the signal stops the restore
  at once; whatever was changed is put back, nothing runs, exit 130 (`Interrupted`);
* CRIU running: CRIU is never killed half-way (the processes it is building would be left
  stuck); the signal is held, and on the stream path the image stream is cut, so CRIU fails
  and kills what it had built: exit 130, nothing runs. If CRIU completes anyway (it already
  had every image: the files and lazy paths, or the last bytes were sent), the job runs;
* the job runs (CRIU exited 0): the signal is held until the restore has reported: the PID
  on stdout, exit 0, and a note that the interrupt came when the job was already running.

So exit 130 always means nothing was restored, and a script that retries on failure never
starts a second copy. The CLI holds the guard until the PID is printed (`guard()`);
gpusnap/ops/restore_paths.py marks CRIU's start and its success. The fault points
`restore:*` (gpusnap/system/faults.py, docs/faults.md) land a signal in each phase in tests.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM/SIGHUP before CRIU starts: the restore unwinds
    as on Ctrl-C, and wherever it lands the command exits 130 as on Ctrl-C."""


class Guard:
    """The signal handlers of one restore, and the phase it is in (checks, criu, running)."""

    def __init__(self) -> None:
        self.phase = "checks"
        self.caught: list[int] = []
        self.noted = False           # the restore's result already carries the note
        self.cut = None              # while CRIU runs: cuts its image stream (only sets a flag)

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
        if self.phase == "checks":
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise Terminated(signum)
        self.caught.append(signum)   # held: CRIU runs, or the job already does
        if self.phase == "criu" and self.cut is not None:
            # at once, in the handler: the feeders stop at their next chunk, not when the
            # supervising loop next wakes (CRIU could meanwhile read its last bytes)
            self.cut()

    @property
    def stop_requested(self) -> bool:
        """A signal came while CRIU runs: cut the stream so CRIU restores nothing."""
        return bool(self.caught) and self.phase == "criu"

    def names(self) -> str:
        return ", ".join(dict.fromkeys(signal.Signals(s).name for s in self.caught))

    def note(self, pid) -> str | None:
        """The line restore prints when a held signal did not stop it (the job runs)."""
        if not self.caught:
            return None
        self.noted = True
        return (f"interrupted ({self.names()}) once CRIU was restoring the job, too late to stop it: the signal "
                f"was held, the restore finished, and the job runs as PID {pid} (to stop it: `kill {pid}`)")


_ACTIVE: list[Guard] = []


def active() -> Guard | None:
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def guard():
    """Install the restore's signal handlers (main thread only; elsewhere the signals keep
    their default meaning), or join the guard already installed (the CLI's, held until the
    PID is printed)."""
    if _ACTIVE:
        yield _ACTIVE[-1]
        return
    g = Guard()
    main = threading.current_thread() is threading.main_thread()
    old = {s: signal.signal(s, g._on_signal) for s in SIGNALS} if main else {}
    _ACTIVE.append(g)
    try:
        yield g
    finally:
        _ACTIVE.remove(g)
        for s, h in old.items():
            signal.signal(s, h)


def reinstall() -> None:
    """Take the signals back from a handler installed inside the restore (the image files'
    directory, repo/materialize.py, whose SIGTERM would end the restore even while CRIU runs)."""
    g = active()
    if g is not None and threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, g._on_signal)


def criu_started(cut=None) -> None:
    """CRIU is running: from here a signal is held, and calls `cut` (the image stream's, which
    must only set a flag: it runs inside the signal handler)."""
    g = active()
    if g is not None and g.phase == "checks":
        g.phase = "criu"
        g.cut = cut


def job_running() -> None:
    """CRIU exited 0: the restored job runs; a signal no longer stops anything."""
    g = active()
    if g is not None:
        g.phase = "running"
        g.cut = None


def stop_requested() -> bool:
    g = active()
    return g is not None and g.stop_requested


def interrupted_error(criu_log=None):
    """The error of a restore a signal stopped: nothing runs (exit 130)."""
    from gpusnap.errors import Interrupted

    g = active()
    what = f" ({g.names()})" if g is not None and g.caught else ""
    hint = "the snapshot is unchanged; restore it again when you want the job back"
    if criu_log:
        hint += f" (CRIU log kept at {criu_log})"
    return Interrupted(f"restore interrupted{what} while CRIU was restoring: the image stream was cut, CRIU "
                       "stopped and removed what it had built; nothing was restored, nothing runs", hint=hint)
