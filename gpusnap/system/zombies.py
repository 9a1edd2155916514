"""Zombies, explained: a process that has exited but whose parent has not collected its exit
status (wait/waitpid) still holds its PID, and no signal removes it, since it no longer runs.
A snapshot's PIDs held that way, or a zombie given to `dump`, get this explanation instead of
"kill it" advice that cannot work."""

from __future__ import annotations

from gpusnap.system import proc


def zombies(pids: list[int]) -> list[proc.ProcStat]:
    return [st for p in pids if (st := proc.read_stat(p)) is not None and st.state == "Z"]


def _parent(st: proc.ProcStat) -> str:
    parent = proc.read_stat(st.ppid)
    return f"PID {st.ppid} ({parent.comm})" if parent else f"PID {st.ppid}"


def describe(pids: list[int]) -> str | None:
    """What the zombies among `pids` are and how they go away; None when there are none."""
    found = zombies(pids)
    if not found:
        return None
    parents = sorted({st.ppid for st in found})
    who = ", ".join(f"{st.pid} (child of {_parent(st)})" for st in found[:5])
    plural = len(found) > 1
    return (f"PID{'s' if plural else ''} {who} {'are zombies' if plural else 'is a zombie'}: "
            f"{'they have' if plural else 'it has'} exited, but the parent has not collected the exit status, "
            "and `kill` cannot remove a process that has already ended; the parent must reap it (a shell: "
            "`wait`; a program: wait()/waitpid(), e.g. Popen.wait() in Python), or, if the parent may go, end "
            f"it (`kill {' '.join(map(str, parents[:5]))}`): init then collects the zombie")
