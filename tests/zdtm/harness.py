"""CRIU's zdtm static tests through gpusnap (or through plain CRIU, the reference).

For one test: start it with zdtm's own Makefile rule (`make NAME.pid`: the test daemonizes,
sets itself up and writes its pid file; its hook, if it has one, runs `--post-start` meanwhile,
as zdtm.py runs it), dump it, restore it (`gpusnap restore`, or `criu restore -d`), stop it with
zdtm's rule (`make NAME.out`: SIGTERM, on which the test checks its state and writes PASS or
FAIL to NAME.out), and judge by that verdict. Two kinds of run:

    exit      dumped with `gpusnap dump --exit` (`criu dump`), as zdtm dumps
    running   dumped leaving the job running (`gpusnap dump`; `criu dump --leave-running`),
              checked to be still running, killed as in a crash, then restored

Each run happens in a child process of its own that is a child subreaper: the daemonized test
is its child, so the dumped test is reaped at once instead of by this machine's PID 1 (which
took ~1.5-3.5 s here), and nothing a test leaves behind outlives the run.

The list of tests is the Makefile's (`$(TST)`); tests/zdtm/list.txt says, for each, whether it
runs (both kinds, or `exit` only), is skipped by zdtm's own rules (flavour, noauto, arch,
feature, checkskip), or fails with plain CRIU here (and why). `--survey` makes that list:
plain CRIU runs every test twice in each kind (resumable; raw results in survey-VERSION.jsonl).

    python tests/zdtm/harness.py [--mode gpusnap|criu|both] [--kind exit|running] [NAME ...]
    python tests/zdtm/harness.py --survey [--write-list]

$ZDTM_VIA (e.g. lazy) restores through that `gpusnap restore --via` path instead of auto.
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
LIST = HERE / "list.txt"
KINDS = ("exit", "running")
ARCH = os.uname().machine
# SysV IPC tests: zdtm runs them in an IPC namespace of their own (its ns flavour), as
# `gpusnap run` starts a job; in the host's namespace neither CRIU nor gpusnap dumps them
IPCNS = {"shm", "msgque", "sem", "shm-unaligned", "shm-hugetlb", "shm-mp"}
START_TIMEOUT = 30      # zdtm.py's own start timeout
# hooks are Python scripts that import CRIU's pycriu: the system's python3, not a venv's
HOOK_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class Outcome:
    name: str
    mode: str
    passed: bool
    stage: str        # start | dump | running | restore | stop | verdict | done
    detail: str = ""
    seconds: float = 0.0
    doctor: str | None = None   # gpusnap mode: doctor PID's verdict before the dump (ok | fail: CHECK)
    kind: str = "exit"


# ---------------------------------------------------------------- the list

@dataclass
class Entry:
    name: str
    status: str               # run | exit | skip | criu-fails
    reason: str = ""

    @property
    def kinds(self) -> tuple[str, ...]:
        return {"run": KINDS, "exit": ("exit",), "criu-fails": ("exit",), "gpusnap-fails": ("exit",)}.get(
            self.status, ())


def read_entries(path: Path = LIST) -> dict[str, Entry]:
    """list.txt: `NAME` (both kinds), `NAME exit: WHY` (exit kind only: plain CRIU fails the
    running kind), `NAME skip: WHY`, `NAME criu-fails: WHY` (plain CRIU fails it here)."""
    out: dict[str, Entry] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        status, _, why = rest.partition(":") if rest else ("run", "", "")
        if status not in ("run", "exit", "skip", "criu-fails", "gpusnap-fails"):
            raise ValueError(f"{path}: unknown status {status!r} on the line of {name}")
        out[name] = Entry(name, status, why.strip())
    return out


def read_list(path: Path = LIST) -> tuple[list[str], dict[str, str]]:
    """(tests that run, {skipped test: reason})."""
    e = read_entries(path)
    return ([n for n, x in e.items() if x.status != "skip"],
            {n: x.reason for n, x in e.items() if x.status == "skip"})


def suite(static: Path) -> list[str]:
    """Every static test zdtm's Makefile knows ($(TST), its conditionals applied)."""
    r = subprocess.run(["make", "-s", "--no-print-directory", "-C", str(static),
                        "--eval", "gpusnap-tst: ; @echo $(TST)", "gpusnap-tst"],
                       capture_output=True, text=True, check=True)
    return r.stdout.split()


