"""The command line as scripts use it: help, --json on every read command, PID selection."""

import pytest

from conftest import run_gpusnap, run_json
from gpusnap.errors import ProcessNotFound, UsageError


def test_help_lists_every_command():
    proc = run_gpusnap("--help", check=True)
    for cmd in ("dump", "restore", "ls", "inspect", "verify", "prune", "schedule", "doctor", "ps"):
        assert cmd in proc.stdout


def test_doctor_json_reports_criu():
    data = run_json("doctor")
    checks = {c["name"]: c for c in data["checks"]}
    assert checks["criu"]["status"] == "ok" and "4." in checks["criu"]["detail"]
    assert "NVIDIA driver" in checks


def test_ps_json_reports_the_driver():
    """Holds on a GPU host too: with a driver, every listed process is a real one using a GPU."""
    data = run_json("ps")
    drv = data["driver"]
    assert drv["summary"]
    if drv["available"]:
        for p in data["processes"]:
            assert p["uses_gpu"] or p["libcuda"]
    else:
        # no driver: only /proc can show GPU users, and without /dev/nvidia* there are none
        import glob
        if not glob.glob("/dev/nvidia[0-9]*"):
            assert data["processes"] == []


def test_pid_selection_is_exclusive(tmp_path):
    proc = run_gpusnap("dump", "1", "--match", "x", "--repo", tmp_path / "r")
    assert proc.returncode == UsageError.exit_code
    proc = run_gpusnap("dump", "--repo", tmp_path / "r")
    assert proc.returncode == UsageError.exit_code
    proc = run_gpusnap("dump", "--match", "no-such-job-anywhere-xyz", "--repo", tmp_path / "r")
    assert proc.returncode == ProcessNotFound.exit_code


def test_bad_snapshot_name_is_refused(tmp_path):
    proc = run_gpusnap("dump", "1", "--name", "../evil", "--repo", tmp_path / "r")
    assert proc.returncode == UsageError.exit_code
    assert "not allowed" in proc.stderr


@pytest.mark.criu
def test_match_pidfile_and_inspect(sample_job, repo):
    job = sample_job(steps=300, mb=8, threads=2, step_ms=20)
    job.wait_steps(3)
    by_match = run_json("dump", "--match", f"gpusnap.samples.job {job.out}", "--repo", repo, "--name", "m")
    assert by_match["pid"] == job.pid
    by_file = run_json("dump", "--pidfile", job.out / "pid", "--repo", repo, "--name", "p")
    assert by_file["pid"] == job.pid
    report = run_json("inspect", by_file["snapshot"])
    procs = {p["pid"]: p for p in report["processes"]}
    assert set(procs) == set(job.pids)
    assert procs[job.pid]["threads"] == 3  # main thread + 2 workers
    assert procs[job.pid]["memory_bytes"] >= 8 << 20
    ls = run_json("ls", "--repo", repo)
    assert [s["name"] for s in ls["snapshots"]] == ["m", "p"]
    assert run_json("verify", "--repo", repo)["ok"] is True
    pr = run_json("prune", "--keep-last", "0", "--name", "m", "--all", "--repo", repo)
    assert len(pr["snapshots_deleted"]) == 1
    assert [s["name"] for s in run_json("ls", "--repo", repo)["snapshots"]] == ["p"]


