"""The README's lab walkthrough, run as written: the shell block under its `walkthrough` marker
goes to bash (`-e`: every line must succeed) in a fresh environment after the set-up, with no
virtual environment: `gpusnap` is whatever PATH finds, here this checkout's code (conftest's
checkout_bin), next to Debian's tmux, pkill and python3. Only where things land is moved into the
test's own directory (HOME, the repository's default location $GPUSNAP_REPO, the schedule's
files, a private tmux server), so that the walkthrough never touches the machine's own; a real
cron daemon runs, as `schedule add` requires. Then what a user would look at: the job restored
into its own tmux session counts on from the snapshot, and the schedule and a dump by name
snapshot the restored job."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from conftest import ROOT, checkout_bin, kill_pids
from gpusnap.system import proc

pytestmark = pytest.mark.criu

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def walkthrough() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- walkthrough:[^>]*-->\n```sh\n(.*?)\n```\n", text, re.S)
    assert m, "README.md has no walkthrough block"
    return m.group(1) + "\n"


def test_the_readme_block_is_the_lab_scenario():
    """The block keeps the steps the issue asks for: tmux, a schedule, a crash, a restore, on."""
    block = walkthrough()
    for step in ("tmux new-session", "gpusnap schedule add", "pkill -9", "gpusnap restore",
                 "gpusnap schedule run", "gpusnap dump --name"):
        assert step in block, step
    assert ".venv" not in block and "activate" not in block


def _steps(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"^step (\d+)\s*$", text, re.M)]


def test_the_readme_lab_walkthrough_runs_as_written(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "tmux").mkdir(mode=0o700)
    env = {"HOME": str(home), "PATH": f"{checkout_bin(tmp_path)}:{SYSTEM_PATH}", "SHELL": "/bin/bash",
           "TERM": "xterm-256color", "LANG": "C.UTF-8", "USER": "root", "LOGNAME": "root",
           "TMUX_TMPDIR": str(tmp_path / "tmux"), "GPUSNAP_REPO": str(tmp_path / "repo"),
           "GPUSNAP_SCHEDULE_DIR": str(tmp_path / "schedules"), "GPUSNAP_LOG_DIR": str(tmp_path / "log"),
           "GPUSNAP_CRON_DIR": str(tmp_path / "cron.d")}
    cron = None
    if not proc.find_matching(r"^(/usr/sbin/)?cron( |$)"):
        cron = subprocess.Popen(["/usr/sbin/cron", "-f"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while (st := proc.read_stat(cron.pid)) is None or st.comm != "cron":
            assert cron.poll() is None, "cron -f exited"
    script = tmp_path / "walkthrough.sh"
    script.write_text(walkthrough())
    job = re.escape(str(home / "train.py"))
    try:
        r = subprocess.run(["bash", "-e", str(script)], cwd=home, env=env, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        # step 4: restore said where the job's terminal is, and the pane shows it counting on
        said = r.stderr
        assert "the job's terminal: tmux -S" in said and "attach -t gpusnap-train" in said, said
        shown = _steps(r.stdout)
        assert shown and shown[0] > 1 and shown == list(range(shown[0], shown[0] + len(shown))), r.stdout
        time.sleep(1.5)
        pane = subprocess.run(["tmux", "capture-pane", "-p", "-t", "gpusnap-train"], env=env,
                              capture_output=True, text=True).stdout
        later = _steps(pane)
        assert later[0] == shown[0] and later[-1] > shown[-1], pane
        assert later == list(range(later[0], later[-1] + 1)), pane
        # step 2 and 5: each scheduled run snapshotted the job, the second one the restored tree
        log = [json.loads(ln) for ln in (tmp_path / "log" / "schedule-train.log").read_text().splitlines()]
        assert [x["outcome"] for x in log] == ["ok", "ok"], log
        pids = proc.find_matching(job)
        assert len(pids) == 1 and log[1]["pid"] == pids[0], (log, pids)
        ls = json.loads(subprocess.run(["gpusnap", "ls", "--json"], env=env, capture_output=True,
                                       text=True, check=True).stdout)
        assert len(ls["snapshots"]) == 4 and {s["name"] for s in ls["snapshots"]} == {"train"}
        named = {j["name"]: j for j in ls["jobs"]}["train"]
        assert named["pid"] == pids[0] and named["running"] and named["restores"] == 1, named
    finally:
        subprocess.run(["tmux", "kill-server"], env=env, capture_output=True)
        subprocess.run(["gpusnap", "schedule", "rm", "train"], env=env, capture_output=True)
        kill_pids(proc.find_matching(job))
        if cron is not None:
            cron.send_signal(signal.SIGTERM)
            cron.wait(timeout=30)
    assert not os.path.exists("/etc/cron.d/gpusnap-train")
