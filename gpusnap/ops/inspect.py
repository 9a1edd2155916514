"""What `gpusnap inspect` shows, in the spirit of `checkpointctl inspect`: what decides
whether a restore will work. Processes with their command lines and working directories,
open files (size and mode at dump time, and whether the file on disk still matches), sockets,
GPU facts recorded at dump, and the repository's page statistics and sizes.

CRIU's images are decoded with pycriu (criu/images.py) from the snapshot itself, so nothing in
them is trusted: a malformed image is reported as unreadable rather than crashing the command.
The report is data (what `inspect --json` prints); render.snapshots.inspect makes the text.
"""

from __future__ import annotations

import os
import stat
from typing import Any

from gpusnap.criu import images
from gpusnap.system import engines

PAGE = 4096
PE_PRESENT = 1 << 2            # pagemap entry flag: its pages are in the pages image
CMDLINE_READ_LIMIT = 256 << 20  # read a pages image for command lines only up to this size
O_ACCMODE, O_APPEND = 0o3, 0o2000


def _read_memory(snap, pagemap: list[dict], ranges: list[tuple[int, int]]) -> list[bytes | None]:
    """The bytes of each virtual address range [start, end) from the process's pages image
    (one pass over the image; None for a range not fully dumped)."""
    if not pagemap or not ranges:
        return [None] * len(ranges)
    image = f"pages-{pagemap[0].get('pages_id')}.img"
    if not snap.has_image(image) or snap.image(image).get("size", 0) > CMDLINE_READ_LIMIT:
        return [None] * len(ranges)
    # where each wanted page lies in the pages image
    want: dict[int, int] = {}          # image offset -> vaddr of that page
    off = 0
    for e in pagemap[1:]:
        n = int(e.get("nr_pages", 0))
        if int(e.get("flags", 0)) & PE_PRESENT:
            va = int(e["vaddr"])
            for a, b in ranges:
                first = max(a & ~(PAGE - 1), va)
                last = min(b, va + n * PAGE)
                p = first
                while p < last:
                    want[off + (p - va)] = p
                    p += PAGE
            off += n * PAGE
    pages: dict[int, bytes] = {}
    if want:
        pos = 0
        try:
            for chunk in snap.read_image(image):
                end = pos + len(chunk)
                for o in [o for o in want if pos <= o < end]:
                    pages[want.pop(o)] = bytes(chunk[o - pos:o - pos + PAGE])
                pos = end
                if not want:
                    break
        except Exception:  # noqa: BLE001 - a damaged image: no command line, not a crash
            pass
    out = []
    for a, b in ranges:
        parts = []
        p = a & ~(PAGE - 1)
        while p < b:
            if p not in pages:
                parts = None
                break
            parts.append(pages[p])
            p += PAGE
        out.append(b"".join(parts)[a - (a & ~(PAGE - 1)):][: b - a] if parts is not None else None)
    return out


def _file_now(path: str, mode: int | None, size: int | None, flags: int) -> dict[str, Any]:
    """Does the file on disk still match what the snapshot recorded?"""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return {"status": "missing", "detail": "gone from the disk: restore will fail"}
    except OSError as e:
        return {"status": "unknown", "detail": e.strerror}
    if mode is not None and stat.S_IFMT(st.st_mode) != stat.S_IFMT(mode):
        return {"status": "differs", "detail": "now a different kind of file"}
    if mode is not None and stat.S_IMODE(st.st_mode) != stat.S_IMODE(mode):
        return {"status": "differs", "detail": f"mode now {stat.filemode(st.st_mode)}"}
    if size is not None and stat.S_ISREG(st.st_mode) and st.st_size != size:
        return {"status": "differs", "detail": f"size now {st.st_size} (CRIU refuses a regular file whose "
                                               "size changed)"}
    return {"status": "ok", "detail": ""}


def _ip(words) -> str:
    """CRIU's address: u32 words holding the address bytes in network order."""
    import ipaddress
    import struct

    try:
        raw = b"".join(struct.pack("<I", int(w)) for w in words or [])
        if len(raw) == 4:
            return str(ipaddress.IPv4Address(raw))
        if len(raw) == 16:
            a = ipaddress.IPv6Address(raw)
            return f"[{a.ipv4_mapped or a}]"
    except (ValueError, struct.error):
        pass
    return "*"


