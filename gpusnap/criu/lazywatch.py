"""The lazy restore's watcher: if gpusnap dies before every page is in, the job dies too.

A process whose memory is being filled through userfaultfd must never outlive the filler:
once the last descriptor of its userfaultfd is closed, the kernel fills every page not yet
copied with zeros, and the job runs on silently with wrong memory. So gpusnap starts this
small process first (stdlib only, run as `python -I -S lazywatch.py FD`, in a session of its
own, ignoring SIGINT, SIGTERM and SIGHUP, spared by the OOM killer) and hands it a duplicate
of every userfaultfd over the socket FD as it gets one. The duplicates keep the kernel from
zero-filling whether gpusnap is alive or not. If the socket closes before gpusnap sent "D"
(done: every page is in place), the watcher waits for CRIU to exit, SIGKILLs the restored
tree (the root CRIU wrote into its pidfile, and the processes of the job it was told, those
that left the tree included) with every descendant, waits until they are gone, and only then
lets the descriptors close.

Messages (each one datagram-like send): b"U" with a userfaultfd attached; b"K" + int32 PID +
uint64 start time (/proc/PID/stat, clock ticks): a process to kill on failure, if that PID
still names it; b"C" + int32: CRIU's PID; b"R" + path: CRIU's pidfile; b"D": done.
"""

import os
import signal
import socket
import struct
import sys
import time


def descendants(pids):
    out, todo = [], list(pids)
    while todo:
        p = todo.pop()
        if p in out:
            continue
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def starttime(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def kill_tree(roots):
    """SIGKILL roots and every descendant; return once they are all gone (or after 30 s)."""
    tree = descendants(roots)
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    end = time.monotonic() + 30
    while any(alive(p) for p in tree) and time.monotonic() < end:
        time.sleep(0.01)
    return tree


def main():
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(s, signal.SIG_IGN)
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-1000")
    except OSError:
        pass
    sk = socket.socket(fileno=int(sys.argv[1]))
    fds, pids, done, criu, pidfile = [], [], False, 0, None
    while True:
        try:
            msg, got, _, _ = socket.recv_fds(sk, 4096, 4)
        except OSError:
            msg, got = b"", []
        fds.extend(got)
        if not msg:
            break
        kind, arg = msg[:1], msg[1:]
        if kind == b"K" and len(arg) == 12:
            pids.append(struct.unpack("<iQ", arg))
        elif kind == b"C" and len(arg) == 4:
            criu = struct.unpack("<i", arg)[0]
        elif kind == b"R":
            pidfile = arg.decode(errors="surrogateescape")
        elif kind == b"D":
            done = True
    if not done and fds:
        end = time.monotonic() + 120
        while criu > 0 and alive(criu) and time.monotonic() < end:
            time.sleep(0.01)         # CRIU writes its pidfile before it resumes the tree
        roots = [p for p, start in pids if p > 0 and starttime(p) == start]
        if pidfile:
            try:
                with open(pidfile) as f:
                    roots.append(int(f.read().split()[0]))
            except (OSError, ValueError, IndexError):
                pass
        tree = kill_tree([p for p in roots if p > 0])
        print(f"gpusnap-lazywatch: the lazy restore ended before every page was in place; "
              f"killed {tree}", file=sys.stderr)
    for fd in fds:
        os.close(fd)


if __name__ == "__main__":
    main()
