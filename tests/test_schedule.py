"""Schedules (issue 8 item 3, issue 13 schedules): nothing typed reaches a cron line or unit
file, every argument is checked as `dump` checks it, intervals mean what they say, the job's
owner is recorded and --match never picks another user's process, and the exact command a
cron line runs dumps a real job with the real CRIU and logs one JSON line per run."""

import datetime as dt
import json
import os
import pwd
import signal
import subprocess
import time

import pytest

from conftest import PY, ROOT, checkout_bin, kill_pids, require_nobody_can_run, run_gpusnap, run_json
from gpusnap.ops import cronexpr, schedule, validate
from gpusnap.errors import ProcessNotFound, UsageError

NOBODY = pwd.getpwnam("nobody").pw_uid


@pytest.fixture
def sched_env(tmp_path, monkeypatch):
    env = {"GPUSNAP_CRON_DIR": str(tmp_path / "cron.d"), "GPUSNAP_LOG_DIR": str(tmp_path / "log"),
           "GPUSNAP_SCHEDULE_DIR": str(tmp_path / "schedules"), "GPUSNAP_SYSTEMD_DIR": str(tmp_path / "systemd"),
           "GPUSNAP_SCHEDULER": "cron"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.fixture
def sleeper(tmp_path):
    """A real process whose command line holds a unique marker (owned by root)."""
    marker = f"gpusnap-sched-marker-{os.getpid()}-{abs(hash(str(tmp_path)))}"
    p = subprocess.Popen([PY, "-c", "import time,sys; time.sleep(600)", marker], start_new_session=True)
    while marker not in open(f"/proc/{p.pid}/cmdline").read():   # (exec'd once Popen returns)
        assert p.poll() is None
    yield marker, p
    p.kill()
    p.wait()


def _cron_line(path) -> tuple[dict[str, str], str, str]:
    """(the file's variables, the user named on its one job line, the command cron hands to
    the shell) of a cron.d file."""
    text = open(path).read().splitlines()
    env = dict(ln.split("=", 1) for ln in text if ln and not ln.startswith("#") and "=" in ln.split()[0])
    lines = [ln for ln in text if ln and not ln.startswith("#") and "=" not in ln.split()[0]]
    assert len(lines) == 1, lines
    fields = lines[0].split(None, 6)
    return env, fields[5], fields[6]


def _cron_command(path) -> str:
    """The command part of the one job line of a cron.d file (what cron hands to sh -c)."""
    _, user, cmd = _cron_line(path)
    assert user == "root"
    return cmd


def _cron_argv(path, hooks: dict[str, str] | None = None) -> list[str]:
    """The job line of a cron.d file as cron runs it: an empty environment but for what
    cron sets (HOME, LOGNAME, and the file's own SHELL and PATH), its SHELL -c the command,
    from /, as the user the line names; nothing of the test's environment (GPUSNAP_*_DIR,
    PYTHONPATH). `hooks` are the one thing added: test hooks (GPUSNAP_FAULT, docs/faults.md;
    GPUSNAP_TEST_HOLD)."""
    variables, user, cmd = _cron_line(path)
    assert {"SHELL", "PATH"} <= set(variables), variables
    pw = pwd.getpwnam(user)
    env = {"HOME": pw.pw_dir, "LOGNAME": user, **variables, **(hooks or {})}
    as_user = [] if pw.pw_uid == os.geteuid() else ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}",
                                                    "--init-groups"]
    return ["/usr/bin/env", "-i", *(f"{k}={v}" for k, v in env.items()), *as_user, variables["SHELL"], "-c", cmd]


