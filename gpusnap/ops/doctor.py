"""`gpusnap doctor [PID]`: is this machine ready to snapshot, and what would stop a dump of PID.

Every check is a Check(name, status, detail, fix, exit_code) with status one of
  ok    fine
  info  worth knowing, changes nothing (a terminal: gpusnap uses --shell-job)
  warn  works, but something is missing or risky
  fail  a dump (or a GPU dump) will not work until this is fixed
Nothing here raises for an ordinary machine state; a machine without an NVIDIA driver gets
a clean "no NVIDIA driver".

Doctor decides nothing that `gpusnap dump` decides on its own: CRIU (which one, its version),
privileges, the process tree and every per-job rule are ops.preflight's findings, the
same objects dump raises from, so a failing check carries the exit code the dump ends with.
The text is made in render.machine.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpusnap.criu import config as criu_config
from gpusnap.criu import runner
from gpusnap.ops import doctor_gpu
from gpusnap.ops import preflight
from gpusnap.system import paths, terminal
from gpusnap.gpu import driver as gdriver
from gpusnap import settings

STATUSES = ("ok", "info", "warn", "fail")
CAP_SYS_RESOURCE = preflight.CAP_SYS_RESOURCE


@dataclass
class Check:
    name: str
    status: str          # ok | info | warn | fail
    detail: str
    fix: str | None = None
    exit_code: int | None = None   # a failure `gpusnap dump` refuses on: the code it exits with

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class DoctorReport:
    checks: list[Check] = field(default_factory=list)
    pid: int | None = None
    driver: dict[str, Any] | None = None   # DriverProbe.to_dict()
    plan: dict[str, Any] | None = None     # PID given: the CRIU options a dump would use
    STATUSES = STATUSES                    # (render/machine.py counts them, in this order)

    def add(self, name: str, status: str, detail: str, fix: str | None = None,
            exit_code: int | None = None) -> Check:
        assert status in STATUSES, status
        c = Check(name, status, detail, fix, exit_code)
        self.checks.append(c)
        return c

    def add_finding(self, f: preflight.Finding) -> Check:
        """A preflight finding as it is, with the exit code of the error dump raises for it."""
        code = f.error.exit_code if f.status == "fail" and f.error is not None else None
        return self.add(f.name, f.status, f.detail, f.fix, code)

    @property
    def worst(self) -> str:
        return max((c.status for c in self.checks), key=STATUSES.index, default="ok")

    @property
    def ok(self) -> bool:
        """No check failed."""
        return self.worst != "fail"

    def by_name(self, name: str) -> list[Check]:
        return [c for c in self.checks if c.name == name]

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "worst": self.worst, "pid": self.pid,
                "checks": [c.to_dict() for c in self.checks], "driver": self.driver, "plan": self.plan}


# ---------------------------------------------------------------- small readers
# capabilities are read as the preflight reads them (shared with `gpusnap dump`)

cap_eff = preflight.cap_eff
has_cap = preflight.has_cap


def _run(cmd: list[str], timeout: float) -> tuple[int, str]:
    """(exit status, stdout + stderr) of a diagnostic command; never raises."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=criu_config.environ())
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:.0f} s"
    except OSError as e:
        return 127, str(e)
    return r.returncode, (r.stdout or "") + (r.stderr or "")


# ---------------------------------------------------------------- system checks

def _check_criu(r: DoctorReport) -> tuple[str, tuple[int, ...]] | None:
    """The CRIU gpusnap will run, through the same finding `gpusnap dump` acts on, and whether
    it works with this kernel. (path, version) when usable."""
    f = preflight.criu()
    r.add_finding(f)
    if f.status == "fail":
        return None
    info = runner.criu_info()
    if runner.sockets_broken(info.version):
        r.add("criu sockets", "warn", f"CRIU {info.version_str} cannot dump a job that holds a network socket "
              f"(AF_INET/AF_INET6/AF_PACKET: a listening port, a UDP socket) on Linux "
              f"{os.uname().release}: kernels >= 6.16 need CRIU >= 4.2; gpusnap refuses such jobs",
              runner.install_hint(info.path))
    return info.path, info.version


