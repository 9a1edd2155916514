"""`schedule add` and `schedule rm`: check everything as `dump` would, record the spec, write
and enable the backend's files; and undo all of it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from gpusnap.ops import cronexpr, validate
from gpusnap.errors import SchedulerUnavailable, UsageError
from gpusnap.ops.schedule.backends import (PREFIX, cron_dir, cron_file, installed_files, require_scheduler,
                                           systemctl, systemd_dir, unit_files)
from gpusnap.ops.schedule.record import (Schedule, gpusnap_executable, load, log_dir, permission_error,
                                         private_dir, safe_word, spec_dir, spec_path, unlink_quiet, write_atomic)


def add(name: str, match: str | None, *, every: str | None = None, cron: str | None = None,
        keep_last: int = 4, repo: Path | None = None, exit_after: bool = False,
        user: str | int | None = None, replace: bool = False, container: str | None = None,
        engine: str | None = None, copy_to: str | None = None, copy_keep_last: int | None = None) -> Schedule:
    """Check everything as `dump` would, then record and install the schedule."""
    from gpusnap.repo import locate

    validate.check_schedule_name(name)
    validate.check_name(name)               # it is also the snapshot name
    # a name clash first: what else is wrong (the job gone, no scheduler) is moot for a name in use
    old = None
    try:
        old = load(name)
    except UsageError:
        pass
    if (old is not None or installed_files(name)) and not replace:
        where = f" (repository {old.repo}, {old.job})" if old else ""
        raise UsageError(f"a schedule named {name} exists{where}",
                         hint="give --replace to overwrite it, or choose another name")
    if match is not None:
        validate.check_match(match)
    if type(keep_last) is not int or keep_last < 1:
        raise UsageError("--keep-last must be at least 1")
    copy_to = _copy_to(copy_to, copy_keep_last, container)
    if bool(every) == bool(cron):
        raise UsageError("give exactly one of --every (e.g. 30m, 2h, 1d) or --cron 'M H DOM MON DOW'")
    repo_path = locate.repo_path(validate.check_repo_arg(repo))
    safe_word("--repo", str(repo_path))
    if os.geteuid() != 0:       # before a repository is made for it: the runs are root's
        from gpusnap.errors import NotRoot
        raise NotRoot("gpusnap schedule add must run as root (the schedule's dumps run as root)",
                      hint="run `sudo gpusnap schedule add ...`")
    if not locate.is_default(repo_path):
        locate.open_repository(repo_path)   # a typo is that one error, before anything else
    backend = require_scheduler()
    when = _when(backend, every, cron)
    uid, engine = _owner(name, match, user, container, engine, repo_path)
    # a repository every run would refuse: say so now. At the default location a missing one is
    # made now: the runs (from cron, without this $GPUSNAP_REPO) could not make it there
    locate.open_repository(repo_path, create_at_default=True)
    sd, ld = spec_dir(), log_dir()
    s = Schedule(name=name, match=match, container=container, engine=engine, uid=uid, docker_host=_docker_host(engine),
                 repo=str(repo_path), keep_last=keep_last, backend=backend,
                 when=when, every=every, cron=cronexpr.check(cron) if cron else None, exit_after=exit_after,
                 created=time.time(), exe=gpusnap_executable(), config_dir=str(sd.absolute()), copy_to=copy_to,
                 copy_keep_last=copy_keep_last, log=str((ld / f"schedule-{name}.log").absolute()))
    safe_word("--config-dir", s.config_dir)
    safe_word("log path", s.log)
    try:
        private_dir(sd)
        private_dir(ld)
        if backend == "cron":
            d = cron_dir()
            d.mkdir(parents=True, exist_ok=True)
            files = {str(d / f"{PREFIX}{name}"): (cron_file(s), 0o644)}   # cron ignores group/other-writable
        else:
            d = systemd_dir()
            d.mkdir(parents=True, exist_ok=True)
            files = {str(d / fn): (text, 0o644) for fn, text in unit_files(s).items()}
        s.files = sorted(files, key=lambda p: (not p.endswith(".timer"), p)) if backend == "systemd" else list(files)
        write_atomic(spec_path(name, sd), json.dumps(s.__dict__, indent=1, sort_keys=True) + "\n", 0o600)
        if old is not None:
            for f in set(old.files) - set(files):
                unlink_quiet(f)
        for p, (text, mode) in files.items():
            write_atomic(Path(p), text, mode)
    except PermissionError as e:
        raise permission_error(e, "the schedule") from None
    if backend == "systemd":
        systemctl("daemon-reload")
        systemctl("enable", "--now", f"{PREFIX}{name}.timer")
    s.replaced_repo = old.repo if old is not None and old.repo != s.repo else None  # type: ignore[attr-defined]
    return s


def _when(backend: str, every: str | None, cron: str | None) -> str:
    """The schedule's time, as the backend takes it (checked: a bad one is refused now)."""
    if cron:
        when = cronexpr.check(cron)
        if backend == "systemd":
            cronexpr.cron_to_oncalendar(when)
        return when
    if backend == "cron":
        return cronexpr.every_to_cron(every)
    cronexpr.parse_every(every)
    return f"every {every}"


