"""Jobs that had a terminal (a tmux or screen pane, a shell's `&` job) restore, with the real
CRIU, tmux and screen: from no terminal (a script, --json) into a new tmux session
gpusnap-NAME that the test attaches to, reads and types into; from another tmux pane onto that
pane's terminal. Each job finishes with exactly the result of an uninterrupted run, and what
`doctor` and `inspect` said beforehand is what the restore then did."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import GPUSNAP, PY, ROOT, kill_pids, run_gpusnap, run_json

pytestmark = [pytest.mark.criu,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (apt install tmux)")]

JOB = ROOT / "tests" / "jobs" / "ttyjob.py"
TICKS, TICK_MS = 200, 30


class Tmux:
    """A tmux server of the test's own: `-S SOCKET`, or the default server under TMUX_TMPDIR
    (the one gpusnap uses when the test gives it that TMUX_TMPDIR)."""

    def __init__(self, socket: Path | None = None, tmpdir: Path | None = None):
        self.args = ["tmux", "-S", str(socket)] if socket else ["tmux"]
        self.env = {k: v for k, v in os.environ.items() if k != "TMUX"}
        if tmpdir:
            self.env["TMUX_TMPDIR"] = str(tmpdir)

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([*self.args, *args], capture_output=True, text=True, env=self.env,
                              check=check, timeout=30)

    def shell(self, name: str) -> None:
        self("new-session", "-d", "-s", name, "-x", "160", "-y", "50",
             "env PS1='$ ' bash --norc --noprofile")

    def type(self, target: str, text: str) -> None:
        if text:
            self("send-keys", "-t", target, "-l", text)
        self("send-keys", "-t", target, "Enter")

    def screen(self, target: str) -> str:
        return self("capture-pane", "-p", "-J", "-S", "-400", "-t", target).stdout

    def wait_for(self, target: str, pattern: str, timeout: float = 90) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen(target)
            m = re.search(pattern, text)
            if m:
                return m
            assert time.monotonic() < deadline, f"no {pattern!r} in pane {target}:\n{text[-2000:]}"
            time.sleep(0.1)

    def alive(self, session: str) -> bool:
        return self("has-session", "-t", f"={session}", check=False).returncode == 0

    def kill(self) -> None:
        self("kill-server", check=False)


@pytest.fixture
def tmux(tmp_path):
    """(the test's own server for the original jobs, gpusnap's server under TMUX_TMPDIR, env)"""
    own = Tmux(socket=tmp_path / "own.sock")
    tmpdir = tmp_path / "tmx"
    tmpdir.mkdir(mode=0o700)
    theirs = Tmux(tmpdir=tmpdir)
    yield own, theirs, {"TMUX_TMPDIR": str(tmpdir)}
    own.kill()
    theirs.kill()


def reference(tmp_path: Path, line: str) -> str:
    out = tmp_path / "reference"
    subprocess.run([PY, str(JOB), str(out), str(TICKS), "0"], input=line + "\n\n", text=True, check=True,
                   capture_output=True, timeout=300)
    return out.read_text()


def job_pid(out: Path, timeout: float = 30) -> int:
    """The PID of the job writing `out` (its command line names it)."""
    deadline = time.monotonic() + timeout
    while True:
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    argv = (d / "cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if len(argv) > 2 and argv[1] == str(JOB).encode() and argv[2] == str(out).encode():
                    return int(d.name)
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.05)


def dump_and_kill(pid: int, repo: Path, name: str, tmux_env: dict) -> tuple[dict, dict, dict]:
    """doctor's terminal finding, the dump, inspect's terminal outlook; then the job killed."""
    doc = run_json("doctor", pid, env=tmux_env)
    finding = next(f for f in doc["checks"] if f["name"] == "terminal")
    dumped = run_json("dump", pid, "--repo", repo, "--name", name, env=tmux_env)
    inspected = run_json("inspect", name, "--repo", repo, env=tmux_env)["terminal"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists():
        assert time.monotonic() < deadline, f"PID {pid} still there"
        time.sleep(0.05)
    return finding, dumped, inspected


def answered(pane: Tmux, target: str, line: str, out: Path, tmp_path: Path, end: str = "Enter") -> None:
    """Type `line` at the job's prompt; its answer shows in the pane, its result is exactly the
    uninterrupted run's; then Enter (or Ctrl-C, `end="C-c"`) ends it."""
    pane.wait_for(target, r"say something: ")
    pane.type(target, line)
    pane.wait_for(target, rf"you said '{re.escape(line)}'\npress Enter to end: ")
    assert out.read_text() == reference(tmp_path, line)
    if end == "Enter":
        pane.type(target, "")
    else:
        pane("send-keys", "-t", target, end)


