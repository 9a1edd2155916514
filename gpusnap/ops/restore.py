"""Bringing a snapshot back: checks first, then CRIU, detached, by one of three paths.

Before CRIU starts: the snapshot's structure, its PIDs (must be free), its GPUs, huge pages,
and the files the job had open (gpusnap/ops/restore_files.py: output files that grew are set
aside and truncated back; anything else changed is refused). Then CRIU gets the images
(gpusnap/ops/restore_paths.py) through `--stream` from the serve streamer, or as image files
written into a private directory for a plain `criu restore -D` (gpusnap/repo/materialize.py):
faster when they fit on tmpfs, and the only way for private huge-page mappings
(gpusnap/ops/restore_needs.py). Either way every page is checked against its checksum before
CRIU can use it, so a damaged snapshot fails before the restored tree ever runs. The third
path, only when asked for (`--via lazy`), resumes the job before its private memory is in,
and fills it while the job runs (gpusnap/criu/lazypages.py): there a damaged page kills the
job, which has run for a moment.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from gpusnap.repo import locate
from gpusnap.criu import netlock
from gpusnap.system import hostlock, linkremap, proc
from gpusnap.ops import identity, restore_files, restore_interrupt, restore_needs, restore_paths, restore_sockdirs
from gpusnap.system.faults import fault
from gpusnap.criu import runner
from gpusnap.criu import images, sparse
from gpusnap.errors import CorruptSnapshot, CriuFailed, HugePagesUnavailable, Interrupted, PidsInUse, UsageError
from gpusnap import settings

# A PID still held by a process that is exiting (or a zombie about to be reaped) frees up
# within moments; wait this long before declaring it taken.
PID_WAIT_SECONDS = 5.0


@dataclass
class RestoreResult:
    pid: int
    snapshot: str
    seconds: float
    pids: list[int]
    # wall seconds: preflight (snapshot checks, PIDs, GPUs, files), materialize (image files
    # written, --via files only), criu (CRIU restoring; with --via stream while the images
    # stream out of the repository), tmux (a restore into a new tmux session: starting it and
    # gpusnap in its pane)
    phases: dict[str, float] = field(default_factory=dict)
    via: str = "stream"             # how CRIU got the images: stream, files (plain -D), lazy; podman, docker (a container)
    images: str | None = None       # where image files were written: tmpfs or disk
    notes: list[str] = field(default_factory=list)   # what restore changed (files set aside)
    # established TCP connections in the snapshot came back closed (--tcp-close), and why
    tcp_closed: str | None = None
    # --via lazy: wall seconds until the tree ran again (`seconds`: until every page was in)
    running_seconds: float | None = None
    # --via lazy: what the job did while its memory was filled (criu/lazypages.py)
    lazy: dict | None = None
    # the name the restored tree carries (gpusnap/ops/identity.py): the snapshot's, or for a
    # fork beside the still-running original its own (NAME-forkK); fork_of: that original
    job: str | None = None
    fork_of: str | None = None
    job_dir: str | None = None      # a `run` job's: where its stdout.log and stderr.log are
    # the job had a terminal: which one it got (ops/restore_terminal.py: mode here or tmux,
    # the tty or the tmux session and its attach command, the line restore prints)
    terminal: dict | None = None
    # a signal that came once CRIU was restoring and did not stop it (restore_interrupt.py)
    interrupted: str | None = None
    bytes_raw: int = 0              # the snapshot's size as CRIU wrote it (the summary line)

    def to_dict(self) -> dict:
        return asdict(self)


def snapshot_pids(snap) -> list[int]:
    """The PIDs (and thread ids) the snapshot will recreate: recorded at dump time, or else
    read from its pstree image (criu/images.py)."""
    meta = snap.manifest.get("meta", {})
    pids, tids = meta.get("pids"), meta.get("tids")
    if (isinstance(pids, list) and isinstance(tids, list) and pids
            and all(type(x) is int and 0 < x < 1 << 22 for x in pids + tids)):
        return list(dict.fromkeys(pids + tids))
    pids = []
    try:
        for e in images.pstree(images.read(snap, "pstree.img")):
            pids.append(e["pid"])
            pids.extend(t for t in e["threads"] if t != e["pid"])
    except ValueError as e:
        raise CorruptSnapshot(f"snapshot {snap.path} has an unreadable process tree: {e}") from None
    if not pids or not all(0 < x < 1 << 22 for x in pids):
        raise CorruptSnapshot(f"snapshot {snap.path} has a process tree without valid PIDs")
    return pids


def pidns_init(snap) -> bool:
    """Whether the snapshot's root is the init of its own PID namespace (pstree.img's first
    entry has PID 1). CRIU then restores the tree into a new PID namespace: its PIDs there
    are its own, and on the host it gets whatever PIDs are free, so it can run side by side
    with the job it was taken from."""
    if not snap.has_image("pstree.img"):
        return False
    try:
        for e in images.pstree(images.read(snap, "pstree.img")):
            return e["pid"] == 1
    except ValueError as e:
        raise CorruptSnapshot(f"snapshot {snap.path} has an unreadable process tree: {e}") from None
    return False


def _check_pids_free(pids: list[int]) -> None:
    busy = [p for p in pids if proc.read_stat(p) is not None]
    if not busy:
        return
    busy = proc.wait_gone(busy, PID_WAIT_SECONDS)
    if busy:
        from gpusnap.system import zombies

        dead = {st.pid for st in zombies.zombies(busy)}
        desc = ", ".join(f"{p} ({'zombie ' + st.comm if p in dead else proc.cmdline(p)[:60] or st.comm})"
                         for p in busy[:5] if (st := proc.read_stat(p)))
        live = [p for p in busy if p not in dead]
        # a zombie is gone already: "stop the job" is no advice for it, reaping is
        hint = "; ".join(filter(None, [zombies.describe(sorted(dead)), pids_hint(live) if live else None]))
        raise PidsInUse(f"PID(s) needed by the snapshot are in use: {desc}", hint=hint)


def pids_hint(busy: list[int]) -> str:
    """What to do when the snapshot's PIDs are taken: a snapshot comes back under its original
    PIDs, so the process holding them (usually the original job) has to go first."""
    kill = " ".join(str(p) for p in busy[:5])
    return (f"the original job is probably still running: stop it (`kill {kill}`, and wait until it has "
            "exited), then restore again; a snapshot restores under its original PIDs, so it cannot run side "
            "by side with the job it was taken from; a job that is the init of its own PID namespace (started "
            "with `gpusnap run`, or `unshare --pid --fork setsid CMD`) restores side by side")


def _gpu_env(snap, gpu_map: str | None) -> dict[str, str]:
    meta = snap.manifest.get("meta", {})
    recorded = meta.get("gpu")
    if not recorded and not gpu_map and not meta.get("cuda_pids"):
        return {}
    from gpusnap.gpu import driver as gpu_driver, remap

    env = remap.plan_gpu_restore(recorded, gpu_driver.driver_info(), gpu_map,
                                 cuda_pids=meta.get("cuda_pids") or []).env()
    if meta.get("own_pid_namespace") is True:  # the plugin sees new PIDs: per-process maps cannot apply
        env = {k: v for k, v in env.items() if k == remap.GPU_MAP_ENV}
    return env


VIAS = ("auto", "stream", "files", "lazy")
# `restore --cgroups MODE`: CRIU's --manage-cgroups modes, the user's choice (None: CRIU's default,
# soft: the job's cgroups made where missing, their properties restored only in new ones; ignore:
# the job stays in the cgroups of the restoring gpusnap, none of its own restored)
CGROUPS = ("none", "props", "soft", "full", "strict", "ignore")


def choose_via(via: str, snap, hugetlb: int) -> str:
    """stream or files. auto: files when the snapshot maps huge pages (only image files let
    CRIU restore them), stream otherwise: on the 2-core machines measured (docs/benchmark.md)
    both paths took the same time within the noise, and the stream needs no memory or disk
    for a copy of the images. `via` is one of VIAS (restore() checks it first)."""
    if via == "stream" and hugetlb:
        raise UsageError(f"snapshot {snap.path} maps {hugetlb >> 20} MiB of huge pages, which CRIU cannot "
                         "restore from a stream (its restorer reads them at an offset in the pages image)",
                         hint="restore with --via files (or auto, the default)")
    if via == "lazy":
        meta = snap.manifest.get("meta", {})
        if meta.get("gpu") or meta.get("cuda_pids"):
            raise UsageError(f"snapshot {snap.path} holds GPU state, which --via lazy does not restore (the "
                             "CUDA restore reads the job's memory while it is still being filled)",
                             hint="restore it with --via files or --via stream (or auto, the default)")
    if via != "auto":
        return via
    return "files" if hugetlb else "stream"


def _check_hugepages(hugetlb: int) -> None:
    if not hugetlb:
        return
    pool = restore_needs.hugepage_pool()
    if pool is None:
        return                       # no pool figures: CRIU will say, and explain_restore too
    total, free, size = pool
    if free * size < hugetlb:
        want = total + -(-(hugetlb - free * size) // size)
        raise HugePagesUnavailable(
            f"the snapshot maps {hugetlb >> 20} MiB of huge pages, the huge-page pool here has "
            f"{free * size >> 20} MiB free",
            hint=f"reserve enough first: `sysctl vm.nr_hugepages={want}` (now {total}), then restore again")


def restore(ref: str, repo: str | os.PathLike | None = None, gpu_map: str | None = None,
            progress: Callable[..., None] | None = None, via: str = "auto",
            tcp_close: bool = False, terminal_want: str = "auto", cgroups: str | None = None) -> RestoreResult:
    """terminal_want, for a job that had a terminal (ops/restore_terminal.py): auto (ours when
    we have one, else a new tmux session), new (always tmux: --json, programs), here.
    cgroups: CRIU's --manage-cgroups mode (CGROUPS; None: CRIU's own default, soft)."""
    t0 = time.monotonic()
    if via not in VIAS:
        raise UsageError(f"--via must be one of {', '.join(VIAS)}, not {via!r}")
    if cgroups is not None and cgroups not in CGROUPS:
        raise UsageError(f"--cgroups must be one of {', '.join(CGROUPS)}, not {cgroups!r}")
    with restore_interrupt.guard() as g:
        try:
            runner.require_privileges("restore")
            info = runner.criu_info()
            repository, snap = locate.open_snapshot(ref, repo)
            if (snap.manifest.get("meta") or {}).get("container"):     # `dump --container`
                from gpusnap.ops.restore_container import restore_container  # lazy: it imports RestoreResult

                if via != "auto":
                    from gpusnap.system import engines

                    title = engines.title(snap.manifest["meta"]["container"].get("engine"))
                    raise UsageError(f"snapshot {snap.path} is of a container: {title} restores it, --via does not apply")
                with repository.readers_lock():
                    return restore_container(repository, snap, t0, progress)
            tty = tty_name = None
            terms = terminals(snap)
            if terms:
                from gpusnap.ops import restore_terminal
                from gpusnap.system import terminal

                if restore_terminal.choose(terms, terminal_want) == "tmux":
                    return restore_terminal.in_tmux(snap, repository.path, gpu_map=gpu_map, via=via,
                                                   tcp_close=tcp_close, t0=t0, cgroups=cgroups)
                import signal

                signal.signal(signal.SIGTTOU, signal.SIG_IGN)   # the job gets the foreground; we still print
                restore_terminal.become_subreaper()
                tty, tty_name = 0, terminal.here()
                modes = restore_terminal.modes(tty, snap)
                if progress:
                    progress(0, 0, "handover")      # no progress bar on the terminal the job will write to
            with repository.readers_lock():
                result = _restore(repository, snap, info, gpu_map, progress, t0, via, tcp_close, tty, cgroups)
        except KeyboardInterrupt:      # Ctrl-C, or SIGTERM/SIGHUP (restore_interrupt.Terminated)
            raise Interrupted("restore interrupted before CRIU started: nothing was restored, and the files "
                              "it had set aside are back as they were",
                              hint="restore again when you want the job back") from None
        if tty is not None:
            restore_terminal.put_back(tty, modes)
            result.terminal = restore_terminal.describe("here", tty=tty_name)
        note_interrupt(g, result)
        return result


def note_interrupt(g, result: RestoreResult) -> None:
    """A signal held since CRIU started (the job runs): say so in the result, once."""
    note = None if g.noted else g.note(result.pid)
    if note:
        result.notes.append(note)
        result.interrupted = g.names()


def terminals(snap) -> list[str]:
    """The terminals of the job that CRIU will hand over on restore (criu/ttyinfo.py)."""
    from gpusnap.criu import ttyinfo

    if "--shell-job" not in (snap.manifest.get("meta", {}).get("restore_flags") or []):
        return []
    try:
        return ttyinfo.handed_over(snap)
    except ValueError as e:
        raise CorruptSnapshot(f"snapshot {snap.path} has an unreadable terminal image: {e}") from None


def _restore(repository, snap, info, gpu_map, progress, t0, via, tcp_close=False, tty=None,
             cgroups=None) -> RestoreResult:
    snap.check_structure()
    env = dict(os.environ)
    env.update(_gpu_env(snap, gpu_map))
    pids = snapshot_pids(snap)
    own_pidns = snap.manifest.get("meta", {}).get("own_pid_namespace")
    if own_pidns is None:               # older snapshots, jobs started with unshare: pstree.img says
        own_pidns = pidns_init(snap)
    own_pidns = own_pidns is True
    # One restore per job at a time (two started together would both find the PIDs free and
    # both set aside the same files); a job in a PID namespace of its own may run side by side,
    # but its copies still share its files.
    key = f"restore-{snap.id}" if own_pidns else f"restore-pid-{pids[0]}"
    with hostlock.held(key, (lambda: progress(0, 0, "waiting")) if progress else None):
        if not own_pidns:  # a PID namespace of its own is recreated fresh: nothing can clash
            _check_pids_free(pids)
        plan, tcp = _plan(repository, snap, info, env, pids, own_pidns, via, tcp_close, tty, t0, cgroups)
        return _run(plan, tcp, progress)


@dataclass(frozen=True)
class _Tcp:
    """The snapshot's TCP connections and whether they come back closed, and why."""
    conns: tuple
    closed: bool
    why: str | None
    dumped_closed: bool     # `dump --tcp-close`: CRIU saved no connection state, locked nothing


