"""`schedule run` (what the cron line or timer runs) and what is read back from its log: one
timestamped JSON line per run in /var/log/gpusnap/schedule-NAME.log; last run, result, next
run, a job gone for several runs in a row; and the schedule checks of `gpusnap doctor`."""

from __future__ import annotations

import datetime as _dt
import json
import os
import time
from pathlib import Path

from gpusnap.ops import cronexpr, validate
from gpusnap.errors import GpusnapError, InterruptedAfterCommit, ProcessNotFound
from gpusnap.ops.schedule.inflight import markers, running, settle
from gpusnap.ops.schedule.backends import detect_scheduler, legacy_cron_files, scheduler_fix
from gpusnap.ops.schedule.record import Schedule, engine_env, list_schedules, load, private_dir

GONE_AFTER = 3          # runs in a row without the job before ls/doctor say it is gone


def _now_iso(t: float | None = None) -> str:
    return _dt.datetime.fromtimestamp(time.time() if t is None else t, _dt.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


def append_log(s: Schedule, record: dict) -> None:
    """One JSON line per run, appended (O_APPEND: concurrent runs never interleave a line)."""
    p = Path(s.log)
    private_dir(p.parent)
    fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (json.dumps(record, sort_keys=True) + "\n").encode())
    finally:
        os.close(fd)


def read_log(s: Schedule, last: int = 50) -> list[dict]:
    try:
        with open(s.log, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - (64 << 10)))
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for ln in lines[-last:]:
        try:
            rec = json.loads(ln)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def run(name: str, config_dir: Path | None = None) -> dict:
    """What the cron line or timer runs: find the job among its owner's processes, dump with
    retention, log one JSON line. Returns the record; raises the dump's error after logging.
    Meanwhile a marker says the run is under way (inflight.py): one killed without a word
    (SIGKILL: the OOM killer) is reported as such, not taken for the run before it."""
    s = load(name, config_dir)
    t0 = time.time()
    rec: dict = {"time": _now_iso(t0), "schedule": s.name, "pid": None}
    settle(s, append_log)      # runs killed since the last one get their line first
    with running(s, rec["time"]):
        return _run(s, rec, t0)


def _run(s: Schedule, rec: dict, t0: float) -> dict:
    from gpusnap.ops.dump import DumpRequest, retention_error

    error: GpusnapError | None = None
    try:
        if s.container is not None:
            res = _dump_container(s, rec)
        elif s.match is None:
            from gpusnap.ops import run as run_op

            pid = run_op.find(s.name, Path(s.repo)).pid
            if validate.process_uid(pid) != s.uid:
                raise ProcessNotFound(f"job {s.name} (PID {pid}) no longer runs as {s.user}")
        else:
            pid = validate.find_job(s.match, s.uid)
        if s.container is None:
            rec["pid"] = pid
            res = _dump(s, DumpRequest(pid=pid, repo=Path(s.repo), name=s.name, leave_running=not s.exit_after,
                                       keep_last=s.keep_last))
        rec.update({"snapshot": res.snapshot, "id": res.id, "pages_total": res.pages_total,
                    "pages_dedup": res.pages_dedup, "bytes_raw": res.bytes_raw, "bytes_stored": res.bytes_stored,
                    "pruned": len(res.pruned), "dump_seconds": res.seconds})
        if res.prune_warnings:
            rec["warnings"] = res.prune_warnings
        if res.copy is not None:
            rec["copy"] = _copy_outcome(res.copy)
        error = retention_error(res)
        rec["outcome"] = "ok" if error is None else "retention-failed"
    except ProcessNotFound as e:
        error = e
        rec["outcome"] = "no-job"
    except InterruptedAfterCommit as e:
        # the snapshot is committed and restorable: not a failed run, nor a clean one
        error = e
        rec["outcome"] = "interrupted-after-commit"
        rec["snapshot"] = e.snapshot
    except GpusnapError as e:
        error = e
        rec["outcome"] = "failed"
    except KeyboardInterrupt:
        from gpusnap.errors import Interrupted
        error = Interrupted("schedule run interrupted")
        rec["outcome"] = "failed"
    rec["exit_code"] = error.exit_code if error else 0
    if error is not None:
        rec["message"] = error.message
    rec["seconds"] = round(time.time() - t0, 3)
    if rec["outcome"] == "no-job":
        gone = 1 + _no_job_streak(read_log(s))
        rec["runs_without_job"] = gone
        if gone >= GONE_AFTER:
            error.message += f"; the job has been gone for {gone} runs in a row"  # type: ignore[union-attr]
            rec["message"] = error.message  # type: ignore[union-attr]
    append_log(s, rec)
    if error is not None:
        raise error
    return rec


def _dump(s: Schedule, req):
    """A run's dump: tiered when the schedule has --copy-to (ops/tiers.py)."""
    from gpusnap.ops import tiers
    from gpusnap.ops.dump import dump

    if s.copy_to is None:
        return dump(req)
    return tiers.dump(req, tiers.Tier(to=s.copy_to, keep_last=s.copy_keep_last))


def _copy_outcome(c: dict) -> dict:
    """The copy in the run's log line: copied, or pending (and why); counts, not lists."""
    out = {"to": c["to"], "status": c["status"], "copied": len(c["copied"]), "pending": len(c["pending"]),
           "bytes_sent": c["bytes_sent"], "seconds": c.get("seconds")}
    if c.get("error"):
        out["error"] = c["error"]
    if c.get("retention"):
        out["pruned_there"] = len(c["retention"]["deleted"])
        if c["retention"].get("error"):
            out["retention_error"] = c["retention"]["error"]
    return out


