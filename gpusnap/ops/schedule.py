"""Periodic snapshots: a systemd timer where systemd runs the machine, /etc/cron.d otherwise.

Nothing a user typed goes into a cron or unit file. `schedule add` checks every argument
with the validators `dump` uses (gpusnap/ops/validate.py, gpusnap/ops/cronexpr.py), records them in a
root-only JSON spec (/etc/gpusnap/schedules/NAME.json, with the job owner's uid), and the
cron line or timer runs only `gpusnap schedule run NAME --config-dir DIR`: a name of
[A-Za-z0-9_-] and paths checked to need no quoting, so neither a newline nor cron's `%`
can reach the command. `schedule run` reads the spec, finds the job among its owner's
processes only, dumps with retention, and appends one timestamped JSON line (outcome and
figures) to /var/log/gpusnap/schedule-NAME.log, which `schedule ls` and `doctor` read back:
last run, result, next run, and a job gone for several runs in a row.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpusnap.ops import cronexpr, validate
from gpusnap.errors import GpusnapError, ProcessNotFound, SchedulerUnavailable, UsageError

PREFIX = "gpusnap-"
MARK = "# gpusnap schedule"
SPEC_VERSION = 1
GONE_AFTER = 3          # runs in a row without the job before ls/doctor say it is gone
_SAFE_PATH = re.compile(r"[A-Za-z0-9_./+-]+")


def cron_dir() -> Path:
    return Path(os.environ.get("GPUSNAP_CRON_DIR", "/etc/cron.d"))


def systemd_dir() -> Path:
    return Path(os.environ.get("GPUSNAP_SYSTEMD_DIR", "/etc/systemd/system"))


def spec_dir() -> Path:
    return Path(os.environ.get("GPUSNAP_SCHEDULE_DIR", "/etc/gpusnap/schedules"))


def log_dir() -> Path:
    return Path(os.environ.get("GPUSNAP_LOG_DIR", "/var/log/gpusnap"))


# -- which scheduler runs here -----------------------------------------------------------
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


# -- the schedule's record ---------------------------------------------------------------
@dataclass
class Schedule:
    name: str
    match: str | None                 # None: the job `gpusnap run --name NAME` started
    uid: int
    repo: str
    keep_last: int
    backend: str                      # "cron" | "systemd"
    when: str                         # the cron expression, or "every 45m" (systemd)
    every: str | None = None
    cron: str | None = None
    exit_after: bool = False
    created: float = 0.0
    exe: list[str] = field(default_factory=list)
    config_dir: str = ""
    log: str = ""
    files: list[str] = field(default_factory=list)    # the cron file, or the unit files
    version: int = SPEC_VERSION

    @property
    def user(self) -> str:
        return validate.user_name(self.uid)

    @property
    def path(self) -> str:
        return self.files[0] if self.files else ""

    def command(self) -> list[str]:
        """The exact argv the cron line or the timer runs."""
        return [*self.exe, "schedule", "run", self.name, "--config-dir", self.config_dir]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["user"] = self.user
        d["command"] = " ".join(self.command())
        return d


def gpusnap_executable() -> list[str]:
    exe = shutil.which("gpusnap")
    if exe:
        return [exe]
    candidate = Path(sys.executable).with_name("gpusnap")
    return [str(candidate)] if candidate.exists() else [sys.executable, "-m", "gpusnap"]


def _safe_word(what: str, s: str) -> str:
    """A path that goes on a cron line or an ExecStart= as is: no quoting, no `%`."""
    if not _SAFE_PATH.fullmatch(s):
        raise UsageError(f"{what} {s!r} holds characters a cron line or unit file would need quoted",
                         hint="use a path of letters, digits and _ . / + -")
    return s


def _spec_path(name: str, d: Path | None = None) -> Path:
    return (d or spec_dir()) / f"{name}.json"


def _private_dir(d: Path) -> None:
    d.mkdir(parents=True, mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (os.geteuid(), 0) or st.st_mode & 0o022:
        raise UsageError(f"{d} is not a private directory of yours (owner {st.st_uid}, mode {st.st_mode & 0o7777:o})",
                         hint="it holds what root runs: chown root: and chmod 700 it")


def _write_atomic(path: Path, text: str, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _permission(e: OSError, what: str) -> GpusnapError:
    from gpusnap.errors import NotRoot
    return NotRoot(f"cannot write {what}: {e.strerror} ({e.filename})",
                   hint="schedules run as root: use sudo gpusnap schedule ...")


def load(name: str, d: Path | None = None) -> Schedule:
    """The recorded schedule `name`; its spec must be a private regular file of root's (or
    the caller's): it says what root runs."""
    validate.check_schedule_name(name)
    p = _spec_path(name, d)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UsageError(f"no schedule named {name!r}", hint="`gpusnap schedule ls` lists them") from None
    except OSError as e:
        raise UsageError(f"cannot read schedule {p}: {e.strerror}") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (os.geteuid(), 0) or st.st_mode & 0o022:
            raise UsageError(f"schedule {p} is not a private file of root's; not used")
        try:
            raw = json.loads(f.read(1 << 20))
            s = Schedule(**{k: v for k, v in raw.items() if k in Schedule.__dataclass_fields__})
        except (ValueError, TypeError) as e:
            raise UsageError(f"schedule {p} is damaged: {e}") from None
    # checked again at every run: a spec edited by hand gets the same checks as `add`
    validate.check_schedule_name(s.name)
    if s.match is not None:  # None: the job `gpusnap run --name NAME` started
        validate.check_match(s.match)
    if s.name != name or not isinstance(s.uid, int) or not isinstance(s.keep_last, int) or s.keep_last < 1:
        raise UsageError(f"schedule {p} is damaged")
    return s