def _tcp(snap, tcp_close: bool) -> _Tcp:
    meta = snap.manifest.get("meta", {})
    conns = tuple(c for c in meta.get("tcp") or [] if isinstance(c, dict))
    if "--tcp-close" in (meta.get("restore_flags") or []):
        return _Tcp(conns, True, "dumped with --tcp-close" if conns else None, True)
    closed, why = netlock.restore_tcp_close(list(conns), tcp_close)
    return _Tcp(conns, closed, why, False)


def _plan(repository, snap, info, env, pids, own_pidns, via, tcp_close, tty, t0, cgroups=None):
    """The restore decided: CRIU's flags (the manifest's, checked: it is data, not a command
    line), the connections, the path, the huge pages it needs. Returns (plan, connections)."""
    flags = list(snap.manifest.get("meta", {}).get("restore_flags", []))
    allowed = {"--shell-job", "--tcp-established", "--file-locks", "--ext-unix-sk", "--tcp-close"}
    if not set(flags) <= allowed:
        raise CorruptSnapshot(f"snapshot {snap.path} asks for unexpected CRIU flags {flags}")
    join, netns_note = restore_needs.join_netns(snap)     # a named network namespace: joined again
    flags += join
    if cgroups is not None:                     # the user's choice (restore --cgroups)
        flags.append(f"--manage-cgroups={cgroups}")
    tcp = _tcp(snap, tcp_close)
    if tcp.closed and not tcp.dumped_closed:
        flags.append("--tcp-close")
    elif "--tcp-established" not in flags and "--tcp-close" not in flags and restore_needs.reset_tcp(snap):
        flags.append("--tcp-established")
    hugetlb = restore_needs.snapshot_hugetlb_bytes(snap)
    mode = choose_via(via, snap, hugetlb)
    _check_hugepages(hugetlb)
    return restore_paths.RestorePlan(repository, snap, info, env, tuple(flags), tuple(pids), own_pidns, mode, via,
                                     tty=tty, t0=t0, notes=(netns_note,) if netns_note else ()), tcp