def _dump_container(s: Schedule, rec: dict):
    """A run of a container's schedule: no container running under that name or id is a
    run without its job, as for a process."""
    from gpusnap.ops.dump import DumpRequest
    from gpusnap.ops.dump_container import dump_container

    with engine_env(s) as eng:
        info = eng.inspect(s.container)
        if not info["running"]:
            raise ProcessNotFound(f"container {s.container} is not running")
        rec["pid"] = info["pid"]
        return dump_container(DumpRequest(pid=0, repo=Path(s.repo), name=s.name, leave_running=not s.exit_after,
                                          keep_last=s.keep_last), s.container, engine=eng.NAME)


def _no_job_streak(records: list[dict]) -> int:
    n = 0
    for r in reversed(records):
        if r.get("outcome") != "no-job":
            break
        n += 1
    return n


# -- status ------------------------------------------------------------------------------
def status(s: Schedule, now: float | None = None) -> dict:
    """Last run, result, next run, and whether the job looks gone, from the log."""
    now = time.time() if now is None else now
    marks = markers(s)
    recs = read_log(s)
    # runs killed since, not yet written into the log by a next run, in their place by start
    # time (a run that overlapped them may have logged after they started)
    killed = [m.record(s) for m in marks if not m.alive]
    if killed:
        recs = sorted(recs + killed, key=lambda r: str(r.get("time", "")))
    under_way = [m for m in marks if m.alive]
    last = recs[-1] if recs else None
    streak = _no_job_streak(recs)
    pid = current_job(s)     # the job now (after a restore, found before the next run)
    out = {"name": s.name, "backend": s.backend, "when": s.when, "match": s.match, "container": s.container,
           "user": s.user,
           "repo": s.repo, "keep_last": s.keep_last, "copy_to": s.copy_to, "copy_keep_last": s.copy_keep_last,
           "last_copy": last.get("copy") if last else None, "last_run": last.get("time") if last else None,
           "result": last.get("outcome") if last else None,
           "last_message": last.get("message") if last else None,
           "job_pid": pid, "runs_without_job": streak if pid is None else 0, "job_gone": streak >= GONE_AFTER and pid is None,
           "running_since": under_way[0].time if under_way else None,
           "installed": all(os.path.exists(f) for f in s.files) and bool(s.files),
           "next_run": next_run(s, recs, now)}
    return out


def current_job(s: Schedule) -> int | None:
    """The PID the next run would dump (the named job wherever it was restored, or what
    --match finds among its owner's processes); None when there is none."""
    try:
        if s.container is not None:
            with engine_env(s) as eng:
                info = eng.inspect(s.container)
            return info["pid"] if info["running"] else None
        if s.match is None:
            from gpusnap.ops import identity

            job = identity.running(s.name, Path(s.repo))
            return job.pid if job is not None and validate.process_uid(job.pid) == s.uid else None
        return validate.find_job(s.match, s.uid)
    except GpusnapError:
        return None


def next_run(s: Schedule, recs: list[dict], now: float) -> str | None:
    if s.cron or s.backend == "cron":
        expr = s.cron or s.when
        nxt = cronexpr.next_fire(expr, _dt.datetime.fromtimestamp(now))   # cron runs in local time
        return nxt.astimezone(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    span = cronexpr.parse_every(s.every or "")
    if recs:
        try:
            last = _dt.datetime.strptime(recs[-1]["time"], "%Y-%m-%dT%H:%M:%SZ").replace(
                tzinfo=_dt.timezone.utc).timestamp()
            return _now_iso(max(last + span, now))
        except (KeyError, ValueError):
            pass
    return _now_iso(now + span)


def doctor_checks(add) -> None:
    """For `gpusnap doctor`: can schedules run here, and is each one healthy.
    `add(name, status, detail, fix)` as DoctorReport.add."""
    kind, why = detect_scheduler()
    try:
        items = list_schedules()
    except GpusnapError:
        items = []
    if kind is None:
        add("scheduler", "fail" if items else "warn", why, scheduler_fix())
    else:
        add("scheduler", "ok", why)
    known = {f for s in items for f in s.files}
    for p in legacy_cron_files(known):
        add(f"schedule file {p.name}", "warn",
            f"{p} was written by an older gpusnap: its command line holds the job's arguments as text",
            f"add the schedule again with --replace (or remove {p})")
    for s in items:
        st = status(s)
        if not st["installed"]:
            add(f"schedule {s.name}", "fail", f"its {s.backend} file is missing ({', '.join(s.files)})",
                f"gpusnap schedule add ... --name {s.name} --replace")
        elif s.backend != kind and kind is not None:
            add(f"schedule {s.name}", "warn", f"written for {s.backend}, but {kind} runs this machine",
                "add it again with --replace")
        elif st["job_gone"]:
            add(f"schedule {s.name}", "warn",
                f"{s.job} (user {s.user}) has been gone for {st['runs_without_job']} runs in a row",
                f"restart the job, or gpusnap schedule rm {s.name}")
        elif st["result"] not in (None, "ok"):
            add(f"schedule {s.name}", "warn", f"last run {st['last_run']}: {st['result']}: {st['last_message']}",
                f"see {s.log}")
        else:
            add(f"schedule {s.name}", "ok",
                f"last run {st['last_run'] or 'never'} ({st['result'] or '-'}), next {st['next_run']}")
