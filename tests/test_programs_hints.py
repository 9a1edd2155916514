"""Every failed dump says what to do: a `hint:` line, and a `hint` key in --json. A real CRIU
failure (an io_uring instance: conftest's undumpable), and CRIU 4.2's own error lines for each class."""

from __future__ import annotations

import json

import pytest

from conftest import run_gpusnap
from gpusnap.system import proc
from gpusnap.criu import runner


@pytest.mark.criu
def test_real_dump_failure_has_a_hint(undumpable, repo):
    """A real CRIU failure (conftest's undumpable: an io_uring instance)."""
    res = run_gpusnap("dump", undumpable.pid, "--repo", repo, "--json")
    assert res.returncode == 8, res.stdout + res.stderr
    err = json.loads(res.stdout)
    assert err["criu_errors"]
    assert err["hint"] == runner.explain_dump(err["criu_errors"]) and "doctor" in err["hint"]
    assert proc.read_stat(undumpable.pid).state in ("S", "R")  # the job kept running
    plain = run_gpusnap("dump", undumpable.pid, "--repo", repo)
    assert "hint:" in plain.stderr and "doctor" in plain.stderr


# Error lines as CRIU 4.2.1 prints them (criu/*.c), one per failure class users meet.
CRIU_LINES = {
    "Error (criu/sk-inet.c:207): Connected TCP socket, consider using --tcp-established option.": "--tcp-established",
    "Error (criu/netfilter.c:104): Iptables configuration failed": "iptables",
    "Error (criu/sk-unix.c:874): External socket is used. Consider using --ext-unix-sk option.": "dump again",
    "Error (criu/sk-unix.c:892): Can't dump name-less external socket.": "nameless peer",
    "Error (criu/cr-dump.c:478): Task 28615 with SysVIPC shmem map @7f1013134000 doesn't live in IPC ns":
        "gpusnap run",
    "Error (criu/sk-unix.c:881): Can't dump half of stream unix connection. name: /run/x; peer name: (null)":
        "outside its tree",
    "Error (criu/file-lock.c:110): Some file locks are hold by dumping tasks! You can try --file-locks to dump them.":
        "--file-locks",
    "Error (criu/files-reg.c:1031): Can't dump ghost file /tmp/x of 4198400 size, increase limit": "deleted file",
    "Error (criu/files-reg.c:1122): Can't create link remap for /dev/shm/sem.HVm2Ok. Use link-remap option.":
        "--link-remap",
    "Error (criu/files-reg.c:1160): Can't link remap to /dev/shm/sem.HVm2Ok: Read-only file system":
        "writable",
    "Error (criu/mem.c:400): Can't allocate memory for pages: Cannot allocate memory": "out of memory",
    "Error (criu/image.c:300): Can't write image: No space left on device": "free space",
    "Error (compel/src/lib/infect.c:187): SEIZE 1234: task not stopped after seize": "debugger",
    "Error (criu/seize.c:635): Unable to freeze cgroup /x (10 x 100ms attempts, timeout: 10s)": "frozen",
    "Error (criu/namespaces.c:1117): Can't dump a pid namespace without the process init": "gpusnap run",
    "Error (criu/proc_parse.c:614): PID 12 has uprobes vma. Consider using --allow-uprobes.": "uprobes",
    "Error (criu/proc_parse.c:760): Unsupported mapping found 7f00-7f01": "cannot snapshot",
    "Error (criu/cr-dump.c:1): something nobody has seen before": "doctor",
}


@pytest.mark.parametrize("line,needle", list(CRIU_LINES.items()))
def test_each_dump_failure_class_has_advice(line, needle):
    hint = runner.explain_dump([line])
    assert needle in hint, hint