def _run(plan: restore_paths.RestorePlan, tcp: _Tcp, progress) -> RestoreResult:
    """The files put in place, the plan run by its path, the name claimed; every way out
    before the job runs puts back what was set aside."""
    snap = plan.snap
    # the name the restored tree will carry (the snapshot's, or a fork's: gpusnap/ops/identity.py)
    claim = identity.claim(plan.repository.path, snap)
    remaps, sockdirs = linkremap.PutBack(), restore_sockdirs.Made()
    try:
        remaps = linkremap.put_back(snap)   # CRIU's link_remap files first: the file checks see them
        sockdirs = restore_sockdirs.make(snap)
        fixes = restore_files.prepare(snap, inherited=claim.paths)
    except BaseException:
        sockdirs.undo()
        remaps.undo()
        claim.abandon()
        raise
    try:
        plan = dataclasses.replace(plan, flags=plan.flags + tuple(claim.criu_flags()))
        fault("restore:checked")
        sp = sparse.plan(snap) if settings.get("GPUSNAP_SPARSE_RESTORE") != "0" else None   # ("0": measuring)
        plan = dataclasses.replace(plan, sparse=sp)
        preflight = round(time.monotonic() - plan.t0, 3)
        plan, out = _run_path(plan, progress)
    except BaseException as e:
        sockdirs.undo()
        remaps.undo()
        fixes.undo()
        claim.abandon(e)
        raise
    return _result(plan, out, {"preflight": preflight, **out.phases}, tcp, claim, fixes)


