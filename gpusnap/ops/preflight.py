"""The one preflight: can this process tree be dumped, and with which CRIU options.

`check(pid)` reads the tree from /proc exactly as CRIU will take it (task/*/children) and
returns a Plan: findings (ok/info/warn/fail, each with what to do) and the CRIU dump options
and restore flags the tree needs (--shell-job, --tcp-established, --file-locks, the network
lock method, --ghost-limit and --link-remap for open deleted files: system/ghosts.py).
`gpusnap dump` raises the first failure (Plan.require); `gpusnap doctor PID` shows every finding. Both read the same Plan, so doctor never says "ready" where dump refuses.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpusnap.criu import netlock
from gpusnap.system import containers, filelocks, proc, sockets, sysvipc, undumpable
# re-exported: doctor and its tests read these here
from gpusnap.system.sockets import decode_addr, parse_proc_net_tcp, parse_ss_unix  # noqa: F401
from gpusnap.errors import CriuUnavailable, GpusnapError, NotDumpable, NotRoot, ProcessNotFound, UsageError
# the capability rule lives in caps.py (doctor and the tests read these names here too)
from gpusnap.system.caps import (CAP_CHECKPOINT_RESTORE, CAP_SYS_PTRACE, CAP_SYS_RESOURCE,  # noqa: F401
                                 cap_eff, has_cap, may_run_criu)

PROC = Path("/proc")


@dataclass
class Finding:
    name: str
    status: str            # ok | info | warn | fail
    detail: str
    fix: str | None = None
    error: type[GpusnapError] | None = None   # for a failure: what `dump` raises

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("error")
        return d


@dataclass
class Plan:
    pid: int
    pids: list[int] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    dump_options: list[str] = field(default_factory=list)    # extra `criu dump` options
    restore_flags: list[str] = field(default_factory=list)   # what `criu restore` then needs
    locks: list[dict[str, Any]] = field(default_factory=list)
    tcp: list[dict[str, Any]] = field(default_factory=list)        # connections (not LISTEN)
    own_pid_namespace: bool = False  # the root is PID 1 of a namespace of its own (`gpusnap run`)
    listening: list[dict[str, Any]] = field(default_factory=list)
    unix_peers: list[str] = field(default_factory=list)  # daemons' addresses the restore reconnects to
    linked: list[Any] = field(default_factory=list)   # files dumped through CRIU's link remap (ghosts.py)
    netns: Any = None    # system/netns.py Netns: the root's network namespace when not gpusnap's own

    def add(self, name: str, status: str, detail: str, fix: str | None = None,
            error: type[GpusnapError] | None = None) -> Finding:
        f = Finding(name, status, detail, fix, error or (NotDumpable if status == "fail" else None))
        self.findings.append(f)
        return f

    def option(self, *opts: str, restore: bool = True) -> None:
        for o in opts:
            if o not in self.dump_options:
                self.dump_options.append(o)
        if restore:
            for o in opts:
                if o not in self.restore_flags:
                    self.restore_flags.append(o)

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if f.status == "fail"]

    @property
    def ok(self) -> bool:
        return not self.failures

    def require(self) -> "Plan":
        """Raise the first failure as the error `gpusnap dump` reports; else return self."""
        for f in self.failures:
            raise (f.error or NotDumpable)(f.detail, hint=f.fix)
        return self


# ---------------------------------------------------------------- small readers

def _read(path: Path | str) -> str | None:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None


def _run(cmd: list[str], timeout: float = 60) -> tuple[int, str]:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:.0f} s"
    except OSError as e:
        return 127, str(e)
    return r.returncode, (r.stdout or "") + (r.stderr or "")


# ---------------------------------------------------------------- the checks

def privileges() -> Finding:
    """Root, or both CAP_CHECKPOINT_RESTORE and CAP_SYS_PTRACE (what CRIU's dump needs)."""
    caps = cap_eff()
    if os.geteuid() == 0:
        return Finding("privileges", "ok", "running as root")
    if may_run_criu(caps):
        return Finding("privileges", "warn", "not root, but CAP_CHECKPOINT_RESTORE and CAP_SYS_PTRACE "
                       "are effective (CRIU's non-root mode: own processes only, fewer features)",
                       "run as root for anything beyond your own simple jobs")
    have = "CAP_CHECKPOINT_RESTORE only" if has_cap(CAP_CHECKPOINT_RESTORE, caps) else "neither capability"
    return Finding("privileges", "fail",
                   f"gpusnap dump must run as root (uid {os.geteuid()}, {have}): CRIU needs root, or "
                   "CAP_CHECKPOINT_RESTORE together with CAP_SYS_PTRACE",
                   "run `sudo gpusnap ...`, or give gpusnap CAP_CHECKPOINT_RESTORE and CAP_SYS_PTRACE",
                   NotRoot)


def criu() -> Finding:
    from gpusnap.criu import runner

    try:
        info = runner.criu_info()
    except CriuUnavailable as e:
        return Finding("criu", "fail", e.message, e.hint, CriuUnavailable)
    return Finding("criu", "ok", f"CRIU {info.version_str} ({info.path})")


def _criu_sockets(plan: Plan, pids: list[int]) -> None:
    """CRIU before 4.2 cannot dump AF_INET/AF_INET6/AF_PACKET sockets on Linux >= 6.16: refuse
    such a job before CRIU touches it, rather than fail half-way through with CRIU's error."""
    from gpusnap.criu import runner

    try:
        info = runner.criu_info()
    except CriuUnavailable:
        return
    if not runner.sockets_broken(info.version):
        return
    found = sockets.network_sockets(pids)
    if found:
        kinds = ", ".join(sorted(set(found.values())))
        plan.add("criu sockets", "fail",
                 f"CRIU {info.version_str} at {info.path} cannot dump this job on Linux {os.uname().release}: "
                 f"it holds {len(found)} network socket(s) ({kinds}), and CRIU before 4.2 fails on those "
                 "from Linux 6.16 on; the job was not touched",
                 runner.install_hint(info.path), CriuUnavailable)


def check(pid: int, *, system: bool = True, tcp_established: bool = False, tcp_close: bool = False) -> Plan:
    """Everything that decides whether `criu dump -t pid` can work, and with which options.
    system: include the machine checks (privileges, CRIU); doctor shows those on its own.
    tcp_close: CRIU's --tcp-close at dump (connections not dumped; the restore has them closed)."""
    plan = Plan(pid=pid)
    if system:
        for f in (privileges(), criu()):
            plan.findings.append(f)
    st = proc.read_stat(pid) if pid > 0 else None
    if st is not None and st.state == "Z":
        from gpusnap.system import zombies

        plan.add("process", "fail", f"PID {pid} ({st.comm}) is a zombie: the job has exited, nothing is left to "
                 "snapshot", zombies.describe([pid]), ProcessNotFound)
        return plan
    if st is None or st.state in ("Z", "X"):
        plan.add("process", "fail", f"no running process with PID {pid}",
                 "check the PID with `ps` or `gpusnap ps`; the job may have finished", ProcessNotFound)
        return plan
    if (st.flags if (st := proc.read_stat(pid)) else 0) & proc.PF_KTHREAD:
        plan.add("process", "fail", f"PID {pid} ({st.comm}) is a kernel thread; only user processes "
                 "can be snapshotted", "give the PID of the job")
        return plan
    pids = proc.tree(pid)
    plan.pids = pids
    desc = f"{pid} ({st.comm})" + (f" and {len(pids) - 1} descendant(s)" if len(pids) > 1 else "")
    plan.add("process", "ok", f"tree: {desc}")
    ctr = containers.container_of(pid)
    if ctr is not None:     # nothing else applies from outside its engine
        plan.add("container", "fail", ctr.describe(pid), ctr.fix(), NotDumpable)
        return plan
    _criu_sockets(plan, pids)
    me = os.getpid()
    if me in pids or pid in proc.ancestors(me):
        plan.add("self", "fail", f"PID {pid} is gpusnap itself or one of its parents (e.g. the shell "
                 "it runs in); it cannot snapshot itself", "dump the job's own PID", UsageError)

    _check_pidns(plan, pid)
    _check_netns(plan, pid)
    _check_uids(plan, pids)
    traced = [(p, t) for p in pids if (t := proc.status(p).get("TracerPid")) and t != "0"]
    if traced:
        plan.add("ptrace", "fail", "traced by another process (" +
                 ", ".join(f"{p} by {t}" for p, t in traced) + "): CRIU cannot seize it",
                 "detach the debugger/strace first")
    outside = [p for p in pids if proc.session_outside_namespace(p)]
    if outside:
        plan.add("session", "fail",
                 f"the session leader of PID {outside[0]} is outside its PID namespace, "
                 "so CRIU could not recreate its session on restore",
                 "start the job in a session of its own (`setsid CMD`, `gpusnap run`, or "
                 "start_new_session=True in Python); the job was not touched")
    _check_terminal(plan, pids)
    _check_sockets(plan, pids, tcp_established, tcp_close)
    _check_locks(plan, pids)
    for status, detail, fix in sysvipc.check(pids):
        plan.add("SysV IPC", status, detail, fix)
    _check_deleted(plan, pids)
    _check_undumpable(plan, pids)
    return plan


def _check_undumpable(plan: Plan, pids: list[int]) -> None:
    """Kernel states CRIU would refuse once the tree is frozen (gpusnap/system/undumpable.py)."""
    inodes = set().union(*(sockets.socket_inodes(p) for p in pids)) if pids else set()
    opts, found = undumpable.tcp_in_flight(pids, plan.listening)
    plan.option(*opts, restore=False)      # a dump option only: nothing of them is restored
    found += undumpable.pending_sigtrap(pids) + undumpable.nested_timens(pids)
    found += undumpable.corked_udp(pids, inodes) if inodes else []
    for name, status, detail, fix in found:
        plan.add(name, status, detail, fix)


def _check_deleted(plan: Plan, pids: list[int]) -> None:
    """Open deleted files: --ghost-limit and --link-remap as they need (gpusnap/system/ghosts.py)."""
    from gpusnap.system import ghosts

    found = ghosts.scan(pids)
    plan.linked = [d for d in found if not d.ghost]
    opts, findings = ghosts.plan(found)
    plan.option(*opts, restore=False)     # dump options only: a restore needs neither
    for name, status, detail, fix in findings:
        plan.add(name, status, detail, fix)


def _nspid(pid: int) -> list[int]:
    v = proc.status(pid).get("NSpid")
    return [int(x) for x in v.split()] if v else []


def _check_pidns(plan: Plan, pid: int) -> None:
    mine, its = _nspid(os.getpid()), _nspid(pid)
    if len(its) <= len(mine):
        return
    if its[-1] == 1:
        plan.own_pid_namespace = True
        plan.add("PID namespace", "ok", f"PID {pid} is the init of its own PID namespace: CRIU dumps the "
                 "namespace, and a restore recreates it, so it runs beside the original without PID clashes")
    else:
        plan.add("PID namespace", "fail", f"PID {pid} lives in a PID namespace of its own (PID {its[-1]} "
                 "there) but is not its init; CRIU can dump a PID namespace only from its init",
                 "dump the namespace's init instead (its PID 1)")


def _check_netns(plan: Plan, pid: int) -> None:
    """A network namespace other than gpusnap's: joined again on restore when it has a name (a
    bind mount, as `ip netns add` makes), else recreated from the images (system/netns.py)."""
    from gpusnap.system import netns

    ns = netns.foreign(pid)
    plan.netns = ns
    if ns is None:
        return
    if ns.path:
        plan.add("network namespace", "ok", f"runs in the named network namespace {ns.name} ({ns.path}, "
                 f"net:[{ns.inode}]): the restore joins it again (CRIU's --join-ns), with whatever else runs "
                 "there", f"it must still exist at restore time (`ip netns add {ns.name}` would make a new, "
                 "empty one of that name)")
    else:
        plan.add("network namespace", "info", f"runs in a network namespace of its own (net:[{ns.inode}]) that "
                 "has no name (no bind mount of it, as `ip netns add` makes): CRIU dumps it and the restore makes "
                 "a new one from the images (interfaces, addresses, routes, firewall rules); processes outside "
                 "the job that share it now will not be in it",
                 "to restore into the same namespace, start the job in a named one (`ip netns exec NAME ...`)")


def _check_uids(plan: Plan, pids: list[int]) -> None:
    me = os.geteuid()
    others = []
    for p in pids:
        uid = proc.status(p).get("Uid")
        if uid and int(uid.split()[1]) != me:
            others.append((p, int(uid.split()[1])))
    if others and not has_cap(CAP_SYS_RESOURCE):
        plan.add("uid", "fail", "runs under another uid (" + ", ".join(f"{p}: uid {u}" for p, u in others[:5])
                 + ") and CAP_SYS_RESOURCE is missing: CRIU fails with \"Can't get rlimit\"",
                 "run gpusnap with CAP_SYS_RESOURCE (a full root shell) or run the job as this user")
    elif others:
        plan.add("uid", "ok", f"runs under uid {others[0][1]} (fine: CAP_SYS_RESOURCE present)")


def _check_terminal(plan: Plan, pids: list[int]) -> None:
    from gpusnap.system import terminal

    held = terminal.held(pids)
    if not proc.needs_shell_job(pids) and not held:
        return
    plan.option("--shell-job")
    tty = [p for p in pids if (s := proc.read_stat(p)) and s.tty_nr != 0]
    if held:
        said = terminal.outlook(held)
        plan.add("terminal", "info", f"has a terminal whose other end is outside the job ({said['had']}): "
                 f"gpusnap dumps it with --shell-job; {said['terminal']}; {said['no_terminal']}",
                 "to run it without a terminal, start jobs with `gpusnap run` (or setsid/nohup with stdio "
                 "redirected to files)")
    elif tty:
        plan.add("terminal", "info", "has a controlling terminal but no terminal open: gpusnap dumps it with "
                 "--shell-job, and it restores without one, from a terminal or not",
                 "`gpusnap run -- CMD` starts jobs in a session of their own")
    else:
        plan.add("shell job", "info", "its session or process group leader is outside the tree (started "
                 "from a shell): gpusnap dumps it with --shell-job",
                 "`gpusnap run -- CMD` starts jobs in a session of their own")


def _check_sockets(plan: Plan, pids: list[int], force_tcp: bool, close: bool = False) -> None:
    if close:   # CRIU records it in the inventory, and its restore then insists on it too
        plan.option("--tcp-close")
    inodes = set().union(*(sockets.socket_inodes(p) for p in pids)) if pids else set()
    if not inodes:
        if force_tcp and not close:
            plan.option("--tcp-established")
        return
    seen_ns: set[str | None] = set()
    rows: list[dict[str, Any]] = []
    for p in pids:  # each network namespace of the tree once
        ns = sockets.netns(p)
        if ns in seen_ns:
            continue
        seen_ns.add(ns)
        rows += sockets.tcp_sockets(p, inodes)
    plan.tcp = [s for s in rows if s["state"] != "LISTEN"]
    plan.listening = [s for s in rows if s["state"] == "LISTEN"]
    if plan.listening:
        plan.add("TCP listen", "ok", "listening on " + ", ".join(s["local"] for s in plan.listening[:5])
                 + " (restored; the port must be free at restore time)")
    if plan.tcp and close:
        plan.add("TCP", "info", f"{len(plan.tcp)} open TCP connection(s): " + ", ".join(
                 f"{s['local']}→{s['remote']} {s['state']}" for s in plan.tcp[:5]) + "; not dumped (--tcp-close): "
                 "no network lock, a job left running keeps them, and the restored job finds them closed",
                 "the program must reconnect when it sees the reset")
    elif (plan.tcp or force_tcp) and not close:
        opts, how = netlock.network_lock()
        conns = ", ".join(f"{s['local']}→{s['remote']} {s['state']}" for s in plan.tcp[:5])
        if opts is None:
            plan.add("TCP", "fail", f"{len(plan.tcp)} open TCP connection(s): {conns}; dumping them needs "
                     f"CRIU's network lock, but {how}",
                     "install iptables (apt-get install iptables), close the connections before the dump, or "
                     "dump with --tcp-close (not dumped; the restored job finds them closed)")
        else:
            plan.option("--tcp-established")
            plan.option(*opts, restore=False)  # CRIU records the lock method in its inventory
            if plan.tcp:
                plan.add("TCP", "info", f"{len(plan.tcp)} open TCP connection(s): {conns}; dumped with "
                         f"--tcp-established (network lock: {how})",
                         "on restore they are re-established when the peer still has its end; otherwise "
                         "(or with `gpusnap restore --tcp-close`) they come back closed and the program "
                         "sees a reset")
    _check_unix(plan, pids, inodes)


def _check_unix(plan: Plan, pids: list[int], inodes: set[int]) -> None:
    if sockets.netns(pids[0]) != sockets.netns(os.getpid()):
        plan.add("unix sockets", "info", "the job runs in another network namespace; unix socket "
                 "peers not checked")
        return
    ss = shutil.which("ss") or ("/usr/bin/ss" if os.access("/usr/bin/ss", os.X_OK) else None)
    if not ss:
        plan.add("unix sockets", "info", "`ss` (iproute2) is not installed; unix socket peers not checked")
        return
    rc, out = _run([ss, "-xaH"], timeout=30)
    if rc != 0:
        plan.add("unix sockets", "info", f"ss failed: {out.strip()[:200]}")
        return
    from gpusnap.system import unixpeers

    ext = unixpeers.external(parse_ss_unix(out), inodes)
    refused = [e for e in ext if e.reason]
    if refused:
        plan.add("unix sockets", "fail", f"{len(refused)} unix socket(s) connected to a process outside the tree: "
                 + "; ".join(f"{e.describe()}: {e.reason}" for e in refused[:5]) + "; the job was not touched",
                 "close them before the dump (e.g. don't log to journald/syslog via a stream socket; redirect "
                 "stdout to a file), or dump the tree that holds both ends")
        return
    if ext:
        plan.option(unixpeers.EXT_OPTION)
        plan.unix_peers = sorted({e.peer_path for e in ext})
        plan.add("unix sockets", "info", f"{len(ext)} datagram socket(s) connected to a daemon outside the tree: "
                 + "; ".join(e.describe() for e in ext[:5]) + f": dumped with {unixpeers.EXT_OPTION}, and the "
                 "restore connects them to the same address again",
                 "the daemon must be listening at that address when the job is restored")


def _check_locks(plan: Plan, pids: list[int]) -> None:
    locks = filelocks.file_locks(pids)
    plan.locks = locks
    if not locks:
        return
    plan.option("--file-locks")
    items = [f"{lk['kind']} {lk['access']} on {lk['path'] or lk['dev'] + ':' + str(lk['ino'])} "
             f"(pid {lk['holder']})" for lk in locks[:6]]
    plan.add("file locks", "info", f"{len(locks)} file lock(s)/lease(s): " + "; ".join(items)
             + ": dumped and restored with them (CRIU's --file-locks, chosen for you)",
             "the locked files must be the same at restore time")
