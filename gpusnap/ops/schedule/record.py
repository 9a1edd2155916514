"""The record of a schedule: a root-only JSON spec (/etc/gpusnap/schedules/NAME.json, with
the job owner's uid), written atomically, read back with the same checks `add` makes (it says
what root runs), and listed. Also the path rule for what goes on a cron line or unit file."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpusnap.ops import validate
from gpusnap.repo import fsutil
from gpusnap.errors import GpusnapError, UsageError
from gpusnap import settings

SPEC_VERSION = 1
_SAFE_PATH = re.compile(r"[A-Za-z0-9_./+-]+")


def spec_dir() -> Path:
    return Path(settings.get("GPUSNAP_SCHEDULE_DIR", "/etc/gpusnap/schedules"))


def log_dir() -> Path:
    return Path(settings.get("GPUSNAP_LOG_DIR", "/var/log/gpusnap"))


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
    container: str | None = None      # `schedule add --container`: a Podman or Docker container (root's), by name or id
    engine: str | None = None         # its engine: podman, docker (None: podman, as before Docker was known)
    docker_host: str | None = None    # DOCKER_HOST when the schedule was added (cron runs without it)
    copy_to: str | None = None        # `--copy-to`: each run copies its snapshot (and any pending) there (ops/tiers.py)
    copy_keep_last: int | None = None  # `--copy-keep-last`: retention there, after the copy

    @property
    def user(self) -> str:
        return validate.user_name(self.uid)

    @property
    def job(self) -> str:
        """The job as the user named it, for messages: the pattern as typed (no repr escapes)."""
        if self.container is not None:
            return f"the container {self.container}"
        if self.match is None:
            return f"the job named {self.name}"
        return f"the job matching `{self.match}`"

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


def safe_word(what: str, s: str) -> str:
    """A path that goes on a cron line or an ExecStart= as is: no quoting, no `%`."""
    if not _SAFE_PATH.fullmatch(s):
        raise UsageError(f"{what} {s!r} holds characters a cron line or unit file would need quoted",
                         hint="use a path of letters, digits and _ . / + -")
    return s


def spec_path(name: str, d: Path | None = None) -> Path:
    return (d or spec_dir()) / f"{name}.json"


def private_dir(d: Path) -> None:
    d.mkdir(parents=True, mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (os.geteuid(), 0) or st.st_mode & 0o022:
        raise UsageError(f"{d} is not a private directory of yours (owner {st.st_uid}, mode {st.st_mode & 0o7777:o})",
                         hint="it holds what root runs: chown root: and chmod 700 it")


def write_atomic(path: Path, text: str, mode: int) -> None:
    fsutil.write_atomic(path, text, mode)


def permission_error(e: OSError, what: str) -> GpusnapError:
    from gpusnap.errors import NotRoot
    return NotRoot(f"cannot write {what}: {e.strerror} ({e.filename})",
                   hint="schedules run as root: use sudo gpusnap schedule ...")


def load(name: str, d: Path | None = None) -> Schedule:
    """The recorded schedule `name`; its spec must be a private regular file of root's (or
    the caller's): it says what root runs."""
    validate.check_schedule_name(name)
    p = spec_path(name, d)
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
    if s.container is not None:
        validate.check_container_ref(s.container)
        if s.engine not in (None, "podman", "docker") or not (s.docker_host is None or (
                isinstance(s.docker_host, str) and s.docker_host.isprintable())):
            raise UsageError(f"schedule {p} is damaged: engine {s.engine!r}, DOCKER_HOST {s.docker_host!r}")
    if s.copy_to is not None:
        from gpusnap.ops import tiers

        s.copy_to = tiers.destination(s.copy_to)
    if s.copy_keep_last is not None and (type(s.copy_keep_last) is not int or s.copy_keep_last < 1):
        raise UsageError(f"schedule {p} is damaged")
    if s.name != name or not isinstance(s.uid, int) or not isinstance(s.keep_last, int) or s.keep_last < 1:
        raise UsageError(f"schedule {p} is damaged")
    return s


def unlink_quiet(p) -> None:
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
        raise permission_error(e, "the schedules") from None
    for fn in names:
        if not fn.endswith(".json") or fn.startswith("."):
            continue
        try:
            out.append(load(fn[:-5], d))
        except UsageError:
            continue
    return out


@contextlib.contextmanager
def engine_env(s: Schedule):
    """The container's engine module, with the environment the schedule was added in (Docker:
    the daemon DOCKER_HOST named then) while it is asked."""
    from gpusnap.system import engines

    old = os.environ.get("DOCKER_HOST")
    if s.docker_host is not None:
        os.environ["DOCKER_HOST"] = s.docker_host
    try:
        yield engines.get(s.engine or "podman")
    finally:
        if s.docker_host is not None:
            if old is None:
                os.environ.pop("DOCKER_HOST", None)
            else:
                os.environ["DOCKER_HOST"] = old
