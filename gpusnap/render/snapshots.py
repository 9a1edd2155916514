"""Human text of the snapshot commands: dump, restore, ls, inspect, export and import.

Each function takes a command's result (the same object its --json prints) and an Output.
Anything that comes from a snapshot or a job (paths, command lines, names) is printed as
plain text, never as rich markup: `train.py --layers [idx]` must print as it is.
"""

from __future__ import annotations

from typing import Any

from gpusnap.render import human_bytes, plain, utc


def dump(result, o, quiet: bool = False) -> None:
    """The snapshot directory on stdout; retention warnings and, on a terminal, a summary on stderr."""
    o.out.print(result.snapshot, markup=False)
    for w in result.prune_warnings:   # stderr even with --quiet: a cron log must show it
        o.warn(f"retention: {w}")
    if result.copy is not None:
        copy_outcome(result.copy, o, quiet)
    if quiet or not o.err.is_terminal or result.prune_error is not None:
        return
    ratio = result.bytes_stored / result.bytes_raw if result.bytes_raw else 0
    frozen = f" (job frozen {result.frozen_seconds:.2f} s)" if result.frozen_seconds is not None else ""
    o.err.print(f"[green]snapshot {result.name} ({result.id})[/]: {result.pages_total} pages "
                f"({result.pages_zero} zero, {result.pages_dedup} already stored), "
                f"{human_bytes(result.bytes_raw)} from CRIU, {human_bytes(result.bytes_stored)} stored "
                f"({ratio:.1%}), {result.seconds:.2f} s{frozen}; job "
                f"{'still running' if result.job_running else 'stopped'}")
    short = (result.staging or {}).get("arena_short")
    if short:     # a budget above what memory allowed: say why the freeze waited for the disk
        o.err.print("[yellow]note:[/] ", plain(
            f"memory ran short: the staging arena {short}; "
            f"{human_bytes(result.staging.get('spilled_bytes') or 0)} spilled to disk while the job was frozen"), sep="")


def copy_outcome(c: dict[str, Any], o, quiet: bool = False) -> None:
    """A tiered dump's copy: a failure on stderr always (a cron log must show it), success on
    a terminal."""
    if c["status"] != "copied":
        o.warn(f"not copied to {c['to']} yet: {c['error']}; the snapshot is kept here, marked not copied "
               f"({len(c['pending'])} waiting); the next dump with --copy-to, or `gpusnap copy --pending "
               f"--to {c['to']}`, copies them")
    elif not quiet and o.err.is_terminal:
        o.err.print(f"copied to {c['to']}: {len(c['copied'])} snapshot(s), {human_bytes(c['bytes_sent'])} sent "
                    f"in {c['seconds']:.2f} s (after the job ran again)", markup=False)
    err = (c.get("retention") or {}).get("error")
    if err:
        o.warn(f"retention in {c['to']} (--copy-keep-last): {err}")


def restore(result, o, quiet: bool = False) -> None:
    for note in result.notes:
        o.err.print(f"[yellow]note:[/] {note}")
    o.out.print(result.pid)
    if result.job and not quiet and result.via in ("podman", "docker"):
        beside = f", beside {result.fork_of}, which keeps its name" if result.fork_of else ""
        o.err.print(f"container {result.job} runs again (PID {result.pid}){beside}", markup=False)
    elif result.job and not quiet:
        where = f"; its output goes to {result.job_dir}/" if result.job_dir else ""
        if result.fork_of:
            o.err.print(f"job {result.job}: a fork of {result.fork_of}, which still runs and keeps its name{where}",
                        markup=False)
        else:
            o.err.print(f"job {result.job} is PID {result.pid} now (`dump --name {result.job}` and its schedules "
                        f"find it){where}", markup=False)
    if result.running_seconds is not None and not quiet:
        o.err.print(f"running again after {result.running_seconds:.2f} s; its memory filled in while it ran, "
                    f"all in place after {result.seconds:.2f} s", markup=False)
    if result.tcp_closed and not quiet:
        o.err.print(f"TCP connections restored closed ({result.tcp_closed}): the job sees a reset")
    if not quiet and o.err.is_terminal:    # like dump's summary: on a terminal only
        o.err.print(f"restored {result.snapshot}: {human_bytes(result.bytes_raw)} from CRIU, "
                    f"{result.seconds:.2f} s via {result.via}; job running as PID {result.pid}", markup=False)
    if result.terminal and not quiet:
        o.err.print(result.terminal["line"], markup=False)


