"""Terminals around a restore: which terminals a live tree holds that a restore would have to
hand over (the same rule criu/ttyinfo.py applies to a snapshot), whether this process can give
its own terminal to a restored job, tmux, and the one wording of what a restore will do with a
job's terminal (restore, inspect and doctor all say it with outlook()).

From a terminal a restored job gets that terminal, as with plain `criu restore --shell-job`:
gpusnap stays in the foreground until the job ends, as the shell would for the original job.
From no terminal (cron, Slurm, a script, --json) gpusnap starts the restore inside a new
detached tmux session, whose pane becomes the job's terminal (ops/restore_terminal.py).
"""

from __future__ import annotations

import os
import re
import shutil

from gpusnap.system import proc

PTS = re.compile(r"/dev/pts/(\d+)$")
SERIAL_OR_VT = re.compile(r"/dev/tty(S|USB|ACM|AMA)?\d+$")
PTMX = ("/dev/ptmx", "/dev/pts/ptmx")
SESSION_PREFIX = "gpusnap-"


def held(pids: list[int]) -> list[str]:
    """The terminals the tree has open whose other end is outside it (a pane's or an ssh
    session's pty, a console), sorted; a pty whose master the tree holds is not one."""
    masters: set[int] = set()
    ends: set[str] = set()
    for pid in pids:
        for fd, target in proc.fd_targets(pid).items():
            if target in PTMX:
                index = _tty_index(pid, fd)
                if index is not None:
                    masters.add(index)
            elif PTS.match(target) or SERIAL_OR_VT.match(target):
                ends.add(target)
    return sorted(t for t in ends if not ((m := PTS.match(t)) and int(m.group(1)) in masters))


def _tty_index(pid: int, fd: int) -> int | None:
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}") as f:
            for line in f:
                if line.startswith("tty-index:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def here(fd: int = 0) -> str | None:
    """This process's controlling terminal when `fd` is it and this process is in its
    foreground process group (so it can hand the terminal to a restored job); else None."""
    try:
        if not os.isatty(fd) or os.tcgetpgrp(fd) != os.getpgrp():   # ENOTTY: not our controlling one
            return None
        return os.ttyname(fd)
    except OSError:
        return None


def tmux() -> str | None:
    """tmux on PATH (cron's PATH has /usr/bin, where Debian puts it)."""
    return shutil.which("tmux")


def tmux_socket() -> str:
    """The tmux server gpusnap uses: this user's default one ($TMUX_TMPDIR, else /tmp), the one
    a plain `tmux attach` as the same user finds ($TMUX is ignored: a restore started inside
    someone's tmux client must not put the job on that server)."""
    return os.path.join(os.environ.get("TMUX_TMPDIR") or "/tmp", f"tmux-{os.geteuid()}", "default")


def attach_command(session: str) -> str:
    """How to reach the session: root's tmux server, so `sudo` first when gpusnap runs under it."""
    sock = tmux_socket()
    default = os.path.join("/tmp", f"tmux-{os.geteuid()}", "default")
    sudo = "sudo " if os.geteuid() == 0 and os.environ.get("SUDO_USER") else ""
    return f"{sudo}tmux attach -t {session}" if sock == default else f"{sudo}tmux -S {sock} attach -t {session}"


def session_base(name: str | None) -> str:
    """gpusnap-NAME, in the characters tmux takes in a session name ('.' and ':' it does not)."""
    return SESSION_PREFIX + (re.sub(r"[^A-Za-z0-9_-]", "-", name or "") or "job")


def session_free(name: str) -> bool:
    """No tmux session of exactly this name on gpusnap's tmux server (or no tmux at all)."""
    import subprocess

    tm = tmux()
    if tm is None:
        return True
    env = {k: v for k, v in os.environ.items() if k != "TMUX"}
    try:
        p = subprocess.run([tm, "has-session", "-t", f"={name}"], stdin=subprocess.DEVNULL,
                           capture_output=True, env=env, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return True
    return p.returncode != 0


def next_session(name: str | None) -> str:
    """The session a restore would take now: gpusnap-NAME, or -2, -3, ... when taken."""
    base = session_base(name)
    return next((n for n in (base, *(f"{base}-{k}" for k in range(2, 100))) if session_free(n)), base)


INSTALL_TMUX = "install tmux (`apt install tmux`) so that gpusnap can give it one"


def outlook(terminals: list[str], session: str | None = None) -> dict[str, str]:
    """What a restore does with these terminals, one sentence per case: `terminal` (run from a
    terminal) and `no_terminal` (cron, a script, --json); `session`: the tmux session name it
    would take, when known. {} when the job had none to hand over."""
    if not terminals:
        return {}
    had = ", ".join(terminals[:3])
    s = session or f"{SESSION_PREFIX}NAME"
    no_term = (f"from no terminal (cron, a script, --json) gpusnap restores it into a new tmux session "
               f"{s}: `{attach_command(s)}` shows its output and takes its input; the session ends with the job"
               if tmux() else
               f"from no terminal (cron, a script, --json) restore refuses it (exit 2, the job stays as it is): "
               f"no tmux here to give it a terminal; {INSTALL_TMUX}")
    return {"had": had, "session": s if tmux() else None,
            "terminal": f"restored from a terminal it gets that terminal (in place of {had}) and runs in its "
                        "foreground; `gpusnap restore` waits until it ends, as the shell would (Ctrl-C goes to "
                        "the job, Ctrl-Z stops both)",
            "no_terminal": no_term}


def doctor_check() -> tuple[str, str, str | None]:
    """doctor's line on tmux: (status, detail, fix)."""
    tm = tmux()
    if tm:
        return ("ok", f"{tm}: a job that had a terminal, restored from no terminal (cron, a script, --json), "
                      "gets a new tmux session gpusnap-NAME", None)
    return ("info", "no tmux: a job that had a terminal (a tmux/screen pane, ssh, a shell's `&` job) restores "
                    "only from a terminal; from cron or a script the restore is refused (exit 2)", INSTALL_TMUX)