def _describe_file(e: dict) -> dict[str, Any]:
    """One entry of files.img in plain terms."""
    t = e.get("type", "?")
    if t == "REG":
        r = e.get("reg", {})
        mode = r.get("mode")
        flags = int(r.get("flags", 0))
        acc = {0: "r", 1: "w", 2: "rw"}.get(flags & O_ACCMODE, "?") + ("a" if flags & O_APPEND else "")
        row = {"kind": "file", "path": r.get("name", "?"), "size": r.get("size"), "pos": r.get("pos"),
               "mode": stat.filemode(mode) if mode is not None else None, "access": acc}
        if mode is not None and stat.S_ISDIR(mode):
            row["kind"] = "directory"
        row.update({"now_" + k: v for k, v in _file_now(row["path"], mode, r.get("size"), flags).items()})
        return row
    if t == "UNIXSK":
        u = e.get("usk", {})
        name = u.get("name")
        if isinstance(name, (bytes, bytearray)):
            name = name.decode(errors="replace")
        return {"kind": "socket", "family": "unix", "type": u.get("type"), "state": u.get("state"),
                "address": name or "", "peer": u.get("peer", 0)}
    if t == "INETSK":
        i = e.get("isk", {})
        fam = {2: "inet", 10: "inet6"}.get(i.get("family"), str(i.get("family")))
        src, dst = _ip(i.get("src_addr")), _ip(i.get("dst_addr"))
        return {"kind": "socket", "family": fam, "type": i.get("type"), "proto": i.get("proto"),
                "state": i.get("state"), "address": f"{src}:{i.get('src_port', 0)}",
                "peer_address": f"{dst}:{i.get('dst_port', 0)}"}
    if t == "PIPE":
        return {"kind": "pipe", "pipe_id": e.get("pipe", {}).get("pipe_id")}
    return {"kind": t.lower()}


def processes(snap) -> list[dict[str, Any]]:
    """One row per process: pid, ppid, command (name and line), cwd, threads, memory in the
    image, and its open file descriptors."""
    tree = images.decoded(snap, "pstree.img") or []
    files = {int(e.get("id", -1)): e for e in (images.decoded(snap, "files.img") or [])}
    described: dict[int, dict] = {}

    def fdesc(fid: int) -> dict:
        if fid not in described:
            described[fid] = _describe_file(files[fid]) if fid in files else {"kind": "unknown"}
        return described[fid]

    meta = snap.manifest.get("meta", {})
    rows = []
    for e in tree:
        pid = int(e.get("pid", 0))
        core = images.decoded(snap, f"core-{pid}.img") or [{}]
        comm = core[0].get("tc", {}).get("comm", "?")
        pagemap = images.decoded(snap, f"pagemap-{pid}.img") or []
        pages = sum(int(x.get("nr_pages", 0)) for x in pagemap[1:])
        ids = (images.decoded(snap, f"ids-{pid}.img") or [{}])[0]
        fs = (images.decoded(snap, f"fs-{pid}.img") or [{}])[0]
        mm = (images.decoded(snap, f"mm-{pid}.img") or [{}])[0]
        cmdline, cmdline_from = None, None
        if mm.get("mm_arg_end", 0) > mm.get("mm_arg_start", 0):
            raw = _read_memory(snap, pagemap, [(int(mm["mm_arg_start"]), int(mm["mm_arg_end"]))])[0]
            if raw is not None:
                if raw[-1:] not in (b"", b"\0"):   # rewritten (setproctitle): up to its first NUL, as ps shows it
                    raw = raw.split(b"\0", 1)[0]
                cmdline = [a.decode(errors="replace") for a in raw.rstrip(b"\0").split(b"\0")]
                cmdline_from = "memory"
        if cmdline is None and pid == meta.get("pid") and meta.get("cmdline"):
            # too big to read here (CMDLINE_READ_LIMIT): the line recorded at dump, one string
            cmdline, cmdline_from = [meta["cmdline"]], "dump"
        fds = []
        fdinfo = images.decoded(snap, f"fdinfo-{ids.get('files_id')}.img") if "files_id" in ids else None
        for fd in fdinfo or []:
            fds.append({"fd": int(fd.get("fd", -1)), **fdesc(int(fd.get("id", -1)))})
        cwd = fdesc(int(fs["cwd_id"])).get("path") if "cwd_id" in fs else None
        root = fdesc(int(fs["root_id"])).get("path") if "root_id" in fs else None
        cuda = pid in (meta.get("cuda_pids") or [])
        rows.append({"pid": pid, "ppid": int(e.get("ppid", 0)), "pgid": e.get("pgid"), "sid": e.get("sid"),
                     "comm": comm, "cmdline": cmdline, "cmdline_from": cmdline_from, "cwd": cwd, "root": root,
                     "threads": len(e.get("threads", [])) or 1, "memory_bytes": pages * PAGE,
                     "pages_image": f"pages-{pagemap[0].get('pages_id')}.img" if pagemap else None,
                     "cuda": cuda, "fds": fds})
    return rows


