"""Cron schedules: the files written, listed and removed, and the command in them really
dumps the matched job with retention."""

import subprocess

import pytest

from conftest import run_gpusnap, run_json
from gpusnap import schedule
from gpusnap.errors import UsageError


@pytest.fixture
def crondir(tmp_path, monkeypatch):
    d = tmp_path / "cron.d"
    monkeypatch.setenv("GPUSNAP_CRON_DIR", str(d))
    monkeypatch.setenv("GPUSNAP_LOG_DIR", str(tmp_path / "log"))
    return d


@pytest.mark.parametrize("every,expr", [("30m", "*/30 * * * *"), ("2h", "0 */2 * * *"), ("1d", "0 3 * * *")])
def test_every_translates_to_cron(every, expr):
    assert schedule.cron_expr(every, None) == expr


@pytest.mark.parametrize("every,cron", [("90m", None), ("x", None), (None, "* * *"), (None, "rm -rf / * * *"),
                                        ("5m", "* * * * *"), (None, None)])
def test_bad_schedules_are_refused(every, cron):
    with pytest.raises(UsageError):
        schedule.cron_expr(every, cron)


def test_add_ls_rm(crondir):
    s = schedule.add("fold", "python train.py", every="30m", keep_last=3)
    text = (crondir / "gpusnap-fold").read_text()
    assert text.startswith("# gpusnap schedule fold")
    assert "*/30 * * * * root " in text and "--keep-last 3" in text and "'python train.py'" in text
    assert [x.name for x in schedule.list_schedules()] == ["fold"]
    assert schedule.remove("fold").path == s.path
    assert schedule.list_schedules() == []
    with pytest.raises(UsageError):
        schedule.remove("fold")


@pytest.mark.criu
def test_the_cron_command_dumps_and_keeps_the_last_n(crondir, sample_job, repo):
    job = sample_job(steps=400, mb=8, threads=1, step_ms=20)
    job.wait_steps(3)
    marker = f"gpusnap.samples.job {job.out}"
    s = schedule.add("sched", marker, every="5m", keep_last=2, repo=repo)
    for _ in range(3):
        subprocess.run(["sh", "-c", s.command], check=True, timeout=120)
    listing = run_json("ls", "--repo", repo)
    assert [x["name"] for x in listing["snapshots"]] == ["sched", "sched"]
    assert job.alive()
    assert run_gpusnap("verify", "--repo", repo).returncode == 0