def _cron_file(s: Schedule) -> str:
    words = [_safe_word("gpusnap executable", w) for w in s.exe]
    cmd = " ".join([*words, "schedule", "run", s.name, "--config-dir", _safe_word("--config-dir", s.config_dir)])
    err = _safe_word("log path", str(Path(s.log).with_suffix(".err")))
    return (f"{MARK} {s.name} (job owner {s.user}, uid {s.uid}); written by `gpusnap schedule add`, "
            f"the job's arguments are in {_spec_path(s.name, Path(s.config_dir))}\n"
            "SHELL=/bin/sh\nPATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n"
            f"{s.when} root {cmd} 2>>{err}\n")


def _unit_files(s: Schedule) -> dict[str, str]:
    cmd = " ".join(_safe_word("gpusnap executable", w) for w in s.exe)
    cmd += f" schedule run {s.name} --config-dir {_safe_word('--config-dir', s.config_dir)}"
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


def _systemctl(*args: str) -> None:
    if "GPUSNAP_SYSTEMD_DIR" in os.environ:      # (tests write units elsewhere; nothing to load)
        return
    p = subprocess.run(["systemctl", *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise SchedulerUnavailable(f"systemctl {' '.join(args)} failed: {p.stderr.strip()}")


def add(name: str, match: str | None, *, every: str | None = None, cron: str | None = None,
        keep_last: int = 4, repo: Path | None = None, exit_after: bool = False,
        user: str | int | None = None, replace: bool = False) -> Schedule:
    """Check everything as `dump` would, then record and install the schedule."""
    from gpusnap.repo import locate

    validate.check_schedule_name(name)
    validate.check_name(name)               # it is also the snapshot name
    if match is not None:
        validate.check_match(match)
    if type(keep_last) is not int or keep_last < 1:
        raise UsageError("--keep-last must be at least 1")
    if bool(every) == bool(cron):
        raise UsageError("give exactly one of --every (e.g. 30m, 2h, 1d) or --cron 'M H DOM MON DOW'")
    repo_path = locate.repo_path(validate.check_repo_arg(repo))
    _safe_word("--repo", str(repo_path))
    backend = require_scheduler()
    if cron:
        when = cronexpr.check(cron)
        if backend == "systemd":
            cronexpr.cron_to_oncalendar(when)
    elif backend == "cron":
        when = cronexpr.every_to_cron(every)
    else:
        cronexpr.parse_every(every)
        when = f"every {every}"
    uid = _job_owner(match, user) if match is not None else _run_job_owner(name, repo_path, user)
    if repo_path.exists():                  # a repository every run would refuse: say so now
        from gpusnap.repo.repository import Repository
        Repository.open(repo_path)
    old = None
    try:
        old = load(name)
    except UsageError:
        pass
    if (old is not None or _installed_files(name)) and not replace:
        where = f" (repository {old.repo})" if old else ""
        raise UsageError(f"a schedule named {name!r} exists{where}",
                         hint="give --replace to overwrite it, or choose another name")
    sd, ld = spec_dir(), log_dir()
    s = Schedule(name=name, match=match, uid=uid, repo=str(repo_path), keep_last=keep_last, backend=backend,
                 when=when, every=every, cron=cronexpr.check(cron) if cron else None, exit_after=exit_after,
                 created=time.time(), exe=gpusnap_executable(), config_dir=str(sd.absolute()),
                 log=str((ld / f"schedule-{name}.log").absolute()))
    _safe_word("--config-dir", s.config_dir)
    _safe_word("log path", s.log)
    try:
        _private_dir(sd)
        _private_dir(ld)
        if backend == "cron":
            d = cron_dir()
            d.mkdir(parents=True, exist_ok=True)
            files = {str(d / f"{PREFIX}{name}"): (_cron_file(s), 0o644)}   # cron ignores group/other-writable
        else:
            d = systemd_dir()
            d.mkdir(parents=True, exist_ok=True)
            files = {str(d / fn): (text, 0o644) for fn, text in _unit_files(s).items()}
        s.files = sorted(files, key=lambda p: (not p.endswith(".timer"), p)) if backend == "systemd" else list(files)
        _write_atomic(_spec_path(name, sd), json.dumps(s.__dict__, indent=1, sort_keys=True) + "\n", 0o600)
        if old is not None:
            for f in set(old.files) - set(files):
                _unlink(f)
        for p, (text, mode) in files.items():
            _write_atomic(Path(p), text, mode)
    except PermissionError as e:
        raise _permission(e, "the schedule") from None
    if backend == "systemd":
        _systemctl("daemon-reload")
        _systemctl("enable", "--now", f"{PREFIX}{name}.timer")
    s.replaced_repo = old.repo if old is not None and old.repo != s.repo else None  # type: ignore[attr-defined]
    return s


def _run_job_owner(name: str, repo: Path, user) -> int:
    """No --match: the job `gpusnap run --name NAME` started, which must run now; its owner."""
    from gpusnap.ops import jobrun

    job = jobrun.find(name, repo)
    uid = validate.process_uid(job.pid)
    if uid is None:
        raise UsageError(f"job {name!r} (PID {job.pid}) went away while the schedule was added")
    if user is not None and validate.resolve_user(user) != uid:
        raise UsageError(f"job {name!r} runs as {validate.user_name(uid)}, not {user}")
    return uid


def _job_owner(match: str, user) -> int:
    """The uid whose processes --match may pick: --user, or the owner of what matches now."""
    if user is not None:
        return validate.resolve_user(user)
    from gpusnap.system import proc
    hits = proc.find_matching(match)
    uids = sorted({u for u in (validate.process_uid(p) for p in hits) if u is not None})
    if not uids:
        raise UsageError(f"no running process matches {match!r}, so the job's owner is unknown",
                         hint="start the job first, or give --user USER (only that user's processes are ever dumped)")
    if len(uids) > 1:
        raise UsageError(f"processes of several users match {match!r} ({', '.join(map(validate.user_name, uids))})",
                         hint="give --user USER: only that user's processes are ever dumped")
    return uids[0]


def _installed_files(name: str) -> list[str]:
    out = [cron_dir() / f"{PREFIX}{name}", systemd_dir() / f"{PREFIX}{name}.timer",
           systemd_dir() / f"{PREFIX}{name}.service"]
    return [str(p) for p in out if os.path.lexists(p)]


def _unlink(p) -> None:
    try:
        os.unlink(p)
    except FileNotFoundError:
        pass


def list_schedules() -> list[Schedule]:
    d = spec_dir()
    out = []
    try:
        names = sorted(os.listdir(d))
    except (FileNotFoundError, NotADirectoryError):
        return out
    except PermissionError as e:
        raise _permission(e, "the schedules") from None
    for fn in names:
        if not fn.endswith(".json") or fn.startswith("."):
            continue
        try:
            out.append(load(fn[:-5], d))
        except UsageError:
            continue
    return out


def remove(name: str) -> Schedule:
    s = load(name)
    try:
        if s.backend == "systemd":
            try:
                _systemctl("disable", "--now", f"{PREFIX}{name}.timer")
            except SchedulerUnavailable:
                pass
        for f in s.files:
            _unlink(f)
        _unlink(_spec_path(name))
    except PermissionError as e:
        raise _permission(e, "the schedule") from None
    if s.backend == "systemd":
        try:
            _systemctl("daemon-reload")
        except SchedulerUnavailable:
            pass
    return s


# -- one run -----------------------------------------------------------------------------
def _now_iso(t: float | None = None) -> str:
    return _dt.datetime.fromtimestamp(time.time() if t is None else t, _dt.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


def append_log(s: Schedule, record: dict) -> None:
    """One JSON line per run, appended (O_APPEND: concurrent runs never interleave a line)."""
    p = Path(s.log)
    _private_dir(p.parent)
    fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (json.dumps(record, sort_keys=True) + "\n").encode())
    finally:
        os.close(fd)


def read_log(s: Schedule, last: int = 50) -> list[dict]:
    try:
        with open(s.log, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - (64 << 10)))
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for ln in lines[-last:]:
        try:
            rec = json.loads(ln)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def run(name: str, config_dir: Path | None = None) -> dict:
    """What the cron line or timer runs: find the job among its owner's processes, dump with
    retention, log one JSON line. Returns the record; raises the dump's error after logging."""
    from gpusnap.ops.dump import DumpRequest, dump, retention_error

    s = load(name, config_dir)
    t0 = time.time()
    rec: dict = {"time": _now_iso(t0), "schedule": s.name, "pid": None}
    error: GpusnapError | None = None
    try:
        if s.match is None:
            from gpusnap.ops import jobrun

            pid = jobrun.find(s.name, Path(s.repo)).pid
            if validate.process_uid(pid) != s.uid:
                raise ProcessNotFound(f"job {s.name!r} (PID {pid}) no longer runs as {s.user}")
        else:
            pid = validate.find_job(s.match, s.uid)
        rec["pid"] = pid
        res = dump(DumpRequest(pid=pid, repo=Path(s.repo), name=s.name, leave_running=not s.exit_after,
                               keep_last=s.keep_last))
        rec.update({"snapshot": res.snapshot, "id": res.id, "pages_total": res.pages_total,
                    "pages_dedup": res.pages_dedup, "bytes_raw": res.bytes_raw, "bytes_stored": res.bytes_stored,
                    "pruned": len(res.pruned), "dump_seconds": res.seconds})
        if res.prune_warnings:
            rec["warnings"] = res.prune_warnings
        error = retention_error(res)
        rec["outcome"] = "ok" if error is None else "retention-failed"
    except ProcessNotFound as e:
        error = e
        rec["outcome"] = "no-job"
    except GpusnapError as e:
        error = e
        rec["outcome"] = "failed"
    except KeyboardInterrupt:
        from gpusnap.errors import Interrupted
        error = Interrupted("schedule run interrupted")
        rec["outcome"] = "failed"
    rec["exit_code"] = error.exit_code if error else 0
    if error is not None:
        rec["message"] = error.message
    rec["seconds"] = round(time.time() - t0, 3)
    if rec["outcome"] == "no-job":
        gone = 1 + _no_job_streak(read_log(s))
        rec["runs_without_job"] = gone
        if gone >= GONE_AFTER:
            error.message += f"; the job has been gone for {gone} runs in a row"  # type: ignore[union-attr]
            rec["message"] = error.message  # type: ignore[union-attr]
    append_log(s, rec)
    if error is not None:
        raise error
    return rec


def _no_job_streak(records: list[dict]) -> int:
    n = 0
    for r in reversed(records):
        if r.get("outcome") != "no-job":
            break
        n += 1
    return n


# -- status ------------------------------------------------------------------------------
def status(s: Schedule, now: float | None = None) -> dict:
    """Last run, result, next run, and whether the job looks gone, from the log."""
    now = time.time() if now is None else now
    recs = read_log(s)
    last = recs[-1] if recs else None
    streak = _no_job_streak(recs)
    out = {"name": s.name, "backend": s.backend, "when": s.when, "match": s.match, "user": s.user,
           "repo": s.repo, "keep_last": s.keep_last, "last_run": last.get("time") if last else None,
           "result": last.get("outcome") if last else None,
           "last_message": last.get("message") if last else None,
           "runs_without_job": streak, "job_gone": streak >= GONE_AFTER,
           "installed": all(os.path.exists(f) for f in s.files) and bool(s.files),
           "next_run": next_run(s, recs, now)}
    return out


def next_run(s: Schedule, recs: list[dict], now: float) -> str | None:
    if s.cron or s.backend == "cron":
        expr = s.cron or s.when
        nxt = cronexpr.next_fire(expr, _dt.datetime.fromtimestamp(now))   # cron runs in local time
        return nxt.astimezone(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    span = cronexpr.parse_every(s.every or "")
    if recs:
        try:
            last = _dt.datetime.strptime(recs[-1]["time"], "%Y-%m-%dT%H:%M:%SZ").replace(
                tzinfo=_dt.timezone.utc).timestamp()
            return _now_iso(max(last + span, now))
        except (KeyError, ValueError):
            pass
    return _now_iso(now + span)


def _legacy_cron_files(known: set[str]) -> list[Path]:
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


def doctor_checks(add) -> None:
    """For `gpusnap doctor`: can schedules run here, and is each one healthy.
    `add(name, status, detail, fix)` as DoctorReport.add."""
    kind, why = detect_scheduler()
    try:
        items = list_schedules()
    except GpusnapError:
        items = []
    if kind is None:
        add("scheduler", "fail" if items else "warn", why,
            "install a cron daemon (Debian/Ubuntu: apt install cron; Fedora/RHEL: dnf install cronie)")
    else:
        add("scheduler", "ok", why)
    known = {f for s in items for f in s.files}
    for p in _legacy_cron_files(known):
        add(f"schedule file {p.name}", "warn",
            f"{p} was written by an older gpusnap: its command line holds the job's arguments as text",
            f"add the schedule again with --replace (or remove {p})")
    for s in items:
        st = status(s)
        if not st["installed"]:
            add(f"schedule {s.name}", "fail", f"its {s.backend} file is missing ({', '.join(s.files)})",
                f"gpusnap schedule add ... --name {s.name} --replace")
        elif s.backend != kind and kind is not None:
            add(f"schedule {s.name}", "warn", f"written for {s.backend}, but {kind} runs this machine",
                "add it again with --replace")
        elif st["job_gone"]:
            add(f"schedule {s.name}", "warn",
                f"the job ({s.match!r}, user {s.user}) has been gone for {st['runs_without_job']} runs in a row",
                f"restart the job, or gpusnap schedule rm {s.name}")
        elif st["result"] not in (None, "ok"):
            add(f"schedule {s.name}", "warn", f"last run {st['last_run']}: {st['result']}: {st['last_message']}",
                f"see {s.log}")
        else:
            add(f"schedule {s.name}", "ok",
                f"last run {st['last_run'] or 'never'} ({st['result'] or '-'}), next {st['next_run']}")
