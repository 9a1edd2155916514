"""Where a schedule runs: a systemd timer where systemd is PID 1, a file in /etc/cron.d
otherwise. Which one runs here, the files each gets (only a schedule name and checked paths
go in them: the job's arguments stay in the spec), and systemctl."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from gpusnap.ops import cronexpr
from gpusnap.errors import SchedulerUnavailable
from gpusnap.ops.schedule.record import Schedule, safe_word, spec_path

PREFIX = "gpusnap-"
MARK = "# gpusnap schedule"


def cron_dir() -> Path:
    return Path(os.environ.get("GPUSNAP_CRON_DIR", "/etc/cron.d"))


def systemd_dir() -> Path:
    return Path(os.environ.get("GPUSNAP_SYSTEMD_DIR", "/etc/systemd/system"))


CRON_DAEMONS = ("cron", "crond", "cronie", "busybox-crond")


def detect_scheduler(systemd_run_dir: str = "/run/systemd/system", which=shutil.which) -> tuple[str | None, str]:
    """("systemd"|"cron"|None, why). systemd when PID 1 is systemd (sd_booted()'s test),
    cron when a cron daemon is installed, else None and what to install.
    GPUSNAP_SCHEDULER=cron|systemd forces one (tests, containers with an outside cron)."""
    forced = os.environ.get("GPUSNAP_SCHEDULER")
    if forced in ("cron", "systemd"):
        return forced, f"forced by GPUSNAP_SCHEDULER={forced}"
    if os.path.isdir(systemd_run_dir):
        return "systemd", "PID 1 is systemd: a systemd timer runs the schedule"
    for d in CRON_DAEMONS:
        exe = which(d) or (f"/usr/sbin/{d}" if os.path.exists(f"/usr/sbin/{d}") else None)
        if exe:
            return "cron", f"cron daemon {exe}: a file in /etc/cron.d runs the schedule"
    return None, ("neither systemd (PID 1) nor a cron daemon runs on this machine, so nothing would "
                  "ever run a schedule")


def require_scheduler() -> str:
    kind, why = detect_scheduler()
    if kind is None:
        raise SchedulerUnavailable(why, hint="install a cron daemon (Debian/Ubuntu: apt install cron, "
                                             "then start it; Fedora/RHEL: dnf install cronie) and add the "
                                             "schedule again")
    return kind


def cron_file(s: Schedule) -> str:
    words = [safe_word("gpusnap executable", w) for w in s.exe]
    cmd = " ".join([*words, "schedule", "run", s.name, "--config-dir", safe_word("--config-dir", s.config_dir)])
    err = safe_word("log path", str(Path(s.log).with_suffix(".err")))
    return (f"{MARK} {s.name} (job owner {s.user}, uid {s.uid}); written by `gpusnap schedule add`, "
            f"the job's arguments are in {spec_path(s.name, Path(s.config_dir))}\n"
            "SHELL=/bin/sh\nPATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n"
            f"{s.when} root {cmd} 2>>{err}\n")


def unit_files(s: Schedule) -> dict[str, str]:
    cmd = " ".join(safe_word("gpusnap executable", w) for w in s.exe)
    cmd += f" schedule run {s.name} --config-dir {safe_word('--config-dir', s.config_dir)}"
    service = (f"{MARK} {s.name} (job owner {s.user}, uid {s.uid})\n[Unit]\n"
               f"Description=gpusnap schedule {s.name}\n\n[Service]\nType=oneshot\nExecStart={cmd}\n")
    if s.every:
        span = cronexpr.every_to_systemd(s.every)
        when = f"OnBootSec={span}\nOnUnitActiveSec={span}\n"
    else:
        when = f"OnCalendar={cronexpr.cron_to_oncalendar(s.cron or s.when)}\nPersistent=true\n"
    timer = (f"{MARK} {s.name}\n[Unit]\nDescription=gpusnap schedule {s.name}\n\n[Timer]\n{when}"
             "AccuracySec=1s\n\n[Install]\nWantedBy=timers.target\n")
    return {f"{PREFIX}{s.name}.service": service, f"{PREFIX}{s.name}.timer": timer}


def systemctl(*args: str) -> None:
    if "GPUSNAP_SYSTEMD_DIR" in os.environ:      # (tests write units elsewhere; nothing to load)
        return
    p = subprocess.run(["systemctl", *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise SchedulerUnavailable(f"systemctl {' '.join(args)} failed: {p.stderr.strip()}")


def installed_files(name: str) -> list[str]:
    out = [cron_dir() / f"{PREFIX}{name}", systemd_dir() / f"{PREFIX}{name}.timer",
           systemd_dir() / f"{PREFIX}{name}.service"]
    return [str(p) for p in out if os.path.lexists(p)]


def legacy_cron_files(known: set[str]) -> list[Path]:
    d = cron_dir()
    out = []
    try:
        entries = sorted(d.glob(f"{PREFIX}*"))
    except OSError:
        return out
    for p in entries:
        if str(p) in known:
            continue
        try:
            with open(p, "rb") as f:
                head = f.read(len(MARK))
        except OSError:
            continue
        if head == MARK.encode():
            out.append(p)
    return out