def restore_ended(result, status: int | None, o, quiet: bool = False) -> None:
    """After a restore that gave the job this terminal: the job has ended."""
    if not quiet:
        how = f"exit status {status}" if status is not None and status >= 0 else (
            f"signal {-status}" if status is not None else "status unknown")
        o.err.print(f"gpusnap: the restored job (PID {result.pid}) ended ({how})", markup=False)


def snapshot_list(listing: dict[str, Any], o, name: str | None = None) -> None:
    """`gpusnap ls` (ops.ls.snapshots): one row per snapshot on stdout, the totals on stderr."""
    rows, totals = listing["snapshots"], listing["totals"]
    if not rows:
        o.err.print(f"no snapshots{f' named {name!r}' if name else ''} in {listing['repository']}", markup=False)
    else:
        from rich.table import Table

        table = Table(box=None)
        for col in ("snapshot", "name", "id", "created (UTC)", "from CRIU", "unique", "shared", "copies"):
            table.add_column(col, justify="right" if col in ("from CRIU", "unique", "shared") else "left",
                             overflow="fold" if col == "copies" else "ellipsis")    # where to: never cut short
        for r in rows:
            table.add_row(plain(r["dir"]), plain(r.get("name", "")), str(r.get("id", ""))[:12],
                          utc(r.get("created", 0)), human_bytes(r.get("bytes_raw", 0)),
                          human_bytes(r.get("bytes_unique", 0)), human_bytes(r.get("bytes_shared", 0)),
                          plain(_copies(r.get("copies") or {})))
        o.out.print(table)
    job_list(listing.get("jobs") or [], o)
    for d in listing.get("damaged", []):     # not listed above: each says why (gpusnap verify tells more)
        o.err.print(f"damaged: {d['reason']}", markup=False)
    if totals["snapshots"]:
        ratio = f" ({totals['ratio']:.1%} of what CRIU produced)" if totals.get("ratio") else ""
        o.err.print(f"{totals['snapshots']} snapshot(s) of {totals['names']} name(s): "
                    f"{human_bytes(totals['bytes_raw'])} from CRIU, {human_bytes(totals['bytes_stored'])} "
                    f"in the repository{ratio}", markup=False)


def _copies(c: dict[str, Any]) -> str:
    """ls's copies column: local only, copied to X, or not copied to X yet."""
    if c.get("pending_to"):
        return "not copied yet: " + ", ".join(p["to"] for p in c["pending_to"])
    if c.get("copied_to"):
        return "copied: " + ", ".join(p["to"] for p in c["copied_to"])
    return "local only"


def job_list(jobs: list[dict[str, Any]], o) -> None:
    """The named jobs of `gpusnap ls`: which PID carries each name now (after restores, forks)."""
    if not jobs:
        return
    from rich.table import Table

    table = Table(box=None)
    for col in ("job", "PID", "state", "restored", "fork of"):
        table.add_column(col)
    for j in jobs:
        table.add_row(plain(j["name"]), str(j["pid"]), "running" if j["running"] else "gone",
                      f"{j['restores']}x" if j["restores"] else "-", plain(j["forked_from"] or "-"))
    o.out.print(table)


def exported(result: dict[str, Any], o, to_stdout: bool) -> None:
    if not to_stdout:   # with -o - stdout carries the export itself
        o.out.print(f"{result['file']}: {result['name']} ({result['id']}), {human_bytes(result['bytes'])} "
                    f"for {human_bytes(result['bytes_raw'])} from CRIU", markup=False)


