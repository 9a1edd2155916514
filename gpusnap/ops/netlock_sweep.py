"""Which of CRIU's network-lock rules a repository's snapshots still need; the rest are lifted.

A committed `dump --exit` snapshot of a job with TCP connections keeps CRIU's lock rules on
them (gpusnap/criu/netlock_rules.py): the peer must see no reset until a restore brings the
connections back. Once no snapshot that could restore them is left (forget, prune, a dump's
--keep-last), nothing needs them, and they are lifted. A rule that no snapshot of the
repository needs is "stale": `doctor` lists such rules, and `doctor --unlock-network` lifts
them. The rule is per repository: a rule that a snapshot in another repository needs looks
stale from this one, which doctor says.
"""

from __future__ import annotations

from typing import Any, Iterable

from gpusnap.criu import netlock_rules


def _exit_conns(snaps: Iterable[Any]) -> dict[tuple, tuple[dict[str, Any], str]]:
    """The connections that `--exit` snapshots among `snaps` hold locked: key → (conn, snapshot)."""
    out: dict[tuple, tuple[dict[str, Any], str]] = {}
    for s in snaps:
        try:
            meta = s.manifest.get("meta") or {}
        except (AttributeError, TypeError):
            continue
        if not isinstance(meta, dict) or meta.get("leave_running") is not False:
            continue
        for c in meta.get("tcp") or []:
            k = netlock_rules.key(c) if isinstance(c, dict) else None
            if k is not None:
                out.setdefault(k, (c, s.path.name))
    return out


def after_removal(before: list, after: list) -> list[str]:
    """Lift the lock rules of connections that only removed snapshots needed. `before` and
    `after`: the repository's snapshots around the removal. Notes for the user (none when
    there was nothing to lift)."""
    kept = {s.path.name for s in after}
    gone = _exit_conns(s for s in before if s.path.name not in kept)
    if not gone:
        return []
    still = _exit_conns(after)
    lift = {k: c for k, (c, _) in gone.items() if k not in still}
    if not lift:
        return []
    here = {netlock_rules.key(c) for c in netlock_rules.present()}
    lift = {k: c for k, c in lift.items() if k in here}
    if not lift:
        return []
    failed = netlock_rules.lift(lift.values())
    notes = [f"lifted CRIU's network lock on {len(lift) - len(failed)} connection(s) that only the "
             "removed snapshots needed"] if len(failed) < len(lift) else []
    if failed:
        notes.append(f"could not lift CRIU's network lock on {', '.join(failed)}")
    return notes


def _in_dump(conns: list[dict[str, str]]) -> set[tuple]:
    """The connections whose socket a stopped or traced process holds: a dump in progress
    (CRIU working, or a `--exit` tree waiting for its commit) locked them rightly."""
    from gpusnap.system import proc, sockets

    rows = sockets.host_tcp()
    want = {netlock_rules.key(c) for c in conns}
    inodes = {r["inode"]: k for r in rows if r["inode"] and (k := netlock_rules.key(r)) in want}
    busy = set()
    for ino, (pid, _) in sockets.who_holds(set(inodes)).items():
        st = proc.read_stat(pid)
        if st is not None and (st.state in ("T", "t") or proc.tracer(pid)):
            busy.add(inodes[ino])
    return busy


def survey(repo) -> tuple[list[tuple[dict[str, str], str]], list[dict[str, str]], list[dict[str, str]]]:
    """(rules held for a snapshot of `repo`: (conn, snapshot dir), stale rules, rules of a
    dump in progress)."""
    present = netlock_rules.present()
    if not present:
        return [], [], []
    needed = _exit_conns(repo.snapshots()) if repo is not None else {}
    held, loose = [], []
    for c in present:
        hit = needed.get(netlock_rules.key(c))
        if hit:
            held.append((c, hit[1]))
        else:
            loose.append(c)
    busy = _in_dump(loose) if loose else set()
    return (held, [c for c in loose if netlock_rules.key(c) not in busy],
            [c for c in loose if netlock_rules.key(c) in busy])


def unlock_stale(repo) -> tuple[list[dict[str, str]], list[str]]:
    """`doctor --unlock-network`: lift every stale rule (never those of a dump in progress).
    -> (lifted, could not)."""
    _, stale, _ = survey(repo)
    if not stale:
        return [], []
    return stale, netlock_rules.lift(stale)


def describe(c: dict[str, str]) -> str:
    return f"{c['local']}→{c['remote']}"
