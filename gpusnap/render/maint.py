"""Human text of the maintenance commands: verify, repair, prune and forget.

The reports (repo.maint.verify.VerifyReport, repo.maint.repair.RepairReport, prune's
PruneResult, ops.forget.ForgetResult) keep only their data; the sentences are made here.
`*_lines()` return the lines (also used for error messages), the others print them.
"""

from __future__ import annotations

from gpusnap.render import human_bytes


# ---------------------------------------------------------------- verify

def verify_summary(report) -> str:
    """One sentence: all good, or how many problems and which snapshots they affect."""
    if report.ok:
        read = f", {human_bytes(report.bytes_read)} read back" if report.read_data else " (structure only)"
        return (f"verified {len(report.snapshots_checked)} snapshot(s), {report.packs_checked} pack(s)"
                f"{read}: all good")
    return report.damage()


def verify_lines(report) -> list[str]:
    return ([f"{p.scope} {p.name}: {p.message}" for p in report.problems]
            + [f"note: {n}" for n in report.notes] + [verify_summary(report)])


def verify(report, o) -> None:
    console = o.out if report.ok else o.err
    for line in verify_lines(report):
        console.print(line, markup=False)


# ---------------------------------------------------------------- repair

def repair_lines(report) -> list[str]:
    would = "would " if report.dry_run else ""
    out = list(report.problems)
    if report.changed:
        out.append(f"{would}write index/{report.index_written}: {report.blobs_indexed} blob(s) "
                   f"({report.blobs_recovered} not indexed before)")
        out += [f"{would}remove index/{n} (superseded)" for n in report.index_removed]
        out += [f"{would}move index/{n} to {report.QUARANTINE}/ (damaged or naming missing data)"
                for n in report.index_quarantined]
        if report.records_dropped:
            out.append(f"{report.records_dropped} index record(s) name data that is in no pack")
    else:
        out.append("the index agrees with the packs: nothing to repair")
    damaged = report.snapshots_damaged
    out += [f"snapshot {n} is damaged: {why}" for n, why in sorted(damaged.items())]
    out.append(f"{report.packs_scanned} pack(s) scanned ({report.packs_confirmed} confirmed by name, "
               f"{report.packs_rehashed} read back), {report.blobs_damaged} damaged blob(s); "
               + (f"damaged snapshots: {', '.join(sorted(damaged))}" if damaged
                  else "every snapshot has all its data"))
    return out


def repair(report, o) -> None:
    console = o.out if report.ok else o.err
    for line in repair_lines(report):
        console.print(line, markup=False)


# ---------------------------------------------------------------- prune and forget

def prune_lines(data: dict) -> list[str]:
    """Prune's result (PruneResult, a dict): a dry run prints its plan (every snapshot and pack
    that would not be kept, and the totals); a real run what went and what it freed."""
    if data.get("dry_run") and "plan" in data:
        p = data["plan"]
        out = [f"would delete snapshot {n}" for n in p["snapshots_remove"]]
        for d in p["packs"]:
            if d["action"] != "keep":
                out.append(f"would {d['action']} pack {d['pack'][:16]} ({d['why']}): {human_bytes(d['size'])}, "
                           f"used {human_bytes(d['used'])}")
        t = p["totals"]
        out.append(f"kept {len(p['snapshots_keep'])} snapshot(s); packs: keep {t['packs_keep']}, rewrite "
                   f"{t['packs_rewrite']} ({human_bytes(t['to_rewrite'])} to copy), delete {t['packs_delete']}; "
                   f"used {human_bytes(t['used'])}, unused {human_bytes(t['unused'])}; "
                   f"would free {human_bytes(t['to_free'])}")
        return out
    out = [f"deleted snapshot {n}" for n in data.get("snapshots_deleted", [])]
    out.append(f"kept {len(data.get('snapshots_kept', []))} snapshot(s); packs deleted: "
               f"{data.get('packs_deleted', 0)}, rewritten: {data.get('packs_rewritten', 0)}; "
               f"freed {human_bytes(data.get('bytes_freed', 0))}")
    return out


def prune(result, o) -> None:
    from gpusnap.render.output import to_data

    data = to_data(result)
    for line in prune_lines(data):
        o.out.print(line, markup=False)
    for why in data.get("unreadable", []):
        o.warn(f"left alone: {why}")
    if data.get("data_kept"):
        o.warn(f"{data['data_kept']} (`gpusnap forget DIR` drops a snapshot beyond repair)")
    for note in data.get("notes", []):
        o.out.print(note, markup=False)


def forget_lines(result) -> list[str]:
    verb = "would forget" if result.dry_run else "forgot"
    out = [f"{verb} {f['dir']}" for f in result.forgotten]
    if not result.forgotten:
        out.append("nothing to forget")
    out.append(f"{len(result.kept)} snapshot(s) kept")
    if result.prune is not None:
        p = result.prune
        out.append(f"{'would free' if result.dry_run else 'freed'} {human_bytes(p.get('bytes_freed', 0))} "
                   f"({p.get('packs_deleted', 0)} packs deleted, {p.get('packs_rewritten', 0)} rewritten)")
    elif result.forgotten and not result.dry_run:
        out.append("their data stays until `gpusnap prune` (or use `forget --prune`)")
    return out + list(result.notes)


def forget(result, o) -> None:
    for line in forget_lines(result):
        o.out.print(line, markup=False)
