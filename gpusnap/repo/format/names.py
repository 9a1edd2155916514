"""The rule for a CRIU image's name, the one both ends use: a name CRIU asks for over the
image stream (criu/protocol.py) and a name a manifest lists (manifest.py). Such a name
becomes a file name when images are written out, so it must be one plain, printable
component; and which images hold memory pages, by their name."""

from __future__ import annotations

MAX_IMAGE_NAME = 255          # bytes, as UTF-8: the longest file-name component


def image_name_problem(name) -> str | None:
    """What is wrong with `name` as an image name: "length", "unsafe" (not one plain path
    component, or not encodable) or "control" (control characters); None when nothing."""
    if not isinstance(name, str):
        return "unsafe"
    try:
        size = len(name.encode())
    except UnicodeEncodeError:          # lone surrogates (JSON allows them): no file name
        return "unsafe"
    if not 0 < size <= MAX_IMAGE_NAME:
        return "length"
    if "/" in name or "\0" in name or name in (".", ".."):
        return "unsafe"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return "control"
    return None


def valid_image_name(name) -> bool:
    return image_name_problem(name) is None


def is_pages_image(name: str) -> bool:
    """A pages image (pages-<n>.img): its bytes are memory pages, 4 KiB each."""
    return name.startswith("pages-") and name.endswith(".img")
