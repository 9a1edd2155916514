"""A lost node on a real one-machine Slurm cluster (tests/test_slurm.py's): a job under
`slurm-run --repo LOCAL --copy-to SHARED` snapshots periodically into its node-local repository,
each snapshot copied to the shared one; the node dies (every process of it SIGKILLed) and its
local repository is deleted with it (the job's output files and slurm-run's log live in the
shared tier's jobs/sjob/); the requeued job finds no local repository, makes one,
resumes from the newest snapshot that verifies in the shared tier, and finishes with the
result of an uninterrupted run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import PY, run_gpusnap
# _events(shared): slurm-run's log in the shared tier's jobs/sjob/ (with the job's output: it outlives the node)
from test_slurm import (JOB_ARGS, MB, STEP_MS, STEPS, THREADS, _events, _lose_node_and_resume, _slurm_output,
                        _steps_done, _wait, cluster)  # noqa: F401 (the cluster fixture)

pytestmark = [pytest.mark.criu, pytest.mark.slow]


def test_requeued_job_resumes_from_the_shared_tier_after_its_node_is_lost(cluster, tmp_path, reference):  # noqa: F811
    tmp_path.chmod(0o700)
    local, shared, out = tmp_path / "local", tmp_path / "shared", tmp_path / "out"
    run_gpusnap("init", "--repo", shared, check=True)
    script = tmp_path / "job.sbatch"
    script.write_text(f"""#!/bin/bash
#SBATCH --requeue
#SBATCH --signal=B:USR1@60
#SBATCH --output={tmp_path}/slurm-%j.out
#SBATCH --open-mode=append
exec {PY} -m gpusnap slurm-run --repo {local} --copy-to {shared} --name sjob --every 3s --keep-last 2 \\
    --copy-keep-last 4 -- {PY} -m gpusnap.samples.job {out} --steps {STEPS} --mb {MB} --threads {THREADS} \\
    --step-ms {STEP_MS}
""")
    job = cluster.sbatch(script)

    def copied():
        return [e for e in _events(shared) if e["event"] == "snapshot" and (e.get("copy") or {}).get("status") == "copied"]

    _wait(lambda: _steps_done(out) >= 30 and len(copied()) >= 2, 120, "30 steps and two copied snapshots",
          lambda: f"{cluster.job(job)} {_events(shared)}\n{_slurm_output(tmp_path)}")

    def node_gone():
        last = copied()[-1]
        shutil.rmtree(local)                 # the node-local repository goes with the node
        return last
    last, resumed = _lose_node_and_resume(cluster, job, shared, tmp_path, node_gone)
    assert resumed["repository"] == str(shared), resumed
    assert Path(resumed["snapshot"]).name >= Path(last["snapshot"]).name, (resumed, last)
    assert [e["event"] for e in _events(shared)].count("started") == 1, _events(shared)
    _wait(lambda: cluster.job(job).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"), 300, "job end",
          lambda: f"{cluster.job(job)} {_events(shared)}\n{_slurm_output(tmp_path)}")
    assert cluster.job(job).get("JobState") == "COMPLETED", _slurm_output(tmp_path)
    assert (out / "result").read_text().strip() == reference(**JOB_ARGS)
    ev = _events(shared)
    assert ev[-1]["event"] == "finished" and ev[-1]["exit_code"] == 0, ev
    assert run_gpusnap("verify", "--repo", shared).returncode == 0
