"""Schedules check what will run them (issue 30 item 6) and follow a restored job (item 2):
a cron daemon that runs (seen in /proc), or systemd as PID 1, not an installed binary; else
`schedule add` exits 22 saying what to start or install, and doctor says the same. Messages
show what the user typed (no `None`, no repr escapes), and a name clash is reported first.
One test runs Debian's real cron daemon (`cron -f`, started and stopped by the test): a `run`
job with a schedule crashes, is restored, and cron's next run snapshots the restored job."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PY, kill_pids, run_gpusnap, run_json
from gpusnap.system import proc
from test_job_identity import _crash, _run, _wait_for, checkout_gpusnap
from test_schedule import no_scheduler_env, sched_env  # noqa: F401 - a fixture

CRON = "/usr/sbin/cron"


def test_an_installed_cron_daemon_nobody_started_is_no_scheduler(sched_env, tmp_path):  # noqa: F811
    """The issue: cron installed, no daemon running: `add` said ok (exit 0), doctor said ok,
    and nothing ever ran. Now exit 22, naming the daemon to start; doctor warns the same."""
    env = no_scheduler_env(sched_env, tmp_path, installed=True)
    p = run_gpusnap("schedule", "add", "--match", "x", "--name", "n", "--every", "30m", "--user", "root",
                    "--repo", tmp_path / "repo", env=env)
    assert p.returncode == 22, p.stderr
    assert "installed but not running" in p.stderr and "start the cron daemon" in p.stderr, p.stderr
    assert not os.path.exists(sched_env["GPUSNAP_SCHEDULE_DIR"])
    d = json.loads(run_gpusnap("doctor", "--json", env=env).stdout)
    check = {c["name"]: c for c in d["checks"]}["scheduler"]
    assert check["status"] == "warn" and "installed but not running" in check["detail"]
    assert "start the cron daemon" in check["fix"]


def test_messages_show_what_was_typed(sched_env, tmp_path):  # noqa: F811
    """On main: `job None of user root` and `'train\\\\.py'` (in add's output and doctor's)."""
    marker = f"gpusnap-msg-{os.getpid()}"
    sleeper = subprocess.Popen([PY, "-c", "import time; time.sleep(600)", f"{marker}.py"])
    job = _run(tmp_path / "repo", "named", tmp_path / "go", 1)
    try:
        while marker not in proc.cmdline(sleeper.pid):
            assert sleeper.poll() is None
        pattern = marker + r"\.py"
        p = run_gpusnap("schedule", "add", "--name", "bymatch", "--match", pattern, "--every", "30m",
                        "--repo", tmp_path / "repo", env=sched_env)
        assert p.returncode == 0, p.stderr
        assert f"the job matching `{pattern}`" in p.stdout and "\\\\" not in p.stdout, p.stdout
        p = run_gpusnap("schedule", "add", "--name", "named", "--every", "30m", "--repo", tmp_path / "repo",
                        env=sched_env)
        assert p.returncode == 0, p.stderr
        assert "the job named named" in p.stdout and "None" not in p.stdout, p.stdout
        # the job goes; each scheduled run finds nothing; doctor names the job as typed
        _crash(job["pid"])
        sleeper.kill()
        sleeper.wait()
        for name in ("bymatch", "named"):
            for _ in range(3):
                r = run_gpusnap("schedule", "run", name, "--config-dir", sched_env["GPUSNAP_SCHEDULE_DIR"],
                                env=sched_env)
                assert r.returncode == 5, r.stderr
        checks = {c["name"]: c for c in json.loads(run_gpusnap("doctor", "--json", env=sched_env).stdout)["checks"]}
        assert checks["schedule named"]["detail"].startswith("the job named named (user root) has been gone")
        assert checks["schedule bymatch"]["detail"].startswith(f"the job matching `{pattern}` (user root)")
        text = run_gpusnap("doctor", env=sched_env)
        assert "None" not in text.stdout + text.stderr and "\\\\" not in text.stdout + text.stderr
        # a clash of names is what `add` reports first, though the job is gone too
        p = run_gpusnap("schedule", "add", "--name", "named", "--every", "1h", "--repo", tmp_path / "repo",
                        env=sched_env)
        assert p.returncode == 2 and "a schedule named named exists" in p.stderr, p.stderr
    finally:
        sleeper.kill()
        sleeper.wait()
        kill_pids(proc.tree(job["pid"]) if proc.exists(job["pid"]) else [])


def test_a_real_cron_daemon_snapshots_the_restored_job(tmp_path):
    """The whole scenario with the real cron daemon: `schedule add` sees it running; the job
    crashes and is restored; cron's next run (at a minute boundary) dumps the restored job by
    its name, with no action from the user."""
    assert proc.find_matching(r"^(/usr/sbin/)?cron( |$)") == [], "another cron daemon runs here"
    repo = tmp_path / "repo"
    name = f"crontest{os.getpid()}"
    env = {"GPUSNAP_LOG_DIR": str(tmp_path / "log"), "GPUSNAP_SCHEDULE_DIR": str(tmp_path / "schedules"),
           "PATH": checkout_gpusnap(tmp_path)}
    for k in ("GPUSNAP_SCHEDULER", "GPUSNAP_CRON_DIR", "GPUSNAP_CRON_DAEMONS", "GPUSNAP_SYSTEMD_RUN_DIR"):
        assert k not in os.environ
    cron = subprocess.Popen([CRON, "-f"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    job = _run(repo, name, tmp_path / "go", 5)
    restored: list[int] = []
    try:
        while (st := proc.read_stat(cron.pid)) is None or st.comm != "cron":
            assert cron.poll() is None, "cron -f exited"
        s = run_json("schedule", "add", "--name", name, "--every", "1m", "--repo", repo, env=env)
        assert s["backend"] == "cron" and s["files"] == [f"/etc/cron.d/gpusnap-{name}"]
        assert s["command"].startswith(str(tmp_path / "bin" / "gpusnap") + " schedule run")
        _wait_for(Path(job["stdout"]), "step 4")
        run_json("dump", "--name", name, "--repo", repo)
        _crash(job["pid"])
        res = run_json("restore", name, "--repo", repo)
        restored = res["pids"]
        t_restored = time.time()
        deadline = time.monotonic() + 150       # the next minute boundary (two if one fell mid-crash)
        ok = []
        while not ok:
            assert time.monotonic() < deadline, f"no cron-fired snapshot of the restored job: {_log(s)}"
            ok = [r for r in _log(s) if r.get("outcome") == "ok" and r.get("pid") == res["pid"]]
            time.sleep(0.5)
        snaps = [r for r in run_json("ls", "--repo", repo)["snapshots"] if r["path"] == ok[0]["snapshot"]]
        assert snaps and snaps[0]["created"] > t_restored
        st = {x["name"]: x for x in run_json("schedule", "ls", env=env)["schedules"]}[name]
        assert st["job_pid"] == res["pid"] and st["result"] == "ok" and not st["job_gone"]
        doctor = {c["name"]: c for c in json.loads(run_gpusnap("doctor", "--json", env=env).stdout)["checks"]}
        assert doctor["scheduler"]["status"] == "ok" and f"PID {cron.pid}" in doctor["scheduler"]["detail"]
    finally:
        cron.terminate()
        cron.wait(timeout=30)
        run_gpusnap("schedule", "rm", name, env=env)
        kill_pids(restored)
        kill_pids(proc.tree(job["pid"]) if proc.exists(job["pid"]) else [])
    assert not os.path.exists(f"/etc/cron.d/gpusnap-{name}")


def _log(s: dict) -> list[dict]:
    try:
        return [json.loads(ln) for ln in open(s["log"]).read().splitlines()]
    except FileNotFoundError:
        return []
