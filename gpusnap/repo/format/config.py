"""The repository's config file (docs/format.md §2): encode, parse."""

from __future__ import annotations

import json
import re

from gpusnap.repo.format.common import FORMAT_VERSION, MAX_CONFIG, PAGE_SIZE, FormatError


def make_config(repo_id: str, created: float) -> dict:
    return {
        "format": "gpusnap-repository",
        "version": FORMAT_VERSION,
        "id": repo_id,
        "created": created,
        "page_size": PAGE_SIZE,
        "page_id": "blake3-128",
        "blob_id": "blake3-256",
        "pack_name": "blake3-256",
    }


def encode_config(cfg: dict) -> bytes:
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()


def parse_config(data: bytes) -> dict:
    if len(data) > MAX_CONFIG:
        raise FormatError("config file too large")
    try:
        cfg = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"config is not valid JSON: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("format") != "gpusnap-repository":
        raise FormatError("not a gpusnap repository config")
    v = cfg.get("version")
    if type(v) is not int:
        raise FormatError("config has no integer version")
    if v != FORMAT_VERSION:
        raise FormatError(f"repository format version {v} is not supported (this gpusnap reads version {FORMAT_VERSION})")
    expect = {"page_size": PAGE_SIZE, "page_id": "blake3-128", "blob_id": "blake3-256", "pack_name": "blake3-256"}
    for k, want in expect.items():
        if cfg.get(k) != want:
            raise FormatError(f"config {k}={cfg.get(k)!r} is not supported (expected {want!r})")
    if not isinstance(cfg.get("id"), str) or not re.fullmatch(r"[0-9a-f]{32}", cfg["id"]):
        raise FormatError("config id malformed")
    return cfg