def imported(result: dict[str, Any], o) -> None:
    o.out.print(result["snapshot"], markup=False)


def copied(result: dict[str, Any], o) -> None:
    """One line per snapshot (the destination's directory first, as import prints it), then the sum."""
    for s in result["snapshots"]:
        if s["already_present"]:
            o.out.print(f"{s['snapshot']}: already there ({s['name']}, {s['source_id']}), skipped", markup=False)
        else:
            o.out.print(f"{s['snapshot']}: {s['name']} ({s['source_id']} -> {s['id']}), "
                        f"{human_bytes(s['bytes_sent'])} sent for {human_bytes(s['bytes_raw'])} from CRIU", markup=False)
    o.out.print(f"{result['copied']} copied, {result['skipped']} already there; {human_bytes(result['bytes_sent'])} "
                f"sent in {result['seconds']:.1f} s", markup=False)


# ---------------------------------------------------------------- inspect

def snapshot_stats(r: dict[str, Any], console, images: bool = True) -> None:
    """The page statistics of one snapshot (repo.maint.usage.inspect_snapshot's report)."""
    console.print(plain(f"snapshot {r['snapshot']}  id {r['id']}  name {r['name']}"))
    console.print(f"pages: {r['pages_total']} total, {r['pages_zero']} zero, {r['pages_dedup']} deduplicated, "
                  f"{r['pages_compressed']} compressed, {r['pages_raw']} raw")
    ratio = r["bytes_stored"] / r["bytes_raw"] if r["bytes_raw"] else 0
    console.print(f"bytes: {human_bytes(r['bytes_raw'])} from CRIU, {human_bytes(r['bytes_stored'])} stored "
                  f"by this dump ({ratio:.1%}); now {human_bytes(r['bytes_unique'])} unique, "
                  f"{human_bytes(r['bytes_shared'])} shared")
    meta = r.get("meta") or {}
    if meta.get("dump_seconds") is not None:
        frozen = meta.get("frozen_seconds")
        console.print(f"dump: {meta['dump_seconds']:.2f} s until stored"
                      + (f", of which the job stood frozen {frozen:.2f} s" if frozen is not None else ""))
    tp = meta.get("throughput") or {}
    if tp.get("dump_mb_s") is not None:
        def mbs(v):
            return f"{v:.0f} MB/s" if v is not None else "-"
        spill = (f"; {human_bytes(tp['spilled_bytes'])} spilled ({tp.get('spill_mode')})"
                 if tp.get("spilled_bytes") else "")
        if tp.get("arena_short"):
            spill += f"; memory running out, the arena {tp['arena_short']}"
        console.print(f"throughput: {mbs(tp.get('criu_mb_s'))} from CRIU into staging, "
                      f"{mbs(tp.get('storing_mb_s'))} storing after CRIU, {mbs(tp['dump_mb_s'])} over the dump; "
                      f"staging budget {human_bytes(tp.get('staging_budget') or 0)} ({tp.get('budget_choice')}){spill}")
    for im in r["images"] if images else []:
        if im["type"] == "pages":
            console.print(plain(f"  {im['name']}: {human_bytes(im['size'])}, {im['pages']} pages "
                                f"({im['pages_zero']} zero, {im['pages_dedup']} dedup, "
                                f"{im['pages_compressed']} compressed, {im['pages_raw']} raw)"))
        else:
            console.print(plain(f"  {im['name']}: {human_bytes(im['size'])}"))


def recorded_gpus(d: dict[str, Any] | None, console) -> None:
    """A snapshot's GPU section (gpu.procs.describe_recorded's form)."""
    if d is None:
        console.print("GPU: none recorded (a CPU-only snapshot, or dumped without an NVIDIA driver)")
        return
    from rich.table import Table

    console.print(f"GPU: NVIDIA driver {d['driver_version'] or '?'}, CUDA {d['cuda_version'] or '?'}")
    t = Table(show_header=True, header_style="bold")
    for col in ("#", "GPU", "memory", "UUID", "used by"):
        t.add_column(col)
    for g in d["gpus"]:
        by = [str(p["pid"]) for p in d["processes"] if g["uuid"] in p["gpus"]]
        t.add_row(str(g["index"]), g["name"] or "?", human_bytes(g["memory_bytes"]), g["uuid"] or "?",
                  ", ".join(by) or "-")
    console.print(t)


