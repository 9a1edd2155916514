"""Snapshot manifests (docs/format.md §5.1): encode, parse, check."""

from __future__ import annotations

import json

import blake3

from gpusnap.repo.format.common import (FORMAT_VERSION, HEX64, MANIFEST_TRAILER_LEN, MANIFEST_TRAILER_PREFIX, MAX_MANIFEST, PAGELIST_NAME,
                                       SNAPSHOT_NAME, FormatError)


def encode_manifest(body: dict) -> tuple[bytes, str]:
    """-> (file bytes, snapshot id). The id is the first 16 hex digits of blake3(body)."""
    raw = json.dumps(body, indent=1, sort_keys=True).encode()
    h = blake3.blake3(raw).hexdigest()
    return raw + MANIFEST_TRAILER_PREFIX + h.encode() + b"\n", h[:16]


def _is_int(v, lo=0, hi=(1 << 63) - 1):
    return type(v) is int and lo <= v <= hi


def valid_image_name(name) -> bool:
    return (isinstance(name, str) and 0 < len(name) <= 255 and "/" not in name and "\x00" not in name
            and name not in (".", ".."))


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
