"""Every restore failure users meet says what to do: a `hint:` line, and `hint` in --json.

The PIDs case runs for real (restore while the original job still runs); the CRIU log-line
cases check the mapping from CRIU's own error lines (copied from real CRIU 4.2 logs) to advice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import kill_pids, run_gpusnap, run_json
from gpusnap.criu import runner


@pytest.mark.criu
def test_restore_while_the_original_runs_says_to_stop_it(sample_job, repo):
    job = sample_job(steps=100000, mb=8, threads=1)
    job.wait_steps(3)
    snap = run_json("dump", job.pid, "--repo", repo)["snapshot"]
    r = run_gpusnap("restore", snap, "--repo", repo, "--json")
    assert r.returncode == 7, r.stdout + r.stderr
    err = json.loads(r.stdout)
    assert f"kill {job.pid}" in err["hint"] and "namespace" in err["hint"]
    assert "restore on another machine or in a PID namespace" not in err["hint"]
    r = run_gpusnap("restore", snap, "--repo", repo)
    assert r.returncode == 7 and "hint:" in r.stderr
    assert job.alive()


CASES = [
    ("pie: 2: Error (criu/pie/restorer.c:1907): Can't read pages data (-29)", "--via files"),
    ("Error (criu/cr-restore.c:1237): Can't fork for 4242: File exists", "original job"),
    ("Error (criu/cr-restore.c:1546): Pid 4242 do not match expected 4243", "stop it"),
    ("Error (criu/files-reg.c:2175): File /tmp/train.log has bad size 93 (expect 70)", "output files that grew"),
    ("Error (criu/files-reg.c:2190): File /usr/lib/libc.so.6 has bad build-id", "replaced"),
    ("Error (criu/sk-inet.c:1059): Can't bind inet socket (id 7): Address already in use", "port"),
    ("Error (criu/mem.c:964): Unable to map ANON_VMA: Cannot allocate memory", "out of memory"),
    ("Error (criu/files-reg.c:2050): Can't open file tmp/in.dat on restore: No such file or directory", "gone"),
    ("Error (criu/files-reg.c:2050): Can't open file dev/shm/link_remap.26 on restore: No such file or directory",
     "named semaphore"),
    ("Error (criu/uffd.c:314): Unable to open an userfaultfd descriptor: Operation not permitted", "--via stream"),
    ("Error (criu/sk-unix.c:1406): unix: Can't connect 1075328 socket: No such file or directory", "daemon"),
    ("Error (criu/sk-unix.c:1406): unix: Can't connect 1075328 socket: Connection refused", "same address"),
    ("Error (criu/cr-restore.c:2400): Something nobody has seen before", "full log"),
]


@pytest.mark.parametrize("line,needle", CASES)
def test_criu_restore_errors_map_to_advice(line, needle):
    hint = runner.explain_restore([line])
    assert hint and needle in hint


def test_pids_count_as_taken_meanwhile_only_when_criu_says_so():
    """A PID held (here: by this test) after CRIU failed is PidsInUse only when CRIU's log
    says it could not have a PID; after any other failure it is what CRIU itself left."""
    from gpusnap.errors import PidsInUse
    from gpusnap.ops.restore_paths import _pids_taken_meanwhile

    me = [os.getpid()]
    _pids_taken_meanwhile(me, "log", ["Error (criu/sk-inet.c:1059): Can't bind inet socket (id 7)"])
    with pytest.raises(PidsInUse):
        _pids_taken_meanwhile(me, "log", ["Error (criu/cr-restore.c:1237): Can't fork for 4242: File exists"])
    with pytest.raises(PidsInUse):
        _pids_taken_meanwhile(me, "log", ["Error (criu/cr-restore.c:1546): Pid 4242 do not match expected 4243"])


@pytest.mark.criu
def test_a_zombie_holding_the_pid_is_explained(repo):
    """The snapshot's PID held by a zombie (the job died, its parent, here this test, has not
    collected it): the hint says what a zombie is and to reap it, not to kill the job."""
    p = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(120)"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, start_new_session=True)
    restored: list[int] = []
    try:
        assert p.stdout.readline().strip() == "ready"
        snap = run_json("dump", p.pid, "--repo", repo, "--exit")["snapshot"]
        r = run_gpusnap("dump", p.pid, "--repo", repo, "--json")     # a zombie is no job to dump
        assert r.returncode == 5 and "is a zombie" in json.loads(r.stdout)["message"], r.stdout
        r = run_gpusnap("restore", snap, "--repo", repo, "--json")
        assert r.returncode == 7, r.stdout + r.stderr
        err = json.loads(r.stdout)
        assert f"{p.pid} (zombie python" in err["message"], err
        assert "zombie" in err["hint"] and f"child of PID {os.getpid()}" in err["hint"], err
        assert f"kill {p.pid}" not in err["hint"] and f"kill {os.getpid()}" in err["hint"]
        p.wait()                                           # reaped: the PID is free again
        restored = run_json("restore", snap, "--repo", repo)["pids"]
        assert restored == [p.pid]
    finally:
        kill_pids(restored)
        if p.poll() is None:
            p.kill()
        p.wait()
