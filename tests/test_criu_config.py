"""CRIU's configuration files (~/.criu/default.conf, $CRIU_CONFIG_FILE) never change a dump or a
restore unseen: gpusnap runs CRIU without them (gpusnap/criu/config.py), and doctor names them."""

import os
import subprocess

import pytest

from conftest import kill_pids, run_json

# an option that makes every CRIU dump that reads it fail: the action script exits 1 at the
# first action (pre-dump), so a dump that succeeds did not read the file
HOSTILE = "action-script /bin/false\n"


@pytest.fixture
def hostile_config(tmp_path) -> dict[str, str]:
    home = tmp_path / "home"
    (home / ".criu").mkdir(parents=True)
    (home / ".criu" / "default.conf").write_text(HOSTILE)
    (tmp_path / "criu.conf").write_text(HOSTILE)
    return {"HOME": str(home), "CRIU_CONFIG_FILE": str(tmp_path / "criu.conf")}


@pytest.mark.criu
def test_config_files_are_not_applied_to_dump_or_restore(sample_job, repo, tmp_path, reference, hostile_config):
    kw = dict(steps=150, mb=8, threads=1)
    expected = reference(**kw)
    job = sample_job(**kw, step_ms=20)
    job.wait_steps(3)
    # the files are hostile: the same CRIU, given the same environment, fails
    plain = tmp_path / "plain"
    plain.mkdir()
    for env in ({"HOME": hostile_config["HOME"]}, {"CRIU_CONFIG_FILE": hostile_config["CRIU_CONFIG_FILE"]}):
        p = subprocess.run(["criu", "dump", "-t", str(job.pid), "-D", str(plain), "--leave-running",
                            "--shell-job", "-o", "log"], env={"PATH": "/usr/local/sbin:/usr/sbin:/usr/bin", **env},
                           capture_output=True, text=True, timeout=120)
        assert p.returncode != 0, f"a plain CRIU dump with {env} should fail: {p.stderr}"
    assert job.alive()
    try:
        info = run_json("dump", job.pid, "--repo", repo, env=hostile_config)
        assert not any("action-script" in o for o in info["criu_options"]), info["criu_options"]
        job.wait_steps(job.steps_done() + 2)
        job.kill()
        restored = run_json("restore", info["snapshot"], "--repo", repo, env=hostile_config)
        assert restored["pid"] == job.pid
        assert job.result() == expected
    finally:
        kill_pids(job.pids or [job.pid])


def test_doctor_names_the_config_files_it_does_not_apply(hostile_config):
    report = run_json("doctor", env=hostile_config)
    lines = [c for c in report["checks"] if c["name"] == "criu config"]
    assert len(lines) == 1, report["checks"]
    assert lines[0]["status"] == "info"
    assert hostile_config["CRIU_CONFIG_FILE"] in lines[0]["detail"]
    assert hostile_config["HOME"] + "/.criu/default.conf" in lines[0]["detail"]
    assert "--no-default-config" in lines[0]["detail"]


def test_doctor_says_nothing_of_config_files_where_there_are_none(tmp_path):
    report = run_json("doctor", env={"HOME": str(tmp_path), "CRIU_CONFIG_FILE": ""})
    said = any(c["name"] == "criu config" for c in report["checks"])
    assert said == os.path.exists("/etc/criu/default.conf"), report["checks"]
