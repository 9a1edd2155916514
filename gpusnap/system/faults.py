"""Test hook: deterministic fault injection at named points of a dump's commit (docs/faults.md).

GPUSNAP_FAULT=POINT:SIG[,POINT:SIG...] makes gpusnap send itself signal SIG (TERM, INT, HUP,
KILL, ...) when it reaches POINT, e.g. GPUSNAP_FAULT=commit:index-renamed:TERM. Unset (the
normal case), fault() is one dict lookup. The fault-injection suite (tests/test_faults*.py)
uses it to land a signal exactly inside the commit; nothing else does.
"""

from __future__ import annotations

import os
import signal

from gpusnap import settings


def _parse(spec: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        point, _, sig = item.rpartition(":")
        try:
            out[point] = int(getattr(signal, "SIG" + sig.upper().removeprefix("SIG")))
        except AttributeError:
            continue
    return out


_POINTS = _parse(settings.get("GPUSNAP_FAULT", ""))


def fault(point: str) -> None:
    """At `point`: if GPUSNAP_FAULT names it, signal this process (once per point)."""
    sig = _POINTS.pop(point, None) if _POINTS else None
    if sig is not None:
        os.kill(os.getpid(), sig)
