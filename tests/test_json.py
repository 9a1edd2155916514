"""`--json` prints exactly one JSON object on stdout, for every command, on success and on
every error class it can produce (a bad command line, another user's repository, a damaged
repository or file, a held lock ...). Repositories are real (written by the repository's own
writer); the cases that need a process use the real CRIU."""

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import GPUSNAP, ROOT, kill_pids, require_nobody_can_run, run_gpusnap
from gpusnap.errors import AccessDenied, BadExportFile, CorruptSnapshot, DamageRemains, NotRoot, ProcessNotFound, RepositoryError, RepositoryLocked, SnapshotNotFound, UsageError
from gpusnap.repo import Repository
from repo_helpers import PAGE, dump

HAVE_RUNUSER = shutil.which("runuser") is not None and os.geteuid() == 0


def one_object(proc) -> dict:
    """stdout is exactly one JSON object (and nothing else)."""
    text = proc.stdout.strip()
    assert text, f"no JSON on stdout (exit {proc.returncode}); stderr: {proc.stderr[-800:]}"
    dec = json.JSONDecoder()
    obj, end = dec.raw_decode(text)
    assert end == len(text), f"more than one JSON value on stdout: {proc.stdout!r}"
    assert isinstance(obj, dict)
    assert "Traceback" not in proc.stderr
    return obj


def check(expect_code: int, *args, env=None, as_nobody=False, input=None):
    full = [*map(str, args), "--json"]
    e = dict(os.environ)
    e.update(env or {})
    if as_nobody:
        require_nobody_can_run()
        cmd = ["runuser", "-u", "nobody", "--", "env", *[f"{k}={v}" for k, v in (env or {}).items()],
               *GPUSNAP, *full]
    else:
        cmd = [*GPUSNAP, *full]
    proc = subprocess.run(cmd, capture_output=True, text=input is None or isinstance(input, str), env=e, cwd=ROOT,
                          timeout=300, input=input)
    if isinstance(proc.stdout, bytes):
        proc = subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(), proc.stderr.decode())
    obj = one_object(proc)
    assert proc.returncode == expect_code, (args, proc.returncode, obj, proc.stderr[-500:])
    if expect_code:
        assert obj["exit_code"] == expect_code and obj["error"] and obj["message"]
    return obj


