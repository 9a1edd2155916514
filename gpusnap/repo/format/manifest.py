"""Snapshot manifests (docs/format.md §5.1): encode, parse, check."""

from __future__ import annotations

import json

import blake3

from gpusnap.repo.format.common import (FORMAT_VERSION, HEX64, MANIFEST_TRAILER_LEN, MANIFEST_TRAILER_PREFIX, MAX_MANIFEST, PAGELIST_NAME,
                                       SNAPSHOT_NAME, FormatError)
from gpusnap.repo.format.names import valid_image_name


def encode_manifest(body: dict) -> tuple[bytes, str]:
    """-> (file bytes, snapshot id). The id is the first 16 hex digits of blake3(body)."""
    raw = json.dumps(body, indent=1, sort_keys=True).encode()
    h = blake3.blake3(raw).hexdigest()
    return raw + MANIFEST_TRAILER_PREFIX + h.encode() + b"\n", h[:16]


def _is_int(v, lo=0, hi=(1 << 63) - 1):
    return type(v) is int and lo <= v <= hi


def parse_manifest(data: bytes) -> tuple[dict, str]:
    """-> (manifest dict, snapshot id). Validates the checksum trailer and the schema."""
    if len(data) > MAX_MANIFEST:
        raise FormatError("manifest too large")
    if len(data) < MANIFEST_TRAILER_LEN + 2:
        raise FormatError("manifest too short")
    trailer = data[-MANIFEST_TRAILER_LEN:]
    if not trailer.startswith(MANIFEST_TRAILER_PREFIX) or not trailer.endswith(b"\n"):
        raise FormatError("manifest has no checksum trailer")
    want = trailer[len(MANIFEST_TRAILER_PREFIX):-1]
    body = data[:-MANIFEST_TRAILER_LEN]
    h = blake3.blake3(body).hexdigest()
    if h.encode() != want:
        raise FormatError("manifest checksum mismatch")
    try:
        m = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"manifest is not valid JSON: {e}") from None
    check_manifest(m)
    return m, h[:16]


def _is_num(v) -> bool:
    return type(v) in (int, float) and v >= 0


def _is_real(v) -> bool:
    return type(v) in (int, float)


def _int_list(v) -> bool:
    return isinstance(v, list) and all(_is_int(x) for x in v)


def _gpu_ok(g) -> bool:
    """meta.gpu as gpu.procs.describe_recorded reads it (two shapes: see there)."""
    if not isinstance(g, dict):
        return False
    drv, gpus, procs = g.get("driver"), g.get("gpus"), g.get("processes")
    if drv is not None and not (isinstance(drv, dict) and
                                (drv.get("gpus") is None or isinstance(drv["gpus"], list) and
                                 all(isinstance(x, dict) for x in drv["gpus"]))):
        return False
    if gpus is not None and not (isinstance(gpus, list) and all(isinstance(x, dict) for x in gpus)):
        return False
    if isinstance(procs, dict):
        return all(isinstance(k, str) and k.isdigit() and len(k) < 12 and (v is None or isinstance(v, list))
                   for k, v in procs.items())
    return procs is None or isinstance(procs, list) and all(
        isinstance(p, dict) and (p.get("gpus") is None or isinstance(p["gpus"], list)) for p in procs)


