"""The steps root takes on a user's files (gpusnap/system/ownerfs.py), on the real filesystem:
the helper has the owner's whole identity, a link anywhere in a path is refused, a file swapped
after the check is not touched, and created files get exactly their mode whatever the umask."""

from __future__ import annotations

import errno
import os
import pwd
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from gpusnap.system import ownerfs


@pytest.fixture
def top():
    d = Path(tempfile.mkdtemp(prefix="gpusnap-ownerfs-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _nobody() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody")


def _ids() -> list:
    return [os.getuid(), os.geteuid(), os.getgid(), os.getegid(), sorted(os.getgroups())]


def test_the_helper_has_the_owners_identity_and_only_its_rights(top):
    nobody = _nobody()
    uid, euid, gid, egid, groups = ownerfs.as_owner(nobody.pw_uid, nobody.pw_gid, _ids)
    assert (uid, euid, gid, egid) == (nobody.pw_uid, nobody.pw_uid, nobody.pw_gid, nobody.pw_gid)
    assert 0 not in groups
    secret = top / "root-only"
    secret.write_bytes(b"x")
    os.chmod(secret, 0o600)
    with pytest.raises(PermissionError):
        ownerfs.as_owner(nobody.pw_uid, nobody.pw_gid, os.open, str(secret), os.O_RDONLY)
    assert _ids()[:2] == [0, 0]           # gpusnap itself never changed identity


def test_a_link_anywhere_in_the_path_is_refused(top):
    (top / "real").mkdir()
    (top / "real" / "log").write_bytes(b"data")
    os.symlink(top / "real", top / "link")
    with pytest.raises(OSError) as e:
        ownerfs.open_parent(str(top / "link" / "log"))
    assert e.value.errno == errno.ELOOP
    fd, name = ownerfs.open_parent(str(top / "real" / "log"))
    try:
        assert name == "log" and os.path.samestat(os.fstat(fd), os.stat(top / "real"))
    finally:
        os.close(fd)


def test_a_file_swapped_after_the_check_is_not_opened(top):
    (top / "log").write_bytes(b"checked")
    st = os.stat(top / "log")
    os.rename(top / "log", top / "log.old")
    (top / "log").write_bytes(b"another file at that name")
    fd, name = ownerfs.open_parent(str(top / "log"))
    try:
        with pytest.raises(OSError) as e:
            ownerfs.open_checked(fd, name, os.O_RDWR, st.st_dev, st.st_ino)
        assert e.value.errno == errno.ESTALE
        os.unlink(top / "log")
        os.symlink(top / "log.old", top / "log")       # a link to the very file checked: not followed
        with pytest.raises(OSError) as e:
            ownerfs.open_checked(fd, name, os.O_RDWR, st.st_dev, st.st_ino)
        assert e.value.errno == errno.ELOOP
    finally:
        os.close(fd)


def test_created_files_have_their_mode_whatever_the_umask_and_never_replace_a_link(top):
    old = os.umask(0)
    try:
        dfd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fd, name = ownerfs.create_numbered(dfd, "log.after", 0o640)
            os.close(fd)
            assert name == "log.after" and stat.S_IMODE(os.stat(top / name).st_mode) == 0o640
            os.symlink("/etc/passwd", top / "log.after.1")
            fd, name = ownerfs.create_numbered(dfd, "log.after", 0o600)
            os.close(fd)
            assert name == "log.after.2" and stat.S_IMODE(os.stat(top / name).st_mode) == 0o600
            assert os.readlink(top / "log.after.1") == "/etc/passwd"
        finally:
            os.close(dfd)
    finally:
        os.umask(old)
