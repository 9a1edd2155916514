"""The CUDA plugin's report ($GPUSNAP_CUDA_REPORT), and setting GPU processes right after it.

The plugin appends one line per CUDA process (docs/plugin.md):
  dump pid=P tid=T initial=S image=S final=S result=ok|fail
  restore pid=P tid=T initial=S final=S result=ok|fail
CRIU does not pass every failure to the plugin (a failed post-dump script reaches its exit
hook as success; a failed RESUME_DEVICES_LATE is ignored), so gpusnap reads the report
itself and finishes the job: after a failed dump every CUDA process must be back in the
state it was found in; after a restore every one must be running.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class Line:
    op: str
    pid: int
    initial: str
    final: str
    result: str
    image: str | None = None


def read(path: Path | str | None) -> list[Line]:
    out: list[Line] = []
    if not path:
        return out
    try:
        text = Path(path).read_text()
    except OSError:
        return out
    for raw in text.splitlines():
        op, *kv = raw.split()
        d = dict(x.split("=", 1) for x in kv if "=" in x)
        try:
            out.append(Line(op, int(d["pid"]), d.get("initial", "unknown"), d.get("final", "unknown"),
                            d.get("result", "fail"), d.get("image")))
        except (KeyError, ValueError):
            continue
    return out


def settle_after_failed_dump(lines: list[Line], candidates: list[int] = ()) -> list[str]:
    """Bring every CUDA process of a failed dump back to how it was found (RUNNING, or
    LOCKED when someone else had locked it). `candidates`: GPU processes found before the
    dump, for when the plugin could not write its report. The tree must already run
    (the driver needs the process's restore thread). Returns the problems left, [] when
    every process is settled."""
    from gpusnap.gpu import driver

    want: dict[int, str] = {}
    for x in lines:
        if x.op == "dump":
            want[x.pid] = x.initial if x.initial in ("running", "locked") else "running"
    for pid in candidates:
        want.setdefault(int(pid), "running")
    if not want:
        return []
    states = driver.checkpoint_states(list(want))
    problems = []
    for pid, target in sorted(want.items()):
        st = states.get(pid)
        if st is None or st == target:
            continue  # not a CUDA process (or gone), or already right
        if st == "locked" and target == "locked":
            continue
        res = driver.resume_process(pid, target=target)
        after = res.get("after")
        if after != target:
            problems.append(f"PID {pid}: {st} -> {after or 'unknown'} ({res.get('error') or 'no error reported'})")
    return problems


def restore_failures(lines: list[Line], expected: list[int] = (), same_pids: bool = True) -> list[str]:
    """What went wrong on the GPU in a restore that CRIU reported as a success. `expected`:
    the snapshot's CUDA processes; matched by PID, or only counted when the restored tree
    has PIDs of its own (a PID namespace recreated fresh)."""
    problems = [f"PID {x.pid}: left {x.final} (was {x.initial})" for x in lines
                if x.op == "restore" and x.result != "ok"]
    seen = {x.pid for x in lines if x.op == "restore"}
    if same_pids:
        problems += [f"PID {p}: the CUDA plugin did not restore it" for p in expected if p not in seen]
    elif len(seen) < len(expected):
        problems.append(f"{len(expected) - len(seen)} of the snapshot's {len(expected)} CUDA process(es) "
                        "were not restored by the CUDA plugin")
    return problems