def inspect(report: dict[str, Any], o, images: bool = False) -> None:
    """`gpusnap inspect`: statistics, processes, open files, sockets, GPUs (ops.inspect.s report)."""
    from rich.table import Table
    from rich.text import Text

    console = o.out
    snapshot_stats(report, console, images=images)
    if report.get("container"):
        c = report["container"]
        console.print(plain(f"container: {c['engine']} {c['name']} ({c['id'][:12]}), image {c['image'] or '-'}; "
                            f"`gpusnap restore` hands it back to {c['engine'].capitalize()}"))
    table = Table(title="processes", box=None, title_justify="left")
    for col in ("pid", "ppid", "command", "threads", "memory", "GPU", "cwd"):
        table.add_column(col, justify="right" if col in ("pid", "ppid", "threads", "memory") else "left")
    for p in report.get("processes", []):
        cmd = " ".join(p["cmdline"]) if p.get("cmdline") else p["comm"]
        table.add_row(str(p["pid"]), str(p["ppid"]), plain(cmd), str(p["threads"]),
                      human_bytes(p["memory_bytes"]), "CUDA" if p["cuda"] else "", plain(p.get("cwd") or ""))
    console.print(table)
    files = report.get("files", [])
    if files:
        ft = Table(title="open files", box=None, title_justify="left")
        for col in ("path", "mode", "access", "size", "on disk now"):
            ft.add_column(col, justify="right" if col == "size" else "left")
        for f in files:
            status = f.get("now_status", "")
            style = {"ok": "green", "missing": "red", "differs": "red"}.get(status, "yellow")
            ft.add_row(plain(f["path"]), f.get("mode") or "", f.get("access", ""),
                       human_bytes(f["size"]) if f.get("size") is not None else "-",
                       Text(f"{status} {f.get('now_detail', '')}".strip(), style=style))
        console.print(ft)
    socks = report.get("sockets", [])
    if socks:
        st = Table(title="sockets", box=None, title_justify="left")
        for col in ("pid", "fd", "family", "address", "peer"):
            st.add_column(col)
        for s in socks:
            st.add_row(str(s["pid"]), str(s["fd"]), s.get("family", ""), plain(s.get("address", "")),
                       plain(s.get("peer_address", s.get("peer", ""))))
        console.print(st)
    if report.get("gpu"):
        recorded_gpus(report["gpu"], console)
    else:
        console.print("GPU: none recorded (a CPU-only job)")
    term = report.get("terminal")
    if term:       # what a restore will do with the job's terminal (system/terminal.outlook)
        console.print(f"terminal: {term['had']}", markup=False)
        console.print(f"  {term['terminal']}", markup=False)
        console.print(f"  {term['no_terminal']}", markup=False)
    ns = report.get("netns")
    if ns:         # a named network namespace (restore_needs.netns_outlook)
        style = {"same": "", "made again": "yellow"}.get(ns["status"], "red")
        console.print(Text(f"network namespace: {ns['path'] or '?'} ({ns['status']}): {ns['detail']}", style=style))
    changed = report.get("files_changed") or []
    checks = {c["path"]: c for c in report.get("file_checks") or []}
    for c in checks.values():       # restore_files.check's verdicts: what restore then does
        if c["verdict"] != "refused":
            console.print(Text(f"restore: {c['detail']}", style="yellow"))
    if changed:
        console.print(Text(f"restore will fail until these files are as they were at the dump: "
                           f"{', '.join(changed)}", style="bold red"))
        for p in changed:
            if p in checks:
                console.print(Text(f"  {checks[p]['detail']}", style="red"))
    if report.get("file_check_error"):
        console.print(Text(f"restore will refuse this snapshot: {report['file_check_error']}", style="bold red"))