def build(static: Path | None = None) -> Path:
    """The built test/zdtm/static directory ($ZDTM_STATIC, or tests/zdtm/build.sh's)."""
    if static is None and os.environ.get("ZDTM_STATIC"):
        static = Path(os.environ["ZDTM_STATIC"])
    if static is not None:
        return static
    out = subprocess.run(["bash", str(HERE / "build.sh")], capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"zdtm build failed: {out.stderr.strip()[-500:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def desc(static: Path, name: str) -> dict:
    p = static / f"{name}.desc"
    if not p.exists():
        return {}
    try:
        d = ast.literal_eval(p.read_text())
        return d if isinstance(d, dict) else {}
    except (ValueError, SyntaxError):
        return {}


def _flags(static: Path, name: str) -> list[str]:
    return str(desc(static, name).get("flags", "")).split()


def zdtm_rule_skip(static: Path, name: str) -> str | None:
    """Why zdtm's own description of `name` keeps it out of a host-flavour run (None: it does not)."""
    d = desc(static, name)
    flavours = str(d.get("flavor", "h ns uns")).split()
    if "h" not in flavours:
        return f"zdtm runs it only in its {'/'.join(flavours)} flavour (a namespace of its own)"
    if "noauto" in _flags(static, name):
        return "marked noauto in zdtm (run only by hand)"
    if d.get("arch", ARCH) != ARCH:
        return f"zdtm runs it only on {d['arch']}"
    return None


def zdtm_skip(static: Path, name: str, features: dict[str, bool] | None = None) -> str | None:
    """Why zdtm itself would not run `name` in its host flavour here (None: it would): its
    description's rules, then this machine's (CRIU features, checkskip, the build)."""
    why = zdtm_rule_skip(static, name)
    if why is not None:
        return why
    d = desc(static, name)
    features = {} if features is None else features
    for feat in str(d.get("feature", "")).split():
        if feat not in features:
            features[feat] = subprocess.run([_criu(), "check", "--feature", feat], capture_output=True,
                                            stdin=subprocess.DEVNULL).returncode == 0
        if not features[feat]:
            return f"`criu check --feature {feat}` fails on this machine"
    chk = static / f"{name}.checkskip"
    if chk.exists() and subprocess.run([f"./{chk.name}"], cwd=static, capture_output=True,
                                       env=dict(os.environ, PATH=HOOK_PATH),
                                       stdin=subprocess.DEVNULL).returncode != 0:
        return "its checkskip script says this machine cannot run it"
    if not (static / name).is_file():
        return "does not build here (see the zdtm build log)"
    return None


# ---------------------------------------------------------------- process plumbing

def _subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0) != 0:     # PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "PR_SET_CHILD_SUBREAPER")


def _reap() -> None:
    """Collect every exited child (the harness is a subreaper: the tests are its children)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _gone(pid: int, timeout: float) -> bool:
    """Wait until `pid` is gone from /proc (exited and reaped: by us, its subreaper)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _reap()
        if not os.path.exists(f"/proc/{pid}"):
            return True
        time.sleep(0.01)
    return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _pids_with_arg(arg: str) -> list[int]:
    """The processes that have `arg` as one of their command-line arguments."""
    mark = arg.encode()
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if mark in (d / "cmdline").read_bytes().split(b"\0"):
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def _test_pids(name: str) -> list[int]:
    """Every process of the zdtm test `name`: started with its --pidfile (its forks keep it)."""
    return _pids_with_arg(f"--pidfile={name}.pid")


