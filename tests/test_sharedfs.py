"""doctor's check of a repository's filesystem: shared between nodes, and do its locks hold there."""

from __future__ import annotations

import json

from conftest import run_gpusnap
from gpusnap.system import sharedfs

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:40 / /shared rw,relatime shared:20 - nfs4 srv:/export rw,vers=4.2,hard,proto=tcp
41 22 0:41 / /nolock rw,relatime shared:21 - nfs srv:/old rw,vers=3,nolock,proto=tcp
42 22 0:42 / /lustre rw shared:22 - lustre 10.0.0.1@tcp:/fs rw,flock
43 22 0:43 / /with\\040space rw shared:23 - nfs4 srv:/x rw,vers=4.1,local_lock=flock
"""


def test_local_filesystem_is_ok():
    status, detail, _ = sharedfs.check("/var/lib/gpusnap/x", MOUNTINFO)
    assert status == "ok" and "ext4" in detail and "local" in detail


def test_nfs4_with_server_locks_is_ok():
    assert sharedfs.check("/shared/gpusnap", MOUNTINFO)[0] == "ok"


def test_nfs_mounted_nolock_warns_that_only_the_lock_files_hold():
    """flock is local with nolock; since revision 1.6 the lock files still keep a prune out
    of other nodes' dumps (docs/format.md §6), on conditions the fix names."""
    status, detail, fix = sharedfs.check("/nolock/repo", MOUNTINFO)
    assert status == "warn" and "nolock" in detail and "lock files" in detail and "clocks" in fix


def test_nfs4_with_local_locks_warns_even_under_an_escaped_mount_point():
    status, detail, _ = sharedfs.check("/with space/repo", MOUNTINFO)
    assert status == "warn" and "local_lock=flock" in detail


def test_other_network_filesystems_are_named_for_the_user_to_check():
    status, detail, _ = sharedfs.check("/lustre/r", MOUNTINFO)
    assert status == "warn" and "lustre" in detail


def test_a_missing_path_is_on_the_mount_of_its_nearest_ancestor():
    m = sharedfs.mount_of("/shared/not/yet/created", MOUNTINFO)
    assert m.point == "/shared" and m.fstype == "nfs4"


def test_doctor_reports_the_repository_filesystem(tmp_path):
    proc = run_gpusnap("doctor", "--repo", tmp_path / "repo", "--json")
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    assert checks["repository filesystem"]["status"] == "ok", checks["repository filesystem"]