def _check_criu_check(r: DoctorReport, criu: str, root_like: bool) -> None:
    if not root_like:
        r.add("criu check", "warn", "skipped: needs root", "run gpusnap doctor as root")
        return
    rc, out = _run(criu_config.argv(criu, "check"), timeout=90)
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    # CRIU always logs this when root lacks CAP_SYS_RESOURCE; the capability check covers it
    noise = re.compile(r"RLIMIT_NOFILE", re.I)
    findings = [ln for ln in lines if re.search(r"warn|error|fail|not supported|unsupported", ln, re.I)
                and not noise.search(ln)]
    if rc == 0 and any("Looks good" in ln for ln in lines) and not findings:
        r.add("criu check", "ok", "Looks good.")
    elif rc == 0:
        r.add("criu check", "warn", "; ".join(findings or lines)[:600] or "no verdict",
              "see `criu check --all`; features CRIU lacks may stop some dumps")
    else:
        r.add("criu check", "warn" if findings else "fail",
              f"criu check exited {rc}: " + "; ".join(findings or lines[-5:])[:600],
              "run `criu check -v4` to see why")


def _check_privileges(r: DoctorReport) -> bool:
    caps = cap_eff()
    f = preflight.privileges()  # the same finding `gpusnap dump` acts on
    r.add_finding(f)
    root_like = f.status != "fail"
    sysres = has_cap(CAP_SYS_RESOURCE, caps)
    if sysres:
        r.add("CAP_SYS_RESOURCE", "ok", "present: processes of any user can be dumped")
    else:
        r.add("CAP_SYS_RESOURCE", "warn",
              "missing from the effective set: CRIU cannot dump processes that run under "
              "another uid (\"Can't get rlimit 0: Operation not permitted\"); it also logs a "
              "harmless \"Can't setup RLIMIT_NOFILE for self\"",
              "run from a full root shell (containers often drop this capability), or dump "
              "only processes running as this user")
    return root_like


def _check_pipe_size(r: DoctorReport) -> None:
    """How large the pipes are that a dump's pages pass through while the job is frozen."""
    from gpusnap.criu import streamer

    want, most = streamer.CAPTURE_PIPE_SIZE, streamer.pipe_max_size()
    if most >= want or has_cap(CAP_SYS_RESOURCE, cap_eff()):
        r.add("pipe size", "ok", f"a dump's pages stream through {want >> 10} KiB pipes")
        return
    r.add("pipe size", "info",
          f"a dump's pages stream through {most >> 10} KiB pipes (fs.pipe-max-size, and no CAP_SYS_RESOURCE "
          f"to go beyond it) instead of {want >> 10} KiB ones, which froze a 512 MiB job ~30 % shorter "
          "in gpusnap's benchmark",
          f"`sysctl -w fs.pipe-max-size={want}` (a file in /etc/sysctl.d/ keeps it), or run from a full root shell")


def _check_criu_config(r: DoctorReport) -> None:
    """CRIU configuration files a plain `criu` would read; gpusnap's CRIU reads none."""
    found = criu_config.files()
    if found:
        r.add("criu config", "info", f"{', '.join(found)} exist: gpusnap runs CRIU with "
              "--no-default-config and without $CRIU_CONFIG_FILE, so their options are not applied "
              "(gpusnap chooses every option itself; `dump --json` lists them as criu_options)")


