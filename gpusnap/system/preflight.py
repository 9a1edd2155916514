"""The one preflight: can this process tree be dumped, and with which CRIU options.

`check(pid)` reads the tree from /proc exactly as CRIU will take it (task/*/children) and
returns a Plan: findings (ok/info/warn/fail, each with what to do) and the CRIU dump options
and restore flags the tree needs (--shell-job, --tcp-established, --file-locks, the network
lock method). `gpusnap dump` raises the first failure (Plan.require); `gpusnap doctor PID`
shows every finding. Both read the same Plan, so doctor never says "ready" where dump refuses.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpusnap.criu import netlock
from gpusnap.system import proc
from gpusnap.errors import CriuUnavailable, GpusnapError, NotDumpable, NotRoot, ProcessNotFound, UsageError

PROC = Path("/proc")
CAP_SYS_PTRACE = 19
CAP_SYS_RESOURCE = 24
CAP_CHECKPOINT_RESTORE = 40
PF_KTHREAD = 0x00200000

TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1",
              "05": "FIN_WAIT2", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT",
              "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING"}


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


def cap_eff(status_text: str | None = None) -> int:
    text = status_text if status_text is not None else (_read("/proc/self/status") or "")
    m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)", text, re.M)
    return int(m.group(1), 16) if m else 0


def has_cap(bit: int, caps: int | None = None) -> bool:
    return bool(((cap_eff() if caps is None else caps) >> bit) & 1)


def _status_field(pid: int, key: str) -> str | None:
    for line in (_read(PROC / str(pid) / "status") or "").splitlines():
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip()
    return None


def _stat_flags(pid: int) -> int:
    raw = _read(PROC / str(pid) / "stat") or ""
    if ")" not in raw:
        return 0
    rest = raw[raw.rindex(")") + 2:].split()
    return int(rest[6]) if len(rest) > 6 else 0


def _fd_targets(pid: int) -> dict[int, str]:
    d = PROC / str(pid) / "fd"
    out: dict[int, str] = {}
    try:
        names = os.listdir(d)
    except OSError:
        return out
    for n in names:
        try:
            out[int(n)] = os.readlink(d / n)
        except (OSError, ValueError):
            continue
    return out


def socket_inodes(pid: int) -> set[int]:
    out = set()
    for t in _fd_targets(pid).values():
        m = re.match(r"socket:\[(\d+)\]$", t)
        if m:
            out.add(int(m.group(1)))
    return out


def netns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
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


# ---------------------------------------------------------------- sockets

def decode_addr(hexaddr: str) -> str:
    """'0100007F:1F90' → '127.0.0.1:8080' (/proc/net/tcp{,6} notation)."""
    ip_hex, port_hex = hexaddr.split(":")
    raw = bytes.fromhex(ip_hex)
    # the kernel prints each 32-bit word in host (little-endian) order
    b = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(b)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    port = int(port_hex, 16)
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def parse_proc_net_tcp(text: str) -> list[dict[str, Any]]:
    """Rows of /proc/PID/net/tcp or tcp6: [{local, remote, state, inode}]."""
    out = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 10:
            continue
        try:
            out.append({"local": decode_addr(f[1]), "remote": decode_addr(f[2]),
                        "state": TCP_STATES.get(f[3].upper(), f[3]), "inode": int(f[9])})
        except ValueError:
            continue
    return out


def tcp_sockets(pid: int, inodes: set[int] | None = None) -> list[dict[str, Any]]:
    """TCP sockets (among `inodes`, or all) in PID's network namespace."""
    out = []
    for name in ("tcp", "tcp6"):
        for row in parse_proc_net_tcp(_read(PROC / str(pid) / "net" / name) or ""):
            if inodes is None or row["inode"] in inodes:
                out.append(row)
    return out


def parse_ss_unix(text: str) -> list[dict[str, Any]]:
    """`ss -xaH` lines → [{type, state, path, inode, peer}] (peer inode, 0 = none)."""
    out = []
    for line in text.splitlines():
        f = line.split()
        if len(f) < 8:
            continue
        try:
            inode, peer = int(f[-3]), int(f[-1])
        except ValueError:
            continue
        path = " ".join(f[4:-3])
        out.append({"type": f[0], "state": f[1], "path": "" if path == "*" else path,
                    "inode": inode, "peer": peer})
    return out


def who_holds(inodes: set[int]) -> dict[int, tuple[int, str]]:
    """socket inode → (pid, comm) of some process holding it."""
    found: dict[int, tuple[int, str]] = {}
    want = set(inodes)
    for n in os.listdir(PROC):
        if not want:
            break
        if not n.isdigit():
            continue
        for ino in socket_inodes(int(n)) & want:
            comm = (_read(PROC / n / "comm") or "?").strip()
            found[ino] = (int(n), comm)
            want.discard(ino)
    return found


