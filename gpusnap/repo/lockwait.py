"""How long a command that changes a repository waits for a lock another gpusnap holds.

Schedules fire on the minute: two dumps into one repository in the same minute, or a dump
whose --keep-last retention met a running verify, failed at once (exit 10, 21) and the
snapshot was lost to timing. A writer (dump, its retention, prune, forget, import, repair) now
waits, bounded: `--lock-wait SECONDS`, else `$GPUSNAP_LOCK_WAIT`, else DEFAULT_WAIT; 0 fails
at once, as before. flock(2) has no timeout, so the wait polls LOCK_NB (from 10 ms up to a
quarter of a second between tries); a dead holder's lock is free at the next try.
"""

from __future__ import annotations

import fcntl
import math
import time
from typing import Callable

from gpusnap.errors import UsageError
from gpusnap import settings

# Long enough for the dump ahead of it (a minute-apart schedule, a large job's store and
# retention) to finish; a lock held longer than this is a stuck or runaway writer, and the
# schedule's run says so (exit 10) rather than piling up.
DEFAULT_WAIT = 600.0
MAX_WAIT = 7 * 86400.0
ENV = "GPUSNAP_LOCK_WAIT"


def seconds(given: float | None = None) -> float:
    """The wait a command uses: `given` (its --lock-wait), else $GPUSNAP_LOCK_WAIT, else the default."""
    src = "--lock-wait"
    if given is None:
        raw = (settings.get(ENV) or "").strip()
        if not raw:
            return DEFAULT_WAIT
        src = f"${ENV}"
        try:
            given = float(raw)
        except ValueError:
            raise UsageError(f"{src}={raw!r} is not a number of seconds",
                             hint=f"give 0 (fail at once) up to {int(MAX_WAIT)}") from None
    if not (math.isfinite(given) and 0 <= given <= MAX_WAIT):
        raise UsageError(f"{src} {given:g} is out of range", hint=f"give 0 (fail at once) up to {int(MAX_WAIT)}")
    return float(given)


def flock(fd: int, op: int, wait: float, on_wait: Callable[[], None] | None = None) -> bool:
    """flock(fd, op) (LOCK_EX or LOCK_SH), waiting up to `wait` seconds for whoever holds it;
    `on_wait` is called once, before a wait. -> whether the lock is now held."""
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        pass
    if wait <= 0:
        return False
    if on_wait is not None:
        on_wait()
    deadline = time.monotonic() + wait
    pause = 0.01
    while True:
        time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        if time.monotonic() >= deadline:
            return False
        pause = min(pause * 2, 0.25)
