"""Periodic snapshots from cron: one /etc/cron.d/gpusnap-<name> file per schedule.

Each file holds one cron line running `gpusnap dump --match … --name … --keep-last …
--quiet` as root, so retention happens right after each successful dump. Output goes to
/var/log/gpusnap/schedule-<name>.log.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from gpusnap.dump import check_name
from gpusnap.errors import UsageError

PREFIX = "gpusnap-"
MARK = "# gpusnap schedule"


def cron_dir() -> Path:
    return Path(os.environ.get("GPUSNAP_CRON_DIR", "/etc/cron.d"))


@dataclass
class Schedule:
    name: str
    cron: str
    command: str
    path: str

    def to_dict(self) -> dict:
        return asdict(self)


_EVERY = re.compile(r"^(\d+)([mhd])$")


def cron_expr(every: str | None, cron: str | None) -> str:
    """'30m' → '*/30 * * * *', '2h' → '0 */2 * * *', '1d' → '0 3 * * *'; or a 5-field expression."""
    if bool(every) == bool(cron):
        raise UsageError("give exactly one of --every (e.g. 30m, 2h, 1d) or --cron 'M H DOM MON DOW'")
    if cron:
        fields = cron.split()
        if len(fields) != 5 or not all(re.fullmatch(r"[0-9*/,\-]+", f) for f in fields):
            raise UsageError(f"--cron {cron!r} is not a 5-field cron expression")
        return " ".join(fields)
    m = _EVERY.match(every or "")
    if not m:
        raise UsageError(f"--every {every!r}: use minutes, hours or days like 30m, 2h, 1d")
    n, unit = int(m.group(1)), m.group(2)
    limits = {"m": 59, "h": 23, "d": 1}
    if not 1 <= n <= limits[unit]:
        raise UsageError(f"--every {every!r} is out of range (1-{limits[unit]}{unit})")
    return {"m": f"*/{n} * * * *", "h": f"0 */{n} * * *", "d": "0 3 * * *"}[unit]


def gpusnap_executable() -> str:
    exe = shutil.which("gpusnap")
    if exe:
        return exe
    candidate = Path(sys.executable).with_name("gpusnap")
    return str(candidate) if candidate.exists() else f"{sys.executable} -m gpusnap"


def add(name: str, match: str | None, *, every: str | None = None, cron: str | None = None,
        keep_last: int = 4, repo: Path | None = None, exit_after: bool = False) -> Schedule:
    check_name(name)
    if keep_last < 1:
        raise UsageError("--keep-last must be at least 1")
    expr = cron_expr(every, cron)
    exe = gpusnap_executable()
    # no --match: `dump --name NAME` finds the job `gpusnap run --name NAME` started
    args = ["dump", *(["--match", match] if match is not None else []), "--name", name,
            "--keep-last", str(keep_last), "--quiet"]
    if repo:
        args += ["--repo", str(Path(repo).absolute())]
    if exit_after:
        args.append("--exit")
    log_dir = Path(os.environ.get("GPUSNAP_LOG_DIR", "/var/log/gpusnap"))
    log_dir.mkdir(parents=True, mode=0o700, exist_ok=True)
    command = f"{exe} {shlex.join(args)} >>{shlex.quote(str(log_dir / f'schedule-{name}.log'))} 2>&1"
    # cron treats '%' as a newline: escape it in the command
    line = f"{expr} root {command.replace('%', chr(92) + '%')}"
    d = cron_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{PREFIX}{name}"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(f"{MARK} {name}\nSHELL=/bin/sh\nPATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n"
                   f"{line}\n")
    os.chmod(tmp, 0o644)  # cron ignores group/other-writable files
    os.replace(tmp, path)
    return Schedule(name=name, cron=expr, command=command, path=str(path))


def list_schedules() -> list[Schedule]:
    out = []
    d = cron_dir()
    if not d.is_dir():
        return out
    for p in sorted(d.glob(f"{PREFIX}*")):
        try:
            text = p.read_text()
        except OSError:
            continue
        if not text.startswith(MARK):
            continue
        for line in text.splitlines():
            if line and not line.startswith("#") and "=" not in line.split()[0]:
                fields = line.split(None, 6)
                if len(fields) == 7:
                    out.append(Schedule(name=p.name[len(PREFIX):], cron=" ".join(fields[:5]),
                                        command=fields[6], path=str(p)))
    return out


def remove(name: str) -> Schedule:
    check_name(name)
    for s in list_schedules():
        if s.name == name:
            Path(s.path).unlink()
            return s
    raise UsageError(f"no schedule named {name!r}", hint="`gpusnap schedule ls` lists them")