@pytest.fixture(scope="module")
def world():
    """A root-owned repository under a directory anyone may enter (for the 'not yours'
    cases), a second empty place, a damaged copy and an export file."""
    base = Path(tempfile.mkdtemp(prefix="gpusnap-json-", dir="/tmp"))
    os.chmod(base, 0o755)
    repo = Repository.open(base / "repo", create=True)
    snap, _ = dump(repo, {"pages-1.img": os.urandom(PAGE * 20) + bytes(PAGE * 4), "core-1.img": b"c" * 300},
                   name="job")
    dump(repo, {"pages-1.img": os.urandom(PAGE * 5)}, name="other")
    damaged = base / "damaged"
    shutil.copytree(base / "repo", damaged)
    packs = sorted(p for p in (damaged / "packs").rglob("*") if p.is_file())
    for p in packs:
        b = bytearray(p.read_bytes())
        b[len(b) // 2] ^= 0xFF
        p.write_bytes(b)
    exp = base / "job.gsx"
    subprocess.run([*GPUSNAP, "export", "job", "-o", exp, "--repo", base / "repo"], check=True, cwd=ROOT,
                   capture_output=True)
    bad = base / "bad.gsx"
    b = bytearray(exp.read_bytes())
    b[len(b) // 2] ^= 1
    bad.write_bytes(b)
    os.chmod(exp, 0o644)
    notrepo = base / "notrepo"
    notrepo.mkdir()
    (notrepo / "something").write_text("x")
    yield {"base": base, "repo": base / "repo", "snap": snap, "damaged": damaged, "export": exp, "bad": bad,
           "notrepo": notrepo}
    shutil.rmtree(base, ignore_errors=True)


def test_read_commands(world):
    r = world["repo"]
    assert len(check(0, "ls", "--repo", r)["snapshots"]) == 2
    assert check(0, "ls", "--repo", r, "--name", "job")["totals"]["snapshots"] == 2
    assert check(0, "inspect", "job", "--repo", r)["name"] == "job"
    assert check(0, "verify", "--repo", r)["ok"] is True
    check(SnapshotNotFound.exit_code, "inspect", "nope", "--repo", r)
    check(SnapshotNotFound.exit_code, "verify", "nope", "--repo", r)
    check(UsageError.exit_code, "inspect", "--repo", r)                 # missing argument (typer's parser)
    check(UsageError.exit_code, "ls", "--no-such-option")
    check(RepositoryError.exit_code, "ls", "--repo", world["notrepo"])    # a directory that is no repository
    check(RepositoryError.exit_code, "ls", "--repo", world["base"] / "nothing-here")   # no repository there


def test_verify_on_a_damaged_repository_is_one_object(world):
    obj = check(CorruptSnapshot.exit_code, "verify", "--repo", world["damaged"])
    assert obj["ok"] is False and obj["error"] == CorruptSnapshot.title and obj["problems"]


def test_repair_that_leaves_damage_is_one_object_with_the_error(world, tmp_path):
    """Like verify: the report, with the keys of the error that sets the exit code."""
    copy = tmp_path / "damaged"
    shutil.copytree(world["damaged"], copy)
    obj = check(DamageRemains.exit_code, "repair", "--read-data", "--repo", copy)
    assert obj["ok"] is False and obj["error"] == DamageRemains.title and obj["snapshots_damaged"]


def test_change_commands(world, tmp_path):
    r = tmp_path / "r"
    shutil.copytree(world["repo"], r)
    check(UsageError.exit_code, "prune", "--keep-last", "0", "--repo", r)
    check(UsageError.exit_code, "forget", "--repo", r)
    check(SnapshotNotFound.exit_code, "forget", "nope", "--repo", r)
    check(RepositoryError.exit_code, "forget", "x", "--repo", world["notrepo"])
    repo = Repository.open(r)
    with repo.writer_lock():        # a writer (shared, docs/format.md §6): prune waits for it
        check(RepositoryLocked.exit_code, "prune", "--repo", r, env={"GPUSNAP_LOCK_WAIT": "0"})
    with repo.writer_lock(exclusive=True):      # a prune: a forget waits for it too
        check(RepositoryLocked.exit_code, "prune", "--repo", r, env={"GPUSNAP_LOCK_WAIT": "0"})
        check(RepositoryLocked.exit_code, "forget", "other", "--repo", r, "--lock-wait", "0")
    assert check(0, "prune", "--dry-run", "--repo", r)["dry_run"] is True
    assert len(check(0, "forget", "other", "--repo", r)["snapshots_forgotten"]) == 1
    assert check(0, "prune", "--repo", r)["bytes_freed"] > 0


def test_export_import(world, tmp_path):
    out = tmp_path / "x.gsx"
    assert check(0, "export", "job", "-o", out, "--repo", world["repo"])["bytes"] == out.stat().st_size
    check(UsageError.exit_code, "export", "job", "-o", "-", "--repo", world["repo"])
    check(SnapshotNotFound.exit_code, "export", "nope", "-o", out, "--repo", world["repo"])
    for r in ("r2", "r3"):
        run_gpusnap("init", "--repo", tmp_path / r, check=True)
    assert check(0, "import", out, "--repo", tmp_path / "r2")["name"] == "job"
    check(BadExportFile.exit_code, "import", world["bad"], "--repo", tmp_path / "r3")
    check(BadExportFile.exit_code, "import", "-", "--repo", tmp_path / "r3", input=b"not an export")
    check(UsageError.exit_code, "import", tmp_path / "missing.gsx", "--repo", tmp_path / "r3")


def test_machine_commands():
    check(0, "ps")
    obj = json.loads(run_gpusnap("doctor", "--json").stdout)   # exit 0 or 1 (a failed check): one object
    assert "checks" in obj
    one_object(run_gpusnap("doctor", "--json"))


def test_schedule_commands(tmp_path):
    env = {"GPUSNAP_CRON_DIR": str(tmp_path / "cron.d"), "GPUSNAP_LOG_DIR": str(tmp_path / "log"),
           "GPUSNAP_SCHEDULE_DIR": str(tmp_path / "schedules"), "GPUSNAP_SYSTEMD_DIR": str(tmp_path / "systemd"),
           "GPUSNAP_SCHEDULER": "cron"}
    check(0, "schedule", "ls", env=env)
    check(UsageError.exit_code, "schedule", "add", "--match", "x", "--name", "s", "--every", "nonsense", env=env)
    check(UsageError.exit_code, "schedule", "rm", env=env)
    # add/rm write system files (cron or systemd, the schedule module decides): whatever the
    # outcome on this machine, one object
    e = dict(os.environ, **env)
    for args in (["schedule", "add", "--match", "no-such-job-xyz", "--name", "jsoncheck", "--every", "30m",
                  "--repo", tmp_path / "r"], ["schedule", "ls"], ["schedule", "run", "jsoncheck"],
                 ["schedule", "rm", "jsoncheck"]):
        one_object(subprocess.run([*GPUSNAP, *map(str, args), "--json"], capture_output=True, text=True, env=e,
                                  cwd=ROOT, timeout=120))


@pytest.mark.skipif(not HAVE_RUNUSER, reason="needs root and runuser to run as another user")
@pytest.mark.parametrize("args,code", [
    (["ls"], AccessDenied.exit_code),
    (["inspect", "job"], AccessDenied.exit_code),
    (["verify"], AccessDenied.exit_code),
    (["prune", "--keep-last", "1"], AccessDenied.exit_code),
    (["forget", "job"], AccessDenied.exit_code),
    (["export", "job", "-o", "/dev/null"], AccessDenied.exit_code),
    (["import", "{export}"], AccessDenied.exit_code),
    (["restore", "job"], NotRoot.exit_code),
    (["dump", "1"], NotRoot.exit_code),
])
def test_not_root_and_not_yours(world, args, code):
    """As user nobody against root's repository: gpusnap's own error and hint, never a usage
    box or a traceback; in text mode too."""
    args = [a.replace("{export}", str(world["export"])) for a in args]
    env = {"GPUSNAP_REPO": str(world["repo"])}
    obj = check(code, *args, env=env, as_nobody=True)
    assert obj["hint"]
    proc = subprocess.run(["runuser", "-u", "nobody", "--", "env", f"GPUSNAP_REPO={world['repo']}", *GPUSNAP,
                           *args], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == code
    assert proc.stderr.startswith("gpusnap: ") and "\nhint: " in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "Usage:" not in proc.stderr and "╭" not in proc.stderr
    # the paths given as a snapshot directory are checked the same way
    if args[0] == "inspect":
        path = world["repo"] / "snapshots" / world["snap"].path.name
        check(AccessDenied.exit_code, "inspect", path, as_nobody=True)


@pytest.mark.criu
def test_dump_and_restore_json(sample_job, repo, tmp_path, world):
    check(UsageError.exit_code, "dump", "--repo", repo)
    check(ProcessNotFound.exit_code, "dump", "--match", "no-such-job-anywhere-xyz", "--repo", repo)
    job = sample_job(steps=100000, mb=4, threads=1, step_ms=20)
    job.wait_steps(2)
    check(RepositoryError.exit_code, "dump", job.pid, "--repo", world["notrepo"])
    d = check(0, "dump", job.pid, "--repo", repo, "--name", "j")
    check(7, "restore", d["snapshot"])                       # PIDs in use: the job still runs
    job.kill()
    r = check(0, "restore", d["snapshot"])
    kill_pids([r["pid"], *r.get("pids", []), *job.pids])
    check(SnapshotNotFound.exit_code, "restore", "nope", "--repo", repo)


@pytest.mark.skipif(not HAVE_RUNUSER, reason="needs root and runuser to run as another user")
@pytest.mark.parametrize("args", [
    ["schedule", "add", "--match", "no-such-job-xyz", "--name", "nobodys", "--every", "30m"],
    ["import", "-", "--repo", "/var/lib/gpusnap-nobody-cannot/repo"],
    ["doctor"],
    ["ps"],
])
def test_not_root_any_command_has_gpusnaps_own_error(args):
    """Whatever the outcome as user nobody (the schedule module decides its own checks): one
    JSON object, or gpusnap's own message with a hint; never a traceback or a usage box."""
    require_nobody_can_run()
    for json_ in (True, False):
        proc = subprocess.run(["runuser", "-u", "nobody", "--", *GPUSNAP, *args, *(["--json"] if json_ else [])],
                              capture_output=True, text=True, cwd=ROOT, timeout=120, input="")
        assert "Traceback" not in proc.stderr and "Usage:" not in proc.stderr, proc.stderr
        if json_:
            one_object(proc)
        elif proc.returncode not in (0, 1):
            assert proc.stderr.startswith("gpusnap: ") and "hint: " in proc.stderr, proc.stderr