def _run_path(plan: restore_paths.RestorePlan, progress):
    """Run the plan's path: (the plan as run, what it did). An automatic stream restore
    that meets a huge-page mapping made after the dump's preflight looked (the stream
    cannot carry it) goes again through image files (restore_needs.py)."""
    try:
        return plan, restore_paths.PATHS[plan.via](plan, progress)
    except CriuFailed as e:
        if plan.via != "stream" or plan.via_asked != "auto" or not any("Can't read pages data" in ln
                                                                       for ln in e.last_lines):
            raise
    plan = dataclasses.replace(plan, via="files")
    if not plan.own_pidns:
        _check_pids_free(list(plan.pids))
    return plan, restore_paths.via_files(plan, progress)


def _result(plan, out, phases: dict, tcp: _Tcp, claim, fixes) -> RestoreResult:
    """The job runs: its PIDs, network locks no longer needed, the name committed."""
    pid = out.pid
    if plan.own_pidns:  # the recorded PIDs are the original's; the restored tree has new ones
        if pid is None:   # never hand back the original's PIDs as the restored ones
            raise CriuFailed("criu restore left no PID file; the restored job's PID is unknown")
        pids = proc.tree(pid)
    else:
        pids = list(plan.pids)
        if pid is None:
            pid = pids[0]
    if tcp.closed and not tcp.dumped_closed:   # such a dump locked nothing
        netlock.unlock_closed(list(tcp.conns))
    notes = [*plan.notes, *fixes.notes()]
    _, unrecorded = claim.commit(pid)
    if unrecorded:
        notes.append(unrecorded)
    fault("restore:job-running")
    lazy = out.lazy
    if lazy and lazy.get("signals_deferred") and restore_interrupt.active() is None:   # else the guard says it
        notes.append("a signal to stop came while the job's memory was being filled; gpusnap finished the fill "
                     "first (stopping then would have killed the job), and the job runs")
    snap = plan.snap
    return RestoreResult(pid=pid, snapshot=str(snap.path), seconds=round(time.monotonic() - plan.t0, 3), pids=pids,
                         phases=phases, via=plan.via, images=out.where, notes=notes,
                         tcp_closed=tcp.why if tcp.closed else None, running_seconds=out.running,
                         lazy=lazy, job=claim.job.name, fork_of=claim.fork_of,
                         job_dir=claim.job.dir if claim.job.kind == "run" else None,
                         bytes_raw=int(snap.manifest.get("stats", {}).get("bytes_raw", 0) or 0))
