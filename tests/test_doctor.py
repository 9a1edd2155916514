"""gpusnap doctor on this (GPU-less) machine, against real processes."""

from __future__ import annotations

import fcntl
import grp
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from conftest import GPUSNAP, PY, ROOT

from gpusnap.ops import doctor
from gpusnap.ops import preflight
from gpusnap.system import paths
from gpusnap.system import proc as gsproc
from gpusnap.criu import runner
from gpusnap.ops.doctor import run_doctor
from gpusnap.render.machine import doctor_table, doctor_text
from gpusnap.gpu import probe as gprobe

NO_DRIVER = not gprobe.probe_inprocess().available
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


def statuses(r, name):
    return [c.status for c in r.by_name(name)]


@pytest.fixture(scope="module")
def system_report():
    return run_doctor()


# ---------------------------------------------------------------- parsers

def test_parse_criu_version():
    assert runner.parse_version("Version: 4.1.1\n") == (4, 1, 1)
    assert runner.parse_version("Version: 3.17\nGitID: v3.17") == (3, 17)
    assert runner.parse_version("nonsense") is None


def test_cap_eff_parsing():
    caps = doctor.cap_eff("Name:\tx\nCapEff:\t000001fffeffffff\n")
    assert not doctor.has_cap(doctor.CAP_SYS_RESOURCE, caps)
    assert doctor.has_cap(preflight.CAP_CHECKPOINT_RESTORE, caps)
    assert doctor.has_cap(21, caps)  # CAP_SYS_ADMIN
    assert doctor.cap_eff("") == 0


def test_decode_addr():
    assert preflight.decode_addr("0100007F:1F90") == "127.0.0.1:8080"
    assert preflight.decode_addr("00000000000000000000000001000000:0016") == "[::1]:22"
    # IPv4-mapped IPv6 shows as IPv4
    assert preflight.decode_addr("0000000000000000FFFF00000100007F:0050") == "127.0.0.1:80"


def test_parse_proc_net_tcp():
    text = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
            "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1 0 100 0 0 10 0\n"
            "   1: 0100007F:9C40 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 4343 1 0 20 4 30 10 -1\n")
    rows = preflight.parse_proc_net_tcp(text)
    assert rows == [{"local": "127.0.0.1:8080", "remote": "0.0.0.0:0", "state": "LISTEN", "inode": 4242},
                    {"local": "127.0.0.1:40000", "remote": "127.0.0.1:8080", "state": "ESTABLISHED",
                     "inode": 4343}]


def test_parse_ss_unix():
    text = ("u_str ESTAB 0 0 * 648 * 647\n"
            "u_str ESTAB 0 0 /run/systemd/journal/stdout 1234 * 999\n"
            "u_dgr UNCONN 0 0 /tmp/with space 77 * 0\n")
    rows = preflight.parse_ss_unix(text)
    assert rows[0] == {"type": "u_str", "state": "ESTAB", "path": "", "inode": 648, "peer": 647}
    assert rows[1]["path"] == "/run/systemd/journal/stdout" and rows[1]["peer"] == 999
    assert rows[2]["path"] == "/tmp/with space" and rows[2]["peer"] == 0


def test_process_tree_finds_descendants():
    p = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    try:
        import time
        for _ in range(50):
            tree = gsproc.tree(p.pid)
            if len(tree) == 2:
                break
            time.sleep(0.05)
        assert tree[0] == p.pid and len(tree) == 2
    finally:
        for child in gsproc.tree(p.pid)[1:]:
            os.kill(child, 9)
        p.kill()
        p.wait()


# ---------------------------------------------------------------- the machine

def test_report_is_json_and_renders(system_report):
    d = system_report.to_dict()
    json.dumps(d)
    assert d["pid"] is None and d["worst"] in doctor.STATUSES
    assert all(c["status"] in doctor.STATUSES for c in d["checks"])
    from rich.console import Console
    con = Console(record=True, width=160)
    con.print(doctor_table(system_report))
    assert "criu" in con.export_text()
    assert "criu" in doctor_text(system_report)


