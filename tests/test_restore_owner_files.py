"""Root restores a user's job whose log grew after the dump, while the user attacks. The log and
its directory are the user's; the attacker (user nobody) races gpusnap:

- swapping every `LOG.gpusnap-*-after` it sees for a symbolic link to a root file, on the
  normal path (the restore succeeds) and on the undo path (CRIU fails after the fix-up: the
  job's working directory was removed, so the moved bytes are put back);
- trading the log itself for a link to the root file, over and over (renameat2 exchange);
- (not racing) swapping the log's directory for a link to a root directory.

Whatever it does, the root file keeps its owner, mode and contents, and no byte of it reaches
the user's log; inspect says beforehand what the restore does. The fix-up runs as the file's
owner, through descriptors (gpusnap/system/ownerfs.py). Real CRIU, real processes, real races;
the job runs as root onto the user's log (CRIU here may lack CAP_SYS_RESOURCE for a job of
another uid).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import kill_pids, require_nobody_can_run, run_gpusnap, run_json

pytestmark = pytest.mark.criu

ROUNDS = 6
SECRET = b"root's own file, nobody may read or own it\n" * 64
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]

JOB = r'''
import os, sys, time
out, steps = sys.argv[1], int(sys.argv[2])
with open(os.path.join(out, "pid"), "w") as p:
    p.write(str(os.getpid()))
for i in range(1, steps + 1):
    print(f"step {i}/{steps}", flush=True)
    time.sleep(0.03)
'''

# The attacker: every `...-after` file that appears in its directory is renamed away and a
# link to the root file takes its name, as fast as it can.
ATTACK = r'''
import os, sys
home, victim, counter = sys.argv[1], sys.argv[2], sys.argv[3]
n = 0
while True:
    for name in os.listdir(home):
        if "-after" not in name or name.endswith(".moved"):
            continue
        p = os.path.join(home, name)
        try:
            if os.path.islink(p):
                continue
            os.rename(p, p + ".moved")
            os.symlink(victim, p)
        except OSError:
            continue
        n += 1
        with open(counter, "w") as f:
            f.write(str(n))
'''


# The second attacker: the log itself and a link to the root file trade names (renameat2
# RENAME_EXCHANGE, atomic) over and over, so that what gpusnap checks and what it then opens differ.
TOGGLE = r'''
import ctypes, os, sys
log, alt = sys.argv[1].encode(), sys.argv[2].encode()
libc = ctypes.CDLL(None, use_errno=True)
while True:
    libc.renameat2(-100, log, -100, alt, 2)
'''


def _wait(pred, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


@pytest.fixture
def userdir():
    """/tmp/X (root, 0755) holding `home` (nobody's: the job's cwd, script and log) and `victim`
    (root's, 0600)."""
    require_nobody_can_run()
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody")
    top = Path(tempfile.mkdtemp(prefix="gpusnap-owner-", dir="/tmp"))
    os.chmod(top, 0o755)
    home = top / "home"
    home.mkdir()
    (home / "cwd").mkdir()
    (home / "job.py").write_text(JOB)
    for p in (home, home / "cwd", home / "job.py"):
        os.chown(p, nobody.pw_uid, nobody.pw_gid)
    victim = top / "victim"
    victim.write_bytes(SECRET)
    os.chmod(victim, 0o600)
    yield home, victim
    shutil.rmtree(top, ignore_errors=True)


def _start_job(home: Path, log: Path) -> subprocess.Popen:
    """`python3 job.py > LOG` in the user's directory, onto the user's own log (an admin's job for
    the user; root's CRIU here may lack CAP_SYS_RESOURCE to dump a job of another uid)."""
    subprocess.run([*AS_NOBODY, "touch", str(log)], check=True)
    return subprocess.Popen(["sh", "-c", 'cd "$0/cwd" && exec /usr/bin/python3 -I "$0/job.py" "$0" 5000 > "$1" 2>&1',
                             str(home), str(log)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _lines(log: Path) -> int:
    try:
        return len(log.read_bytes().splitlines())
    except FileNotFoundError:
        return 0


def _snapshot_then_kill(home: Path, log: Path, repo: Path) -> tuple[str, int]:
    job = _start_job(home, log)
    _wait(lambda: _lines(log) >= 5, "the job's first lines")
    pid = int((home / "pid").read_text())
    snap = run_json("dump", pid, "--repo", repo)["snapshot"]
    n = _lines(log)
    _wait(lambda: _lines(log) >= n + 5, "the job to log on after the dump")
    os.kill(pid, signal.SIGKILL)
    job.wait(timeout=30)
    _wait(lambda: _gone(pid), "the killed job's PID to be free")
    return snap, pid


def _grow(log: Path) -> None:
    with open(log, "ab") as f:      # the crashed run's last words, again
        f.write(b"written after the snapshot\n" * 20)


def _attacker(home: Path, victim: Path) -> subprocess.Popen:
    return subprocess.Popen([*AS_NOBODY, "/usr/bin/python3", "-I", "-c", ATTACK, str(home), str(victim),
                             str(home / "swaps")], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _victim_intact(victim: Path, log: Path, mode: int = 0o600) -> None:
    assert SECRET[:40] not in log.read_bytes(), "the root file's contents reached the user's log"
    st = os.stat(victim)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, 0, mode), "the root file was handed to the user"
    assert victim.read_bytes() == SECRET


def _inspect(repo: Path, snap: str) -> tuple[list, dict]:
    rep = run_json("inspect", snap, "--repo", repo)
    return rep["files_changed"], {c["path"]: c for c in rep.get("file_checks", [])}


def _swaps(home: Path) -> int:
    try:
        return int((home / "swaps").read_text() or 0)
    except FileNotFoundError:
        return 0


def _stop(attacker: subprocess.Popen) -> None:
    attacker.kill()
    attacker.wait(timeout=30)


def test_racing_attacker_gains_nothing_while_a_grown_log_is_set_aside(userdir, repo):
    home, victim = userdir
    log = home / "job.log"
    snap, pid = _snapshot_then_kill(home, log, repo)
    changed, checks = _inspect(repo, snap)       # what inspect says, restore does
    assert changed == [] and checks[str(log)]["verdict"] == "set-aside"
    attacker = _attacker(home, victim)
    try:
        for _ in range(ROUNDS):
            _grow(log)
            r = run_gpusnap("restore", snap, "--repo", repo, "--json")
            try:
                assert r.returncode == 0, r.stdout + r.stderr
            finally:
                kill_pids([pid])
                _wait(lambda: _gone(pid), "the restored job's PID to be free")
            _victim_intact(victim, log)
        # the attacker swapped every after-file (the race was run); they are the user's, never root's
        _wait(lambda: _swaps(home) >= ROUNDS, "the attacker to swap each after-file")
        moved = sorted(home.glob("job.log.gpusnap-*-after*.moved"))
        assert len(moved) >= ROUNDS and all(p.stat().st_uid == home.stat().st_uid for p in moved)
    finally:
        _stop(attacker)


def test_racing_attacker_gains_nothing_when_a_failed_restore_puts_bytes_back(userdir, repo):
    home, victim = userdir
    log = home / "job.log"
    snap, pid = _snapshot_then_kill(home, log, repo)
    os.rmdir(home / "cwd")           # CRIU cannot restore the job's cwd: it fails after the fix-up
    changed, checks = _inspect(repo, snap)       # inspect: this restore fails (the cwd), the log is set aside
    assert changed == [str(home / "cwd")] and checks[str(log)]["verdict"] == "set-aside"
    attacker = _attacker(home, victim)
    try:
        for _ in range(ROUNDS):
            _grow(log)
            r = run_gpusnap("restore", snap, "--repo", repo, "--json")
            assert r.returncode not in (0, 25), r.stdout + r.stderr   # CRIU's failure, after the fix-up
            assert _gone(pid)
            _victim_intact(victim, log)
        # it swapped at least once while CRIU ran (a round it misses is one more chance for the undo)
        assert _swaps(home) >= 1
    finally:
        _stop(attacker)
    # with nobody racing, the undo puts every byte back, as the log's owner, and leaves no after-file
    _grow(log)
    before, afters = log.read_bytes(), set(home.glob("job.log.gpusnap-*"))
    r = run_gpusnap("restore", snap, "--repo", repo, "--json")
    assert r.returncode not in (0, 25), r.stdout + r.stderr
    assert log.read_bytes() == before and set(home.glob("job.log.gpusnap-*")) == afters
    assert os.stat(log).st_uid == os.stat(home).st_uid


def test_a_log_directory_swapped_for_a_link_to_a_root_directory_is_refused_untouched(userdir, repo):
    home, victim = userdir
    logs = home / "logs"
    subprocess.run([*AS_NOBODY, "mkdir", str(logs)], check=True)
    log = logs / "job.log"
    snap, pid = _snapshot_then_kill(home, log, repo)
    # a root directory holding a longer file of the same name and mode; the user points `logs` at it
    rootdir = victim.parent / "rootdir"
    rootdir.mkdir(mode=0o755)
    (rootdir / "job.log").write_bytes(SECRET)
    os.chmod(rootdir / "job.log", stat.S_IMODE(os.stat(log).st_mode))
    subprocess.run([*AS_NOBODY, "sh", "-c", 'mv "$0" "$0.old" && ln -s "$1" "$0"', str(logs), str(rootdir)],
                   check=True)
    changed, checks = _inspect(repo, snap)
    assert changed == [str(log)] and "symbolic link" in checks[str(log)]["detail"]
    r = run_gpusnap("restore", snap, "--repo", repo, "--json")
    assert r.returncode == 25, r.stdout + r.stderr
    assert str(log) in r.stdout and "symbolic link" in r.stdout
    assert _gone(pid)
    assert sorted(p.name for p in rootdir.iterdir()) == ["job.log"]
    _victim_intact(rootdir / "job.log", logs.with_name("logs.old") / "job.log", stat.S_IMODE(os.stat(log).st_mode))


def _pause(p: subprocess.Popen) -> None:
    os.kill(p.pid, signal.SIGSTOP)
    _wait(lambda: Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T",
          "the attacker to stop")


@pytest.mark.parametrize("traded", ["file", "directory"])
def test_racing_attacker_trading_the_log_for_a_link_gains_nothing(userdir, repo, traded):
    """The log itself (or its directory) and a link to the root file (or a root directory
    holding a file of the log's name and mode) trade names all through the restores."""
    home, victim = userdir
    if traded == "file":
        real, alt, name, mode = home / "job.log", home / "job.log.alt", "", 0o600
    else:
        subprocess.run([*AS_NOBODY, "mkdir", str(home / "logs")], check=True)
        real, alt, name = home / "logs", home / "logs.alt", "job.log"
    log = real / name if name else real
    snap, pid = _snapshot_then_kill(home, log, repo)
    if traded == "directory":
        mode = stat.S_IMODE(os.stat(log).st_mode)
        rootdir = victim.parent / "rootdir"
        rootdir.mkdir(mode=0o755)
        victim = rootdir / name
        victim.write_bytes(SECRET)
        os.chmod(victim, mode)
    subprocess.run([*AS_NOBODY, "ln", "-s", str(victim.parent if name else victim), str(alt)], check=True)
    toggler = subprocess.Popen([*AS_NOBODY, "/usr/bin/python3", "-I", "-c", TOGGLE, str(real), str(alt)],
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    outcomes = []
    try:
        for _ in range(3 * ROUNDS):
            _pause(toggler)          # the log back at its name, and grown, between rounds
            if os.path.islink(real):
                os.rename(real, home / "swap")
                os.rename(alt, real)
                os.rename(home / "swap", alt)
            _victim_intact(victim, log, mode)
            _grow(log)
            os.kill(toggler.pid, signal.SIGCONT)
            r = run_gpusnap("restore", snap, "--repo", repo, "--json")
            outcomes.append(r.returncode)
            kill_pids([pid])
            _wait(lambda: _gone(pid), "the restored job's PID to be free")
        _pause(toggler)
        if os.path.islink(real):
            log = alt / name if name else alt
        _victim_intact(victim, log, mode)
        # every round ended in a restore, a refusal naming the file, or CRIU's refusal; never in harm
        assert set(outcomes) <= {0, 8, 25}, outcomes
    finally:
        os.kill(toggler.pid, signal.SIGCONT)
        _stop(toggler)
