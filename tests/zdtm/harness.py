"""CRIU's zdtm static tests through gpusnap (or through plain CRIU, the reference).

For one test: start it with zdtm's own Makefile rule (`make NAME.pid`: the test daemonizes,
sets itself up and writes its pid file), dump it (`gpusnap dump --exit`, or `criu dump` with
the options the test's .desc file asks for), wait until the killed test has been reaped,
restore it (`gpusnap restore`, or `criu restore -d`), stop it with zdtm's rule (`make NAME.out`:
SIGTERM, on which the test checks its state and writes PASS or FAIL to NAME.out), and judge by
that verdict.

    python tests/zdtm/harness.py [--mode gpusnap|criu|both] [NAME ...]   # a report per test

$ZDTM_VIA (e.g. lazy) restores through that `gpusnap restore --via` path instead of auto.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
LIST = HERE / "list.txt"


@dataclass
class Outcome:
    name: str
    mode: str
    passed: bool
    stage: str        # start | dump | restore | stop | verdict | done
    detail: str = ""
    seconds: float = 0.0
    doctor: str | None = None   # gpusnap mode: doctor PID's verdict before the dump (ok | fail: CHECK)


def read_list(path: Path = LIST) -> tuple[list[str], dict[str, str]]:
    """(tests to run, {skipped test: reason}); see read_xfail for known failures."""
    run, skip = [], {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        if rest.startswith("skip:"):
            skip[name] = rest[len("skip:"):].strip()
        else:
            run.append(name)
    return run, skip


def read_ipcns(path: Path = LIST) -> set[str]:
    """Tests started in an IPC namespace of their own (`NAME ipcns`), as zdtm's ns flavour
    starts them and as `gpusnap run` starts a job: CRIU dumps and recreates that namespace
    with its SysV objects (in the host's namespace it cannot)."""
    return {ln.split()[0] for ln in path.read_text().splitlines()
            if ln.strip() and not ln.startswith("#") and "ipcns" in ln.split()[1:2]}


def read_xfail(path: Path = LIST) -> dict[str, str]:
    """{test known to fail through gpusnap: why} (they are run all the same)."""
    out = {}
    for line in path.read_text().splitlines():
        name, _, rest = line.strip().partition(" ")
        if rest.strip().startswith("xfail:"):
            out[name] = rest.strip()[len("xfail:"):].strip()
    return out


def build(static: Path | None = None) -> Path:
    """The built test/zdtm/static directory ($ZDTM_STATIC, or tests/zdtm/build.sh's)."""
    if static is None and os.environ.get("ZDTM_STATIC"):
        static = Path(os.environ["ZDTM_STATIC"])
    if static is not None:
        return static
    out = subprocess.run(["bash", str(HERE / "build.sh")], capture_output=True, text=True, timeout=1800)
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


def _make(static: Path, target: str, log: Path, timeout: float = 120, ipcns: bool = False) -> int:
    """zdtm's rule `target`; its exit status. One that has not ended within `timeout` (a test
    that cannot start here: a connection over the loopback that never completes) is killed,
    with the test processes it started, and fails: the test's outcome, not the suite's."""
    with open(log, "ab") as f:
        # close_fds: the test must not inherit our descriptors (CRIU would dump them as its own)
        p = subprocess.Popen([*(["unshare", "--ipc"] if ipcns else []),
                              "make", "-s", "--no-print-directory", "-C", str(static), target],
                             stdin=subprocess.DEVNULL, stdout=f, stderr=f, close_fds=True, start_new_session=True)
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # what held it, for the report: the TCP sockets of zdtm's ports (8880 and up)
            ss = subprocess.run(["ss", "-tanp"], capture_output=True, text=True).stdout.splitlines()
            held = [ln for ln in ss if ":88" in ln][:12]
            os.killpg(p.pid, 9)
            p.wait()
            _kill_strays(target.rsplit(".", 1)[0])
            f.write((f"\n(harness: `make {target}` did not end within {timeout:.0f} s; killed)\n"
                     + "".join(f"  {ln}\n" for ln in held)).encode())
            return -1


def _kill_strays(name: str) -> None:
    """Kill every process of the zdtm test `name` (it daemonizes into a session of its own,
    out of make's process group): those started with its --pidfile."""
    mark = f"--pidfile={name}.pid".encode()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if mark in (d / "cmdline").read_bytes().split(b"\0"):
                    os.kill(int(d.name), 9)
            except OSError:
                pass


def _gone(pid: int, timeout: float) -> bool:
    """Wait until `pid` is gone from /proc (exited and reaped by whoever adopted it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}"):
            return True
        time.sleep(0.05)
    return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def _clean(static: Path, name: str) -> None:
    for suffix in (".pid", ".out", ".out.inprogress", ".state"):
        try:
            (static / f"{name}{suffix}").unlink()
        except FileNotFoundError:
            pass
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


def run_one(static: Path, name: str, mode: str, work: Path) -> Outcome:
    t0 = time.monotonic()
    log = work / f"{name}.{mode}.log"
    out = Outcome(name, mode, False, "start")

    def fail(stage: str, detail: str) -> Outcome:
        out.stage, out.detail, out.seconds = stage, detail.strip()[-800:], round(time.monotonic() - t0, 2)
        return out

    _clean(static, name)
    if not (static / name).is_file():
        return fail("start", f"{name} did not build (see the zdtm build log)")
    if _make(static, f"{name}.pid", log, ipcns=name in read_ipcns()) != 0:
        return fail("start", log.read_text(errors="replace"))
    pid = int((static / f"{name}.pid").read_text().split()[0])
    opts = str(desc(static, name).get("opts", "")).split()
    try:
        if mode == "gpusnap":
            repo = work / "repo"
            if not repo.exists():    # (a dump makes none outside the default location)
                _gpusnap("init", "--repo", str(repo))
            out.doctor = _doctor(pid)
            r = _gpusnap("dump", str(pid), "--exit", "--repo", str(repo), "--name", name.replace("_", "-"))
            if r.returncode != 0:
                _kill(pid)
                return fail("dump", r.stdout + r.stderr)
            snap = json.loads(r.stdout)["snapshot"]
        else:
            imgs = work / f"{name}.img"
            shutil.rmtree(imgs, ignore_errors=True)
            imgs.mkdir()
            r = subprocess.run([_criu(), "dump", "-t", str(pid), "-D", str(imgs), "-o", "dump.log", "-v4", *opts],
                               capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
            if r.returncode != 0:
                _kill(pid)
                errs = [ln for ln in (imgs / "dump.log").read_text(errors="replace").splitlines() if "Error" in ln]
                return fail("dump", "\n".join(errs[-5:]) or r.stderr)
        # the killed test must be reaped (by PID 1, here ~1.5 s) before its PIDs are free again
        if not _gone(pid, 60):
            return fail("dump", f"the dumped test {pid} was still there 60 s later")
        if mode == "gpusnap":
            via = ["--via", os.environ["ZDTM_VIA"]] if os.environ.get("ZDTM_VIA") else []
            r = _gpusnap("restore", snap, "--repo", str(work / "repo"), *via)
            if r.returncode != 0:
                return fail("restore", r.stdout + r.stderr)
        else:
            r = subprocess.run([_criu(), "restore", "-D", str(imgs), "-d", "-o", "restore.log", "-v4", *opts],
                               capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
            if r.returncode != 0:
                errs = [ln for ln in (imgs / "restore.log").read_text(errors="replace").splitlines()
                        if "Error" in ln]
                return fail("restore", "\n".join(errs[-5:]) or r.stderr)
        if _make(static, f"{name}.out", log) != 0:
            _kill(pid)
            return fail("stop", log.read_text(errors="replace"))
        if not _gone(pid, 120):
            _kill(pid)
            return fail("stop", "the test did not exit within 120 s of SIGTERM")
        verdict = (static / f"{name}.out").read_text(errors="replace") if (static / f"{name}.out").exists() else ""
        if "PASS" not in verdict or "FAIL" in verdict:
            return fail("verdict", verdict or "no verdict written")
        out.passed, out.stage = True, "done"
        out.seconds = round(time.monotonic() - t0, 2)
        return out
    finally:
        if out.stage != "done":
            _kill(pid)
            _kill_strays(name)      # its children too (a client it forked), so none holds a port
        _clean(static, name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("gpusnap", "criu", "both"), default="both")
    ap.add_argument("--static", type=Path, help="built test/zdtm/static (default: build it)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("names", nargs="*")
    a = ap.parse_args(argv)
    static = build(a.static)
    names, skip = read_list()
    names = a.names or names
    modes = ("criu", "gpusnap") if a.mode == "both" else (a.mode,)
    results: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="gpusnap-zdtm-") as tmp:
        for name in names:
            for mode in modes:
                o = run_one(static, name, mode, Path(tmp))
                results.append(o)
                if not a.json:
                    print(f"{mode:8} {name:16} {'PASS' if o.passed else 'FAIL at ' + o.stage:16} {o.seconds:6.1f}s"
                          + (f" doctor {o.doctor}" if o.doctor else "")
                          + ("" if o.passed else "  " + o.detail.replace(chr(10), ' | ')[:300]), flush=True)
    counts = {m: sum(o.passed for o in results if o.mode == m) for m in modes}
    if a.json:
        print(json.dumps({"results": [o.__dict__ for o in results], "passed": counts, "run": len(names),
                          "skipped": skip}))
    else:
        print(" ".join(f"{m}: {n}/{len(names)} passed" for m, n in counts.items()), f"({len(skip)} skipped)")
    return 0 if all(o.passed for o in results) else 1


if __name__ == "__main__":
    sys.exit(main())