def session_ends(pane: Tmux, session: str) -> None:
    deadline = time.monotonic() + 30
    while pane.alive(session):
        assert time.monotonic() < deadline, f"tmux session {session} outlived the job"
        time.sleep(0.1)


def _state(pid: int) -> str:
    st = Path(f"/proc/{pid}/stat").read_text()
    return st[st.rindex(")") + 2]


def last_tick(text: str) -> int:
    return max(int(t) for t in re.findall(r"^tick (\d+)$", text, re.M))


@pytest.mark.parametrize("via", ["stream", "files", "lazy"])
def test_pane_job_restored_from_a_script_gets_a_tmux_session(tmp_path, repo, tmux, via):
    """A job typed into a shell in a tmux pane; restored by a script (stdin not a terminal):
    it runs in a new tmux session gpusnap-NAME, whose pane shows its output go on and takes
    its input; it ends with the uninterrupted result, and the session with it."""
    own, theirs, env = tmux
    out = tmp_path / "out"
    own.shell("orig")
    own.type("orig", f"{PY} {JOB} {out} {TICKS} {TICK_MS}")
    own.wait_for("orig", r"tick 20\b")
    pid = job_pid(out)
    finding, dumped, inspected = dump_and_kill(pid, repo, "train", env)
    at_dump = last_tick(own.screen("orig"))
    assert "new tmux session gpusnap-NAME" in finding["detail"]          # doctor, before the dump
    assert inspected["session"] == "gpusnap-train"
    assert "from no terminal" in inspected["no_terminal"] and "gpusnap-train" in inspected["no_terminal"]

    p = subprocess.run([*GPUSNAP, "restore", "train", "--repo", str(repo), "--via", via], cwd=ROOT,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
                       env={**os.environ, **env})
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [str(pid)]
    attach = f"tmux -S {tmp_path / 'tmx'}/tmux-0/default attach -t gpusnap-train"
    assert f"the job's terminal: {attach}" in p.stderr
    assert f"`{attach}`" in inspected["no_terminal"]                      # inspect said this very command
    try:
        assert theirs.alive("gpusnap-train")
        theirs.wait_for("gpusnap-train", rf"tick {TICKS - 1}\n")
        shown = {int(t) for t in re.findall(r"^tick (\d+)$", theirs.screen("gpusnap-train"), re.M)}
        assert set(range(at_dump + 1, TICKS)) <= shown                    # its output goes on there
        assert os.readlink(f"/proc/{pid}/fd/0") == theirs("display", "-p", "-t", "gpusnap-train",
                                                            "#{pane_tty}").stdout.strip()
        answered(theirs, "gpusnap-train", "hello from tmux", out, tmp_path)
        session_ends(theirs, "gpusnap-train")                             # "the session ends with the job"
    finally:
        kill_pids([pid])


def test_pane_job_restored_from_another_pane_gets_that_pane(tmp_path, repo, tmux):
    """`gpusnap restore` typed in another tmux pane: the job gets that pane's terminal and its
    foreground; restore waits until the job ends, then the shell has the pane again."""
    own, _theirs, env = tmux
    out = tmp_path / "out"
    own.shell("orig")
    own.shell("other")
    own.type("orig", f"{PY} {JOB} {out} {TICKS} {TICK_MS}")
    own.wait_for("orig", r"tick 20\b")
    pid = job_pid(out)
    finding, _dumped, inspected = dump_and_kill(pid, repo, "train", env)
    assert "restored from a terminal it gets that terminal" in finding["detail"]
    assert inspected["terminal"].startswith("restored from a terminal it gets that terminal")

    tty = own("display", "-p", "-t", "other", "#{pane_tty}").stdout.strip()
    own.type("other", f"cd {ROOT} && TMUX_TMPDIR={env['TMUX_TMPDIR']} {' '.join(GPUSNAP)} restore train "
                      f"--repo {repo}; echo restore-exit=$?")
    try:
        own.wait_for("other", rf"the job's terminal: this one \({re.escape(tty)}\)")
        own.wait_for("other", rf"tick {TICKS - 1}\n")
        assert os.readlink(f"/proc/{pid}/fd/1") == tty
        st = Path(f"/proc/{pid}/stat").read_text()
        pgrp, tpgid = (int(x) for x in st[st.rindex(")") + 2:].split()[2:6:3])
        assert tpgid == pgrp                                              # it has the pane's foreground
        own.wait_for("other", r"say something: ")
        own("send-keys", "-t", "other", "C-z")                            # "Ctrl-Z stops both"
        own.wait_for("other", r"Stopped.*gpusnap restore train.*\nrestore-exit=148")
        assert _state(pid) == "T"
        own.type("other", "fg")                                           # ... and `fg` resumes both
        own.wait_for("other", r"\$ fg\n.*gpusnap restore train")
        deadline = time.monotonic() + 30
        while _state(pid) == "T":
            assert time.monotonic() < deadline, "fg did not continue the job"
            time.sleep(0.05)
        own.type("other", "typed in the other pane")
        own.wait_for("other", r"you said 'typed in the other pane'\npress Enter to end: ")
        assert out.read_text() == reference(tmp_path, "typed in the other pane")
        own.type("other", "")
        own.wait_for("other", r"gpusnap: the restored job \(PID \d+\) ended \(exit status 0\)\n\$ ")
    finally:
        kill_pids([pid])


