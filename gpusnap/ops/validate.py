"""Arguments shared by `dump`, `run` and `schedule add`, checked by one set of functions, so a
schedule never stores what a dump would refuse (and a cron or timer line never receives
what could end the line or the command). The rules themselves are the format's
(gpusnap/repo/format.py): a snapshot or job name is what a manifest may hold, a codec is
one the format knows, or "auto"."""

from __future__ import annotations

import os
import pwd
import re
from pathlib import Path

from gpusnap.errors import ProcessNotFound, UsageError
from gpusnap.repo.codec import CHOICES as COMPRESS_CHOICES  # what --compress accepts: defined once, with the codecs
from gpusnap.repo.format import SNAPSHOT_NAME

SCHEDULE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# the words of format.SNAPSHOT_NAME, for messages
NAME_RULE = "use letters, digits, '.', '_', '+' and '-' (up to 100), starting with a letter or digit"


def _no_control(what: str, value: str) -> None:
    if any(c in value for c in "\n\r\0"):
        raise UsageError(f"{what} {value!r} contains a newline or NUL character", hint="remove it")


def check_match(pattern: str) -> str:
    """A --match pattern: one line, no NUL, a regular expression that compiles."""
    _no_control("--match", pattern)
    if not pattern:
        raise UsageError("--match needs a non-empty pattern")
    try:
        re.compile(pattern)
    except re.error as e:
        raise UsageError(f"--match {pattern!r} is not a valid regular expression: {e}") from None
    return pattern


def check_name(name: str, what: str = "snapshot name") -> str:
    """A snapshot name, or a `gpusnap run` job's (it becomes its snapshots' name): the
    format's rule, matched whole (no trailing newline slips through)."""
    if not isinstance(name, str) or not SNAPSHOT_NAME.match(name):
        raise UsageError(f"{what} {name!r} is not allowed", hint=NAME_RULE)
    return name


def default_name(text: str) -> str:
    """A name made from a command name: what the rule refuses becomes '-', at most 40."""
    return re.sub(r"[^A-Za-z0-9._+-]", "-", text).strip("-.+")[:40] or "job"


def check_container_ref(ref) -> str:
    """A container's name or id as Podman and Docker take it (and as a cron line or unit may
    carry it; never an option: it starts with a letter or digit)."""
    if not isinstance(ref, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", ref):
        raise UsageError(f"bad container name or id {ref!r}", hint="give it as `podman ps` or `docker ps` shows it")
    return ref


def check_compress(codec: str) -> str:
    if codec not in COMPRESS_CHOICES:
        raise UsageError(f"--compress must be one of {', '.join(COMPRESS_CHOICES)}, not {codec!r}")
    return codec


def check_schedule_name(name: str) -> str:
    """Schedule names are matched whole (no trailing newline slips through a `$`), and use
    only characters Debian's cron accepts in an /etc/cron.d file name."""
    if not isinstance(name, str) or not SCHEDULE_NAME.fullmatch(name):
        raise UsageError(f"schedule name {name!r} is not allowed",
                         hint="use letters, digits, '_' and '-' (up to 64)")
    return name


def check_repo_arg(repo) -> Path | None:
    if repo is None:
        return None
    s = str(repo)
    _no_control("--repo", s)
    return Path(s).expanduser().absolute()


def resolve_user(user) -> int:
    """A user name or numeric uid -> uid."""
    s = str(user)
    _no_control("--user", s)
    if s.isdigit():
        return int(s)
    try:
        return pwd.getpwnam(s).pw_uid
    except KeyError:
        raise UsageError(f"--user {s!r}: no such user") from None


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def process_uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def find_job(match: str, uid: int | None = None) -> int:
    """The one process tree whose command line matches `match` (of user `uid` when given:
    another user's process that happens to match is never picked)."""
    from gpusnap.system import proc

    check_match(match)
    hits = proc.find_matching(match)
    others = []
    if uid is not None:
        others = [p for p in hits if process_uid(p) != uid]
        hits = [p for p in hits if process_uid(p) == uid]
    if not hits:
        extra = (f" of user {user_name(uid)}" if uid is not None else "")
        more = f" ({len(others)} of other users ignored)" if others else ""
        raise ProcessNotFound(f"no running process{extra} matches `{match}`{more}")
    if len(hits) > 1:
        listing = "; ".join(f"{p}: {proc.cmdline(p)[:60]}" for p in hits[:5])
        raise UsageError(f"{len(hits)} process trees match `{match}` ({listing})",
                         hint="make the pattern more specific, or pass the PID")
    return hits[0]