@pytest.mark.criu
def test_inspect_shows_what_a_restore_depends_on(tmp_path):
    """checkpointctl-style inspect of a real dump: command line verbatim (`[idx]` survives the
    terminal rendering), cwd, open files with mode and size and whether they still match the
    disk, a listening socket."""
    import os
    import subprocess
    import sys
    import time

    work = tmp_path / "work"
    work.mkdir()
    data = work / "state.bin"
    code = ("import os,socket,sys,time; os.chdir(sys.argv[1]); f=open('state.bin','w'); f.write('x'*5000); "
            "f.flush(); s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
            "s.bind(('127.0.0.1',0)); s.listen(1); open('port.tmp','w').write(str(s.getsockname()[1])); os.rename('port.tmp','port'); "
            "time.sleep(600)")
    job = subprocess.Popen([sys.executable, "-c", code, str(work), "--layers", "[idx]"], start_new_session=True,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (work / "port").exists():
            assert time.monotonic() < deadline and job.poll() is None
            time.sleep(0.05)
        port = int((work / "port").read_text())
        repo = tmp_path / "repo"
        d = run_json("dump", job.pid, "--repo", repo, "--name", "insp")
        with open(data, "a") as f:           # the file changes after the dump
            f.write("more")
        rep = run_json("inspect", d["snapshot"])
        p = {x["pid"]: x for x in rep["processes"]}[job.pid]
        assert p["cmdline"][-2:] == ["--layers", "[idx]"] and p["cmdline"][1] == "-c"
        assert p["cwd"] == str(work)
        files = {f["path"]: f for f in rep["files"]}
        st = files[str(data)]
        assert st["size"] == 5000 and st["mode"] == "-rw-r--r--" and st["access"] == "w"
        assert st["now_status"] == "differs" and str(data) in rep["files_changed"]
        assert any(s["family"] == "inet" and s["address"] == f"127.0.0.1:{port}" for s in rep["sockets"]), \
            rep["sockets"]
        text = run_gpusnap("inspect", d["snapshot"], check=True, env={"COLUMNS": "250"}).stdout
        assert "--layers [idx]" in text
        assert "differs" in text and f"127.0.0.1:{port}" in text
        assert "restore will fail until these files are as they were" in " ".join(text.split())
        assert "pages-" not in text     # CRIU's image files only on request
        assert "pages-" in run_gpusnap("inspect", d["snapshot"], "--images", check=True).stdout
        os.unlink(data)
        assert run_json("inspect", d["snapshot"])["files_changed"] == [str(data)]
        assert {f["path"]: f for f in run_json("inspect", d["snapshot"])["files"]}[str(data)]["now_status"] == "missing"
    finally:
        job.kill()
        job.wait()


HEAVY = ("numpy", "blake3", "zstandard", "lz4", "cuda", "pycriu", "gpusnap.repo", "gpusnap.gpu", "gpusnap.ops")


def _loaded_after(argv: list[str] | None) -> set[str]:
    """The modules a fresh interpreter holds after importing the CLI (and running argv)."""
    import subprocess
    import sys

    code = ("import sys\nimport gpusnap.cli\n"
            f"argv = {argv!r}\n"
            "if argv is not None:\n"
            "    try:\n        gpusnap.cli.main(argv)\n    except SystemExit:\n        pass\n"
            "print(' '.join(sorted(sys.modules)), file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return set(proc.stderr.split("\n")[-2].split())


@pytest.mark.parametrize("argv", [None, ["--version"], ["restore", "--help"], ["dump", "--help"]])
def test_start_up_loads_no_repository_numpy_or_cuda(argv):
    """Every dump and restore pays the CLI's start-up: importing it (and --help, --version)
    loads typer and gpusnap's errors, not the repository layers, numpy, blake3, zstandard,
    lz4 or CUDA (each command imports those it uses)."""
    loaded = _loaded_after(argv)
    heavy = sorted(m for m in loaded if any(m == h or m.startswith(h + ".") for h in HEAVY))
    assert heavy == [], heavy
    if argv in (None, ["--version"]):
        assert not any(m == "rich" or m.startswith("rich.") for m in loaded)   # no console built


def test_start_up_check_sees_a_heavy_import():
    """The check above can fail: a command that uses the repository does load it."""
    loaded = _loaded_after(["ls", "--repo", "/nonexistent/gpusnap-test-repo", "--json"])
    assert "gpusnap.ops.ls" in loaded


def test_dump_help_offers_every_codec():
    """The --compress metavar is written out (the CLI must not import the codecs to start):
    it must name exactly the codecs dump accepts."""
    import typer.main

    from gpusnap.cli import app
    from gpusnap.repo.codec import CHOICES

    cmd = typer.main.get_command(app).commands["dump"]
    opt = next(p for p in cmd.params if "--compress" in getattr(p, "opts", ()))
    assert opt.metavar == "|".join(CHOICES)


def test_a_run_builds_only_its_command_the_same_way():
    """main() builds just the command it runs (cli.build_app(name)); that command must be the
    very one the full app has: same options, defaults, settings and help, for every command."""
    import typer.main

    from gpusnap.cli import _TOP_LEVEL, app, build_app

    def shape(cmd):
        params = [(p.name, tuple(p.opts), p.default, p.required, getattr(p, "help", None), p.metavar)
                  for p in cmd.params]
        subs = {n: shape(c) for n, c in getattr(cmd, "commands", {}).items()}
        return (cmd.name, cmd.help, dict(cmd.context_settings), params, subs)

    full = typer.main.get_command(app)
    assert len(_TOP_LEVEL) == len(full.commands) > 10
    for name in sorted(_TOP_LEVEL):
        one = typer.main.get_command(build_app(name))
        assert list(one.commands) == [name]
        assert shape(one.commands[name]) == shape(full.commands[name]), name
        assert [p.name for p in one.params] == [p.name for p in full.params]   # the root's --version