def test_criu_version_ok(system_report):
    from gpusnap.criu import runner

    path = runner.criu_path()
    if not path:
        assert statuses(system_report, "criu") == ["fail"]
        assert "make setup" in system_report.by_name("criu")[0].fix
        return
    assert statuses(system_report, "criu") == ["ok"]
    detail = system_report.by_name("criu")[0].detail
    assert detail.startswith("CRIU 4.") and detail.endswith(f"({path})")   # version and path
    # flagged only when this CRIU cannot dump network sockets on this kernel
    version = runner.parse_version(subprocess.run([path, "--version"], capture_output=True, text=True).stdout)
    assert statuses(system_report, "criu sockets") == (["warn"] if runner.sockets_broken(version) else [])


@needs_root
def test_root_and_criu_check(system_report):
    assert statuses(system_report, "privileges") == ["ok"]
    assert system_report.by_name("criu check")[0].status in ("ok", "warn")


def test_cap_sys_resource_reported(system_report):
    expect = "ok" if doctor.has_cap(doctor.CAP_SYS_RESOURCE) else "warn"
    c = system_report.by_name("CAP_SYS_RESOURCE")[0]
    assert c.status == expect
    if expect == "warn":
        assert "another uid" in c.detail


def test_soft_dirty_is_informational(system_report):
    c = system_report.by_name("soft-dirty tracking")[0]
    assert c.status in ("ok", "info") and "does not need it" in c.detail


@pytest.mark.skipif(not NO_DRIVER, reason="this machine has an NVIDIA driver")
def test_no_nvidia_driver_is_clean(system_report):
    c = system_report.by_name("NVIDIA driver")[0]
    assert c.status in ("info", "warn") and "no NVIDIA driver" in c.detail
    assert system_report.driver["available"] is False
    assert not system_report.by_name("CUDA checkpoint API")


def _plugin_check(monkeypatch, plugin_dir) -> "doctor.Check":
    monkeypatch.setenv("GPUSNAP_PLUGIN_DIR", str(plugin_dir))
    assert paths.plugin_dir() == plugin_dir
    checks = run_doctor().by_name("CUDA plugin")
    assert len(checks) == 1
    return checks[0]


def test_plugin_missing_from_its_directory_warns(monkeypatch, tmp_path):
    c = _plugin_check(monkeypatch, tmp_path)
    assert c.status == "warn" and "not in" in c.detail


def test_plugin_that_is_no_library_fails(monkeypatch, tmp_path):
    (tmp_path / "gpusnap_cuda.so").write_bytes(b"not elf")
    assert _plugin_check(monkeypatch, tmp_path).status == "fail"


def test_plugin_that_is_a_library_is_ok(monkeypatch, tmp_path):
    shutil.copy(sys.executable if Path(sys.executable).read_bytes()[:4] == b"\x7fELF"
                else "/bin/true", tmp_path / "gpusnap_cuda.so")
    assert _plugin_check(monkeypatch, tmp_path).status == "ok"


def test_plugin_directory_missing_warns(monkeypatch, tmp_path):
    c = _plugin_check(monkeypatch, tmp_path / "nope")
    assert c.status == "warn" and "does not exist" in c.detail


def test_plugin_dir_default(monkeypatch):
    monkeypatch.delenv("GPUSNAP_PLUGIN_DIR", raising=False)
    d = paths.plugin_dir()
    assert d == paths.source_root() / "build" / "plugins" or d == paths.SYSTEM_PLUGIN_DIR
    assert paths.plugin_path().name == "gpusnap_cuda.so"


# ---------------------------------------------------------------- a job

def test_missing_process():
    r = run_doctor(2 ** 22 + 11)
    assert statuses(r, "process") == ["fail"] and not r.ok


