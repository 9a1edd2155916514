"""Preemptible, requeue-resumable batch jobs on a real one-machine Slurm cluster.

munged, slurmctld and slurmd (Debian's packages) run on 127.0.0.1 for this module; a batch
script runs the sample job under `gpusnap slurm-run`. Preemption is Slurm's own signal to the
batch shell (`scancel --batch --signal=USR1`, what `#SBATCH --signal=B:USR1@SECONDS` sends before a
time limit), after which slurm-run snapshots, requeues, and the requeued job resumes from the
snapshot; a node failure is every process of the node killed hard (slurmd, slurmstepd and the
job), after which Slurm requeues the job and it resumes from its last periodic snapshot. Both
must finish with exactly the result of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PY, run_gpusnap, run_json
from slurm_cluster import SlurmCluster, available

pytestmark = [pytest.mark.criu, pytest.mark.slow]

STEPS, MB, THREADS, STEP_MS = 240, 16, 2, 100
JOB_ARGS = dict(steps=STEPS, mb=MB, threads=THREADS)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = available()
    if why:
        pytest.skip(f"Slurm: {why} (make test installs slurmd, slurmctld, slurm-client and munge)")
    root = tmp_path_factory.mktemp("slurm")
    root.chmod(0o700)
    c = SlurmCluster(root)
    try:
        c.start()
    except Exception:
        c.stop()
        raise
    yield c
    c.stop()


def _batch_script(tmp: Path, repo: Path, out: Path, every: str) -> Path:
    run_gpusnap("init", "--repo", repo, check=True)     # (the batch job runs without our $GPUSNAP_REPO)
    script = tmp / "job.sbatch"
    script.write_text(f"""#!/bin/bash
#SBATCH --requeue
#SBATCH --signal=B:USR1@60
#SBATCH --output={tmp}/slurm-%j.out
#SBATCH --open-mode=append
exec {PY} -m gpusnap slurm-run --repo {repo} --name sjob --every {every} --keep-last 3 -- \\
    {PY} -m gpusnap.samples.job {out} --steps {STEPS} --mb {MB} --threads {THREADS} --step-ms {STEP_MS}