def test_background_job_of_a_pane_shell_restored_with_json(tmp_path, repo, tmux):
    """`job &` from a shell in a pane, restored by a program (`--json`): one JSON object that
    names the tmux session, which takes the job's input."""
    own, theirs, env = tmux
    out = tmp_path / "out"
    own.shell("orig")
    own.type("orig", f"{PY} {JOB} {out} {TICKS} {TICK_MS} &")
    own.wait_for("orig", r"tick 20\b")
    pid = job_pid(out)
    finding, _dumped, inspected = dump_and_kill(pid, repo, "bg", env)
    r = run_json("restore", "bg", "--repo", repo, env=env, stdin=subprocess.DEVNULL)
    try:
        assert r["pid"] == pid
        assert r["terminal"]["mode"] == "tmux" and r["terminal"]["session"] == inspected["session"] == "gpusnap-bg"
        answered(theirs, "gpusnap-bg", "bg", out, tmp_path, end="C-c")    # Ctrl-C reaches the job
        session_ends(theirs, "gpusnap-bg")
        assert not Path(f"/proc/{pid}").exists()                          # the job ended (reaped)
    finally:
        kill_pids([pid])


@pytest.mark.skipif(shutil.which("screen") is None, reason="needs screen")
def test_screen_job_restored_from_a_script(tmp_path, repo, tmux):
    """A job that is a screen window's command (it leads the window's session) comes back in a
    tmux session: output, input, the uninterrupted result; a second restore beside a running
    session takes gpusnap-NAME-2, as inspect says beforehand."""
    _own, theirs, env = tmux
    out = tmp_path / "out"
    sock = f"gst{os.getpid()}"
    subprocess.run(["screen", "-dmS", sock, PY, str(JOB), str(out), str(TICKS), str(TICK_MS)], check=True,
                   timeout=30)
    pid = job_pid(out)
    try:
        theirs("new-session", "-d", "-s", "gpusnap-win", "sleep 600")     # the name is taken
        copy = tmp_path / "hardcopy"
        deadline = time.monotonic() + 60
        while not (copy.exists() and re.search(r"tick 10\b", copy.read_text(errors="replace"))):
            assert time.monotonic() < deadline, "the job in screen printed nothing"
            subprocess.run(["screen", "-S", sock, "-p", "0", "-X", "hardcopy", str(copy)], timeout=30)
            time.sleep(0.1)
        _finding, _dumped, inspected = dump_and_kill(pid, repo, "win", env)
        assert inspected["session"] == "gpusnap-win-2"
        p = subprocess.run([*GPUSNAP, "restore", "win", "--repo", str(repo)], cwd=ROOT, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=300, env={**os.environ, **env})
        assert p.returncode == 0, p.stderr
        assert "attach -t gpusnap-win-2 " in p.stderr
        answered(theirs, "gpusnap-win-2", "from screen", out, tmp_path, end="C-c")   # passed on to it
        session_ends(theirs, "gpusnap-win-2")
        assert not Path(f"/proc/{pid}").exists()                          # the job ended (reaped)
    finally:
        kill_pids([pid])
        subprocess.run(["screen", "-S", sock, "-X", "quit"], capture_output=True, timeout=30)


