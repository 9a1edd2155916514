"""A restored job's terminal: which one it gets, the restore run inside a new tmux session when
gpusnap has no terminal to give, and gpusnap waiting in its terminal while the job runs there.

A job that had a terminal (a tmux or screen pane, an ssh session, a shell's `&` job) comes
back through CRIU's --shell-job, which hands it CRIU's own stdin in place of that terminal
(criu/ttyinfo.py). So:

- from a terminal (stdin is gpusnap's controlling terminal, gpusnap in its foreground, no
  --json): CRIU runs in gpusnap's session with that terminal as stdin, in a process group of
  its own (a Ctrl-C meant for the restore never reaches it) with SIGTTOU ignored, and gives the
  job the terminal's foreground. gpusnap, a child subreaper, adopts the job when CRIU exits and
  then waits for it as a shell waits for a foreground job (stay()): as with plain
  `criu restore --shell-job`, the prompt comes back when the job ends; Ctrl-Z stops both.
- from no terminal: gpusnap starts a new detached tmux session (gpusnap-NAME) whose pane runs
  this module's main(): the same restore, now from the pane's terminal, which stays in the pane
  as the job's session leader. It writes the result (or the error) into a private directory
  the caller reads, so the caller prints and exits as any restore does.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from gpusnap.errors import GpusnapError, UsageError
from gpusnap.system import terminal

WANTS = ("auto", "new", "here")     # here if possible, else a new one / always new / must be here
PR_SET_CHILD_SUBREAPER = 36


def choose(terminals: list[str], want: str) -> str:
    """'here' or 'tmux' for a job that had `terminals`; UsageError when neither can be."""
    if want not in WANTS:
        raise UsageError(f"terminal must be one of {', '.join(WANTS)}, not {want!r}")
    if want != "new" and terminal.here():
        return "here"
    if want == "here":
        raise UsageError("the job had a terminal and gpusnap's stdin is not its foreground terminal")
    if terminal.tmux() is None:
        raise UsageError(f"the job had a terminal ({', '.join(terminals[:3])}) and this restore has none to "
                         "give it (stdin is not a terminal, or --json): no tmux here to provide one; "
                         "nothing was touched",
                         hint=f"run `gpusnap restore` from a terminal (the job gets it), or {terminal.INSTALL_TMUX} "
                              "and restore again")
    return "tmux"


def describe(mode: str, tty: str | None = None, session: str | None = None) -> dict:
    """The `terminal` of a restore's result: its mode and the one line restore prints."""
    if mode == "here":
        return {"mode": "here", "tty": tty, "line": f"the job's terminal: this one ({tty}); gpusnap restore "
                "waits until the job ends (Ctrl-C goes to the job)"}
    attach = terminal.attach_command(session)
    return {"mode": "tmux", "session": session, "attach": attach,
            "line": f"the job's terminal: {attach} (a new tmux session; it ends with the job)"}