# The type of every meta key a reader uses (ops/inspect, ops/restore*, render, ops/export, ops/import_):
# a key may be absent or null, never of another type (a crafted manifest must not turn
# `inspect` or `restore` into a traceback). Other keys are free.
META_TYPES = {
    "pid": _is_int, "pids": _int_list, "tids": _int_list, "cuda_pids": _int_list,
    "cmdline": lambda v: isinstance(v, str), "hostname": lambda v: isinstance(v, str),
    "kernel": lambda v: isinstance(v, str), "criu_version": lambda v: isinstance(v, str),
    "compress": lambda v: isinstance(v, str),
    "restore_flags": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "leave_running": lambda v: type(v) is bool, "own_pid_namespace": lambda v: type(v) is bool,
    "hugetlb_bytes": _is_int, "dump_seconds": _is_real, "frozen_seconds": _is_real,
    "tcp": lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v),
    "file_locks": lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v),
    "append_files": lambda v: isinstance(v, list),
    "link_remaps": lambda v: isinstance(v, list),
    "gpu": _gpu_ok,
    "imported_from": lambda v: isinstance(v, dict) and isinstance(v.get("id"), str),
    "container": lambda v: isinstance(v, dict) and all(isinstance(v.get(k), str) for k in ("engine", "id", "name", "image")),
}
# numbers the readers format (stats of the manifest and of each pages image)
STATS_KEYS = ("pages_total", "pages_zero", "pages_dedup", "pages_compressed", "pages_raw", "bytes_raw",
              "bytes_stored")
IMAGE_STATS_KEYS = ("pages", "pages_zero", "pages_dedup", "pages_compressed", "pages_raw")


def _check_meta_stats(m: dict) -> None:
    for k, ok in META_TYPES.items():
        v = m["meta"].get(k)
        if v is not None and not ok(v):
            raise FormatError(f"manifest meta.{k} malformed")
    for k in STATS_KEYS:
        v = m["stats"].get(k)
        if v is not None and not _is_num(v):
            raise FormatError(f"manifest stats.{k} malformed")


def check_manifest(m) -> None:
    if not isinstance(m, dict):
        raise FormatError("manifest is not an object")
    if m.get("format") != "gpusnap-snapshot":
        raise FormatError("not a gpusnap snapshot manifest")
    if m.get("version") != FORMAT_VERSION or type(m.get("version")) is not int:
        raise FormatError(f"unsupported snapshot version {m.get('version')!r}")
    if not isinstance(m.get("name"), str) or not SNAPSHOT_NAME.match(m["name"]):
        raise FormatError("manifest name malformed")
    if type(m.get("created")) not in (int, float) or not 0 <= m["created"] < 1e11:
        raise FormatError("manifest created time malformed")
    if not isinstance(m.get("meta"), dict):
        raise FormatError("manifest meta malformed")
    if not isinstance(m.get("stats"), dict):
        raise FormatError("manifest stats malformed")
    if not isinstance(m.get("repo_id"), str):
        raise FormatError("manifest repo_id malformed")
    _check_meta_stats(m)
    imgs = m.get("images")
    if not isinstance(imgs, list):
        raise FormatError("manifest images malformed")
    seen = set()
    pls = set()
    for im in imgs:
        if not isinstance(im, dict):
            raise FormatError("image entry malformed")
        name = im.get("name")
        if not valid_image_name(name) or name in seen:
            raise FormatError(f"image name malformed or repeated: {name!r}")
        seen.add(name)
        if not _is_int(im.get("size")):
            raise FormatError(f"image {name}: size malformed")
        if not isinstance(im.get("digest"), str) or not HEX64.match(im["digest"]):
            raise FormatError(f"image {name}: digest malformed")
        for k in IMAGE_STATS_KEYS:
            if im.get(k) is not None and not _is_int(im[k]):
                raise FormatError(f"image {name}: {k} malformed")
        t = im.get("type")
        if t == "pages":
            pl = im.get("pagelist")
            if not isinstance(pl, str) or not PAGELIST_NAME.match(pl) or pl in pls:
                raise FormatError(f"image {name}: pagelist malformed")
            pls.add(pl)
            if not _is_int(im.get("pagelist_size")):
                raise FormatError(f"image {name}: pagelist_size malformed")
        elif t == "blob":
            blobs = im.get("blobs")
            if not isinstance(blobs, list) or not all(isinstance(b, str) and HEX64.match(b) for b in blobs):
                raise FormatError(f"image {name}: blob list malformed")
            if (im["size"] == 0) != (len(blobs) == 0) or len(blobs) > im["size"]:
                raise FormatError(f"image {name}: blob list inconsistent with size")
        else:
            raise FormatError(f"image {name}: unknown type {t!r}")
