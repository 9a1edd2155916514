"""Human-readable forms shared by every command: the one byte-size formatter, and text that
must reach the terminal verbatim (never read as rich markup)."""

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
