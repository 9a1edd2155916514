"""SIGTERM and SIGHUP as an exception in the main thread, so that a command unwinds as on
Ctrl-C (its `finally` blocks and aborts remove what it had written) and then says it was
interrupted, rather than dying where it stood (the default action of both signals)."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived (raised by the handler as_exception() installs)."""


def _raise(signum, frame):  # noqa: ARG001
    raise Terminated(signum)


@contextlib.contextmanager
def as_exception() -> Iterator[None]:
    """Within: SIGTERM and SIGHUP raise Terminated (only the main thread can take signals;
    elsewhere this does nothing). The previous handlers come back on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _raise) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
