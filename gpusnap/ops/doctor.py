"""`gpusnap doctor [PID]`: is this machine ready to snapshot, and what would stop a dump of PID.

Every check is a Check(name, status, detail, fix, exit_code) with status one of
  ok    fine
  info  worth knowing, changes nothing (a terminal: gpusnap uses --shell-job)
  warn  works, but something is missing or risky
  fail  a dump (or a GPU dump) will not work until this is fixed
Nothing here raises for an ordinary machine state; a machine without an NVIDIA driver gets
a clean "no NVIDIA driver".

Doctor decides nothing that `gpusnap dump` decides on its own: CRIU (which one, its version),
privileges, the process tree and every per-job rule are system.preflight's findings, the
same objects dump raises from, so a failing check carries the exit code the dump ends with.
The text is made in render.machine.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from gpusnap.criu import runner
from gpusnap.errors import GpuUnsupportedProcess
from gpusnap.system import paths, preflight, terminal
from gpusnap.gpu import driver as gdriver
from gpusnap.gpu import procs as gprocs
from gpusnap.render import human_bytes

STATUSES = ("ok", "info", "warn", "fail")
CAP_SYS_RESOURCE = preflight.CAP_SYS_RESOURCE
PROC = Path("/proc")


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


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def _run(cmd: list[str], timeout: float) -> tuple[int, str]:
    """(exit status, stdout + stderr) of a diagnostic command; never raises."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:.0f} s"
    except OSError as e:
        return 127, str(e)
    return r.returncode, (r.stdout or "") + (r.stderr or "")


def _environ(pid: int) -> dict[str, str]:
    raw = _read(PROC / str(pid) / "environ") or ""
    out = {}
    for item in raw.split("\0"):
        if "=" in item:
            k, v = item.split("=", 1)
            out[k] = v
    return out


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
    rc, out = _run([criu, "check"], timeout=90)
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


def _check_dirty_tracking(r: DoctorReport, criu: str | None, root_like: bool) -> None:
    why = "gpusnap does not need it: incremental dumps dedup pages by content"
    if not (criu and root_like):
        r.add("soft-dirty tracking", "info", f"not checked; {why}")
        return
    rc, out = _run([criu, "check", "--feature", "mem_dirty_track"], timeout=30)
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
    src = "$GPUSNAP_PLUGIN_DIR" if os.environ.get("GPUSNAP_PLUGIN_DIR") else "default"
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


def _check_driver(r: DoctorReport, probe: gdriver.DriverProbe) -> None:
    if not probe.available:
        kmod = gdriver.kernel_driver_version()
        if kmod:
            r.add("NVIDIA driver", "warn", f"kernel module {kmod} is loaded but {probe.reason}",
                  "install the matching user-space driver (libcuda.so.1)")
        else:
            r.add("NVIDIA driver", "info", f"{gdriver.NO_DRIVER}: CPU-only dumps and restores "
                  f"work; GPU jobs cannot be snapshotted here ({probe.reason})")
        return
    ver = f"driver {probe.driver_version or '?'}, CUDA {probe.cuda_version or '?'}"
    if probe.reason:
        r.add("NVIDIA driver", "warn", f"{ver}: {probe.reason}", "check nvidia-smi")
    else:
        r.add("NVIDIA driver", "ok", ver)
    if probe.checkpoint_api:
        r.add("CUDA checkpoint API", "ok", "cuCheckpointProcess* available")
    else:
        r.add("CUDA checkpoint API", "fail",
              f"the driver (CUDA {probe.cuda_version or '?'}) lacks cuCheckpointProcess*: GPU "
              "processes cannot be snapshotted", "update the NVIDIA driver to r570 (CUDA 12.8) or newer")
    if probe.gpus:
        r.add("GPUs", "ok", "; ".join(
            f"#{g.index} {g.name} {human_bytes(g.memory_bytes)} {g.uuid}" for g in probe.gpus))
    elif not probe.reason:
        r.add("GPUs", "warn", "the driver lists no GPU", "check nvidia-smi")
    mps = [p for p in _pids_named(("nvidia-cuda-mps-control", "nvidia-cuda-mps-server"))]
    if mps:
        r.add("MPS", "warn", f"an MPS daemon runs (pid {', '.join(map(str, mps))}): CUDA jobs that "
              "go through MPS cannot be checkpointed", "stop MPS (echo quit | nvidia-cuda-mps-control) "
              "before starting jobs you want to snapshot")


def _pids_named(names: Iterable[str]) -> list[int]:
    names = set(names)
    out = []
    for n in os.listdir(PROC):
        if n.isdigit() and ((_read(PROC / n / "comm") or "").strip() in names):
            out.append(int(n))
    return out


# ---------------------------------------------------------------- per-job checks

def _check_pid(r: DoctorReport, pid: int, probe: gdriver.DriverProbe) -> None:
    """The preflight `gpusnap dump` runs, finding by finding, then the GPU checks."""
    plan = preflight.check(pid, system=False)
    for f in plan.findings:
        r.add_finding(f)
    r.plan = {"pids": plan.pids, "dump_options": plan.dump_options, "restore_flags": plan.restore_flags,
              "tcp": plan.tcp, "listening": plan.listening, "locks": plan.locks}
    if plan.pids:
        _check_gpu_job(r, plan.pids, probe)