def become_subreaper() -> None:
    """The restored root (detached by CRIU) becomes our child when CRIU exits, so stay() can
    wait for it and see it stop."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def modes(fd: int, snap) -> tuple:
    """What of our terminal's state to put back after CRIU (which sets the recorded one on
    it): its size always (the size that counts is this terminal's), and its modes when the
    job was not in the foreground of its terminal at the dump (then the recorded modes were
    the shell's raw readline ones, and typed lines would never reach the job)."""
    import termios

    from gpusnap.criu import ttyinfo

    try:
        size = termios.tcgetwinsize(fd)
        attrs = None if ttyinfo.job_had_foreground(snap) else termios.tcgetattr(fd)
    except (termios.error, OSError, ValueError):
        return None, None
    return size, attrs


def put_back(fd: int, saved: tuple) -> None:
    import termios

    size, attrs = saved
    try:
        if size is not None:
            termios.tcsetwinsize(fd, size)
        if attrs is not None:
            termios.tcsetattr(fd, termios.TCSANOW, attrs)
    except (termios.error, OSError):
        pass


# --- the restore inside a new tmux session -------------------------------------------------

def in_tmux(snap, repo_path, *, gpu_map, via, tcp_close, t0: float, cgroups: str | None = None) -> "object":
    """Run this restore in a new detached tmux session named after the snapshot; returns its
    RestoreResult (with `terminal` naming the session) or raises its error."""
    from gpusnap.ops.restore import RestoreResult  # lazy: restore.py calls this module for a job with a terminal

    work = Path(tempfile.mkdtemp(prefix="gpusnap-tty-"))       # private (0700)
    try:
        req = {"ref": os.path.abspath(snap.path), "repo": os.path.abspath(repo_path), "gpu_map": gpu_map, "via": via,
               "tcp_close": tcp_close, "cgroups": cgroups, "env": dict(os.environ)}
        fd = os.open(work / "request.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(req, f)
        session, pane = _new_session(terminal.session_base(snap.name), work)
        caught: list[int] = []
        # A signal to stop is passed on to the restore in the pane, as an interrupt, and its
        # outcome (interrupted, or done: the job runs) is what we report: never an interrupt
        # code here with a job running there.
        with _signals_passed_on(pane, caught):
            report = _wait_report(work, pane)
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    if report is None:
        raise GpusnapError(f"the restore in tmux session {session} ended without saying how it went",
                           hint=f"`{terminal.attach_command(session)}` if it is still there; `gpusnap ps` shows "
                                "whether the job runs")
    if "error" in report:
        if "runs as PID" not in str(report["error"].get("message")):
            _close_session(session, pane)      # nothing runs there: leave no session behind
        raise _error(report["error"])
    result = RestoreResult(**report["result"])
    result.terminal = describe("tmux", session=session)
    total = round(time.monotonic() - t0, 3)              # with the session's start
    result.phases["tmux"] = round(max(0.0, total - result.seconds), 3)
    result.seconds = total
    if caught:
        result.notes.append("a signal to stop came while the restore ran in its tmux session; it was passed "
                            "on, the restore had already gone too far to stop, and the job runs")
    return result


@contextmanager
def _signals_passed_on(pane: int, caught: list):
    """SIGINT, SIGTERM and SIGHUP to us: noted, and an interrupt (SIGINT) to the pane's restore."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def pass_on(signum, frame):
        caught.append(signum)
        try:
            os.kill(pane, signal.SIGINT)
        except OSError:
            pass

    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, pass_on) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _new_session(base: str, work: Path) -> tuple[str, int]:
    """A new detached tmux session running main(work) in its pane: (its name, the pane's PID).
    The name is gpusnap-NAME, or gpusnap-NAME-2, -3, ... when taken."""
    tmux = terminal.tmux()
    env = {k: v for k, v in os.environ.items() if k != "TMUX"}
    pkg_root = str(Path(__file__).resolve().parent.parent.parent)   # so -m finds this gpusnap
    for k in range(1, 100):
        name = base if k == 1 else f"{base}-{k}"
        p = subprocess.run([tmux, "new-session", "-d", "-s", name, "-x", "132", "-y", "40", "-P",
                            "-F", "#{pane_pid}", "-c", pkg_root, "--",
                            sys.executable, "-m", "gpusnap.ops.restore_terminal", str(work)],
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=60)
        if p.returncode == 0 and p.stdout.strip().isdigit():
            return name, int(p.stdout.strip())
        if "duplicate session" not in p.stderr:
            raise UsageError(f"tmux could not start a session for the job's terminal: "
                             f"{(p.stderr or p.stdout).strip()[-300:]}; nothing was touched",
                             hint="check `tmux new-session -d` works here, or restore from a terminal")
    raise UsageError(f"tmux sessions {base} to {base}-99 all exist", hint="close some (`tmux ls`)")


def _close_session(session: str, pane: int) -> None:
    """The pane's restore has ended: its session goes (tmux notices the pane's end a moment later)."""
    try:
        pidfd = os.pidfd_open(pane)
        try:
            select.select([pidfd], [], [], 10)
        finally:
            os.close(pidfd)
    except OSError:
        pass
    env = {k: v for k, v in os.environ.items() if k != "TMUX"}
    subprocess.run([terminal.tmux(), "kill-session", "-t", f"={session}"], stdin=subprocess.DEVNULL,
                   capture_output=True, env=env, timeout=30)


def _wait_report(work: Path, pane: int) -> dict | None:
    path = work / "result.json"
    try:
        pidfd = os.pidfd_open(pane)
    except OSError:
        pidfd = None
    try:
        while not path.exists():
            if pidfd is None:
                return None
            ready, _, _ = select.select([pidfd], [], [], 0.1)
            if ready and not path.exists():      # the pane's process ended without a report
                return None
    finally:
        if pidfd is not None:
            os.close(pidfd)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _error(d: dict) -> GpusnapError:
    """The error the restore in the pane raised, rebuilt (same class, so the same exit code)."""
    from gpusnap import errors

    cls = getattr(errors, str(d.get("class")), None)
    if not (isinstance(cls, type) and issubclass(cls, GpusnapError)):
        cls = GpusnapError
    e = cls.__new__(cls)
    GpusnapError.__init__(e, str(d.get("message", "")), d.get("hint"))
    if isinstance(e, errors.CriuFailed):
        e.log_path, e.last_lines = d.get("log_path"), list(d.get("last_lines") or [])
    return e


def _report(work: Path, data: dict) -> None:
    tmp = work / "result.json.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, work / "result.json")


def main(argv: list[str]) -> int:
    """In the tmux pane: the restore, from this pane's terminal; the report; then the wait."""
    work = Path(argv[0])
    try:
        req = json.loads((work / "request.json").read_text())
        os.environ.clear()
        os.environ.update(req["env"])
        from gpusnap.ops.restore import restore  # lazy: the pane runs the restore that called in_tmux()

        result = restore(req["ref"], repo=req["repo"], gpu_map=req["gpu_map"], via=req["via"],
                         tcp_close=req["tcp_close"], terminal_want="here", cgroups=req.get("cgroups"))
    except GpusnapError as e:
        err = {"class": type(e).__name__, "message": e.message, "hint": e.hint,
               "log_path": getattr(e, "log_path", None), "last_lines": getattr(e, "last_lines", None)}
        _report(work, {"error": err})
        return e.exit_code
    except KeyboardInterrupt:       # the caller passed on a signal to stop
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        from gpusnap.system import proc

        # CRIU may have finished: the job, adopted by us (a subreaper), then runs here
        running = [p for p in proc.children(os.getpid()) if proc.exists(p)]
        if not running:
            _report(work, {"error": {"class": "Interrupted", "message": "restore interrupted before the job "
                                     "ran; nothing runs", "hint": "restore again"}})
            return 130
        _report(work, {"error": {"class": "Interrupted", "message": f"restore interrupted after CRIU had "
                                 f"restored the job: it runs as PID {running[0]}, in its tmux session",
                                 "hint": "do not restore it again while it runs"}})
        stay(running[0])
        return 130
    except BaseException as e:  # noqa: BLE001 - whatever it was, the caller must hear of it
        _report(work, {"error": {"class": "GpusnapError", "message": f"restore failed in its tmux pane: {e!r}"}})
        return 1
    # from here the job runs: a late interrupt from the caller must not end us (the job's
    # session leader: the job would get a SIGHUP)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _report(work, {"result": result.to_dict()})
    print(f"gpusnap: restored {result.snapshot} as PID {result.pid}; this pane is its terminal and "
          "closes when the job ends", flush=True)
    stay(result.pid)
    return 0


# --- waiting while the job has the terminal ------------------------------------------------

def stay(pid: int, fd: int = 0) -> int | None:
    """Wait while the restored job runs in our terminal, as a shell waits for its foreground
    job: when the job stops (Ctrl-Z) take the terminal back and stop too, so the shell sees it;
    when continued (`fg`) give the terminal back to the job and continue it (`bg`: continue it
    only). A job that leads its own session (a pane's or screen window's command) cannot have
    our terminal's foreground: the keys' signals (Ctrl-C, Ctrl-\\, Ctrl-Z) reach us and are
    passed on to it. The job's exit status, or None when it was not our child."""
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)   # terminal calls from the background allowed
    mine = os.getpgrp()
    try:
        job_group = os.tcgetpgrp(fd)
    except OSError:
        job_group = mine
    holds = job_group != mine                        # the job has the foreground
    if not holds:
        try:
            job_group = os.getpgid(pid)
        except OSError:
            job_group = None

        def pass_on(signum, frame):
            if job_group is not None:
                try:
                    os.killpg(job_group, signum)
                except OSError:
                    pass

        for s in (signal.SIGINT, signal.SIGQUIT, signal.SIGTSTP):
            signal.signal(s, pass_on)
    status = None
    while True:
        try:
            got, st = os.waitpid(-1, os.WUNTRACED)
        except ChildProcessError:     # not adopted (no subreaper): wait for it all the same
            _wait_gone(pid)
            break
        if got != pid:
            continue                  # an orphan of the job, adopted and now reaped
        if os.WIFSTOPPED(st):
            _give_terminal(fd, mine)
            _stop_self()
            if job_group is not None:
                if holds and _foreground(fd, mine):
                    _give_terminal(fd, job_group)
                try:
                    os.killpg(job_group, signal.SIGCONT)
                except OSError:
                    pass
            continue
        status = os.waitstatus_to_exitcode(st)
        break
    _give_terminal(fd, mine)
    return status


def _stop_self() -> None:
    """Stop as a Ctrl-Z'd program does (SIGTSTP, default action: the shell says Stopped)."""
    old = signal.signal(signal.SIGTSTP, signal.SIG_DFL)
    try:
        os.kill(os.getpid(), signal.SIGTSTP)
    finally:
        signal.signal(signal.SIGTSTP, old)


def _foreground(fd: int, group: int) -> bool:
    try:
        return os.tcgetpgrp(fd) == group
    except OSError:
        return False


def _give_terminal(fd: int, group: int) -> None:
    try:
        os.tcsetpgrp(fd, group)
    except OSError:
        pass


def _wait_gone(pid: int) -> None:
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        select.select([pidfd], [], [])
    finally:
        os.close(pidfd)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