def _run_as_cron(path, fault: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The job line of a cron.d file run as cron runs it (_cron_argv), with a GPUSNAP_FAULT hook."""
    argv = _cron_argv(path, {"GPUSNAP_FAULT": fault} if fault else None)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd="/", env={})


@pytest.fixture
def installed_gpusnap(tmp_path, monkeypatch):
    """This checkout installed as `gpusnap` (what `make install` puts in /usr/local/bin: an
    executable that runs this code whatever the caller's environment), first on PATH, so that
    `schedule add` writes it on the cron line and the line runs the code under test."""
    d = checkout_bin(tmp_path)
    exe = d / "gpusnap"
    monkeypatch.setenv("PATH", f"{d}:{os.environ['PATH']}")
    return exe


# -- intervals and cron expressions ---------------------------------------------------------
@pytest.mark.parametrize("every,expr", [("30m", "*/30 * * * *"), ("1m", "* * * * *"), ("15m", "*/15 * * * *"),
                                        ("60m", "0 * * * *"), ("2h", "0 */2 * * *"), ("1h", "0 * * * *"),
                                        ("1d", "0 3 * * *"), ("24h", "0 3 * * *")])
def test_every_translates_to_cron_exactly(every, expr):
    assert cronexpr.every_to_cron(every) == expr


@pytest.mark.parametrize("every", ["45m", "90m", "7m", "5h", "2d", "x", "0m", "30", "30m\n", "-5m", "40d"])
def test_every_cron_cannot_express_is_refused(every):
    with pytest.raises(UsageError):
        cronexpr.every_to_cron(every)


def test_every_45m_is_exact_on_a_systemd_timer():
    assert cronexpr.every_to_systemd("45m") == "2700s"
    assert cronexpr.every_to_systemd("2d") == "172800s"


@pytest.mark.parametrize("expr", ["99 99 99 99 99", "60 * * * *", "* 24 * * *", "* * 0 * *", "* * * 13 *",
                                  "* * * * 8", "* * *", "rm -rf / * * *", "*/0 * * * *", "5-1 * * * *",
                                  "* * * jan *", "@hourly", "* * * * *\n* * * * * root touch /tmp/x",
                                  "*/5%x * * * *", "1,,2 * * * *"])
def test_bad_cron_expressions_are_refused(expr):
    with pytest.raises(UsageError):
        cronexpr.check(expr)


def test_cron_next_fire():
    t = dt.datetime(2026, 1, 1, 10, 7, 30)          # a Thursday
    assert cronexpr.next_fire("*/15 * * * *", t) == dt.datetime(2026, 1, 1, 10, 15)
    assert cronexpr.next_fire("0 3 * * 1-5", dt.datetime(2026, 1, 3, 10, 0)) == dt.datetime(2026, 1, 5, 3, 0)
    assert cronexpr.next_fire("0 0 1 * *", t) == dt.datetime(2026, 2, 1, 0, 0)
    # both day fields restricted: either matches (the 13th, or any Friday)
    assert cronexpr.next_fire("0 12 13 * 5", t) == dt.datetime(2026, 1, 2, 12, 0)
    assert cronexpr.next_fire("0 12 * * 7", t) == dt.datetime(2026, 1, 4, 12, 0)   # 7 = Sunday


def test_cron_to_systemd_calendar():
    assert cronexpr.cron_to_oncalendar("*/15 * * * *") == "*-*-* *:00,15,30,45:00"
    assert cronexpr.cron_to_oncalendar("0 3 * * 1-5") == "Mon,Tue,Wed,Thu,Fri *-*-* 03:00:00"
    with pytest.raises(UsageError):
        cronexpr.cron_to_oncalendar("0 3 13 * 5")


# -- names and arguments -------------------------------------------------------------------
@pytest.mark.parametrize("name", ["nl\n", "a.b", "", "a b", "x" * 65, "a/b", "-"[:0], "ä", "a\0"])
def test_bad_schedule_names_are_refused(name):
    with pytest.raises(UsageError):
        validate.check_schedule_name(name)


@pytest.mark.parametrize("match", ["python\n* * * * * root touch /tmp/PWNED #", "a\0b", "(", "", "a\rb"])
def test_bad_match_is_refused_like_dump(match, sched_env):
    with pytest.raises(UsageError):
        schedule.add("x", match, every="30m", user="root")
    if "\0" not in match:
        p = run_gpusnap("dump", "--match", match, "--repo", "/nonexistent-repo")
        assert p.returncode == 2, p.stderr


def test_injection_attempts_never_reach_the_cron_file(sched_env, tmp_path):
    with pytest.raises(UsageError):
        schedule.add("x", "python\n* * * * * root touch /tmp/PWNED #", every="30m", user="root")
    with pytest.raises(UsageError):
        schedule.add("nl\n", "python", every="30m", user="root")
    with pytest.raises(UsageError):
        schedule.add("x", "python", cron="99 99 99 99 99", user="root")
    with pytest.raises(UsageError):
        schedule.add("x", "python", every="30m", user="root", repo=tmp_path / "r\n* * * * * root id #")
    assert not os.path.exists(sched_env["GPUSNAP_CRON_DIR"]) or not os.listdir(sched_env["GPUSNAP_CRON_DIR"])
    # a pattern with cron's '%' and shell quotes is stored, never written on the cron line
    pat = "a\\%b'$(touch /tmp/PWNED)`id`"
    s = schedule.add("pct", pat, every="30m", user="root", repo=tmp_path / "repo")
    text = open(s.path).read()
    assert "%" not in text and "PWNED" not in text and "$(" not in text
    cmd = _cron_command(s.path)
    assert cmd.endswith(f"schedule run pct --config-dir {sched_env['GPUSNAP_SCHEDULE_DIR']} "
                        f"2>>{sched_env['GPUSNAP_LOG_DIR']}/schedule-pct.err")
    assert schedule.load("pct").match == pat
    spec = os.stat(os.path.join(sched_env["GPUSNAP_SCHEDULE_DIR"], "pct.json"))
    assert spec.st_mode & 0o777 == 0o600 and os.stat(s.path).st_mode & 0o777 == 0o644


def test_cron_file_content(sched_env, tmp_path):
    s = schedule.add("fold", "python train.py", every="30m", keep_last=3, user="nobody", repo=tmp_path / "repo")
    text = open(s.path).read()
    assert s.path == os.path.join(sched_env["GPUSNAP_CRON_DIR"], "gpusnap-fold")
    assert text.startswith("# gpusnap schedule fold (job owner nobody")
    job = [ln for ln in text.splitlines() if ln.startswith("*/30 * * * * root ")]
    assert len(job) == 1
    assert schedule.load("fold").uid == NOBODY and schedule.load("fold").keep_last == 3
    assert [x.name for x in schedule.list_schedules()] == ["fold"]
    assert schedule.remove("fold").path == s.path
    assert schedule.list_schedules() == [] and not os.path.exists(s.path)
    with pytest.raises(UsageError):
        schedule.remove("fold")


def test_systemd_timer_files(sched_env, monkeypatch, tmp_path):
    monkeypatch.setenv("GPUSNAP_SCHEDULER", "systemd")
    s = schedule.add("every45", "python train.py", every="45m", user="root", repo=tmp_path / "repo")
    d = sched_env["GPUSNAP_SYSTEMD_DIR"]
    timer = open(os.path.join(d, "gpusnap-every45.timer")).read()
    service = open(os.path.join(d, "gpusnap-every45.service")).read()
    assert "OnUnitActiveSec=2700s" in timer and "WantedBy=timers.target" in timer
    assert "Type=oneshot" in service
    assert f"ExecStart={' '.join(s.command())}\n" in service and "%" not in service
    s2 = schedule.add("weekdays", "python train.py", cron="0 3 * * 1-5", user="root", repo=tmp_path / "repo")
    assert "OnCalendar=Mon,Tue,Wed,Thu,Fri *-*-* 03:00:00" in open(s2.files[0]).read()
    assert {x.name for x in schedule.list_schedules()} == {"every45", "weekdays"}
    schedule.remove("every45")
    assert not os.path.exists(os.path.join(d, "gpusnap-every45.timer"))


def test_add_of_an_existing_name_refuses_without_replace(sched_env, tmp_path):
    for r in ("r1", "r2"):
        run_gpusnap("init", "--repo", tmp_path / r, check=True)
    schedule.add("job", "python train.py", every="30m", user="root", repo=tmp_path / "r1")
    with pytest.raises(UsageError, match="exists"):
        schedule.add("job", "python train.py", every="1h", user="root", repo=tmp_path / "r2")
    assert schedule.load("job").repo == str(tmp_path / "r1")
    s = schedule.add("job", "python train.py", every="1h", user="root", repo=tmp_path / "r2", replace=True)
    assert s.replaced_repo == str(tmp_path / "r1") and schedule.load("job").when == "0 * * * *"
    p = run_gpusnap("schedule", "add", "--match", "python train.py", "--name", "job", "--every", "1h",
                    "--user", "root", "--repo", tmp_path / "r2", env=sched_env)
    assert p.returncode == 2 and "--replace" in p.stderr


def test_owner_is_recorded_from_the_running_job(sched_env, sleeper, tmp_path):
    sleeper, p = sleeper
    assert p.poll() is None, "the marker process died"
    s = schedule.add("own", sleeper, every="30m", repo=tmp_path / "repo")
    assert s.uid == os.geteuid()
    with pytest.raises(UsageError, match="owner is unknown"):
        schedule.add("own2", sleeper + "-nothing-runs", every="30m", repo=tmp_path / "repo")


def test_match_never_picks_another_users_process(tmp_path):
    """The issue's lesser item: --match also matching another user's process."""
    marker = f"gpusnap-two-users-{os.getpid()}"
    mine = subprocess.Popen([PY, "-c", "import time; time.sleep(600)", marker], start_new_session=True)
    theirs = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                               PY, "-c", "import time; time.sleep(600)", marker], start_new_session=True)
    try:
        import time
        deadline = time.monotonic() + 10
        while validate.process_uid(theirs.pid) != NOBODY and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(UsageError, match="2 process trees"):
            validate.find_job(marker)
        assert validate.find_job(marker, os.geteuid()) == mine.pid
        assert validate.find_job(marker, NOBODY) == theirs.pid
        mine.kill()
        mine.wait()
        with pytest.raises(ProcessNotFound, match="other users ignored"):
            validate.find_job(marker, os.geteuid())
    finally:
        for p in (mine, theirs):
            p.kill()
            p.wait()


NOTHING_RUNS = "gpusnap-test-no-such-crond"     # a process name nothing on any machine has


def test_detect_scheduler_finds_none_without_systemd_or_cron(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUSNAP_SCHEDULER", raising=False)
    kind, why = schedule.detect_scheduler(schedule.Probes(daemons=(NOTHING_RUNS,),
                                                          systemd_run_dir=str(tmp_path / "none")))
    assert kind is None and "no cron daemon runs" in why


def test_detect_scheduler_prefers_systemd_when_it_is_pid_1(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUSNAP_SCHEDULER", raising=False)
    (tmp_path / "run-systemd").mkdir()
    pid1 = open("/proc/1/comm").read().strip()     # what PID 1 is here stands for systemd
    assert schedule.detect_scheduler(schedule.Probes(systemd_run_dir=str(tmp_path / "run-systemd"),
                                                     pid1_names=(pid1,)))[0] == "systemd"
    # the directory alone (left behind, or bind-mounted into a container) is not systemd running
    assert schedule.detect_scheduler(schedule.Probes(systemd_run_dir=str(tmp_path / "run-systemd"),
                                                     daemons=(NOTHING_RUNS,),
                                                     pid1_names=("not-" + pid1,)))[0] is None


def test_detect_scheduler_finds_a_running_cron_daemon(tmp_path, monkeypatch):
    """A live process of that name counts (read from /proc), not an installed binary."""
    monkeypatch.delenv("GPUSNAP_SCHEDULER", raising=False)
    p = subprocess.Popen(["sleep", "600"])
    try:
        while open(f"/proc/{p.pid}/comm").read().strip() != "sleep":   # (exec'd once Popen returns)
            assert p.poll() is None
        kind, why = schedule.detect_scheduler(schedule.Probes(daemons=("sleep",),
                                                              systemd_run_dir=str(tmp_path / "none")))
        assert kind == "cron" and "sleep runs" in why
    finally:
        p.kill()
        p.wait()


def _no_scheduler_env(sched_env, tmp_path, installed: bool) -> dict:
    """No scheduler: cron daemons looked for under a name nothing runs as (installed: an
    executable of that name on PATH, which nobody started)."""
    env = dict(sched_env, GPUSNAP_SCHEDULER="", GPUSNAP_CRON_DAEMONS=NOTHING_RUNS,
               GPUSNAP_SYSTEMD_RUN_DIR=str(tmp_path / "no-systemd"))
    if installed:
        b = tmp_path / "bin"
        b.mkdir()
        (b / NOTHING_RUNS).write_text("#!/bin/sh\nexit 0\n")
        (b / NOTHING_RUNS).chmod(0o755)
        env["PATH"] = f"{b}:{os.environ['PATH']}"
    return env


no_scheduler_env = _no_scheduler_env   # (tests/test_schedule_daemon.py)


def test_no_scheduler_makes_add_refuse_naming_the_package(sched_env, tmp_path):
    env = _no_scheduler_env(sched_env, tmp_path, installed=False)
    p = run_gpusnap("schedule", "add", "--match", "x", "--name", "n", "--every", "30m", "--user", "root",
                    "--repo", tmp_path / "repo", env=env)
    assert p.returncode == 22 and "apt install cron" in p.stderr, p.stderr
    assert not os.path.exists(sched_env["GPUSNAP_CRON_DIR"]) and not os.path.exists(sched_env["GPUSNAP_SCHEDULE_DIR"])


def test_no_scheduler_is_a_doctor_warning(sched_env, tmp_path):
    env = _no_scheduler_env(sched_env, tmp_path, installed=False)
    d = run_gpusnap("doctor", "--json", env=env)
    checks = {c["name"]: c for c in json.loads(d.stdout)["checks"]}
    assert checks["scheduler"]["status"] == "warn" and "cron" in checks["scheduler"]["fix"]


def test_job_gone_is_reported_after_runs_in_a_row(sched_env, installed_gpusnap, tmp_path):
    """The exact cron command, run for real: the job does not exist, each run logs a JSON
    line 'no-job' and exits 5; after GONE_AFTER runs `ls` and `doctor` say the job is gone."""
    s = schedule.add("gone", f"no-such-job-{os.getpid()}-xyz", every="30m", user="root", repo=tmp_path / "repo")
    assert _cron_command(s.path).startswith(f"{installed_gpusnap} ")
    for i in range(schedule.GONE_AFTER):
        p = _run_as_cron(s.path)
        assert p.returncode == 5, (p.stdout, p.stderr)
    lines = open(s.log).read().splitlines()
    recs = [json.loads(ln) for ln in lines]
    assert [r["outcome"] for r in recs] == ["no-job"] * schedule.GONE_AFTER
    assert [r["runs_without_job"] for r in recs] == list(range(1, schedule.GONE_AFTER + 1))
    assert all(dt.datetime.strptime(r["time"], "%Y-%m-%dT%H:%M:%SZ") for r in recs)
    assert "gone for 3 runs" in open(s.log[:-4] + ".err").read()
    st = run_json("schedule", "ls", env=sched_env)["schedules"][0]
    assert st["job_gone"] and st["result"] == "no-job" and st["last_run"] == recs[-1]["time"]
    assert st["next_run"] > st["last_run"]
    text = run_gpusnap("schedule", "ls", env=sched_env).stdout
    assert "JOB GONE" in text
    checks = {c["name"]: c for c in json.loads(run_gpusnap("doctor", "--json", env=sched_env).stdout)["checks"]}
    assert checks["schedule gone"]["status"] == "warn" and "3 runs in a row" in checks["schedule gone"]["detail"]


@pytest.mark.criu
def test_the_cron_command_dumps_keeps_the_last_n_and_logs_json(sched_env, installed_gpusnap, sample_job, repo):
    job = sample_job(steps=400, mb=8, threads=1, step_ms=20)
    job.wait_steps(3)
    marker = f"gpusnap.samples.job {job.out}"
    p = run_gpusnap("schedule", "add", "--match", marker, "--name", "sched", "--every", "5m", "--keep-last", "2",
                    "--repo", repo, "--json", env=sched_env)
    assert p.returncode == 0, p.stderr
    s = schedule.load("sched")
    assert s.uid == 0
    assert _cron_command(s.path).startswith(f"{installed_gpusnap} ")
    for _ in range(3):
        r = _run_as_cron(s.path)
        assert r.returncode == 0, r.stderr
    recs = [json.loads(ln) for ln in open(s.log).read().splitlines()]
    assert [r["outcome"] for r in recs] == ["ok"] * 3
    assert all(r["pid"] == job.pid and r["bytes_raw"] > 0 and r["snapshot"] and r["exit_code"] == 0 for r in recs)
    assert recs[-1]["pruned"] == 1
    listing = run_json("ls", "--repo", repo)
    assert [x["name"] for x in listing["snapshots"]] == ["sched", "sched"]
    assert {x["path"] for x in listing["snapshots"]} == {r["snapshot"] for r in recs[1:]}
    st = run_json("schedule", "ls", env=sched_env)["schedules"][0]
    assert st["result"] == "ok" and st["last_run"] == recs[-1]["time"] and st["next_run"] and not st["job_gone"]
    assert job.alive()
    assert run_gpusnap("verify", "--repo", repo).returncode == 0


def test_legacy_cron_file_is_flagged_by_doctor(sched_env):
    os.makedirs(sched_env["GPUSNAP_CRON_DIR"])
    old = os.path.join(sched_env["GPUSNAP_CRON_DIR"], "gpusnap-old")
    with open(old, "w") as f:
        f.write("# gpusnap schedule old\n*/30 * * * * root gpusnap dump --match 'x' --name old\n")
    checks = {c["name"]: c for c in json.loads(run_gpusnap("doctor", "--json", env=sched_env).stdout)["checks"]}
    assert checks["schedule file gpusnap-old"]["status"] == "warn"
    p = run_gpusnap("schedule", "add", "--match", "x", "--name", "old", "--every", "30m", "--user", "root",
                    env=sched_env)
    assert p.returncode == 2 and "--replace" in p.stderr


def test_not_root_gets_an_error_not_a_traceback(tmp_path):
    require_nobody_can_run()
    env = {"GPUSNAP_SCHEDULER": "cron", "GPUSNAP_SCHEDULE_DIR": "/etc/gpusnap-test-not-writable/schedules",
           "GPUSNAP_CRON_DIR": "/etc/cron.d", "GPUSNAP_LOG_DIR": "/var/log/gpusnap-test-nope",
           "PYTHONPATH": str(ROOT)}
    p = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", PY, "-m", "gpusnap",
                        "schedule", "add", "--match", "x", "--name", "y", "--every", "30m", "--user", "root",
                        "--repo", "/tmp/gpusnap-nobody-repo-none"],
                       capture_output=True, text=True, env={**os.environ, **env}, cwd="/")
    assert p.returncode == 3 and "Traceback" not in p.stderr and "sudo" in p.stderr, p.stderr
    assert not os.path.exists("/etc/gpusnap-test-not-writable")


def test_a_run_interrupted_after_the_commit_logs_the_kept_snapshot(sched_env, installed_gpusnap, sample_job, repo,
                                                                   reference):
    """A TERM after the commit point (fault hook, docs/faults.md): the log line says the
    snapshot is kept (not "failed"), names it, and that snapshot restores to the result of an
    uninterrupted run."""
    kw = dict(steps=300, mb=8, threads=1)
    expected = reference(**kw)
    job = sample_job(**kw, step_ms=20)
    job.wait_steps(3)
    p = run_gpusnap("schedule", "add", "--match", f"gpusnap.samples.job {job.out}", "--name", "cut",
                    "--every", "5m", "--repo", repo, env=sched_env)
    assert p.returncode == 0, p.stderr
    s = schedule.load("cut")
    assert _cron_command(s.path).startswith(f"{installed_gpusnap} ")
    r = _run_as_cron(s.path, fault="commit:snapshot-renamed:TERM")
    assert r.returncode == 28, r.stderr
    [rec] = [json.loads(ln) for ln in open(s.log).read().splitlines()]
    assert rec["outcome"] == "interrupted-after-commit" and rec["exit_code"] == 28
    [listed] = run_json("ls", "--repo", repo)["snapshots"]
    assert rec["snapshot"] == listed["path"]
    assert run_json("schedule", "ls", env=sched_env)["schedules"][0]["result"] == "interrupted-after-commit"
    job.kill()
    try:
        assert run_json("restore", "cut", "--repo", repo)["pid"] == job.pid
        assert job.result() == expected
    finally:
        kill_pids(job.pids)


@pytest.mark.criu
def test_a_run_killed_without_a_word_is_reported_not_hidden(sched_env, installed_gpusnap, sample_job, repo, tmp_path):
    """A scheduled run SIGKILLed in the middle of its dump (as the OOM killer takes a dump
    before its job) logs nothing itself: while it runs `schedule ls` says a run is under way;
    once it is dead, `ls` and `doctor` say it was killed at once, the next run writes its
    line into the log before its own, and nothing of it is left behind."""
    job = sample_job(steps=400, mb=16, threads=1, step_ms=20)
    job.wait_steps(3)
    p = run_gpusnap("schedule", "add", "--match", f"gpusnap.samples.job {job.out}", "--name", "oomed",
                    "--every", "5m", "--repo", repo, env=sched_env)
    assert p.returncode == 0, p.stderr
    s = schedule.load("oomed")
    hold = tmp_path / "hold.json"
    cron = subprocess.Popen(_cron_argv(s.path, {"GPUSNAP_TEST_HOLD": f"after-gate:{hold}"}), cwd="/", env={},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not hold.exists():
            assert cron.poll() is None and time.monotonic() < deadline, "the run did not reach the hold"
            time.sleep(0.05)
        st = run_json("schedule", "ls", env=sched_env)["schedules"][0]
        assert st["running_since"] and st["result"] is None
        assert "a run under way since" in run_gpusnap("schedule", "ls", env=sched_env).stdout
        os.kill(json.loads(hold.read_text())["pid"], signal.SIGKILL)
        cron.wait(timeout=60)
    finally:
        if cron.poll() is None:
            os.killpg(cron.pid, signal.SIGKILL)
            cron.wait()
    assert not os.path.exists(s.log) or open(s.log).read() == ""      # the run itself wrote nothing
    st = run_json("schedule", "ls", env=sched_env)["schedules"][0]
    assert st["result"] == "killed" and st["running_since"] is None
    assert "ended without a word" in st["last_message"] and "OOM killer" in st["last_message"]
    checks = {c["name"]: c for c in json.loads(run_gpusnap("doctor", "--json", env=sched_env).stdout)["checks"]}
    assert checks["schedule oomed"]["status"] == "warn" and "killed" in checks["schedule oomed"]["detail"]
    assert run_json("ls", "--repo", repo)["snapshots"] == []
    assert job.alive() and job.wait_steps(job.steps_done() + 3)     # the job ran on
    r = _run_as_cron(s.path)
    assert r.returncode == 0, r.stderr
    recs = [json.loads(ln) for ln in open(s.log).read().splitlines()]
    assert [r["outcome"] for r in recs] == ["killed", "ok"]
    assert run_json("schedule", "ls", env=sched_env)["schedules"][0]["result"] == "ok"
    assert not [n for n in os.listdir(os.path.dirname(s.log)) if ".run-" in n]


def test_a_killed_run_counts_in_its_place_among_the_runs(sched_env, tmp_path):
    """A dead run's marker stands for a `killed` result where it started: after a run that
    logged later (they overlapped) the last result is that run's; a marker newer than every
    line is the last result; a live run's marker is `running_since`, never a result."""
    from gpusnap.ops.schedule import inflight

    s = schedule.add("overlap", f"no-such-job-{os.getpid()}-q", every="30m", user="root", repo=tmp_path / "repo")
    dead = subprocess.Popen(["true"])
    dead.wait()
    os.makedirs(os.path.dirname(s.log), exist_ok=True)
    marker = f"{s.log[:-4]}.run-{dead.pid}-1"
    with open(marker, "w") as f:
        json.dump({"time": "2026-01-01T10:00:00Z"}, f)
    schedule.append_log(s, {"time": "2026-01-01T10:00:05Z", "schedule": s.name, "pid": 1, "outcome": "ok"})
    st = schedule.status(s)
    assert st["result"] == "ok" and st["running_since"] is None
    with open(marker, "w") as f:
        json.dump({"time": "2026-01-01T10:00:09Z"}, f)
    st = schedule.status(s)
    assert st["result"] == "killed" and st["last_run"] == "2026-01-01T10:00:09Z"
    os.unlink(marker)
    with inflight.running(s, "2026-01-01T10:01:00Z"):
        st = schedule.status(s)
        assert st["running_since"] == "2026-01-01T10:01:00Z" and st["result"] == "ok"
    assert schedule.status(s)["running_since"] is None
    assert not [n for n in os.listdir(os.path.dirname(s.log)) if ".run-" in n]