""")
    return script


def _events(repo: Path) -> list[dict]:
    p = repo / "jobs" / "sjob" / "slurm.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def _steps_done(out: Path) -> int:
    try:
        return len((out / "job.log").read_text().splitlines())
    except OSError:
        return 0


def _wait(pred, timeout: float, what: str, diag=lambda: ""):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.3)
    raise AssertionError(f"{what} did not happen within {timeout:.0f} s\n{diag()}")


def _slurm_output(tmp: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(tmp.glob("slurm-*.out")))


_pending_since: dict[int, float] = {}


def _requeued_and_running(c: SlurmCluster, job: int):
    info = c.job(job)
    if (info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime"
            and c.run("sinfo", "-h", "-o", "%t", check=False).stdout.strip() == "idle"
            and time.monotonic() - _pending_since.setdefault(job, time.monotonic()) > 2.5):
        # Skip Slurm's requeue delay, but only once the node has finished with the old instance
        # and a new second has begun: slurmd refuses a credential issued in the second it
        # revoked the old one in ("Job credential revoked", the launch fails with exit 1).
        c.run("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
    return info.get("JobState") == "RUNNING" and int(info.get("Restarts", "0")) >= 1


def _ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        chain.append(pid)
    return chain


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _check_finished(c, job, repo, out, reference, tmp):
    diag = lambda: (f"job: {c.job(job)}\nevents: {_events(repo)}\n"  # noqa: E731
                    f"slurm output: {_slurm_output(tmp)}")
    _wait(lambda: c.job(job).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"), 300, "job end", diag)
    assert c.job(job).get("JobState") == "COMPLETED", diag()
    assert (out / "result").read_text().strip() == reference(**JOB_ARGS), diag()
    # The job's own log: every step exactly once and in order, so it never started over.
    assert (out / "job.log").read_text().splitlines() == [f"step {i}/{STEPS}" for i in range(1, STEPS + 1)]
    ev = _events(repo)
    assert [e["event"] for e in ev if e["event"] in ("started", "finished")] == ["started", "finished"], ev
    assert ev[-1]["exit_code"] == 0
    return ev


def test_preempted_job_snapshots_requeues_and_resumes(cluster, tmp_path, reference):
    tmp_path.chmod(0o700)
    repo, out = tmp_path / "repo", tmp_path / "out"
    job = cluster.sbatch(_batch_script(tmp_path, repo, out, every="4s"))
    _wait(lambda: _steps_done(out) >= 40 and any(e["event"] == "snapshot" for e in _events(repo)),
          120, "40 steps and a periodic snapshot", lambda: f"{cluster.job(job)} {_events(repo)}")

    # Slurm's preemption/time-limit signal to the batch shell.
    cluster.run("scancel", "--batch", "--signal=USR1", str(job))
    _wait(lambda: _requeued_and_running(cluster, job), 120, "requeue and restart",
          lambda: f"{cluster.job(job)} {_events(repo)}\n{_slurm_output(tmp_path)}")
    resumed = _wait(lambda: next((e for e in _events(repo) if e["event"] == "resumed"), None), 120,
                    "resume", lambda: f"{_events(repo)}")
    final = [e for e in _events(repo) if e["event"] == "final-snapshot"]
    assert len(final) == 1 and resumed["snapshot"] == final[0]["snapshot"], _events(repo)
    assert resumed["work_saved_s"] > 0
    assert cluster.comment(job).startswith("gpusnap: resumed from"), cluster.comment(job)
    # the name follows the resumed job (gpusnap/ops/identity.py): `dump --name sjob` would find it
    named = {j["name"]: j for j in run_json("ls", "--repo", repo)["jobs"]}["sjob"]
    assert named["pid"] == resumed["pid"] and named["restores"] == 1 and named["forked_from"] is None

    # The restored processes belong to the new job: below its slurm-run, in its cgroup.
    pid = resumed["pid"]
    if os.path.exists(f"/proc/{pid}"):
        chain = _ancestors(pid)
        sup = next((p for p in chain if "slurm-run" in _cmdline(p)), None)
        assert sup is not None, [(p, _cmdline(p)) for p in chain]
        assert any("slurmstepd" in _cmdline(p) for p in chain)
        with open(f"/proc/{pid}/cgroup") as a, open(f"/proc/{sup}/cgroup") as b:
            assert a.read() == b.read()

    ev = _check_finished(cluster, job, repo, out, reference, tmp_path)
    kinds = [e["event"] for e in ev]
    assert kinds.index("preempted") < kinds.index("final-snapshot") < kinds.index("requeue") < kinds.index("resumed")


def _kill_node(c: SlurmCluster) -> None:
    """What a node failure does to this node: slurmd, every slurmstepd and the jobs under them die."""
    stepds = [int(p) for p in subprocess.run(["pgrep", "-x", "slurmstepd"], capture_output=True,
                                            text=True).stdout.split()]

    def descendants(p):
        out = []
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    for k in f.read().split():
                        out += [int(k)] + descendants(int(k))
        except OSError:
            pass
        return out

    victims = set(stepds)
    for p in stepds:
        victims |= set(descendants(p))
    for p in victims:
        try:
            os.kill(p, signal.SIGSTOP)  # stop all first, so nothing reacts to the others' death
        except ProcessLookupError:
            pass
    c.kill_daemon("slurmd", signal.SIGKILL)
    for p in victims:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _lose_node_and_resume(c: SlurmCluster, job: int, repo: Path, tmp: Path, while_down=lambda: None):
    """The node dies (_kill_node) and comes back; `while_down()` runs in between (what else goes
    with the node); the job is requeued and resumes. -> (while_down's value, the "resumed" event
    of slurm-run's log in `repo`)."""
    _kill_node(c)
    gone = while_down()
    time.sleep(1)
    c.start_slurmd()
    _wait(lambda: _requeued_and_running(c, job), 180, "requeue after the node failure",
          lambda: f"{c.job(job)}\n{c.log('slurmctld')[-3000:]}\n{_slurm_output(tmp)}")
    resumed = _wait(lambda: next((e for e in _events(repo) if e["event"] == "resumed"), None), 120,
                    "resume", lambda: f"{_events(repo)}\n{_slurm_output(tmp)}")
    return gone, resumed


def test_node_failure_resumes_from_last_periodic_snapshot(cluster, tmp_path, reference):
    tmp_path.chmod(0o700)
    repo, out = tmp_path / "repo", tmp_path / "out"
    job = cluster.sbatch(_batch_script(tmp_path, repo, out, every="3s"))
    _wait(lambda: _steps_done(out) >= 30 and sum(e["event"] == "snapshot" for e in _events(repo)) >= 2,
          120, "30 steps and two periodic snapshots", lambda: f"{cluster.job(job)} {_events(repo)}")
    last, resumed = _lose_node_and_resume(
        cluster, job, repo, tmp_path, lambda: [e for e in _events(repo) if e["event"] == "snapshot"][-1])
    # The last periodic snapshot, or a newer one whose dump committed as the node died (its event
    # line was never written); never an older one, never a half-written one.
    listed = {e.get("snapshot") for e in _events(repo) if e["event"] == "snapshot"}
    assert resumed["snapshot"] == last["snapshot"] or resumed["snapshot"] not in listed, _events(repo)
    _check_finished(cluster, job, repo, out, reference, tmp_path)