def test_no_terminal_and_no_tmux_is_refused_untouched(tmp_path, repo, tmux):
    """No terminal to give and no tmux: exit 2 naming tmux, nothing restored, as inspect said."""
    own, _theirs, env = tmux
    out = tmp_path / "out"
    own.shell("orig")
    own.type("orig", f"{PY} {JOB} {out} {TICKS} {TICK_MS}")
    own.wait_for("orig", r"tick 5\b")
    pid = job_pid(out)
    bare = tmp_path / "bin"
    bare.mkdir()
    no_tmux = {**env, "PATH": str(bare)}
    _f, _d, _i = dump_and_kill(pid, repo, "nt", env)
    inspected = run_json("inspect", "nt", "--repo", repo, env=no_tmux)["terminal"]
    assert "restore refuses it (exit 2" in inspected["no_terminal"] and inspected["session"] is None
    tmux_check = next(c for c in run_json("doctor", env=no_tmux)["checks"] if c["name"] == "tmux")
    assert "the restore is refused (exit 2)" in tmux_check["detail"]
    p = run_gpusnap("restore", "nt", "--repo", repo, env=no_tmux, stdin=subprocess.DEVNULL)
    assert p.returncode == 2, p.stderr
    assert "apt install tmux" in p.stderr
    assert not Path(f"/proc/{pid}").exists()


def test_slurm_run_after_a_requeue_restores_a_terminal_job_into_tmux(tmp_path, repo, tmux):
    """slurm-run after a requeue restores from no terminal: a snapshot of a job that had one
    comes back in a tmux session, and the `resumed` event says how to reach it."""
    import json

    own, theirs, env = tmux
    out = tmp_path / "out"
    own.shell("orig")
    own.type("orig", f"{PY} {JOB} {out} {TICKS} {TICK_MS}")
    own.wait_for("orig", r"tick 20\b")
    pid = job_pid(out)
    _f, _d, inspected = dump_and_kill(pid, repo, "sj", env)
    sup = subprocess.Popen([*GPUSNAP, "slurm-run", "--name", "sj", "--repo", str(repo), "--", "false"], cwd=ROOT,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, **env, "SLURM_RESTART_COUNT": "1"})
    events = repo / "jobs" / "sj" / "slurm.jsonl"
    try:
        deadline = time.monotonic() + 120
        while True:
            got = [json.loads(ln) for ln in events.read_text().splitlines()] if events.exists() else []
            resumed = [e for e in got if e["event"] == "resumed"]
            if resumed:
                break
            assert time.monotonic() < deadline and sup.poll() is None, got
            time.sleep(0.1)
        term = resumed[0]["terminal"]
        assert resumed[0]["pid"] == pid and term["mode"] == "tmux" and term["session"] == inspected["session"]
        answered(theirs, "gpusnap-sj", "after the requeue", out, tmp_path)
        session_ends(theirs, "gpusnap-sj")
        sup.wait(timeout=60)
        assert f"the job's terminal: {term['attach']}" in sup.stderr.read()
    finally:
        kill_pids([pid])
        if sup.poll() is None:
            sup.kill()
            sup.wait()


def test_a_restore_refused_in_its_tmux_session_is_reported_and_leaves_no_session(tmp_path, repo, tmux):
    """The restore inside the tmux session fails (the original still holds its PIDs): the
    caller exits with that failure's code and message, and no session is left behind."""
    own, theirs, env = tmux
    out = tmp_path / "out"
    own.shell("orig")
    own.type("orig", f"{PY} {JOB} {out} {TICKS} {TICK_MS}")
    own.wait_for("orig", r"tick 5\b")
    pid = job_pid(out)
    try:
        run_json("dump", pid, "--repo", repo, "--name", "busy", env=env)
        assert run_json("inspect", "busy", "--repo", repo, env=env)["terminal"]["session"] == "gpusnap-busy"
        p = run_gpusnap("restore", "busy", "--repo", repo, "--json", env=env, stdin=subprocess.DEVNULL)
        assert p.returncode == 7, p.stdout + p.stderr
        assert '"error": "PIDs in use"' in p.stdout and str(pid) in p.stdout
        assert theirs("ls", check=False).returncode != 0          # no session (no server) left
        answered(own, "orig", "still here", out, tmp_path)           # the original, untouched, finishes
    finally:
        kill_pids([pid])
