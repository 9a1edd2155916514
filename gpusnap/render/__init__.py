"""Everything gpusnap prints for people, and how results reach the terminal.

This module holds the forms shared by every command: the one byte-size formatter, UTC times,
and text that must reach the terminal verbatim (never read as rich markup). render.output
is the one output path (JSON or human, errors included); render.snapshots, render.maint and
render.machine make the text and tables of each command from the library's result objects,
which keep only data and to_dict().
"""

from __future__ import annotations

import datetime

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float | int | None) -> str:
    """1536 -> '1.5 KiB' (binary units); None -> '-'."""
    if n is None:
        return "-"
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in _UNITS:
        if n < 1024 or unit == _UNITS[-1]:
            return f"{sign}{int(n)} B" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    return f"{sign}{n}"  # pragma: no cover - the loop always returns


def utc(ts: float | int | None) -> str:
    """Seconds since the epoch -> 'YYYY-MM-DD HH:MM:SS' (UTC)."""
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(float(ts), datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def plain(text) -> "object":
    """A rich Text of `text`: printed exactly, `[idx]` and all (rich would read it as markup)."""
    from rich.text import Text

    return Text("" if text is None else str(text))
