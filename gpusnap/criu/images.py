"""The one reader of CRIU's image files (images/*.proto) for every part of gpusnap that looks
inside a snapshot's images: the process tree, memory mappings and pagemaps, regular files and
their remaps, CRIU's dump statistics, the fields of any other image (criu/ttyinfo.py), and
whole images decoded for `inspect`.

Read at the protobuf wire level (criu/pbwire.py): pycriu is imported only by `decoded`, which
needs its full decoding, because its import alone costs 0.06-0.1 s, more than reading the
images a restore needs. Nothing read from an image is trusted: each is checked to be of the
kind expected (its magic), lengths are bounds-checked, and a malformed image raises
ValueError (`decoded`: gives None).
"""

from __future__ import annotations

import re
from typing import Any, Iterator

from gpusnap.criu import pbwire

# images/magic.h: the magic word of each kind of image read here
PSTREE_MAGIC = 0x50273030
MM_MAGIC = 0x57492820
PAGEMAP_MAGIC = 0x56084025
FILES_MAGIC = 0x56303138
REG_FILES_MAGIC = 0x50363636
REMAP_FPATH_MAGIC = 0x59133954
TTY_INFO_MAGIC = 0x59453036
STATS_MAGIC = 0x57093306

# criu/include/pagemap.h: PagemapEntry.flags
PE_PARENT, PE_LAZY, PE_PRESENT = 1, 2, 4
FD_TYPE_REG, FD_TYPE_INETSK, FD_TYPE_UNIXSK = 1, 4, 5   # images/fdinfo.proto fd_types

_PAGEMAP_NAME = re.compile(r"pagemap-(\d+)\.img")


def _int(f: dict, num: int, default: int | None = None) -> int:
    """Field `num` of a decoded message, which must be a number (a length-delimited value
    where a number belongs would otherwise reach arithmetic, or bytes(n) allocate n bytes)."""
    v = f.get(num, default)
    if not isinstance(v, int):
        raise ValueError(f"field {num} missing or not a number")
    return v


def _opt(f: dict, num: int) -> int | None:
    return _int(f, num) if num in f else None


def _bytes(f: dict, num: int) -> bytes | None:
    v = f.get(num)
    if v is not None and not isinstance(v, bytes):
        raise ValueError(f"field {num} is not a message or string")
    return v


def read(snap, name: str) -> bytes:
    """The bytes of image `name` of `snap`."""
    return b"".join(snap.read_image(name))


def fields(msg: bytes) -> dict[int, Any]:
    """A message as {field number: value} (the last of a repeated field, as protobuf reads a
    scalar given twice)."""
    return dict(pbwire.fields(msg))


def entries(raw: bytes, magic: int) -> Iterator[dict[int, Any]]:
    """Each entry of an image of kind `magic`, as `fields` gives it."""
    for msg in pbwire.entries(raw, magic):
        yield fields(msg)


def pagemaps(snap) -> Iterator[tuple[str, int]]:
    """(image name, PID) of every pagemap image of `snap`."""
    for name in snap.image_names():
        m = _PAGEMAP_NAME.fullmatch(name)
        if m:
            yield name, int(m.group(1))


def pstree(raw: bytes) -> Iterator[dict]:
    """pid, pgid and threads of each process of a pstree image (images/pstree.proto), in order."""
    for msg in pbwire.entries(raw, PSTREE_MAGIC):
        pid = pgid = None
        threads: list[int] = []
        for num, v in pbwire.fields(msg):
            if num == 1:
                pid = v
            elif num == 3:
                pgid = v
            elif num == 5:              # repeated uint32: one field each, or packed
                threads.extend(pbwire.packed(v) if isinstance(v, bytes) else [v])
        if not isinstance(pid, int):
            raise ValueError("process tree entry without a PID")
        yield {"pid": pid, "pgid": pgid, "threads": threads}


def vmas(raw: bytes) -> list[dict]:
    """start, end, flags, status of every VMA of an mm image (images/mm.proto: vmas = 14,
    images/vma.proto)."""
    out = []
    for msg in pbwire.entries(raw, MM_MAGIC):
        for num, v in pbwire.fields(msg):
            if num == 14:
                if not isinstance(v, bytes):
                    raise ValueError("a VMA that is not a message")
                f = fields(v)
                out.append({"start": _int(f, 1), "end": _int(f, 2), "flags": _int(f, 6), "status": _int(f, 7)})
    return out


def pagemap(raw: bytes) -> tuple[int, list[dict]]:
    """pages_id and entries (vaddr, nr_pages, flags, has_flags) of a pagemap image
    (images/pagemap.proto: a pagemap_head, then pagemap_entry each)."""
    msgs = pbwire.entries(raw, PAGEMAP_MAGIC)
    head = fields(next(msgs))
    out = []
    for m in msgs:
        f = fields(m)
        if 3 in f and _int(f, 3):         # in_parent: the pages are in a parent image
            f[4] = _int(f, 4, 0) | PE_PARENT
        out.append({"vaddr": _int(f, 1), "nr_pages": _int(f, 5, _int(f, 2, 0)),
                    "flags": _int(f, 4, PE_PRESENT), "has_flags": 4 in f})
    return _int(head, 1), out


