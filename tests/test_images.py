"""The one CRIU image reader (gpusnap/criu/images.py) on its one wire-level decoder
(criu/pbwire.py), and the one image-name rule (repo/format/names.py): malformed input is a
ValueError (never another exception, never a huge allocation), an image of another kind is
refused, and the stream and the manifest accept exactly the same names."""

from __future__ import annotations

import struct

import pytest

from gpusnap.criu import images, pbwire, protocol
from gpusnap.errors import StreamProtocolError
from gpusnap.repo import format as F


def _img(magic: int, *msgs: bytes) -> bytes:
    return pbwire.image(struct.pack("<II", pbwire.IMG_COMMON_MAGIC, magic), list(msgs))


def test_varints_longer_than_64_bits_are_refused():
    assert pbwire.varint(b"\xff" * 9 + b"\x01", 0) == ((1 << 64) - 1, 10)
    with pytest.raises(ValueError, match="too long"):
        pbwire.varint(b"\xff" * 10 + b"\x01", 0)
    with pytest.raises(ValueError, match="truncated"):
        pbwire.varint(b"\xff\xff", 0)


@pytest.mark.parametrize("msg", [b"\x0a\xff\xff\xff\xff\x0f", b"\x0a\x05ab", b"\x0d\x01\x02", b"\x09\x01", b"\x0b"])
def test_fields_running_past_their_message_are_refused(msg):
    with pytest.raises(ValueError):
        list(pbwire.fields(msg))


def test_an_image_of_another_kind_is_refused():
    raw = _img(images.MM_MAGIC, b"\x08\x01")
    with pytest.raises(ValueError, match="magic"):
        list(images.pstree(raw))
    with pytest.raises(ValueError, match="truncated entry"):
        list(images.pstree(_img(images.PSTREE_MAGIC) + struct.pack("<I", 100) + b"\x08\x01"))


def test_pstree_threads_one_field_each_or_packed():
    one_each = _img(images.PSTREE_MAGIC, b"\x08\x07\x18\x07\x28\x07\x28\x08")
    packed = _img(images.PSTREE_MAGIC, b"\x08\x07\x18\x07\x2a\x02\x07\x08")
    want = [{"pid": 7, "pgid": 7, "threads": [7, 8]}]
    assert list(images.pstree(one_each)) == want == list(images.pstree(packed))
    with pytest.raises(ValueError, match="without a PID"):
        list(images.pstree(_img(images.PSTREE_MAGIC, b"\x18\x07")))


def test_a_string_where_a_number_belongs_is_refused():
    vma = b"\x0a\x02ab\x10\x02\x30\x00\x38\x00"          # start given as bytes
    with pytest.raises(ValueError, match="not a number"):
        images.vmas(_img(images.MM_MAGIC, b"\x72" + bytes([len(vma)]) + vma))


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "x\0y", "tab\there", "z" * 256, "é" * 128, "\ud800"])
def test_one_name_rule_for_the_stream_and_the_manifest(name):
    assert not F.valid_image_name(name)
    with pytest.raises(StreamProtocolError):
        protocol.check_filename(name, F)


@pytest.mark.parametrize("name", ["pages-1.img", "core-123.img", "é.img", "z" * 255])
def test_good_names_pass_both(name):
    assert F.valid_image_name(name) and protocol.check_filename(name, F) == name
