"""Whether a process lives in a container, and whose: Podman, Docker, containerd, CRI-O, LXC.

The engines leave their mark where gpusnap can read it without asking them: the process's
cgroup path (libpod-ID, docker-ID.scope or docker/ID, cri-containerd-ID, crio-ID, lxc/NAME),
the runtime monitor among its ancestors (conmon, containerd-shim), and a mount namespace with
a root of its own. CRIU run from outside cannot dump such a process (the container's root,
mounts and network are the engine's: CRIU stops at "doesn't have a proper root mount"), so
the preflight refuses it before the job is touched and names what works: `gpusnap dump
--container` for Podman and Docker (ops/dump_container.py), the engine's own checkpoint for the
others.
Everything is judged against gpusnap's own process: a gpusnap that runs inside the same
container (or on a machine that is itself a container) sees its jobs as on a host.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from gpusnap.system import engines, proc

# engine, and the id (or name) in a cgroup path component
_CGROUP_MARKS = (
    ("podman", re.compile(r"libpod-(?:conmon-)?([0-9a-f]{12,64})(?:\.scope)?$")),
    ("docker", re.compile(r"docker-([0-9a-f]{12,64})\.scope$")),
    ("docker", re.compile(r"^docker$")),
    ("containerd", re.compile(r"cri-containerd-([0-9a-f]{12,64})\.scope$")),
    ("cri-o", re.compile(r"crio-(?:conmon-)?([0-9a-f]{12,64})\.scope$")),
    ("lxc", re.compile(r"^lxc\.payload\.(.+)$")),
)
_MONITORS = {"conmon": "podman", "containerd-shim": "containerd"}     # comm prefix -> engine
_HEX_ID = re.compile(r"^[0-9a-f]{64}$")


@dataclass
class Container:
    engine: str | None      # podman, docker, containerd, cri-o, lxc; None: not known
    id: str | None          # the container's id (or LXC name) when the cgroup says it
    how: str                # what showed it

    @property
    def short(self) -> str | None:
        return self.id[:12] if self.id and _HEX_ID.match(self.id) else self.id

    def describe(self, pid: int) -> str:
        which = (f"the {self.engine} container {self.short}" if self.id and self.engine
                 else f"a {self.engine} container" if self.engine else "a container")
        return (f"PID {pid} runs in {which} ({self.how}): CRIU cannot dump it from outside its engine "
                "(the container's root, mounts and network are the engine's); the job was not touched")

    def fix(self) -> str:
        ref = self.short or "CONTAINER"
        if self.engine in engines.ENGINES:
            title = engines.title(self.engine)
            return (f"snapshot it through {title}'s checkpoint: `gpusnap dump --container {ref}` (restored by "
                    f"`gpusnap restore`, into {title})")
        return "snapshot it with its engine's own checkpoint (it runs CRIU inside the container's view)"


def cgroup_mark(cgroup_text: str) -> tuple[str, str | None] | None:
    """(engine, id) from the text of /proc/PID/cgroup, or None."""
    for line in cgroup_text.splitlines():
        path = line.split(":", 2)[-1]
        parts = [p for p in path.split("/") if p]
        for i, comp in enumerate(parts):
            for engine, rx in _CGROUP_MARKS:
                m = rx.search(comp)
                if not m:
                    continue
                if m.groups():
                    return engine, m.group(1)
                # cgroup v1 docker: /docker/ID
                nxt = parts[i + 1] if i + 1 < len(parts) else ""
                if re.fullmatch(r"[0-9a-f]{64}", nxt):
                    return engine, nxt
    return None


def foreign_mark(job_cgroup: str, own_cgroup: str) -> tuple[str, str | None] | None:
    """The job's container mark when it is not gpusnap's own (a gpusnap in the same container,
    or on a machine that is itself one, sees its jobs as on a host)."""
    mark = cgroup_mark(job_cgroup)
    return mark if mark is not None and mark != cgroup_mark(own_cgroup) else None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _ns(pid: int | str, kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def _root_id(pid: int | str) -> tuple[int, int] | None:
    try:
        st = os.stat(f"/proc/{pid}/root")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def container_of(pid: int) -> Container | None:
    """The container `pid` lives in, as seen from this process; None on the host (or in the
    same container as gpusnap)."""
    mark = foreign_mark(_read(f"/proc/{pid}/cgroup"), _read("/proc/self/cgroup"))
    if mark is not None:
        return Container(mark[0], mark[1], "its cgroup")
    for anc in proc.ancestors(pid):
        st = proc.read_stat(anc)
        engine = next((e for prefix, e in _MONITORS.items() if st and st.comm.startswith(prefix)), None)
        if engine and anc not in proc.ancestors(os.getpid()):
            return Container(engine, mark[1] if mark else None, f"its runtime monitor {st.comm}, PID {anc}")
    if _ns(pid, "mnt") != _ns("self", "mnt") and _root_id(pid) not in (None, _root_id("self")):
        return Container(None, None, "a mount namespace and a root of its own")
    return None