def rewrite_pagemap(raw: bytes, new: list[dict]) -> bytes:
    """Pagemap image `raw` with its entries replaced by `new` (as `pagemap` gives them): its
    magic and pagemap_head kept, each entry written as CRIU itself writes one."""
    head = raw[:pbwire.header_len(raw)]
    first = next(pbwire.entries(raw, PAGEMAP_MAGIC))
    msgs = [pbwire.pagemap_entry(e["vaddr"], e["nr_pages"], e["flags"] if e["has_flags"] else None) for e in new]
    return pbwire.image(head, [first, *msgs])


def _file_entries(snap, fd_type: int, field: int) -> Iterator[bytes]:
    """The `field` sub-message of each files.img entry (file_entry: type = 1) of `fd_type`."""
    if not snap.has_image("files.img"):
        return
    for f in entries(read(snap, "files.img"), FILES_MAGIC):
        sub = _bytes(f, field)
        if f.get(1) == fd_type and sub is not None:
            yield sub


def _reg(msg: bytes) -> dict:
    """A reg_file_entry (images/regfile.proto)."""
    d = fields(msg)
    return {"id": _int(d, 1, 0), "flags": _int(d, 2, 0), "pos": _int(d, 3, 0),
            "name": (_bytes(d, 6) or b"").decode(errors="surrogateescape"),
            "size": _opt(d, 8), "ext": bool(_int(d, 9, 0)), "mode": _opt(d, 10)}


def reg_files(snap) -> list[dict]:
    """id, flags, pos, name, size, ext, mode of every regular-file entry of `snap`: in
    files.img (file_entry: type = 1, reg = 3), or in reg-files.img of older CRIUs."""
    out = [_reg(m) for m in _file_entries(snap, FD_TYPE_REG, 3)]
    if snap.has_image("reg-files.img"):
        out.extend(_reg(m) for m in pbwire.entries(read(snap, "reg-files.img"), REG_FILES_MAGIC))
    return out


def unix_sockets(snap) -> list[dict]:
    """name (bytes, as bound: a path, an abstract name or b""), deleted, uid and gid of every
    unix socket of `snap` (file_entry.usk = 16, images/sk-unix.proto: name = 11, file_perms =
    13 {uid = 2, gid = 3}, deleted = 15)."""
    out = []
    for u in map(fields, _file_entries(snap, FD_TYPE_UNIXSK, 16)):
        perms = fields(_bytes(u, 13) or b"")
        out.append({"name": _bytes(u, 11) or b"", "deleted": bool(_int(u, 15, 0)),
                    "uid": _int(perms, 2, 0), "gid": _int(perms, 3, 0)})
    return out


def inet_sockets(snap) -> list[dict]:
    """proto, state and dst_port of every inet socket of `snap` (file_entry.isk = 4,
    images/sk-inet.proto: proto = 5, state = 6, dst_port = 8)."""
    return [{"proto": _int(i, 5), "state": _int(i, 6), "dst_port": _int(i, 8)}
            for i in map(fields, _file_entries(snap, FD_TYPE_INETSK, 4))]


def remapped_ids(snap) -> set[int]:
    """The file ids of remap-fpath.img (remap_fpath_entry.orig_id): files CRIU restores
    itself (deleted-but-open ghosts, linked remaps)."""
    if not snap.has_image("remap-fpath.img"):
        return set()
    return {_int(f, 1) for f in entries(read(snap, "remap-fpath.img"), REMAP_FPATH_MAGIC) if 1 in f}


def frozen_seconds(raw: bytes) -> float | None:
    """frozen_time of a stats-dump image, in seconds: StatsEntry{dump = 1:
    DumpStatsEntry{frozen_time = 2}}, microseconds from the freeze to the resume. None when
    the image does not say."""
    try:
        for f in entries(raw, STATS_MAGIC):
            dump = f.get(1)
            v = fields(dump).get(2) if isinstance(dump, bytes) else None
            return v / 1e6 if isinstance(v, int) else None
    except ValueError:
        return None
    return None


def decoded(snap, name: str) -> list[dict] | None:
    """Every entry of image `name` as pycriu decodes it (dicts); None when the snapshot has no
    such image or it does not decode."""
    if not snap.has_image(name):
        return None
    import pycriu.images            # here, not at the top: 0.06-0.1 s that only inspect needs

    try:
        return pycriu.images.loads(read(snap, name))["entries"]
    except Exception:  # noqa: BLE001 - data from a snapshot: unreadable, never a crash
        return None
