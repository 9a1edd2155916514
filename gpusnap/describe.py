"""What `gpusnap inspect` shows: the repository's page statistics for a snapshot, plus the
processes decoded from CRIU's own images (with pycriu) and the GPU facts recorded at dump.

Images come from the snapshot itself, so nothing in them is trusted: a malformed image is
reported as unreadable rather than crashing the command.
"""

from __future__ import annotations

from typing import Any


def _load(snap, name: str) -> list[dict] | None:
    import pycriu.images

    if not snap.has_image(name):
        return None
    try:
        return pycriu.images.loads(b"".join(snap.read_image(name)))["entries"]
    except Exception:  # noqa: BLE001 - data from disk; report, never crash
        return None


def processes(snap) -> list[dict[str, Any]]:
    """One row per process: pid, ppid, command name, threads, resident pages in the image."""
    tree = _load(snap, "pstree.img") or []
    rows = []
    for e in tree:
        pid = int(e.get("pid", 0))
        core = _load(snap, f"core-{pid}.img") or [{}]
        comm = core[0].get("tc", {}).get("comm", "?")
        pagemap = _load(snap, f"pagemap-{pid}.img") or []
        pages = sum(int(x.get("nr_pages", 0)) for x in pagemap[1:])
        cuda = pid in (snap.manifest.get("meta", {}).get("cuda_pids") or [])
        rows.append({"pid": pid, "ppid": int(e.get("ppid", 0)), "comm": comm,
                     "threads": len(e.get("threads", [])) or 1, "memory_bytes": pages * 4096,
                     "pages_image": f"pages-{pagemap[0].get('pages_id')}.img" if pagemap else None,
                     "cuda": cuda})
    return rows


def describe(repository, snap) -> dict[str, Any]:
    from gpusnap.gpu import procs as gpu_procs
    from gpusnap.repo import inspect as repo_inspect

    report = repo_inspect.inspect_snapshot(repository, snap)
    report["processes"] = processes(snap)
    meta = snap.manifest.get("meta", {})
    report["command"] = meta.get("cmdline")
    report["gpu"] = gpu_procs.describe_recorded(meta.get("gpu"))
    return report


def render(report: dict[str, Any], console) -> None:
    from rich.table import Table

    from gpusnap.gpu import procs as gpu_procs
    from gpusnap.repo import inspect as repo_inspect

    repo_inspect.render(report, console)
    if report.get("command"):
        console.print(f"command: {report['command']}")
    table = Table(title="processes", box=None, title_justify="left")
    for col in ("pid", "ppid", "command", "threads", "memory", "GPU"):
        table.add_column(col, justify="right" if col in ("pid", "ppid", "threads", "memory") else "left")
    for p in report.get("processes", []):
        table.add_row(str(p["pid"]), str(p["ppid"]), p["comm"], str(p["threads"]),
                      f"{p['memory_bytes'] / (1 << 20):.1f} MiB", "CUDA" if p["cuda"] else "")
    console.print(table)
    if report.get("gpu"):
        gpu_procs.render_recorded(report["gpu"], console)
    else:
        console.print("GPU: none recorded (a CPU-only job)")