def test_plain_job_has_nothing_in_the_way():
    p = subprocess.Popen(["sleep", "30"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        r = run_doctor(p.pid)
        job = [c for c in r.checks if c.name in ("process", "TCP", "unix sockets", "terminal",
                                                  "GPU", "uid", "ptrace", "self", "session")]
        assert {c.name: c.status for c in job} == {"process": "ok", "GPU": "ok"}, doctor_text(r)
        assert "CPU-only" in r.by_name("GPU")[0].detail
    finally:
        p.kill()
        p.wait()


@needs_root
def test_session_leader_outside_the_pid_namespace_is_flagged():
    holder = subprocess.Popen(["unshare", "--pid", "--fork", "sleep", "60"], stdin=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
    target = None
    try:
        deadline = time.monotonic() + 10
        while not (kids := gsproc.children(holder.pid)):
            if holder.poll() is not None:   # a sandbox that forbids new PID namespaces
                pytest.skip(f"cannot make a PID namespace here: {holder.stderr.read().decode().strip()}")
            assert time.monotonic() < deadline
            time.sleep(0.02)
        target = kids[0]
        r = run_doctor(target)
        assert statuses(r, "session") == ["fail"] and not r.ok, doctor_text(r)
    finally:
        if target:
            os.kill(target, 9)
        holder.kill()
        holder.wait()


def test_tcp_connection_is_flagged():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    code = (f"import socket,time; s=socket.create_connection(('127.0.0.1',{port})); "
            "print('ok',flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "ok"
        conn, _ = srv.accept()
        r = run_doctor(p.pid)
        c = r.by_name("TCP")
        # dumped with --tcp-established automatically (the network lock is available here)
        assert c and c[0].status == "info", doctor_text(r)
        assert f"127.0.0.1:{port}" in c[0].detail and "ESTABLISHED" in c[0].detail
        assert "--tcp-established" in c[0].detail and "--tcp-close" in c[0].fix
        assert "--tcp-established" in r.plan["dump_options"]
        conn.close()
    finally:
        p.kill()
        p.wait()
        srv.close()


def test_listening_socket_is_fine():
    code = ("import socket,time; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen(); "
            "print(s.getsockname()[1],flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        port = p.stdout.readline().strip()
        r = run_doctor(p.pid)
        assert not r.by_name("TCP")
        assert r.by_name("TCP listen")[0].status == "ok" and port in r.by_name("TCP listen")[0].detail
    finally:
        p.kill()
        p.wait()


def test_controlling_terminal_is_flagged():
    master, slave = os.openpty()

    def take_tty():
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)

    p = subprocess.Popen(["sleep", "30"], stdin=slave, stdout=slave, stderr=slave,
                         preexec_fn=take_tty, pass_fds=(slave,))
    try:
        assert gsproc.read_stat(p.pid).tty_nr != 0
        r = run_doctor(p.pid)
        c = r.by_name("terminal")
        assert c and c[0].status == "info" and "--shell-job" in c[0].detail
        assert "/dev/pts/" in c[0].detail
    finally:
        p.kill()
        p.wait()
        os.close(master)
        os.close(slave)


def test_external_unix_socket_is_flagged(tmp_path):
    if not shutil.which("ss"):
        pytest.skip("ss not installed")
    path = str(tmp_path / "ext.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen()
    code = (f"import socket,time; s=socket.socket(socket.AF_UNIX); s.connect({path!r}); "
            "print('ok',flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "ok"
        conn, _ = srv.accept()
        r = run_doctor(p.pid)
        c = r.by_name("unix sockets")
        assert c and c[0].status == "fail", doctor_text(r)
        assert f"pid {os.getpid()}" in c[0].detail   # the test process holds the peer
        conn.close()
    finally:
        p.kill()
        p.wait()
        srv.close()


def test_socketpair_inside_the_tree_is_fine():
    code = ("import socket,os,time; a,b=socket.socketpair(); pid=os.fork()\n"
            "if pid==0: time.sleep(60)\n"
            "print('ok',flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "ok"
        r = run_doctor(p.pid)
        assert not r.by_name("unix sockets"), doctor_text(r)
    finally:
        os.killpg(p.pid, 9)
        p.wait()


@needs_root
@pytest.mark.parametrize("cap", ["kept", "dropped"])
def test_other_uid_without_cap_sys_resource(cap):
    """A job of another user: fine for root with CAP_SYS_RESOURCE, a failed check without it
    (root with the capability dropped from its bounding set, as in some containers)."""
    if cap == "kept" and not doctor.has_cap(doctor.CAP_SYS_RESOURCE):
        pytest.skip("root has no CAP_SYS_RESOURCE on this machine (a container that withholds it)")
    try:
        nobody = pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("no user nobody")
    p = subprocess.Popen(["sleep", "30"], user=nobody, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        drop = [] if cap == "kept" else ["setpriv", "--bounding-set=-sys_resource", "--inh-caps=-sys_resource"]
        r = subprocess.run([*drop, *GPUSNAP, "doctor", str(p.pid), "--json"], capture_output=True, text=True,
                           cwd=ROOT, timeout=300)
        [c] = [c for c in json.loads(r.stdout)["checks"] if c["name"] == "uid"]
        if cap == "kept":
            assert c["status"] == "ok", c
        else:
            assert c["status"] == "fail" and "CAP_SYS_RESOURCE" in c["detail"], c
    finally:
        p.kill()
        p.wait()


def test_mps_environment_is_flagged_for_cuda_jobs_only():
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY="/tmp/nvidia-mps")
    p = subprocess.Popen(["sleep", "30"], env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        r = run_doctor(p.pid)
        assert r.by_name("MPS")[0].status == "warn"
        assert r.by_name("GPU")[0].status == "ok"
    finally:
        p.kill()
        p.wait()


def test_own_ancestor_is_refused():
    r = run_doctor(os.getppid())
    assert statuses(r, "self") == ["fail"]


# ---------------------------------------------------------------- doctor and dump agree
# Each rule below is decided once (ops.preflight, criu.runner) and read by both commands:
# where doctor fails a check, dump refuses with the exit code doctor names, with the same
# message and hint, before it touches the job.

def _gpusnap(*args, env: dict[str, str], drop: tuple[str, ...] = (), user: str | None = None,
             caps: str | None = None):
    """gpusnap ARGS with env; as `user` (runuser), or as nobody with only the capabilities
    `caps` ('+checkpoint_restore,...': setpriv)."""
    from conftest import GPUSNAP, ROOT, require_nobody_can_run

    if user is not None or caps is not None:
        require_nobody_can_run()
        drop = (*drop, "GPUSNAP_REPO")      # (conftest's is in root's private tmp_path)
    full = {k: v for k, v in os.environ.items() if k not in drop} | env
    prefix = ["runuser", "-u", user, "--", "env", *(f"{k}={v}" for k, v in full.items())] if user else []
    if caps is not None:
        prefix = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", f"--inh-caps={caps}",
                  f"--ambient-caps={caps}"]
    return subprocess.run([*prefix, *GPUSNAP, *map(str, args)], capture_output=True, text=True,
                          env=full, cwd=ROOT, timeout=300)


def _doctor_check(name: str, env: dict[str, str], user: str | None = None, caps: str | None = None) -> dict:
    res = _gpusnap("doctor", "--json", env=env, user=user, caps=caps)
    checks = {c["name"]: c for c in json.loads(res.stdout)["checks"]}
    # doctor exits 1 when any check fails, 0 otherwise (warnings included)
    assert res.returncode == (1 if any(c["status"] == "fail" for c in checks.values()) else 0), res.stderr
    return checks[name]


def _refused_alike(check: dict, res: subprocess.CompletedProcess) -> None:
    """dump refused for exactly the reason, and with the exit code, doctor gave."""
    assert check["status"] == "fail" and check["exit_code"], check
    assert res.returncode == check["exit_code"], (res.stdout, res.stderr)
    err = json.loads(res.stdout)
    assert (err["message"], err.get("hint")) == (check["detail"], check["fix"])


@pytest.fixture
def idle_job():
    p = subprocess.Popen(["sleep", "120"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         start_new_session=True)
    yield p
    p.kill()
    p.wait()


def _untouched(p: subprocess.Popen, repo: Path) -> None:
    assert gsproc.read_stat(p.pid).state == "S"          # running (sleeping), never stopped
    assert list((repo / "snapshots").glob("*")) == []    # (none, whether the directory was made or not)


@needs_root
@pytest.mark.parametrize("script", ["old", "no-version", "missing"])
def test_doctor_and_dump_agree_on_the_criu_of_GPUSNAP_CRIU(tmp_path, idle_job, script):
    """$GPUSNAP_CRIU names the CRIU both use: a too-old one, one that says no version, one
    that is not there. Doctor fails its check; dump refuses with that check's code."""
    fake = tmp_path / "criu"
    if script == "old":
        fake.write_text("#!/bin/sh\necho 'Version: 3.17'\n")
    elif script == "no-version":
        fake.write_text("#!/bin/sh\necho 'criu, somehow'\n")
    if fake.exists():
        fake.chmod(0o755)
    env = {"GPUSNAP_CRIU": str(fake)}
    check = _doctor_check("criu", env)
    from gpusnap.errors import CriuUnavailable

    assert check["exit_code"] == CriuUnavailable.exit_code and str(fake) in check["detail"]
    if script == "old":
        assert "3.17" in check["detail"] and "too old" in check["detail"]
    res = _gpusnap("dump", idle_job.pid, "--repo", tmp_path / "repo", "--json", env=env)
    _refused_alike(check, res)
    _untouched(idle_job, tmp_path / "repo")


def test_doctor_finds_criu_where_dump_does_without_sbin_on_path():
    """cron's PATH lacks the sbin directories: doctor still reports the CRIU that dump runs
    (criu.runner.criu_path, not a PATH lookup of its own)."""
    env = {"PATH": "/usr/bin:/bin"}
    from conftest import PY

    where = _gpusnap_py("from gpusnap.criu import runner; print(runner.criu_path())", env, PY)
    if where == "None":
        pytest.skip("no CRIU installed")
    check = _doctor_check("criu", {**env, "GPUSNAP_CRIU": ""})
    assert check["status"] == "ok" and check["detail"].endswith(f"({where})"), check


def _gpusnap_py(code: str, env: dict[str, str], py: str) -> str:
    full = {k: v for k, v in os.environ.items() if k != "GPUSNAP_CRIU"} | env
    return subprocess.run([py, "-c", code], capture_output=True, text=True, env=full, check=True).stdout.strip()


@needs_root
@pytest.mark.skipif(shutil.which("runuser") is None, reason="needs runuser to run as another user")
def test_doctor_and_dump_agree_on_privileges(tmp_path):
    """As a user without root or CRIU's capabilities, doctor says 'fail' for privileges and
    dump refuses with that exit code (not 'ready' where dump refuses)."""
    try:
        nobody = pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("no user nobody")
    job = subprocess.Popen(["sleep", "120"], user=nobody, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        check = _doctor_check("privileges", {}, user="nobody")
        from gpusnap.errors import NotRoot

        assert check["exit_code"] == NotRoot.exit_code
        res = _gpusnap("dump", job.pid, "--repo", "/tmp/gpusnap-nobody-cannot-write/repo", "--json",
                       env={}, user="nobody")
        _refused_alike(check, res)
        assert gsproc.read_stat(job.pid).state == "S"
    finally:
        job.kill()
        job.wait()


@needs_root
@pytest.mark.criu
def test_doctor_and_dump_take_the_same_process_tree(tmp_path):
    """Children forked by a worker thread, and a grandchild: doctor's tree (plan.pids) is the
    tree the dump takes (the processes the snapshot records)."""
    from conftest import kill_pids, run_json

    code = ("import os,subprocess,sys,threading,time\n"
            "kids=[]\n"
            "def worker():\n"
            "    kids.append(subprocess.Popen(['sh','-c','sleep 300 & wait']))\n"
            "t=threading.Thread(target=worker); t.start(); t.join()\n"
            "kids.append(subprocess.Popen(['sleep','300']))\n"
            "print('ready',flush=True); time.sleep(300)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        for _ in range(100):       # the grandchild `sleep` of `sh -c` appears a moment later
            if len(gsproc.tree(p.pid)) == 4:
                break
            time.sleep(0.05)
        doc = run_json("doctor", p.pid)
        assert len(doc["plan"]["pids"]) == 4, doc["plan"]
        d = run_json("dump", p.pid, "--repo", tmp_path / "repo")
        recorded = {x["pid"] for x in run_json("inspect", d["snapshot"])["processes"]}
        assert recorded == set(doc["plan"]["pids"])
    finally:
        kill_pids(gsproc.tree(p.pid)[::-1])
        p.wait()


@needs_root
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv to drop to chosen capabilities")
@pytest.mark.parametrize("caps,ready", [("+checkpoint_restore", False),
                                        ("+checkpoint_restore,+sys_ptrace", True)])
def test_doctor_and_dump_agree_on_capabilities_without_root(caps, ready):
    """Not root: CAP_CHECKPOINT_RESTORE alone is not enough for either command; with
    CAP_SYS_PTRACE too, doctor warns (CRIU's non-root mode) and dump does not refuse for
    privileges (it goes on, here to a repository it may not create)."""
    try:
        pwd.getpwnam("nobody"), grp.getgrnam("nogroup")
    except KeyError:
        pytest.skip("no user nobody / group nogroup")
    from gpusnap.errors import NotRoot

    job = subprocess.Popen(["sleep", "120"], user="nobody", stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        check = _doctor_check("privileges", {}, caps=caps)
        res = _gpusnap("dump", job.pid, "--repo", "/var/lib/gpusnap-nobody-cannot/repo", "--json", env={},
                       caps=caps)
        if ready:
            assert check["status"] == "warn" and check["exit_code"] is None, check
            from gpusnap.errors import RepositoryError

            assert res.returncode == RepositoryError.exit_code, (res.stdout, res.stderr)   # past preflight
        else:
            assert check["exit_code"] == NotRoot.exit_code, check
            _refused_alike(check, res)
        assert gsproc.read_stat(job.pid).state == "S"
    finally:
        job.kill()
        job.wait()


def test_doctor_says_whether_the_repository_is_there(tmp_path, monkeypatch):
    """`doctor --repo TYPO` said `ok` (only the filesystem was checked): now it warns with the
    same path and `gpusnap init` hint that every command's exit 14 gives; a directory that is
    no repository fails; a real one is ok; the default location not made yet is information."""
    def check(*args, env=None):
        p = subprocess.run([PY, "-m", "gpusnap", "doctor", "--json", *args], capture_output=True, text=True,
                           env={**os.environ, **(env or {})})
        return {c["name"]: c for c in json.loads(p.stdout)["checks"]}["repository"]

    typo = tmp_path / "repo-typo"
    c = check("--repo", str(typo))
    assert c["status"] == "warn" and str(typo) in c["detail"] and f"gpusnap init --repo {typo}" in c["fix"]
    dump = subprocess.run([PY, "-m", "gpusnap", "ls", "--repo", str(typo)], capture_output=True, text=True)
    assert dump.returncode == 14 and str(typo) in dump.stderr and not typo.exists()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    c = check("--repo", str(tmp_path / "other"))
    assert c["status"] == "fail" and c["exit_code"] == 14, c
    subprocess.run([PY, "-m", "gpusnap", "init", "--repo", str(tmp_path / "real")], check=True, capture_output=True)
    assert check("--repo", str(tmp_path / "real"))["status"] == "ok"
    c = check(env={"GPUSNAP_REPO": str(tmp_path / "default-to-be")})
    assert c["status"] == "info" and "first dump" in c["detail"]