def _copy_to(copy_to: str | None, copy_keep_last: int | None, container: str | None) -> str | None:
    """--copy-to checked (ops/tiers.py) and recorded as every run will use it."""
    from gpusnap.ops import tiers

    if copy_to is None:
        if copy_keep_last is not None:
            raise UsageError("--copy-keep-last is the retention of --copy-to's repository", hint="give --copy-to REPO")
        return None
    if container is not None:
        raise UsageError("--container takes no --copy-to yet", hint="copy its snapshots with `gpusnap copy`")
    return tiers.destination(copy_to)


def _run_job_owner(name: str, repo: Path, user) -> int:
    """No --match: the job `gpusnap run --name NAME` started, which must run now; its owner."""
    from gpusnap.ops import run as run_op

    job = run_op.find(name, repo)
    uid = validate.process_uid(job.pid)
    if uid is None:
        raise UsageError(f"job {name} (PID {job.pid}) went away while the schedule was added")
    if user is not None and validate.resolve_user(user) != uid:
        raise UsageError(f"job {name} runs as {validate.user_name(uid)}, not {user}")
    return uid


def _owner(name: str, match: str | None, user, container: str | None, engine: str | None,
           repo_path: Path) -> tuple[int, str | None]:
    """Whose job the schedule dumps, and the container's engine: a container is root's; else
    what --match finds, or the `gpusnap run --name NAME` job."""
    if container is not None or engine is not None:
        return 0, _container_engine(container, engine, match, user)
    return (_job_owner(match, user) if match is not None else _run_job_owner(name, repo_path, user)), None


def _docker_host(engine: str | None) -> str | None:
    return os.environ.get("DOCKER_HOST") if engine == "docker" else None


def _container_engine(container: str | None, engine: str | None, match: str | None, user) -> str | None:
    """The engine that runs the container now (a container's schedule is root's); recorded, so
    that every run asks that engine (and, for Docker, the daemon DOCKER_HOST names now: cron
    runs without this environment). None for a schedule of no container."""
    if container is None:
        if engine is not None:
            raise UsageError("--engine only says whose --container it is")
        return None
    validate.check_container_ref(container)
    if match is not None or user is not None:
        raise UsageError("--container takes no --match or --user: its engine finds the container, as root's")
    from gpusnap.system import engines

    eng = engines.find(container, engine)
    if not eng.inspect(container)["running"]:     # (ProcessNotFound when there is none)
        raise UsageError(f"container {container} is not running", hint="start it, then add the schedule")
    return eng.NAME


def _job_owner(match: str, user) -> int:
    """The uid whose processes --match may pick: --user, or the owner of what matches now."""
    if user is not None:
        return validate.resolve_user(user)
    from gpusnap.system import proc
    hits = proc.find_matching(match)
    uids = sorted({u for u in (validate.process_uid(p) for p in hits) if u is not None})
    if not uids:
        raise UsageError(f"no running process matches `{match}`, so the job's owner is unknown",
                         hint="start the job first, or give --user USER (only that user's processes are ever dumped)")
    if len(uids) > 1:
        raise UsageError(f"processes of several users match `{match}` ({', '.join(map(validate.user_name, uids))})",
                         hint="give --user USER: only that user's processes are ever dumped")
    return uids[0]


def remove(name: str) -> Schedule:
    s = load(name)
    try:
        if s.backend == "systemd":
            try:
                systemctl("disable", "--now", f"{PREFIX}{name}.timer")
            except SchedulerUnavailable:
                pass
        for f in s.files:
            unlink_quiet(f)
        unlink_quiet(spec_path(name))
    except PermissionError as e:
        raise permission_error(e, "the schedule") from None
    if s.backend == "systemd":
        try:
            systemctl("daemon-reload")
        except SchedulerUnavailable:
            pass
    return s
