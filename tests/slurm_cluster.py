"""A one-machine Slurm cluster for the tests: munged, slurmctld and slurmd on 127.0.0.1.

Everything lives in one private directory (config, state, spool, logs, munge socket and key), the
daemons run as root and are stopped by PID at the end, and the client commands find the cluster
through $SLURM_CONF. One partition, `low`; requeue is allowed (JobRequeue=1) and a node that comes back returns to
service by itself (ReturnToService=2), with a short SlurmdTimeout so that a dead node is noticed
within seconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")


def available() -> str | None:
    """None when Slurm and munge are installed, else why not."""
    missing = [d for d in DAEMONS + ("/usr/bin/sbatch", "/usr/bin/scontrol") if not os.access(d, os.X_OK)]
    return f"not installed: {', '.join(missing)}" if missing else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    def __init__(self, root: Path, slurmd_timeout_s: int = 10):
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.slurmd_timeout_s = slurmd_timeout_s
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    # --- set-up ---------------------------------------------------------------------------
    def _write_config(self) -> None:
        r = self.root
        for d in ("state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        key = r / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        ctld, slurmd = _free_port(), _free_port()
        self.conf.write_text(f"""\
ClusterName=gpusnaptest
SlurmctldHost={self.host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld}
SlurmdPort={slurmd}
AuthType=auth/munge
AuthInfo=socket={r}/munge.sock
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdTimeout={self.slurmd_timeout_s}
MpiDefault=none
JobRequeue=1
KillWait=30
MinJobAge=300
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=low Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
""")

    def start(self) -> None:
        self._write_config()
        r = self.root
        subprocess.run(["/usr/sbin/munged", "--force", f"--socket={r}/munge.sock", f"--key-file={r}/munge.key",
                        f"--log-file={r}/log/munged.log", f"--pid-file={r}/munged.pid",
                        f"--seed-file={r}/munge.seed"], check=True)
        subprocess.run(["/usr/sbin/slurmctld", "-f", str(self.conf), "-i"], check=True, env=self.env)
        self.start_slurmd()
        self.wait_idle()

    def start_slurmd(self) -> None:
        subprocess.run(["/usr/sbin/slurmd", "-f", str(self.conf)], check=True, env=self.env)

    def wait_idle(self, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            out = self.run("sinfo", "-h", "-o", "%t", check=False).stdout
            if "idle" in out or "mix" in out or "alloc" in out:
                return
            time.sleep(0.5)
        raise TimeoutError(f"the Slurm node did not come up: {self.log('slurmd')[-2000:]}")

    # --- use --------------------------------------------------------------------------------
    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, check=check, timeout=60)

    def sbatch(self, script: Path, *args: str) -> int:
        out = self.run("sbatch", "--parsable", *args, str(script)).stdout.strip()
        return int(out.split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (the fields this harness reads)."""
        out = self.run("scontrol", "-o", "show", "job", str(job_id), check=False).stdout
        fields = {}
        for tok in out.split():
            k, _, v = tok.partition("=")
            fields[k] = v
        return fields

    def comment(self, job_id: int) -> str:
        return self.run("squeue", "-h", "-j", str(job_id), "-o", "%k", check=False).stdout.strip()

    def wait_job(self, job_id: int, pred, timeout: float, what: str) -> dict[str, str]:
        end = time.monotonic() + timeout
        info = {}
        while time.monotonic() < end:
            info = self.job(job_id)
            if info and pred(info):
                return info
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id}: {what} did not happen within {timeout:.0f} s; last state {info}")

    def log(self, daemon: str) -> str:
        p = self.root / "log" / f"{daemon}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    # --- tear-down --------------------------------------------------------------------------
    def _pid(self, name: str) -> int | None:
        try:
            return int((self.root / f"{name}.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def kill_daemon(self, name: str, sig: int = signal.SIGTERM, wait: float = 15) -> None:
        pid = self._pid(name)
        if pid is None:
            return
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        end = time.monotonic() + wait
        while time.monotonic() < end:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        try:
            self.run("scancel", "--full", "--user=root", check=False)
        except Exception:
            pass
        for name in ("slurmd", "slurmctld", "munged"):
            self.kill_daemon(name)
        shutil.rmtree(self.root / "state", ignore_errors=True)