# ---------------------------------------------------------------- file locks

def _parse_lock_line(text: str) -> dict[str, Any] | None:
    """'1: POSIX  ADVISORY  WRITE 1234 08:01:5678 0 EOF' → {kind, mode, access, pid, dev, ino}."""
    f = text.split()
    if len(f) < 6 or f[1] == "->":  # "->" rows are waiters, not holders
        return None
    try:
        maj, mnr, ino = f[5].split(":")
        return {"kind": f[1], "mode": f[2], "access": f[3], "pid": int(f[4]),
                "dev": f"{maj}:{mnr}", "ino": int(ino)}
    except ValueError:
        return None


def file_locks(pids: list[int]) -> list[dict[str, Any]]:
    """Locks and leases the tree holds: /proc/PID/fdinfo `lock:` lines (which see OFD locks
    too, whose /proc/locks pid is -1) and /proc/locks rows owned by a tree member."""
    members = set(pids)
    found: dict[tuple, dict[str, Any]] = {}
    for pid in pids:
        targets = _fd_targets(pid)
        for fd, target in targets.items():
            for line in (_read(PROC / str(pid) / "fdinfo" / str(fd)) or "").splitlines():
                if line.startswith("lock:"):
                    row = _parse_lock_line(line.split(":", 1)[1].strip())
                    if row:
                        row.update(holder=pid, path=target)
                        found.setdefault((row["kind"], row["dev"], row["ino"], row["pid"]), row)
    for line in (_read(PROC / "locks") or "").splitlines():
        row = _parse_lock_line(line)
        if row and row["pid"] in members:
            found.setdefault((row["kind"], row["dev"], row["ino"], row["pid"]), dict(row, holder=row["pid"],
                                                                                      path=None))
    return list(found.values())


# ---------------------------------------------------------------- the checks

def privileges() -> Finding:
    """Root, or both CAP_CHECKPOINT_RESTORE and CAP_SYS_PTRACE (what CRIU's dump needs)."""
    caps = cap_eff()
    if os.geteuid() == 0:
        return Finding("privileges", "ok", "running as root")
    if has_cap(CAP_CHECKPOINT_RESTORE, caps) and has_cap(CAP_SYS_PTRACE, caps):
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
    found = runner.network_sockets(pids)
    if found:
        kinds = ", ".join(sorted(set(found.values())))
        plan.add("criu sockets", "fail",
                 f"CRIU {info.version_str} at {info.path} cannot dump this job on Linux {os.uname().release}: "
                 f"it holds {len(found)} network socket(s) ({kinds}), and CRIU before 4.2 fails on those "
                 "from Linux 6.16 on; the job was not touched",
                 runner.install_hint(info.path), CriuUnavailable)


def check(pid: int, *, system: bool = True, tcp_established: bool = False) -> Plan:
    """Everything that decides whether `criu dump -t pid` can work, and with which options.
    system: include the machine checks (privileges, CRIU); doctor shows those on its own."""
    plan = Plan(pid=pid)
    if system:
        for f in (privileges(), criu()):
            plan.findings.append(f)
    st = proc.read_stat(pid) if pid > 0 else None
    if st is None or st.state in ("Z", "X"):
        plan.add("process", "fail", f"no running process with PID {pid}",
                 "check the PID with `ps` or `gpusnap ps`; the job may have finished", ProcessNotFound)
        return plan
    if _stat_flags(pid) & PF_KTHREAD:
        plan.add("process", "fail", f"PID {pid} ({st.comm}) is a kernel thread; only user processes "
                 "can be snapshotted", "give the PID of the job")
        return plan
    pids = proc.tree(pid)
    plan.pids = pids
    desc = f"{pid} ({st.comm})" + (f" and {len(pids) - 1} descendant(s)" if len(pids) > 1 else "")
    plan.add("process", "ok", f"tree: {desc}")
    _criu_sockets(plan, pids)
    me = os.getpid()
    if me in pids or pid in proc.ancestors(me):
        plan.add("self", "fail", f"PID {pid} is gpusnap itself or one of its parents (e.g. the shell "
                 "it runs in); it cannot snapshot itself", "dump the job's own PID", UsageError)

    _check_pidns(plan, pid)
    _check_uids(plan, pids)
    traced = [(p, t) for p in pids if (t := _status_field(p, "TracerPid")) and t != "0"]
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
    _check_sockets(plan, pids, tcp_established)
    _check_locks(plan, pids)
    return plan


def _nspid(pid: int) -> list[int]:
    v = _status_field(pid, "NSpid")
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