def _check_dirty_tracking(r: DoctorReport, criu: str | None, root_like: bool) -> None:
    why = "gpusnap does not need it: incremental dumps dedup pages by content"
    if not (criu and root_like):
        r.add("soft-dirty tracking", "info", f"not checked; {why}")
        return
    rc, out = _run(criu_config.argv(criu, "check", "--feature", "mem_dirty_track"), timeout=30)
    if rc == 0:
        r.add("soft-dirty tracking", "ok", f"available ({why})")
    else:
        msg = next((ln.strip() for ln in out.splitlines() if "dirty" in ln.lower()), "not available")
        msg = re.sub(r"^\w+\s*\([^)]*\):\s*", "", msg)
        r.add("soft-dirty tracking", "info", f"{msg}; {why}")


def _check_page_library(r: DoctorReport) -> None:
    """The native page library every dump, restore and verify needs (loaded as they load it)."""
    from gpusnap.errors import NativeLibraryMissing
    from gpusnap.repo import native

    try:
        native.load()
    except NativeLibraryMissing as e:
        r.add("page library", "fail", e.message, e.hint, exit_code=e.exit_code)
        return
    r.add("page library", "ok", str(native.lib_path))


def _check_gate(r: DoctorReport) -> None:
    """The post-dump gate executable every dump runs inside the freeze."""
    from gpusnap.criu.gate import native_gate
    from gpusnap.errors import NativeLibraryMissing

    try:
        r.add("post-dump gate", "ok", str(native_gate()))
    except NativeLibraryMissing as e:
        r.add("post-dump gate", "fail", e.message, e.hint, exit_code=e.exit_code)


def _check_plugin(r: DoctorReport) -> None:
    d = paths.plugin_dir()
    p = d / paths.PLUGIN_NAME
    src = "$GPUSNAP_PLUGIN_DIR" if settings.get("GPUSNAP_PLUGIN_DIR") else "default"
    if not d.is_dir():
        r.add("CUDA plugin", "warn", f"plugin directory {d} ({src}) does not exist: GPU processes "
              "cannot be dumped (CPU-only dumps work)",
              "build it: cmake -S . -B build && cmake --build build (or scripts/setup.sh), "
              "or set GPUSNAP_PLUGIN_DIR")
        return
    if not p.is_file():
        r.add("CUDA plugin", "warn", f"{paths.PLUGIN_NAME} is not in {d} ({src}): GPU processes "
              "cannot be dumped (CPU-only dumps work)",
              "cmake --build build (or scripts/setup.sh), or set GPUSNAP_PLUGIN_DIR")
        return
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        r.add("CUDA plugin", "fail", f"{p}: {e}", "check its permissions")
        return
    if magic != b"\x7fELF":
        r.add("CUDA plugin", "fail", f"{p} is not a shared library", "rebuild it")
        return
    others = sorted(x.name for x in d.glob("*.so") if x.name != paths.PLUGIN_NAME)
    extra = f"; CRIU will also load {', '.join(others)}" if others else ""
    r.add("CUDA plugin", "ok", f"{p}{extra}")


# ---------------------------------------------------------------- per-job checks

def _check_pid(r: DoctorReport, pid: int, probe: gdriver.DriverProbe) -> None:
    """The preflight `gpusnap dump` runs, finding by finding, then the GPU checks."""
    plan = preflight.check(pid, system=False)
    for f in plan.findings:
        r.add_finding(f)
    r.plan = {"pids": plan.pids, "dump_options": plan.dump_options, "restore_flags": plan.restore_flags,
              "tcp": plan.tcp, "listening": plan.listening, "locks": plan.locks}
    if plan.pids:
        doctor_gpu.job_checks(r.add, plan.pids, probe)


# ---------------------------------------------------------------- entry point

