"""Where a schedule runs: a systemd timer where systemd is PID 1, a file in /etc/cron.d
where a cron daemon runs (a live process, seen in /proc: an installed daemon nobody started
runs nothing). Which one runs here, the files each gets (only a schedule name and checked paths
go in them: the job's arguments stay in the spec), and systemctl."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from gpusnap.ops import cronexpr
from gpusnap.errors import SchedulerUnavailable
from gpusnap.ops.schedule.record import Schedule, safe_word, spec_path
from gpusnap import settings

PREFIX = "gpusnap-"
MARK = "# gpusnap schedule"


def cron_dir() -> Path:
    return Path(settings.get("GPUSNAP_CRON_DIR", "/etc/cron.d"))


def systemd_dir() -> Path:
    return Path(settings.get("GPUSNAP_SYSTEMD_DIR", "/etc/systemd/system"))


CRON_DAEMONS = ("cron", "crond", "cronie", "busybox-crond")


@dataclass(frozen=True)
class Probes:
    """Where the scheduler checks look: the one place a test points elsewhere
    (GPUSNAP_CRON_DAEMONS=name,name, GPUSNAP_SYSTEMD_RUN_DIR, GPUSNAP_PID1_NAMES=name,name)."""
    daemons: tuple[str, ...] = CRON_DAEMONS        # process names (/proc/PID/comm) of cron daemons
    systemd_run_dir: str = "/run/systemd/system"   # exists when systemd booted the machine (sd_booted)
    pid1_names: tuple[str, ...] = ("systemd",)     # what PID 1 is called when systemd runs the machine
    sbin: tuple[str, ...] = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")   # where daemons are installed


def probes() -> Probes:
    names = settings.get("GPUSNAP_CRON_DAEMONS")
    daemons = tuple(n for n in names.split(",") if n) if names is not None else CRON_DAEMONS
    return Probes(daemons=daemons,
                  systemd_run_dir=settings.get("GPUSNAP_SYSTEMD_RUN_DIR", Probes.systemd_run_dir),
                  pid1_names=tuple(n for n in settings.get("GPUSNAP_PID1_NAMES", "systemd").split(",") if n))


def running_daemon(names) -> tuple[str, int] | None:
    """(name, PID) of a live process called one of `names` (a cron daemon), from /proc."""
    from gpusnap.system import proc

    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = proc.read_stat(int(entry))
        if st is not None and st.comm in names and st.state not in ("Z", "X"):
            return st.comm, st.pid
    return None


def installed_daemon(p: Probes) -> str | None:
    for d in p.daemons:
        exe = shutil.which(d) or next((f"{b}/{d}" for b in p.sbin if os.access(f"{b}/{d}", os.X_OK)), None)
        if exe:
            return exe
    return None


def detect_scheduler(p: Probes | None = None) -> tuple[str | None, str]:
    """("systemd"|"cron"|None, why). What will run a schedule: systemd when it is PID 1 (and
    booted the machine), cron when a cron daemon runs now (an installed one that nobody
    started runs nothing). GPUSNAP_SCHEDULER=cron|systemd forces one (tests, containers
    whose cron runs outside)."""
    forced = settings.get("GPUSNAP_SCHEDULER")
    if forced in ("cron", "systemd"):
        return forced, f"forced by GPUSNAP_SCHEDULER={forced}"
    p = p or probes()
    try:
        with open("/proc/1/comm") as f:
            pid1 = f.read().strip()
    except OSError:
        pid1 = ""
    if pid1 in p.pid1_names and os.path.isdir(p.systemd_run_dir):
        return "systemd", "PID 1 is systemd: a systemd timer runs the schedule"
    daemon = running_daemon(p.daemons)
    if daemon:
        return "cron", f"the cron daemon {daemon[0]} runs (PID {daemon[1]}): a file in {cron_dir()} runs the schedule"
    exe = installed_daemon(p)
    if exe:
        return None, (f"the cron daemon {exe} is installed but not running, and systemd is not PID 1 "
                      f"(PID 1 is {pid1 or 'unknown'}), so nothing would ever run a schedule")
    return None, (f"no cron daemon runs and systemd is not PID 1 (PID 1 is {pid1 or 'unknown'}), so nothing "
                  "would ever run a schedule")


def scheduler_fix(p: Probes | None = None) -> str:
    """What to start or install so that schedules run."""
    exe = installed_daemon(p or probes())
    if exe:
        return (f"start the cron daemon and keep it running: `{exe}` (as root; Debian/Ubuntu: `service cron "
                "start`), then add the schedule again")
    return ("install and start a cron daemon (Debian/Ubuntu: apt install cron, then `service cron start`; "
            "Fedora/RHEL: dnf install cronie, then `systemctl enable --now crond`) and add the schedule again")


def require_scheduler() -> str:
    kind, why = detect_scheduler()
    if kind is None:
        raise SchedulerUnavailable(why, hint=scheduler_fix())
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
    if settings.get("GPUSNAP_SYSTEMD_DIR") is not None:      # (tests write units elsewhere; nothing to load)
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
