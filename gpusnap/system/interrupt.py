"""SIGTERM and SIGHUP as an exception in the main thread, so that a command unwinds as on
Ctrl-C (its `finally` blocks and aborts remove what it had written) and then says it was
interrupted, rather than dying where it stood (the default action of both signals)."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Iterator


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived (raised by the handler as_exception() installs)."""


_pending: BaseException | None = None


def _raise(signum, frame):  # noqa: ARG001
    raise Terminated(signum)


def _keep(hook):
    """An unraisablehook that keeps a Terminated or KeyboardInterrupt raised in a finalizer
    (`__del__`, a weakref callback), where Python prints and drops it: the command would go on
    as if never interrupted. check() raises it again."""
    def unraisable(u):
        global _pending
        if isinstance(u.exc_value, (Terminated, KeyboardInterrupt)):
            _pending = u.exc_value
        else:
            hook(u)
    return unraisable


def check() -> None:
    """Raise the interruption a finalizer swallowed, if any: called where work becomes
    visible (a snapshot's commit) and on the way out of as_exception()."""
    global _pending
    exc, _pending = _pending, None
    if exc is not None:
        raise exc


@contextlib.contextmanager
def as_exception() -> Iterator[None]:
    """Within: SIGTERM and SIGHUP raise Terminated (only the main thread can take signals;
    elsewhere this does nothing). The previous handlers come back on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _raise) for s in (signal.SIGTERM, signal.SIGHUP)}
    old_hook, sys.unraisablehook = sys.unraisablehook, _keep(sys.unraisablehook)
    try:
        yield
        check()
    finally:
        sys.unraisablehook = old_hook
        for s, h in old.items():
            signal.signal(s, h)