def describe(repository, snap) -> dict[str, Any]:
    from gpusnap.gpu import procs as gpu_procs
    from gpusnap.repo.maint import usage as repo_inspect

    report = repo_inspect.inspect_snapshot(repository, snap)
    report["processes"] = processes(snap)
    meta = snap.manifest.get("meta", {})
    report["command"] = meta.get("cmdline")
    report["gpu"] = gpu_procs.describe_recorded(meta.get("gpu"))
    # every distinct open file and socket once (checkpointctl's --files / --sockets views)
    seen_files: dict[str, dict] = {}
    sockets = []
    for p in report["processes"]:
        for fd in p["fds"]:
            if fd["kind"] in ("file", "directory"):
                seen_files.setdefault(fd["path"], {k: v for k, v in fd.items() if k != "fd"})
            elif fd["kind"] == "socket":
                sockets.append({"pid": p["pid"], **fd})
    report["files"] = list(seen_files.values())
    report["sockets"] = sockets
    if isinstance(meta.get("container"), dict):     # `dump --container`: its paths are the container's
        report["container"] = {k: str(meta["container"].get(k, "")) for k in ("engine", "id", "name", "image")}
        for f in report["files"]:
            f["now_status"] = "container"
            f["now_detail"] = f"in the container's own root: {engines.title(report['container']['engine'])} restores it"
        report["file_checks"], report["files_changed"] = [], []
    else:
        _restore_verdict(snap, report)
    report["terminal"] = _terminal(snap)
    report["netns"] = _netns(snap)
    return report


def _netns(snap) -> dict | None:
    """The named network namespace the job ran in, and what a restore does with it now."""
    from gpusnap.errors import GpusnapError
    from gpusnap.ops import restore_needs

    try:
        return restore_needs.netns_outlook(snap)
    except GpusnapError as e:       # a malformed record: restore refuses it too
        return {"path": None, "name": None, "status": "malformed", "detail": e.message}


def _restore_verdict(snap, report: dict[str, Any]) -> None:
    """What restore will do with each file: restore_files.check decides, for restore and here
    alike. `file_checks`: every file it would set aside, leave or refuse, with the reason;
    `files_changed`: the files that make the restore fail (refused, or gone: CRIU reopens
    every file and directory by its path)."""
    from gpusnap.errors import GpusnapError
    from gpusnap.ops import restore_files

    try:
        checks = restore_files.check(snap)
    except GpusnapError as e:       # a damaged files image: say so, restore will refuse it too
        report["file_checks"] = []
        report["files_changed"] = []
        report["file_check_error"] = e.message
        return
    by_path = {c.path: c for c in checks}
    for f in report["files"]:
        c = by_path.get(f["path"])
        if c is None or c.verdict == restore_files.OK:
            continue
        if c.verdict in (restore_files.SET_ASIDE, restore_files.LEFT):
            f["now_status"] = "grew"
        f["now_detail"] = c.detail
    report["file_checks"] = [{"path": c.path, "verdict": c.verdict, "detail": c.detail, "size": c.size, "now": c.now}
                             for c in checks if c.verdict != restore_files.OK]
    gone = [f["path"] for f in report["files"] if f["path"] not in by_path and f.get("now_status") == "missing"]
    for p in report["processes"]:       # a working directory gone: CRIU cannot restore the process
        if p.get("cwd") and p["cwd"] not in gone and not os.path.lexists(p["cwd"]):
            gone.append(p["cwd"])
    report["files_changed"] = [c.path for c in checks if c.verdict == restore_files.REFUSED] + gone


def _terminal(snap) -> dict[str, str] | None:
    """What a restore will do with the job's terminal (the rule restore applies), or None."""
    from gpusnap.errors import CorruptSnapshot
    from gpusnap.ops.restore import terminals
    from gpusnap.system import terminal

    try:
        held = terminals(snap)
    except CorruptSnapshot:
        return None
    return terminal.outlook(held, terminal.next_session(snap.name)) or None