def _check_gpu_job(r: DoctorReport, tree: list[int], probe: gdriver.DriverProbe) -> None:
    mm = {g["minor"]: g for g in gprocs.machine_gpus(probe) if g.get("minor") is not None}
    gps = [g for p in tree if (g := gprocs.scan_process(p, mm)) is not None]
    env_mps = [p for p in tree if "CUDA_MPS_PIPE_DIRECTORY" in _environ(p)]
    if not gps:
        if env_mps:
            r.add("MPS", "warn", f"CUDA_MPS_PIPE_DIRECTORY is set in {env_mps[:3]}: once it uses CUDA "
                  "it goes through MPS, which CUDA checkpoint does not support")
        r.add("GPU", "ok", "the job uses no NVIDIA GPU: a CPU-only dump")
        return
    users = [g for g in gps if g.uses_gpu]
    names = ", ".join(f"{g.pid} ({g.comm}): " + (", ".join(
        f"#{x['index']} {x['uuid']}" if x.get("uuid") else f"/dev/nvidia{x['minor']}" for x in g.gpus)
        or "no GPU opened") for g in gps[:6])
    if not probe.available:
        r.add("GPU", "fail", f"CUDA process(es) {names}, but {probe.reason or gdriver.NO_DRIVER}",
              "install the NVIDIA driver's user-space library (libcuda.so.1)")
    elif not probe.checkpoint_api:
        r.add("GPU", "fail", f"CUDA process(es) {names}, but the driver lacks the checkpoint API",
              "update the NVIDIA driver to r570 (CUDA 12.8) or newer")
    else:
        states = gdriver.checkpoint_states([g.pid for g in users]) if users else {}
        bad = {p: s for p, s in states.items() if s not in (None, "running")}
        if bad:
            r.add("GPU", "fail", f"CUDA checkpoint state not 'running': {bad}",
                  "a previous dump or cuda-checkpoint left it so; `cuda-checkpoint --toggle --pid N` "
                  "or gpusnap restore it first")
        else:
            r.add("GPU", "ok", f"CUDA process(es) {names}; states: "
                  + ", ".join(f"{p}={s or 'not CUDA-initialised'}" for p, s in states.items()))
        nocontext = gprocs.devices_without_context(tree)
        if nocontext:  # the same check `gpusnap dump` refuses on
            r.add("GPU", "fail", "NVIDIA device files without a CUDA context: "
                  + gprocs.describe_without_context(nocontext), gprocs.NO_CONTEXT_HINT,
                  GpuUnsupportedProcess.exit_code)
        if not paths.plugin_path().is_file():
            r.add("GPU", "fail", f"the job uses a GPU but {paths.plugin_path()} is missing",
                  "build the plugin (cmake --build build) or set GPUSNAP_PLUGIN_DIR")
    if any(g.uvm for g in gps):
        r.add("UVM", "info", "/dev/nvidia-uvm is open (every CUDA runtime opens it); a job that "
              "allocates managed memory (cudaMallocManaged) cannot be checkpointed — the dump "
              "would fail at the checkpoint step and the job keeps running")
    mig = [g.pid for g in gps if g.mig]
    if mig:
        r.add("MIG", "fail", f"{mig} hold /dev/nvidia-caps (a MIG instance): CUDA checkpoint "
              "does not support MIG", "run the job on a full GPU")
    mps_sock = [g.pid for g in gps if any("nvidia-mps" in t for t in gprocs.fd_targets(g.pid))]
    if env_mps or mps_sock:
        r.add("MPS", "fail", f"{sorted(set(env_mps + mps_sock))} use MPS (CUDA_MPS_PIPE_DIRECTORY "
              "or an MPS pipe): CUDA checkpoint does not support MPS", "run the job without MPS")
    nccl = [g.pid for g in gps if g.nccl]
    if nccl:
        r.add("NCCL", "warn", f"{nccl} load NCCL: live NCCL communicators cannot be checkpointed",
              "tear communicators down before the dump and rebuild them after (or dump between "
              "phases that hold none)")
    nvml = [g.pid for g in gps if g.nvml]
    if nvml:
        if _driver_major(probe) >= 570:
            # r570+ checkpoints processes that hold NVML handles (criu#2953): PyTorch loads it
            r.add("NVML", "info", f"{nvml} load NVML (libnvidia-ml); driver {probe.driver_version or '?'} "
                  "(r570 or newer) checkpoints such processes")
        else:
            r.add("NVML", "warn", f"{nvml} load NVML (libnvidia-ml); drivers before r570 cannot "
                  "checkpoint a process that holds NVML handles", "update the NVIDIA driver to r570 "
                  "or newer, or keep NVML (pynvml, GPU monitoring threads) out of the job")


def _driver_major(probe: gdriver.DriverProbe) -> int:
    """The driver branch (570 for 570.133.20); from the CUDA version when the module's is unknown."""
    v = probe.driver_version or ""
    if v.split(".")[0].isdigit():
        return int(v.split(".")[0])
    return 570 if (probe.cuda_version_int or 0) >= 12080 else 0


# ---------------------------------------------------------------- entry point

def run_doctor(pid: int | None = None, repo: Path | None = None) -> DoctorReport:
    """All system checks, plus what would stop a dump of `pid` when one is given."""
    r = DoctorReport(pid=pid)
    criu = _check_criu(r)
    root_like = _check_privileges(r)
    if criu:
        _check_criu_check(r, criu[0], root_like)
    _check_dirty_tracking(r, criu and criu[0], root_like)
    _check_page_library(r)
    _check_gate(r)
    _check_plugin(r)
    probe = gdriver.probe_cached()
    r.driver = probe.to_dict()
    _check_driver(r, probe)
    if pid is not None:
        _check_pid(r, int(pid), probe)
    _check_schedules(r)
    r.add("tmux", *terminal.doctor_check())
    if repo is not None:
        _check_repository(r, repo)
        _check_repository_fs(r, repo)
    return r


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
