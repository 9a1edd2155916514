"""The one CRIU image reader (gpusnap/criu/images.py) on its one wire-level decoder
(criu/pbwire.py), and the one image-name rule (repo/format/names.py): malformed input is a
ValueError (never another exception, never a huge allocation), an image of another kind is
refused, and the stream and the manifest accept exactly the same names."""

from __future__ import annotations

import json
import os
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


SOCKETS_JOB = r"""
import os, socket, struct, sys, time
d = sys.argv[1]
bound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); bound.bind(os.path.join(d, "bound.sock")); bound.listen()
gone = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); gone.bind(os.path.join(d, "gone.sock"))
os.unlink(os.path.join(d, "gone.sock"))
abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); abstract.bind(b"\0gpusnap-test-abstract\0x")
pair = socket.socketpair()
lst = socket.socket(); lst.bind(("127.0.0.1", 0)); lst.listen()
cli = socket.create_connection(lst.getsockname()); srv, _ = lst.accept()
for s in (cli, srv):   # closed by a reset when the job is killed: no TIME_WAIT holds a port at the restore
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
open(os.path.join(d, "ready"), "w").close()
while True:
    time.sleep(0.05)
"""


def test_socket_entries_read_at_the_wire_level_match_pycriu(tmp_path, repo):
    """A restore reads the job's sockets from files.img without pycriu (its import alone costs
    ~0.05-0.1 s): on a real snapshot of a job holding unix sockets (bound to a path, bound and
    unlinked, abstract, unnamed) and TCP ones (listening, connected both ways), the wire reader
    gives what pycriu decodes, and the restore path loads neither pycriu nor protobuf."""
    import quopri
    import subprocess
    import sys

    from conftest import kill_pids, run_gpusnap, run_json, wait_for
    from gpusnap.repo.repository import Repository

    (tmp_path / "job.py").write_text(SOCKETS_JOB)
    job = subprocess.Popen([sys.executable, str(tmp_path / "job.py"), str(tmp_path)], start_new_session=True)
    try:
        wait_for(lambda: (tmp_path / "ready").exists(), "the job's sockets")
        name = run_json("dump", job.pid, "--repo", repo, "--tcp-established")["snapshot"]
    finally:
        job.kill()
        job.wait()
    snap = Repository.open(repo).snapshot(name)
    full = images.decoded(snap, "files.img")
    assert full is not None
    want_unix = sorted((quopri.decodestring(e["usk"]["name"].encode()), bool(e["usk"].get("deleted")),
                        e["usk"].get("file_perms", {}).get("uid", 0), e["usk"].get("file_perms", {}).get("gid", 0))
                       for e in full if e["type"] == "UNIXSK")
    got_unix = sorted((u["name"], u["deleted"], u["uid"], u["gid"]) for u in images.unix_sockets(snap))
    assert got_unix == want_unix
    names = [n for n, *_ in got_unix]   # (a path's name as the kernel gives it: NUL-ended)
    assert str(tmp_path / "bound.sock").encode() + b"\0" in names and b"\0gpusnap-test-abstract\0x" in names
    assert [d for n, d, *_ in got_unix if n == str(tmp_path / "gone.sock").encode() + b"\0"] == [True]
    want_inet = sorted((e["isk"]["proto"], e["isk"]["state"], e["isk"]["dst_port"]) for e in full if e["type"] == "INETSK")
    got_inet = sorted((s["proto"], s["state"], s["dst_port"]) for s in images.inet_sockets(snap))
    assert got_inet == want_inet and len(got_inet) == 3

    os.unlink(tmp_path / "bound.sock")     # (left by the killed job; the restore binds it again)
    restored = run_gpusnap("restore", name, "--repo", repo, "--json", env={"PYTHONPROFILEIMPORTTIME": "1"})
    try:
        assert restored.returncode == 0, restored.stdout
        loaded = {line.split("|")[-1].strip() for line in restored.stderr.splitlines() if line.startswith("import time:")}
        assert "gpusnap.ops.restore" in loaded         # (the check sees the restore's own imports)
        assert not [m for m in loaded if m.split(".")[0] in ("pycriu", "google")]
        wait_for(lambda: (tmp_path / "bound.sock").exists(), "the restored job's socket")
    finally:
        kill_pids(json.loads(restored.stdout.strip().splitlines()[-1])["pids"] if restored.returncode == 0 else [])


def test_socket_entries_malformed_are_refused():
    """files.img is data from a snapshot: a socket entry whose fields are not what
    sk-unix.proto / sk-inet.proto say is a ValueError, never another exception."""

    class Snap:
        def __init__(self, raw):
            self.raw = raw

        def has_image(self, name):
            return name == "files.img"

        def read_image(self, name):
            yield self.raw

    def entry(fd_type, field, sub):     # file_entry{type, id = 1, field: sub}
        return bytes([0x08, fd_type, 0x10, 0x01]) + pbwire.encode_varint(field << 3 | 2) + pbwire.encode_varint(len(sub)) + sub

    # usk.name (11) given as a number; isk.proto (5) given as bytes
    bad_unix = _img(images.FILES_MAGIC, entry(images.FD_TYPE_UNIXSK, 16, b"\x58\x01"))
    bad_inet = _img(images.FILES_MAGIC, entry(images.FD_TYPE_INETSK, 4, b"\x2a\x01x"))
    with pytest.raises(ValueError):
        images.unix_sockets(Snap(bad_unix))
    with pytest.raises(ValueError):
        images.inet_sockets(Snap(bad_inet))
    good = _img(images.FILES_MAGIC, entry(images.FD_TYPE_UNIXSK, 16, b"\x5a\x02/x"))
    assert images.unix_sockets(Snap(good)) == [{"name": b"/x", "deleted": False, "uid": 0, "gid": 0}]
