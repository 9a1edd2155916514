"""Lazy restore: gpusnap as CRIU's lazy-pages daemon, the job running while its memory fills.

`criu restore --lazy-pages` restores everything but the private anonymous memory CRIU marked
lazy (PE_LAZY in the pagemaps), resumes the tree at once, and hands over one userfaultfd per
restored process through `lazy-pages.socket` in its working directory (criu/uffd.c: an int32
PID, then the descriptor over SCM_RIGHTS; a negative PID for a zombie, without one; then the
word "RSTF" once the restore is finished). This daemon then puts every lazy page in place with
UFFDIO_COPY, straight from the repository: the pages image's jobs (repo/reader.py) decoded and
checked in worker threads, in order, while one thread owns every userfaultfd and serves faults
first (a fault pulls its whole job in at once), so the job never waits for more than the one
job it touches.

The process may fork, mremap, munmap or madvise meanwhile; the kernel reports each as an
event (and fails copies with EAGAIN until the event is read), and the pending ranges follow:
a fork's child gets its own userfaultfd and a copy of what is still pending, a remap moves
the pending ranges, an unmap or a MADV_DONTNEED drops them.

The danger of any lazy restore is a page never copied: once its userfaultfd is closed, the
kernel gives the process zeros there and it runs on silently. So: the restore counts what is
pending and fails unless it is all resolved; on any failure the tree is SIGKILLed and gone
before a userfaultfd is closed; and a watcher process (criu/lazywatch.py) holds a duplicate
of each userfaultfd, so that if gpusnap itself dies (SIGKILL, OOM), the watcher kills the tree
instead of the kernel zero-filling it. "The tree" includes what leaves it: for the fill,
gpusnap is a child subreaper, so a process of the job whose parent exits (a double fork) is
adopted by gpusnap instead of init and is killed with the rest; the watcher is told every
process of the job (PID and start time) as it appears, within SCAN_EVERY.

Over 400 lines on purpose: one thread owns the socket, every userfaultfd and the fill, and
the order of its steps (kill before close, read an event before retrying a copy) is what
keeps the job safe; split across modules, that order would be harder to see. The pure
bookkeeping (what is pending, where) is criu/lazyplan.py.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gpusnap.criu import uffd
from gpusnap.criu.lazyplan import LazyPlan, Mm
from gpusnap.criu.lazywatch import descendants, kill_tree
from gpusnap.errors import CorruptSnapshot, CriuFailed, GpusnapError
from gpusnap.system.faults import fault
from gpusnap.system import proc
from gpusnap import settings

PAGE = 4096
SOCK_NAME = "lazy-pages.socket"          # criu/include/uffd.h: LAZY_PAGES_SOCK_NAME
RESTORE_FINISHED = 0x52535446            # criu/uffd.c: LAZY_PAGES_RESTORE_FINISHED
JOB_BYTES = 4 << 20
MAX_PID = 1 << 22
SCAN_EVERY = 0.02                        # seconds between two looks for new processes of the job
PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37


class _Retry(Exception):
    """A copy met EAGAIN: read the events, then copy the rest."""


class LazyDaemon:
    """Listens on lazy-pages.socket in `images` for `criu restore --lazy-pages`, then fills.

    start() before CRIU starts; criu_started(pid) once it runs; then wait() for the fill
    (returns when every lazy page is in place, or raises with the tree killed). abort()
    (CRIU failed, or anything else went wrong) kills what was restored and closes."""

    def __init__(self, snap, lp: LazyPlan, images: Path, pidfile: Path, threads: int,
                 drop: dict | None = None, pause: float | None = None):
        self.snap = snap
        self._drop = drop or {}
        self.lp = lp
        self.images = Path(images)
        self.pidfile = Path(pidfile)
        self.threads = max(1, threads)
        self.pause = pause if pause is not None else _env_pause()
        self.mms: list[Mm] = []
        self.filled = 0
        # what the job did while its memory was filled: page faults served, forks, mremaps,
        # unmaps and MADV_DONTNEEDs followed
        self.events = {"faults": 0, "forks": 0, "remaps": 0, "unmaps": 0}
        self.error: BaseException | None = None
        self.root: int | None = None                 # the restored root (CRIU's pidfile)
        self._stop = threading.Event()
        self._done = threading.Event()
        self._closed = False
        self._lock = threading.Lock()
        self._msgbuf = bytearray(uffd.MSG_SIZE * 64)
        self._jobs: dict[str, list] = {}
        self._job_pos: dict[str, list[int]] = {}
        self._applied: set = set()
        self._window: dict = {}
        self._reader = None
        self._readers: list = []
        self._src = None           # the snapshot's page jobs (criu/needs.py PageJobs)
        self._listener: socket.socket | None = None
        self._watch: subprocess.Popen | None = None
        self._wsock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._ours: set[int] = set()                # our children that are not the job's
        self._told: set[tuple[int, int]] = set()    # (PID, start time) the watcher knows
        self._adopted: set[tuple[int, int]] = set()  # of those, the ones seen adopted by gpusnap
        self._next_scan = 0.0
        self._subreaper: int | None = None          # the setting before ours, to put back

    # -- set-up ------------------------------------------------------------------------------

    def start(self) -> "LazyDaemon":
        from gpusnap.criu import lazywatch

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with open(self.pidfile.parent / "lazywatch.log", "wb") as log:
                self._watch = subprocess.Popen(
                    [sys.executable, "-I", "-S", lazywatch.__file__, str(theirs.fileno())],
                    pass_fds=[theirs.fileno()], start_new_session=True, stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL, stderr=log)
        finally:
            theirs.close()
        self._wsock = ours
        self._ours = set(proc.children(os.getpid())) | {self._watch.pid}
        self._subreaper = _set_subreaper(1)
        self._tell(b"R" + os.fsencode(str(self.pidfile)))
        # bound through the directory's descriptor: the images directory's full path may be
        # longer than a socket address can be (CRIU connects relative to its working directory)
        dfd = os.open(self.images, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            lsn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            lsn.bind(f"/proc/self/fd/{dfd}/{SOCK_NAME}")
        finally:
            os.close(dfd)
        lsn.listen(1)
        lsn.settimeout(0.05)
        self._listener = lsn
        self._thread = threading.Thread(target=self._run, name="gpusnap-lazy", daemon=True)
        self._thread.start()
        return self

    def criu_started(self, pid: int) -> None:
        self._ours.add(pid)
        self._tell(b"C" + struct.pack("<i", pid))

    def _job_pids(self) -> list[int]:
        """Every process of the restored job: the root's tree, and what gpusnap adopted as
        the subreaper (processes whose parent exited), with their trees."""
        roots = [c for c in proc.children(os.getpid()) if c not in self._ours]
        if self.root:
            roots.append(self.root)
        return descendants(roots)

    def _track(self, now: float) -> None:
        """Tell the watcher the job's processes it does not know yet (PID and start time:
        it kills only a PID that still names the same process)."""
        if now < self._next_scan or not self.root:
            return
        self._next_scan = now + SCAN_EVERY
        for pid in self._job_pids():
            st = proc.read_stat(pid)
            if st is None:
                continue
            key = (pid, st.starttime)
            if key not in self._told:
                self._told.add(key)
                self._tell(b"K" + struct.pack("<iQ", pid, st.starttime))
            # (test hook: one that left the tree is known; it may have been told while still in
            # the tree, so the hook fires when it is first seen adopted)
            if st.ppid == os.getpid() and pid != self.root and key not in self._adopted:
                self._adopted.add(key)
                fault("lazy:watcher-told-adopted")

    def _tell(self, msg: bytes, fd: int | None = None) -> None:
        """Hand the watcher a message (and a descriptor). Failing to is fatal: without the
        watcher nothing guards the job against zero-filled memory."""
        if fd is None:
            self._wsock.send(msg)
        else:
            socket.send_fds(self._wsock, [msg], [fd])

    def _run(self) -> None:
        try:
            order = self._plan_jobs()       # before CRIU connects: faults may come before "finished"
            client = self._accept()
            if client is None:
                return
            with client:
                self._receive(client)
            self._fill(order)
            self._tell(b"D")
            self._close_all()
        except BaseException as e:  # noqa: BLE001 - any failure: kill, then close (in wait/abort)
            self.error = e
            self._kill()
        finally:
            self._done.set()

    def _accept(self) -> socket.socket | None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            client.settimeout(None)
            return client
        return None

    def _receive(self, client: socket.socket) -> None:
        """Every task's PID and userfaultfd, then "finished"; faults are served meanwhile."""
        while True:
            if not self._wait([client.fileno()], 0.05):
                if self._stop.is_set():
                    raise CriuFailed("the restore stopped before CRIU said it had finished")
                continue
            raw = client.recv(4, socket.MSG_WAITALL)
            if len(raw) != 4:
                raise CriuFailed("criu restore closed the lazy-pages socket before it had finished")
            n = struct.unpack("<i", raw)[0]
            if n == RESTORE_FINISHED:    # CRIU wrote its pidfile before: the root to kill on failure
                if self._read_root():
                    self._track(time.monotonic())
                return
            if n < 0:
                continue                                  # a zombie: no memory, no descriptor
            if not 0 < n < MAX_PID:
                raise CriuFailed(f"criu restore sent an unexpected word {n:#x} on the lazy-pages socket")
            _, fds, _, _ = socket.recv_fds(client, 1, 1)
            if len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                raise CriuFailed(f"criu restore sent no userfaultfd for PID {n}")
            fd = fds[0]
            os.set_blocking(fd, False)
            self._tell(b"U", fd)
            pages, pieces = self.lp.tasks.get(n, (None, []))
            self.mms.append(Mm(fd, {pages: [list(p) for p in pieces]} if pages else {}))

    def _read_root(self) -> bool:
        try:
            self.root = int(self.pidfile.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return False
        return 0 < self.root < MAX_PID

    def _wait(self, extra: list[int], timeout: float) -> bool:
        """Serve every waiting uffd message, waiting up to timeout for one (or for an fd of
        `extra` to become readable: returns True then)."""
        p = select.poll()
        for mm in self.mms:
            p.register(mm.fd, select.POLLIN)
        for fd in extra:
            p.register(fd, select.POLLIN)
        ready = {fd for fd, _ in p.poll(min(timeout, SCAN_EVERY) * 1000)}
        self._events()
        self._track(time.monotonic())
        return any(fd in ready for fd in extra)

    def _events(self) -> None:
        for mm in list(self.mms):
            while True:
                try:
                    msgs = uffd.read_msgs(mm.fd, self._msgbuf)
                except uffd.Gone:
                    self._gone(mm)
                    break
                if not msgs:
                    break
                for m in msgs:
                    self._event(mm, m)

    def _event(self, mm: Mm, m: tuple) -> None:
        ev = m[0]
        if ev == uffd.EVENT_PAGEFAULT:
            self._fault(mm, m[1])
        elif ev == uffd.EVENT_FORK:
            fd = m[1]
            os.set_blocking(fd, False)
            self._tell(b"U", fd)
            self.mms.append(mm.clone(fd))
            self.events["forks"] += 1
        elif ev == uffd.EVENT_REMAP:
            mm.remap(m[1], m[2], m[3])
            self.events["remaps"] += 1
        else:                                     # REMOVE (madvise) or UNMAP
            mm.drop(m[1], m[2])
            self.events["unmaps"] += 1
            if ev == uffd.EVENT_REMOVE:
                # the mapping stays: its pages are the kernel's to zero-fill from now on
                try:
                    uffd.unregister(mm.fd, m[1], m[2] - m[1])
                except uffd.Gone:
                    self._gone(mm)

    def _gone(self, mm: Mm) -> None:
        if mm in self.mms:
            self.mms.remove(mm)
            os.close(mm.fd)

    def _fault(self, mm: Mm, addr: int) -> None:
        self.events["faults"] += 1
        hit = mm.find(addr)
        try:
            if hit is None:                      # not in the snapshot (or resolved meanwhile)
                uffd.zeropage(mm.fd, addr)
                return
            img, off = hit
            idx = bisect.bisect_right(self._job_pos.get(img, []), off) - 1
            job = self._jobs[img][idx] if idx >= 0 else None
            if job is None or not job.pos <= off < job.pos + job.size:
                raise CorruptSnapshot(f"snapshot {self.snap.path}: no data for a lazy page of {img}")
            self._apply_job(img, idx)
            uffd.wake(mm.fd, addr, PAGE)
        except uffd.Gone:
            self._gone(mm)

    def _plan_jobs(self) -> list[tuple[str, int]]:
        self._src = self.snap.page_jobs()
        self._reader = self._src.open_reader()
        order = []
        for img, holes in self.lp.holes.items():
            jobs, pos = [], []
            drop = self._drop.get(img)
            for job in self._src.jobs(img, JOB_BYTES, drop):
                i = bisect.bisect_right(holes, job.pos, key=lambda h: h[0]) - 1
                lazy = (i >= 0 and holes[i][1] > job.pos) or \
                       (i + 1 < len(holes) and holes[i + 1][0] < job.pos + job.size)
                if lazy:
                    order.append((img, len(jobs)))
                    jobs.append(job)
                    pos.append(job.pos)
            self._jobs[img], self._job_pos[img] = jobs, pos
        return order

    def _assemble(self, img: str, idx: int, rd=None):
        return self._src.build(img, self._jobs[img][idx], rd or self._reader)   # checked

    def _apply_job(self, img: str, idx: int, buf=None, have: bool = False) -> None:
        """Copy job idx of image img into every process still waiting for part of it."""
        if (img, idx) in self._applied:
            return
        if not have:
            fut = self._window.get((img, idx))
            buf = fut.result() if fut is not None else self._assemble(img, idx)
        job = self._jobs[img][idx]
        lo, hi = job.pos, job.pos + job.size
        src = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf)) if buf is not None else 0
        while True:
            again = False
            for mm in list(self.mms):
                for piece in mm.take(img, lo, hi):
                    if buf is None:      # zero pages: what an untouched page reads anyway
                        continue
                    try:
                        self._copy(mm, img, piece, src + piece[0] - lo)
                    except _Retry:
                        again = True
                    except uffd.Gone:
                        self._gone(mm)
                        break
            if not again:
                break
            self._wait([], 0.001)        # the event behind the EAGAIN; then the rest again
        if (img, idx) not in self._applied:  # (a fault served meanwhile may have done it)
            self._applied.add((img, idx))
            self.filled += job.size

    def _copy(self, mm: Mm, img: str, piece: list[int], src: int) -> None:
        off, va, ln = piece
        pos = 0
        step = ln
        while pos < ln:
            n, e = uffd.copy(mm.fd, va + pos, src + pos, min(step, ln - pos))
            pos += n
            if e == 0:
                step = ln            # a whole stretch went in: try the rest in one again
                continue
            if e == errno.EEXIST:
                pos += PAGE          # already there (put in by the process's own fault path)
            elif e == errno.ENOENT:
                if step > PAGE and n == 0:
                    step = max(PAGE, (min(step, ln - pos) // 2) & ~(PAGE - 1))
                    continue         # maybe across a mapping split since: smaller pieces
                pos += PAGE          # not mapped (any more): nothing to fill
            else:                    # EAGAIN: the rest waits for the event
                mm.put(img, [off + pos, va + pos, ln - pos])
                raise _Retry()

    def _fill(self, order: list) -> None:
        """The jobs in order, decoded `2 * threads` ahead, each copied as it comes; events and
        faults served between them. Fails unless nothing is left pending."""
        win = deque()
        ex = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="gpusnap-lazy-read")
        local = threading.local()

        def build(img, idx):
            if not hasattr(local, "rd"):
                local.rd = self._src.open_reader()
                with self._lock:
                    self._readers.append(local.rd)
            return self._assemble(img, idx, local.rd)

        it = iter(order)
        try:
            more = True
            while more or win:
                while more and len(win) < 2 * self.threads:
                    nxt = next(it, None)
                    if nxt is None:
                        more = False
                    elif nxt not in self._applied:
                        self._window[nxt] = ex.submit(build, *nxt)
                        win.append(nxt)
                if self._stop.is_set():
                    raise CriuFailed("the lazy restore was stopped before every page was in place")
                self._wait([], 0)
                if not win:
                    continue
                head = win[0]
                fut = self._window[head]
                if not fut.done():
                    self._wait([], 0.002)
                    continue
                win.popleft()
                del self._window[head]
                if head not in self._applied:
                    if self.pause:
                        self._idle(self.pause)
                    self._apply_job(*head, buf=fut.result(), have=True)
            self._wait([], 0)
            left = sum(mm.bytes_pending() for mm in self.mms)
            if left:
                raise CriuFailed(f"lazy restore: {left} bytes of the job's memory were never filled")
        finally:
            for f in self._window.values():
                f.cancel()
            ex.shutdown(wait=True)
            for r in self._readers:
                r.close()
            if self._reader is not None:
                self._reader.close()

    def _idle(self, seconds: float) -> None:
        """Serve faults and events for `seconds`."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self._wait([], left)

    def _kill(self) -> list[int]:
        """SIGKILL the restored tree, and what of the job left it, and wait until they are
        gone (before any userfaultfd closes)."""
        if not self.root:
            self._read_root()
        return kill_tree(self._job_pids())

    def _close_all(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for mm in self.mms:
                os.close(mm.fd)
            self.mms = []
            if self._listener is not None:
                self._listener.close()
            if self._wsock is not None:
                self._wsock.close()        # after "D", or after the kill: the watcher may go
        if self._watch is not None:
            try:
                self._watch.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        if self._subreaper is not None:
            _set_subreaper(self._subreaper)
            self._subreaper = None
        for pid in proc.children(os.getpid()):
            if pid not in self._ours and not proc.exists(pid):
                try:                       # an adopted process of the job that ended: reap it
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass

    def wait(self, progress=None) -> None:
        """Until every lazy page is in place; raises (the tree killed) if that failed."""
        while not self._done.wait(0.1):
            if progress:
                progress(min(self.filled, self.lp.bytes), self.lp.bytes, "filling")
        self._end()

    def abort(self) -> None:
        """Stop (CRIU failed, or the caller did): kill whatever was restored, then close."""
        self._stop.set()
        if self._thread is not None:
            self._done.wait(60)
        self._kill()
        self._close_all()

    def _end(self) -> None:
        if self.error is not None:
            # the thread killed what it knew; CRIU's pidfile may only have come since
            self._kill()
            self._close_all()
            e = self.error
            if isinstance(e, GpusnapError):
                e.message += "; the restored job was killed, so that it could not run on with missing memory"
            raise e
        self._close_all()


def _env_pause() -> float:
    """$GPUSNAP_LAZY_PAUSE: seconds to wait (serving faults) before each filled job (slows the
    fill down: for tests of what happens during it, or to spare a busy disk)."""
    try:
        return max(0.0, float(settings.get("GPUSNAP_LAZY_PAUSE", "0") or 0))
    except ValueError:
        return 0.0


def _set_subreaper(on: int) -> int | None:
    """Make this process a child subreaper (or not); returns the setting before, or None if
    prctl refused (then only the root's own tree is known to the fill)."""
    libc = ctypes.CDLL(None, use_errno=True)
    before = ctypes.c_int(0)
    if libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(before), 0, 0, 0) != 0:
        return None
    if libc.prctl(PR_SET_CHILD_SUBREAPER, on, 0, 0, 0) != 0:
        return None
    return before.value