def _check_uids(plan: Plan, pids: list[int]) -> None:
    me = os.geteuid()
    others = []
    for p in pids:
        uid = _status_field(p, "Uid")
        if uid and int(uid.split()[1]) != me:
            others.append((p, int(uid.split()[1])))
    if others and not has_cap(CAP_SYS_RESOURCE):
        plan.add("uid", "fail", "runs under another uid (" + ", ".join(f"{p}: uid {u}" for p, u in others[:5])
                 + ") and CAP_SYS_RESOURCE is missing: CRIU fails with \"Can't get rlimit\"",
                 "run gpusnap with CAP_SYS_RESOURCE (a full root shell) or run the job as this user")
    elif others:
        plan.add("uid", "ok", f"runs under uid {others[0][1]} (fine: CAP_SYS_RESOURCE present)")


def _check_terminal(plan: Plan, pids: list[int]) -> None:
    if not proc.needs_shell_job(pids):
        return
    plan.option("--shell-job")
    tty = [p for p in pids if (s := proc.read_stat(p)) and s.tty_nr != 0]
    tty_fds = sorted({t for p in pids for t in _fd_targets(p).values()
                      if t.startswith("/dev/pts/") or re.match(r"/dev/tty\w*$", t)})
    if tty or tty_fds:
        plan.add("terminal", "info", "has a controlling terminal"
                 + (f" ({', '.join(tty_fds[:4])} open)" if tty_fds else "")
                 + ": gpusnap dumps it with --shell-job; on restore it gets the terminal of `gpusnap restore`",
                 "to detach it from terminals, start jobs with `gpusnap run` (or setsid/nohup with stdio "
                 "redirected to files)")
    else:
        plan.add("shell job", "info", "its session or process group leader is outside the tree (started "
                 "from a shell): gpusnap dumps it with --shell-job",
                 "`gpusnap run -- CMD` starts jobs in a session of their own")


def _check_sockets(plan: Plan, pids: list[int], force_tcp: bool) -> None:
    inodes = set().union(*(socket_inodes(p) for p in pids)) if pids else set()
    if not inodes:
        if force_tcp:
            plan.option("--tcp-established")
        return
    seen_ns: set[str | None] = set()
    rows: list[dict[str, Any]] = []
    for p in pids:  # each network namespace of the tree once
        ns = netns(p)
        if ns in seen_ns:
            continue
        seen_ns.add(ns)
        rows += tcp_sockets(p, inodes)
    plan.tcp = [s for s in rows if s["state"] != "LISTEN"]
    plan.listening = [s for s in rows if s["state"] == "LISTEN"]
    if plan.listening:
        plan.add("TCP listen", "ok", "listening on " + ", ".join(s["local"] for s in plan.listening[:5])
                 + " (restored; the port must be free at restore time)")
    if plan.tcp or force_tcp:
        opts, how = netlock.network_lock()
        conns = ", ".join(f"{s['local']}→{s['remote']} {s['state']}" for s in plan.tcp[:5])
        if opts is None:
            plan.add("TCP", "fail", f"{len(plan.tcp)} open TCP connection(s): {conns}; dumping them needs "
                     f"CRIU's network lock, but {how}",
                     "install iptables (apt-get install iptables), or close the connections before the dump")
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
    if netns(pids[0]) != netns(os.getpid()):
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
    rows = [s for s in parse_ss_unix(out) if s["inode"] in inodes]
    ext = [s for s in rows if s["peer"] and s["peer"] not in inodes]
    if not ext:
        return
    holders = who_holds({s["peer"] for s in ext})
    items = []
    for s in ext[:5]:
        h = holders.get(s["peer"])
        who = f"{h[1]} (pid {h[0]})" if h else "a process outside the tree"
        items.append(f"{s['type']} {s['path'] or '(unnamed)'} → {who}")
    plan.add("unix sockets", "fail", f"{len(ext)} unix socket(s) connected to a process outside the tree: "
             + "; ".join(items) + "; CRIU cannot restore the other end, so it refuses them",
             "close them before the dump (e.g. don't log to journald/syslog via a socket; redirect stdout "
             "to a file), or dump the tree that holds both ends")


def _check_locks(plan: Plan, pids: list[int]) -> None:
    locks = file_locks(pids)
    plan.locks = locks
    if not locks:
        return
    plan.option("--file-locks")
    items = [f"{lk['kind']} {lk['access']} on {lk['path'] or lk['dev'] + ':' + str(lk['ino'])} "
             f"(pid {lk['holder']})" for lk in locks[:6]]
    plan.add("file locks", "info", f"{len(locks)} file lock(s)/lease(s): " + "; ".join(items)
             + ": dumped with --file-locks", "the locked files must be the same at restore time")
