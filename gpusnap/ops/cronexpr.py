"""Cron expressions and intervals, checked and understood (pure functions).

A 5-field expression is checked field by field (numbers in range, steps positive) so that
nothing a cron daemon would ignore or misread is ever written; `next_fire` says when it
fires next (Vixie cron's rule: when both day fields are restricted, either may match).
`every` intervals are turned into cron only when cron can say exactly that interval:
`*/45` fires at :00 and :45, not every 45 minutes, so 45m is refused for cron (a systemd
timer can run it: OnUnitActiveSec).
"""

from __future__ import annotations

import datetime as _dt
import re

from gpusnap.errors import UsageError

FIELDS = (("minute", 0, 59), ("hour", 0, 23), ("day of month", 1, 31), ("month", 1, 12),
          ("day of week", 0, 7))
_ITEM = re.compile(r"(\*|(\d{1,2})(?:-(\d{1,2}))?)(?:/(\d{1,2}))?")
_EVERY = re.compile(r"([1-9]\d{0,4})([mhd])")
UNIT_SECONDS = {"m": 60, "h": 3600, "d": 86400}


def parse_field(text: str, index: int) -> set[int]:
    name, lo, hi = FIELDS[index]
    out: set[int] = set()
    for item in text.split(","):
        m = _ITEM.fullmatch(item)
        if not m:
            raise UsageError(f"cron {name} field {text!r}: {item!r} is not a number, range, '*' or step",
                             hint=f"use numbers {lo}-{hi}, a-b, */n, a-b/n, lists with ','")
        star, a, b, step = m.group(1) == "*", m.group(2), m.group(3), m.group(4)
        start, end = (lo, hi) if star else (int(a), int(b) if b is not None else int(a))
        if step is not None and not star and b is None:
            end = hi                            # "a/n": from a to the end
        s = int(step) if step is not None else 1
        if not (lo <= start <= hi and lo <= end <= hi) or start > end or s < 1:
            raise UsageError(f"cron {name} field {text!r} is out of range ({lo}-{hi})")
        out.update(range(start, end + 1, s))
    if index == 4 and 7 in out:                 # 7 is Sunday too
        out.discard(7)
        out.add(0)
    return out


def check(expr: str) -> str:
    """A 5-field cron expression, normalised to single spaces; UsageError otherwise."""
    if not isinstance(expr, str) or any(c in expr for c in "\n\r\0%"):
        raise UsageError(f"--cron {expr!r} contains a newline, NUL or '%'")
    fields = expr.split()
    if len(fields) != 5:
        raise UsageError(f"--cron {expr!r} is not a 5-field cron expression",
                         hint="'M H DOM MON DOW', e.g. '*/15 * * * *' or '0 3 * * 1-5'")
    for i, f in enumerate(fields):
        parse_field(f, i)
    return " ".join(fields)


def next_fire(expr: str, after: _dt.datetime) -> _dt.datetime:
    """The first minute strictly after `after` (naive local time) at which `expr` fires."""
    fields = check(expr).split()
    mins, hours, doms, mons, dows = (parse_field(f, i) for i, f in enumerate(fields))
    dom_any, dow_any = fields[2].startswith("*"), fields[4].startswith("*")
    t = after.replace(second=0, microsecond=0) + _dt.timedelta(minutes=1)
    limit = t + _dt.timedelta(days=366 * 5)
    while t < limit:
        if t.month not in mons:
            t = (t.replace(day=1, hour=0, minute=0) + _dt.timedelta(days=32)).replace(day=1)
            continue
        dow = (t.weekday() + 1) % 7
        if dom_any and dow_any:
            day_ok = True
        elif dom_any:
            day_ok = dow in dows
        elif dow_any:
            day_ok = t.day in doms
        else:
            day_ok = t.day in doms or dow in dows
        if not day_ok:
            t = t.replace(hour=0, minute=0) + _dt.timedelta(days=1)
            continue
        if t.hour not in hours:
            t = t.replace(minute=0) + _dt.timedelta(hours=1)
            continue
        if t.minute not in mins:
            t += _dt.timedelta(minutes=1)
            continue
        return t
    raise UsageError(f"--cron {expr!r} never fires")


def parse_every(every: str) -> int:
    """'45m' / '2h' / '1d' -> seconds."""
    m = _EVERY.fullmatch(every or "")
    if not m:
        raise UsageError(f"--every {every!r}: use minutes, hours or days like 30m, 2h, 1d")
    secs = int(m.group(1)) * UNIT_SECONDS[m.group(2)]
    if not 60 <= secs <= 31 * 86400:
        raise UsageError(f"--every {every!r} is out of range (1m to 31d)")
    return secs


def every_to_cron(every: str) -> str:
    """The cron expression that fires exactly every `every`, or UsageError when cron cannot
    (its steps restart at each hour/day: */45 fires at :00 and :45)."""
    secs = parse_every(every)
    if secs < 3600 and 3600 % secs == 0:
        n = secs // 60
        return "* * * * *" if n == 1 else f"*/{n} * * * *"
    if secs < 86400 and secs % 3600 == 0 and 86400 % secs == 0:
        n = secs // 3600
        return "0 * * * *" if n == 1 else f"0 */{n} * * *"
    if secs == 86400:
        return "0 3 * * *"
    raise UsageError(
        f"--every {every}: cron cannot fire exactly every {every} (its steps restart every hour and "
        "every day, so e.g. */45 fires at :00 and :45)",
        hint="use an interval that divides an hour or a day (1-6, 10, 12, 15, 20, 30m; 1-4, 6, 8, 12h; 1d), "
             "a --cron expression, or run on a systemd machine (its timers take any interval)")


def every_to_systemd(every: str) -> str:
    """An interval in systemd's time span syntax (always exact)."""
    return f"{parse_every(every)}s"


_DOW = ("Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat")


def cron_to_oncalendar(expr: str) -> str:
    """A systemd OnCalendar= value that fires exactly when `expr` does. systemd requires
    both day fields to hold (cron: either), so an expression restricting both is refused."""
    fields = check(expr).split()
    sets = [parse_field(f, i) for i, f in enumerate(fields)]
    if not fields[2].startswith("*") and not fields[4].startswith("*"):
        raise UsageError(f"--cron {expr!r} restricts both day of month and day of week; a systemd timer "
                         "cannot say 'either' as cron does", hint="give two schedules, one per day rule")

    def lst(values, full, width=2):
        if values == set(full):
            return "*"
        return ",".join(f"{v:0{width}d}" for v in sorted(values))

    dow = "" if fields[4].startswith("*") else ",".join(_DOW[d] for d in sorted(sets[4])) + " "
    return (f"{dow}*-{lst(sets[3], range(1, 13))}-{lst(sets[2], range(1, 32))} "
            f"{lst(sets[1], range(24))}:{lst(sets[0], range(60))}:00")