def _tree(root: int) -> list[int]:
    """`root` and its descendants (by their parent PIDs in /proc)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [c for c, pp in parent.items() if pp == p]
    return out


def _kill_strays(name: str) -> None:
    for pid in _test_pids(name):
        _kill(pid)


def _hook_pids(name: str) -> list[int]:
    """Processes still running the test's hook (`zdtm/static/NAME.hook ...`): a daemon its
    --post-start forked (netns_lock_*'s server, in a session of its own) that zdtm.py ends with
    the test's namespace; here it would live on, holding its network namespace alive."""
    return _pids_with_arg(f"zdtm/static/{name}.hook")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def _hook(static: Path, name: str, arg: str, env: dict | None = None, wait: bool = True):
    """Run the test's hook as zdtm.py does (from test/, `zdtm/static/NAME.hook ARG`)."""
    if not (static / f"{name}.hook").exists():
        return None
    # the pycriu of the CRIU in use (CRIU's source tree has only its unbuilt one)
    pycriu = Path(os.path.realpath(_criu())).parent.parent / "python"
    e = dict(os.environ, PATH=HOOK_PATH, PYTHONPATH=str(pycriu), **(env or {}))
    # output to a file, not a pipe: a hook may fork a helper that lives on (net_lock_*'s
    # client), and a pipe would stay open until that helper ends
    out = tempfile.TemporaryFile()
    p = subprocess.Popen([f"zdtm/static/{name}.hook", arg], cwd=static.parent.parent, env=e,
                         stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    p.out = out
    if not wait:
        return p
    if _hook_wait(p, 120) != 0:
        raise RuntimeError(f"hook {arg} failed: {_hook_output(p)[-400:]}")
    return None


def _hook_wait(p, timeout: float) -> int:
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        return p.wait()


def _hook_output(p) -> str:
    p.out.seek(0)
    return p.out.read().decode(errors="replace")


def _make(static: Path, target: str, log: Path, timeout: float = 120, ipcns: bool = False,
          hook_name: str | None = None) -> int:
    """zdtm's rule `target`; its exit status. One that has not ended within `timeout` (a test
    that cannot start here: a connection over the loopback that never completes) is killed,
    with the test processes it started, and fails: the test's outcome, not the suite's."""
    with open(log, "ab") as f:
        # close_fds: the test must not inherit our descriptors (CRIU would dump them as its own)
        p = subprocess.Popen([*(["unshare", "--ipc"] if ipcns else []),
                              "make", "-s", "--no-print-directory", "-C", str(static), target],
                             stdin=subprocess.DEVNULL, stdout=f, stderr=f, close_fds=True, start_new_session=True)
        hook = _hook(static, hook_name, "--post-start", wait=False) if hook_name else None
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # what held it, for the report: the TCP sockets of zdtm's ports (8880 and up)
            ss = subprocess.run(["ss", "-tanp"], capture_output=True, text=True).stdout.splitlines()
            held = [ln for ln in ss if ":88" in ln][:12]
            os.killpg(p.pid, 9)
            p.wait()
            _kill_strays(target.rsplit(".", 1)[0])
            f.write((f"\n(harness: `make {target}` did not end within {timeout:.0f} s; killed)\n"
                     + "".join(f"  {ln}\n" for ln in held)).encode())
            rc = -1
        if hook is not None:
            _hook_wait(hook, 60)
            f.write(_hook_output(hook).encode())
            if hook.returncode != 0 and rc == 0:
                f.write(b"\n(harness: the --post-start hook failed)\n")
                rc = -2
        return rc


def _firewall() -> dict[str, list[str]]:
    """The filter table's rules, per iptables command (some tests add DROP rules on their ports
    and remove them only when they end well: one left behind blocks every later test's port)."""
    out = {}
    for cmd in ("iptables", "ip6tables"):
        r = subprocess.run([cmd, "-w", "-S"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if r.returncode == 0:
            out[cmd] = [ln for ln in r.stdout.splitlines() if ln.startswith("-A ")]
    return out


def _firewall_restore(before: dict[str, list[str]]) -> list[str]:
    """Delete the rules added on zdtm's ports (8880 and up) since `before`; the rules deleted.
    The tests add such rules, and plain CRIU leaves its network lock's after a failed TCP
    restore: one left behind drops every later connection on that port pair (a loopback
    connect that never completes)."""
    gone = []
    for cmd, rules in _firewall().items():
        for rule in rules:
            if rule not in before.get(cmd, []) and ("--dport 88" in rule or "--sport 88" in rule) \
                    and ("-j DROP" in rule or "-j REJECT" in rule):
                subprocess.run([cmd, "-w", "-D", *rule.split()[1:]], capture_output=True, stdin=subprocess.DEVNULL)
                gone.append(f"{cmd} {rule}")
    return gone


def _clean(static: Path, name: str) -> None:
    for suffix in (".pid", ".out", ".out.inprogress", ".out.external", ".state"):
        try:
            (static / f"{name}{suffix}").unlink()
        except FileNotFoundError:
            pass
    # a test that failed half way leaves what it mounted in its directory (the cgroup tests)
    prefix = str(static / f"{name}.")
    mounts = [ln.split()[1] for ln in Path("/proc/self/mounts").read_text().splitlines()]
    for m in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", m], capture_output=True, stdin=subprocess.DEVNULL)
    for p in static.glob(f"{name}.*test*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _gpusnap(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpusnap", *args, "--json"], capture_output=True, text=True,
                          cwd=ROOT, stdin=subprocess.DEVNULL, timeout=timeout)


def _doctor(pid: int) -> str:
    """`gpusnap doctor PID`'s verdict: "ok", or "fail: " and the failing checks' names."""
    r = _gpusnap("doctor", str(pid))
    try:
        rep = json.loads(r.stdout)
    except ValueError:
        return f"fail: doctor printed no report ({r.stderr.strip()[-200:]})"
    bad = [c["name"] for c in rep.get("checks", []) if c.get("status") == "fail"]
    return "fail: " + ", ".join(bad) if bad else "ok"


def _criu() -> str:
    sys.path.insert(0, str(ROOT))
    from gpusnap.criu import runner

    return runner.criu_info().path


def _criu_errors(log: Path, fallback: str) -> str:
    try:
        errs = [ln for ln in log.read_text(errors="replace").splitlines() if "Error" in ln]
    except OSError:
        errs = []
    return "\n".join(errs[-5:]) or fallback


# ---------------------------------------------------------------- one run

def _opts(static: Path, name: str, stage: str) -> list[str]:
    """CRIU options the test's description asks for at `stage` (dump or restore): its `opts`,
    then its `dopts` or `ropts` (what plain CRIU is given; gpusnap must find them itself)."""
    d = desc(static, name)
    return (str(d.get("opts", "")) + " " + str(d.get("dopts" if stage == "dump" else "ropts", ""))).split()


# CRIU options that are a user's choice, not something the job's state decides: gpusnap has
# them too, and is given them as the test's description gives them to CRIU (--tcp-close:
# the connections are not kept; the others gpusnap must find by itself)
USER_CHOICES = ("--tcp-close",)
# a restore's choice with a value: CRIU's --manage-cgroups=MODE is `gpusnap restore --cgroups
# MODE` (where the restored job's cgroups come from; a bare --manage-cgroups is CRIU's default
# mode, soft, which gpusnap uses when not told)
RESTORE_CHOICES = {"--manage-cgroups": "--cgroups"}


def _user_choices(opts: list[str], stage: str = "dump") -> list[str]:
    out = [o for o in USER_CHOICES if o in opts]
    if stage == "restore":
        for o in opts:
            key, eq, value = o.partition("=")
            if eq and key in RESTORE_CHOICES:
                out += [RESTORE_CHOICES[key], value]
    return out


def _dump(static: Path, name: str, pid: int, mode: str, kind: str, work: Path, out: Outcome):
    """Dump the test; (error text or None, what the restore needs)."""
    opts = _opts(static, name, "dump")
    if mode == "gpusnap":
        repo = work / "repo"
        if not repo.exists():    # (a dump makes none outside the default location)
            _gpusnap("init", "--repo", str(repo))
        out.doctor = _doctor(pid)
        _hook(static, name, "--pre-dump", {"ZDTM_TEST_PID": str(pid)})
        r = _gpusnap("dump", str(pid), *(["--exit"] if kind == "exit" else []), "--repo", str(repo),
                     "--name", name.replace("_", "-"), *_user_choices(opts))
        if r.returncode != 0:
            return r.stdout + r.stderr, None
        return None, json.loads(r.stdout)["snapshot"]
    imgs = work / f"{name}.{kind}.img"
    shutil.rmtree(imgs, ignore_errors=True)
    imgs.mkdir()
    _hook(static, name, "--pre-dump", {"ZDTM_TEST_PID": str(pid)})
    r = subprocess.run([_criu(), "dump", "-t", str(pid), "-D", str(imgs), "-o", "dump.log", "-v4", *opts,
                        *(["--leave-running"] if kind == "running" else [])],
                       capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    if r.returncode != 0:
        return _criu_errors(imgs / "dump.log", r.stderr), None
    return None, imgs


def _restore(static: Path, name: str, mode: str, handle, opts: list[str], work: Path) -> str | None:
    _hook(static, name, "--pre-restore")
    if mode == "gpusnap":
        via = ["--via", os.environ["ZDTM_VIA"]] if os.environ.get("ZDTM_VIA") else []
        r = _gpusnap("restore", handle, "--repo", str(work / "repo"), *via, *_user_choices(opts, "restore"))
        if r.returncode != 0:
            return r.stdout + r.stderr
        return None
    r = subprocess.run([_criu(), "restore", "-D", str(handle), "-d", "-o", "restore.log", "-v4", *opts],
                       capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    return None if r.returncode == 0 else _criu_errors(Path(handle) / "restore.log", r.stderr)


def run_one(static: Path, name: str, mode: str, work: Path, kind: str = "exit") -> Outcome:
    """One run of one test in this process (run_isolated runs it in a subreaper child)."""
    t0 = time.monotonic()
    log = work / f"{name}.{mode}.{kind}.log"
    out = Outcome(name, mode, False, "start", kind=kind)

    def fail(stage: str, detail: str) -> Outcome:
        out.stage, out.detail, out.seconds = stage, detail.strip()[-800:], round(time.monotonic() - t0, 2)
        return out

    _clean(static, name)
    if not (static / name).is_file():
        return fail("start", f"{name} did not build (see the zdtm build log)")
    rules = _firewall()
    try:
        return _run_started(static, name, mode, work, kind, log, out, fail)
    finally:
        _firewall_restore(rules)


def _run_started(static, name, mode, work, kind, log, out, fail) -> Outcome:
    if _make(static, f"{name}.pid", log, timeout=START_TIMEOUT, ipcns=name in IPCNS, hook_name=name) != 0:
        _kill_strays(name)      # started, but its hook failed: it must not hold its ports for the next
        _reap()
        _clean(static, name)
        return fail("start", log.read_text(errors="replace"))
    pid = int((static / f"{name}.pid").read_text().split()[0])
    opts = _opts(static, name, "restore")
    try:
        try:
            err, handle = _dump(static, name, pid, mode, kind, work, out)
        except RuntimeError as e:        # a hook failed
            return fail("dump", str(e))
        if err is not None:
            return fail("dump", err)
        if kind == "running":
            # the job must go on after the dump; then it dies as in a crash, every process of it
            if not _alive(pid):
                return fail("running", "the test was not running after a dump that leaves it running")
            time.sleep(0.1)
            tree = _tree(pid)
            for p in tree:
                os.kill(p, 19)          # SIGSTOP first: none forks or reaps while the others die
            for p in tree:
                _kill(p)
            for p in tree:              # every PID of the tree free again before the restore
                _gone(p, 30)
        if not _gone(pid, 60):
            return fail("dump", f"the dumped test {pid} was still there 60 s later")
        try:
            err = _restore(static, name, mode, handle, opts, work)
            if err is None:
                _hook(static, name, "--post-restore",
                      {"ZDTM_TEST_PID": str(pid), "ZDTM_IMG_DIR": str(handle if mode == "criu" else work)})
        except RuntimeError as e:
            err = str(e)
        if err is not None:
            return fail("restore", err)
        if _make(static, f"{name}.out", log) != 0:
            return fail("stop", log.read_text(errors="replace"))
        if not _gone(pid, 120):
            return fail("stop", "the test did not exit within 120 s of SIGTERM")
        verdict = (static / f"{name}.out").read_text(errors="replace") if (static / f"{name}.out").exists() else ""
        if "PASS" not in verdict or "FAIL" in verdict:
            return fail("verdict", verdict or "no verdict written")
        out.passed, out.stage = True, "done"
        return fail("done", "")
    finally:
        if out.stage != "done":
            _kill(pid)
            _kill_strays(name)      # its children too (a client it forked), so none holds a port
            _gone(pid, 10)
        try:
            _hook(static, name, "--clean")
        except (RuntimeError, subprocess.TimeoutExpired):
            pass
        for p in _hook_pids(name):      # every hook has ended: what is left is a daemon of one
            _kill(p)
        _clean(static, name)
        _reap()


def run_isolated(static: Path, name: str, mode: str, work: Path, kind: str = "exit",
                 timeout: float = 900) -> Outcome:
    """run_one in a child process that is a child subreaper (see the module's docstring)."""
    try:
        r = subprocess.run([sys.executable, str(Path(__file__)), "--one", name, "--mode", mode, "--kind", kind,
                            "--static", str(static), "--work", str(work)],
                           capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        _kill_strays(name)
        return Outcome(name, mode, False, "harness", f"the run took more than {timeout:.0f} s", timeout, kind=kind)
    try:
        return Outcome(**json.loads(r.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError, TypeError):
        return Outcome(name, mode, False, "harness", (r.stdout + r.stderr)[-800:], kind=kind)


# ---------------------------------------------------------------- the survey

def survey(static: Path, names: list[str], out_path: Path, rounds: int = 2) -> None:
    """Plain CRIU runs each test `rounds` times in each kind; one JSON line per run, appended to
    out_path (runs already there are not run again, so an interrupted survey resumes)."""
    done: dict[tuple, int] = {}
    if out_path.exists():
        for ln in out_path.read_text().splitlines():
            r = json.loads(ln)
            done[(r["name"], r.get("kind", "exit"))] = done.get((r["name"], r.get("kind", "exit")), 0) + 1
    features: dict[str, bool] = {}
    with tempfile.TemporaryDirectory(prefix="gpusnap-zdtm-survey-") as tmp, open(out_path, "a") as f:
        for name in names:
            why = zdtm_skip(static, name, features)
            if why is not None:
                if not done.get((name, "skip")):
                    f.write(json.dumps({"name": name, "kind": "skip", "reason": why}) + "\n")
                    f.flush()
                continue
            for kind in KINDS:
                for _ in range(rounds - done.get((name, kind), 0)):
                    o = run_isolated(static, name, "criu", Path(tmp), kind, timeout=300)
                    f.write(json.dumps(asdict(o)) + "\n")
                    f.flush()
                    print(f"{kind:7} {name:28} {'PASS' if o.passed else 'FAIL at ' + o.stage:16} {o.seconds:6.1f}s",
                          flush=True)


def list_from_survey(names: list[str], path: Path, keep: dict[str, Entry]) -> list[Entry]:
    """The list's entries from a survey's runs. `keep`: entries whose reason a person wrote
    (a skip that the survey cannot find, such as a hang that needs its own explanation)."""
    runs: dict[str, dict[str, list[dict]]] = {}
    skips: dict[str, str] = {}
    for ln in path.read_text().splitlines():
        r = json.loads(ln)
        if r["kind"] == "skip":
            skips[r["name"]] = r["reason"]
        else:
            runs.setdefault(r["name"], {}).setdefault(r["kind"], []).append(r)
    out = []
    for name in names:
        if name in keep:
            out.append(keep[name])
        elif name in skips:
            out.append(Entry(name, "skip", skips[name]))
        else:
            by = runs.get(name, {})
            ex, ru = by.get("exit", []), by.get("running", [])
            if ex and all(r["passed"] for r in ex):
                if ru and all(r["passed"] for r in ru):
                    out.append(Entry(name, "run"))
                else:
                    bad = next((r for r in ru if not r["passed"]), {"stage": "?", "detail": "not surveyed"})
                    out.append(Entry(name, "exit", f"left running, plain CRIU fails it at {bad['stage']}: "
                                     + _first_line(bad["detail"])))
            elif ex:
                bad = next(r for r in ex if not r["passed"])
                n = sum(r["passed"] for r in ex)
                out.append(Entry(name, "criu-fails", f"{'' if not n else f'passes {n} of {len(ex)}; '}"
                                 f"at {bad['stage']}: " + _first_line(bad["detail"])))
            else:
                out.append(Entry(name, "skip", "not surveyed"))
    return out


def _first_line(detail: str) -> str:
    """The line of a failed run that names its cause (CRIU's "FAILED" summary says none, and
    its RLIMIT_NOFILE line comes in every run on a machine without CAP_SYS_RESOURCE)."""
    lines = [ln.strip() for ln in detail.splitlines() if ln.strip()]
    errs = [ln for ln in lines if ("Error" in ln or "ERR:" in ln) and "FAILED" not in ln and "RLIMIT_NOFILE" not in ln]
    err = errs[0] if errs else (lines[0] if lines else "no detail")
    # CRIU's log lines start with a timestamp and a PID: the message is what follows
    return err.split(": ", 1)[-1][:160] if err.startswith("(") else err[:160]


HEADER = """\
# CRIU's zdtm static suite, every test of its Makefile, as tests/zdtm/test_zdtm.py runs it
# through gpusnap (made by `harness.py --survey --write-list` from plain CRIU's runs on this
# kind of machine; tests/zdtm/harness.py says how a test is run). One line per test:
#   NAME                   run in both kinds: dumped with --exit, and left running then killed
#   NAME exit: WHY         run with --exit only: plain CRIU fails the left-running kind here
#   NAME criu-fails: WHY   plain CRIU fails it here: run through gpusnap (exit kind) to check
#                          that doctor's verdict agrees with the dump, expected to fail
#   NAME gpusnap-fails: WHY  plain CRIU passes it, gpusnap does not yet: run (exit kind), expected
#                          to fail for WHY
#   NAME skip: WHY         not run: zdtm itself would not run it here, or WHY
# A reason that starts with "(kept)" was written by hand; --write-list keeps it. A criu-fails
# reason that says "doctor cannot see it" names a state /proc does not show before the dump.
"""


def write_list(entries: list[Entry], path: Path = LIST) -> None:
    lines = [HEADER]
    for e in entries:
        lines.append(e.name if e.status == "run" else f"{e.name} {e.status}: {e.reason}")
    path.write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------- command line

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("gpusnap", "criu", "both"), default="both")
    ap.add_argument("--kind", choices=(*KINDS, "both"), default="both")
    ap.add_argument("--static", type=Path, help="built test/zdtm/static (default: build it)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--one", metavar="NAME", help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--survey", action="store_true", help="plain CRIU, every test of the Makefile, twice per kind")
    ap.add_argument("--write-list", action="store_true", help="rewrite list.txt from the survey")
    ap.add_argument("names", nargs="*")
    a = ap.parse_args(argv)
    static = build(a.static)
    if a.one:
        _subreaper()
        o = run_one(static, a.one, a.mode, a.work, a.kind)
        print(json.dumps(asdict(o)))
        return 0
    version = _criu_version()
    if a.survey or a.write_list:
        raw = HERE / f"survey-{version}.jsonl"
        names = a.names or suite(static)
        if a.survey:
            survey(static, names, raw)
        if a.write_list:
            keep = {n: e for n, e in read_entries().items() if e.reason.startswith("(kept)")}
            write_list(list_from_survey(suite(static), raw, keep))
        return 0
    entries = read_entries()
    names = a.names or [n for n, e in entries.items() if e.kinds]
    modes = ("criu", "gpusnap") if a.mode == "both" else (a.mode,)
    results: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="gpusnap-zdtm-") as tmp:
        for name in names:
            kinds = entries[name].kinds if name in entries and a.kind == "both" else \
                (KINDS if a.kind == "both" else (a.kind,))
            for kind in kinds:
                for mode in modes:
                    o = run_isolated(static, name, mode, Path(tmp), kind)
                    results.append(o)
                    if not a.json:
                        print(f"{mode:8} {kind:7} {name:28} {'PASS' if o.passed else 'FAIL at ' + o.stage:16} "
                              f"{o.seconds:6.1f}s" + (f" doctor {o.doctor}" if o.doctor else "")
                              + ("" if o.passed else "  " + o.detail.replace(chr(10), ' | ')[:300]), flush=True)
    counts = {m: sum(o.passed for o in results if o.mode == m) for m in modes}
    if a.json:
        print(json.dumps({"results": [asdict(o) for o in results], "passed": counts}))
    else:
        print(" ".join(f"{m}: {n}/{sum(o.mode == m for o in results)} passed" for m, n in counts.items()))
    return 0 if all(o.passed for o in results) else 1


def _criu_version() -> str:
    r = subprocess.run([_criu(), "--version"], capture_output=True, text=True)
    return next((ln.split()[-1] for ln in r.stdout.splitlines() if ln.startswith("Version")), "unknown")


if __name__ == "__main__":
    sys.exit(main())
