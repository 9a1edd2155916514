"""Where `gpusnap copy` sends to: the other end, `gpusnap serve`, started as a child with a
pipe each way. A local repository gets this gpusnap's own Python; `ssh://[user@]host[:port]/path`
runs the `ssh` found on PATH (so ~/.ssh/config applies; $GPUSNAP_RSH replaces the command,
as borg's BORG_RSH) with `gpusnap serve --repo /path` on the other machine, or the program
named by `--remote-gpusnap`. The child ignores SIGINT: Ctrl-C on a terminal reaches the whole
process group, and it is `copy` that decides how the conversation ends (closing the pipe makes
the other end abort)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from gpusnap.errors import CopyFailed, UsageError
from gpusnap.ops.copy_wire import Channel

_SSH = re.compile(r"ssh://(?:(?P<user>[^@/:\s]+)@)?(?P<host>\[[0-9A-Fa-f:.]+\]|[^@/:\s\[\]]+)"
                  r"(?::(?P<port>[0-9]{1,5}))?(?P<path>/.*)$")


def serve_command(to: str, remote_gpusnap: str | None, lock_wait: float | None) -> tuple[list[str], str | None]:
    """-> (the command line that starts the other end, the local repository path or None)."""
    return _command(to, remote_gpusnap, ["serve"] + ([] if lock_wait is None else ["--lock-wait", str(lock_wait)]))


def remote_command(to: str, remote_gpusnap: str | None, tail: list[str]) -> list[str]:
    """`gpusnap TAIL... --repo PATH` run for the repository `to` names, as `serve` is: this
    gpusnap for a path, the other machine's through ssh (a tiered dump's --copy-keep-last)."""
    return _command(to, remote_gpusnap, tail)[0]


def _command(to: str, remote_gpusnap: str | None, tail: list[str]) -> tuple[list[str], str | None]:
    from gpusnap import settings

    if "://" not in to:
        local = str(Path(to).expanduser().absolute())
        prog = [remote_gpusnap] if remote_gpusnap else [sys.executable, "-m", "gpusnap"]
        return [*prog, *tail, "--repo", local], local
    m = _SSH.fullmatch(to)
    if not m or (m["port"] and not 0 < int(m["port"]) < 65536):
        raise UsageError(f"--to {to}: not a repository path nor ssh://[user@]host[:port]/path")
    rsh = shlex.split(settings.get("GPUSNAP_RSH") or "ssh")
    if not rsh:
        raise UsageError("GPUSNAP_RSH is empty", hint="unset it (ssh is used), or name a command")
    dest = f"{m['user']}@{m['host']}" if m["user"] else m["host"]
    remote = " ".join(shlex.quote(a) for a in [remote_gpusnap or "gpusnap", *tail, "--repo", m["path"]])
    # "--" ends ssh's options: a host name can never be taken for one
    return [*rsh, *(["-p", m["port"]] if m["port"] else []), "--", dest.strip("[]"), remote], None


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Peer:
    """The running other end: its Channel, and its exit status once it is gone."""

    def __init__(self, argv: list[str], what: str):
        from gpusnap.ops.export import widen_pipe

        self.argv = argv
        self.what = what
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                         preexec_fn=_ignore_sigint, close_fds=True)
        except OSError as e:
            raise CopyFailed(f"copy: cannot start {argv[0]}: {e.strerror}",
                             hint="install it, or name another with --remote-gpusnap / $GPUSNAP_RSH") from None
        for f in (self.proc.stdin, self.proc.stdout):
            widen_pipe(f.fileno())
        self.channel = Channel(os.fdopen(self.proc.stdout.fileno(), "rb", buffering=1 << 16, closefd=False),
                               os.fdopen(self.proc.stdin.fileno(), "wb", buffering=1 << 20, closefd=False),
                               what)

    def lost(self) -> CopyFailed | Exception:
        """The error to report when the pipe broke under us: what the other end said in an
        error frame, if it said anything before it went, else that it is gone."""
        import struct

        from gpusnap.ops.copy_wire import ERROR, JSON_MAX, RECORD, remote_error

        ch = self.channel
        try:
            head = ch.r.read(RECORD.size)
            tag, _, _, _, n = RECORD.unpack(head)
            if tag == ERROR and n <= JSON_MAX:
                return remote_error(ch._json(ch.exact(n, "its last word"), "its last word"))
        except (OSError, CopyFailed, struct.error):
            pass
        return self.gone()

    def gone(self) -> CopyFailed:
        status = self.close(timeout=10)
        return CopyFailed(f"copy: the connection to {self.what} broke ({Path(self.argv[0]).name} exited with "
                          f"status {status})",
                          hint="its messages, if any, are above; nothing of the snapshot in progress was "
                               "committed there; run the same copy again")

    def close(self, timeout: float = 60) -> int | None:
        """Close our ends (the other end sees EOF and aborts what it had not committed) and
        wait for it; one that does not end in `timeout` s is killed."""
        for f in (self.channel.w, self.proc.stdin, self.channel.r, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