def run_doctor(pid: int | None = None, repo: Path | None = None, unlock_network: bool = False) -> DoctorReport:
    """All system checks, plus what would stop a dump of `pid` when one is given; with
    `unlock_network`, first lift CRIU network-lock rules no snapshot of `repo` needs."""
    r = DoctorReport(pid=pid)
    criu = _check_criu(r)
    root_like = _check_privileges(r)
    if criu:
        _check_criu_check(r, criu[0], root_like)
    _check_criu_config(r)
    _check_pipe_size(r)
    _check_dirty_tracking(r, criu and criu[0], root_like)
    _check_page_library(r)
    _check_gate(r)
    _check_plugin(r)
    probe = gdriver.probe_cached()
    r.driver = probe.to_dict()
    doctor_gpu.driver_checks(r.add, probe)
    if pid is not None:
        _check_pid(r, int(pid), probe)
    _check_schedules(r)
    r.add("tmux", *terminal.doctor_check())
    if repo is not None:
        _check_repository(r, repo)
        _check_repository_fs(r, repo)
    _check_network_locks(r, repo, unlock_network)
    return r


def _check_network_locks(r: DoctorReport, repo: Path | None, unlock: bool) -> None:
    """CRIU's per-connection lock rules: held for a `dump --exit` snapshot (a restore needs
    them), or stale (they blackhole a connection; gpusnap/ops/netlock_sweep.py)."""
    from gpusnap.errors import GpusnapError
    from gpusnap.ops import netlock_sweep
    from gpusnap.repo.repository import Repository

    try:
        repository = Repository.open(repo) if repo is not None and os.path.isdir(repo) else None
    except GpusnapError:
        repository = None
    if unlock:
        lifted, failed = netlock_sweep.unlock_stale(repository)
        if lifted:
            r.add("network lock", "fail" if failed else "ok",
                  f"lifted CRIU's network lock on {len(lifted) - len(failed)} connection(s)"
                  + (f"; could not on {', '.join(failed)}" if failed else ""))
    held, stale, busy = netlock_sweep.survey(repository)
    for c, snap in held:
        r.add("network lock", "info", f"{netlock_sweep.describe(c)} is locked for snapshot {snap} (`dump --exit`): "
              "its restore brings the connection back", "forget the snapshot, or restore it with --tcp-close, "
              "to lift it")
    for c in busy:
        r.add("network lock", "info", f"{netlock_sweep.describe(c)} is locked by a dump in progress (its "
              "process is stopped or traced)")
    where = f"no snapshot in {repo}" if repository is not None else "no snapshot of this repository"
    for c in stale:     # one line each: every one of them cuts a connection
        r.add("network lock", "warn", f"CRIU's network lock blackholes {netlock_sweep.describe(c)}, which "
              f"{where} needs", "`gpusnap doctor --unlock-network` lifts it (unless a snapshot in another "
              "repository still needs it: then restore or forget it there)")


def _check_repository(r: DoctorReport, repo: Path) -> None:
    """Is there a repository where this user's commands will look (a typo in --repo says so
    here too, never `ok`); a missing one at the default location is made by the first dump."""
    from gpusnap.errors import GpusnapError
    from gpusnap.repo import locate
    from gpusnap.repo.repository import Repository

    if not os.path.lexists(repo):
        if locate.is_default(repo):
            r.add("repository", "info", f"none yet at {repo}: the first dump, run or import makes it")
        else:
            r.add("repository", "warn", f"no gpusnap repository at {repo}",
                  f"`gpusnap init --repo {repo}` creates one there; or check the path (--repo, $GPUSNAP_REPO)")
        return
    try:
        Repository.open(repo)
    except GpusnapError as e:
        r.add("repository", "fail", e.message, e.hint, e.exit_code)
        return
    r.add("repository", "ok", f"gpusnap repository at {repo}")


def _check_repository_fs(r: DoctorReport, repo: Path) -> None:
    """Shared between machines (NFS for a Slurm cluster)? Then its locks must hold across them."""
    from gpusnap.system import sharedfs

    r.add("repository filesystem", *sharedfs.check(repo))


def _check_schedules(r: DoctorReport) -> None:
    """Can schedules run here (systemd or a cron daemon), and is each one healthy."""
    from gpusnap.ops import schedule

    schedule.doctor_checks(r.add)
