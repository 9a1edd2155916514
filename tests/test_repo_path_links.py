"""A repository path is checked as given, component by component, before anything is resolved
(issue 31 item 2; docs/format.md §1). The attack: user nobody plants /tmp/x -> root's
repository; root's `forget --prune --repo /tmp/x` must refuse (exit 14) and delete nothing,
where a resolve-first check trusted the link's target and deleted snapshots in the repository
root never named. A link is followed only when root owns it and it lies in a directory only
root can write (as /var/run -> /run)."""

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import run_gpusnap, run_json
from gpusnap.errors import RepositoryError
from gpusnap.repo import Repository
from repo_helpers import PAGE, dump

NOBODY = pwd.getpwnam("nobody").pw_uid
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (user nobody plants the links)")


@pytest.fixture
def public_dir():
    """A root-owned 0755 directory under /tmp that nobody can reach (tmp_path is 0700)."""
    d = Path(tempfile.mkdtemp(prefix="gpusnap-links-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def planted(public_dir):
    """`plant(target)`: a symlink that nobody creates in /tmp (sticky, world-writable), as the
    issue's attacker did; removed afterwards."""
    made = []

    def plant(target) -> Path:
        link = Path(tempfile.mktemp(prefix="gpusnap-x-", dir="/tmp"))
        subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                        "ln", "-s", str(target), str(link)], check=True)
        assert link.lstat().st_uid == NOBODY
        made.append(link)
        return link

    yield plant
    for link in made:
        link.unlink(missing_ok=True)


def _repo(where: Path, names=("a", "a", "a")) -> Repository:
    repo = Repository.open(where, create=True)
    for k, name in enumerate(names):
        dump(repo, {"pages-1.img": os.urandom(PAGE * 8) + bytes([k]) * PAGE}, name=name)
    return repo


def _contents(repo: Repository) -> tuple[list[str], list[str]]:
    return (sorted(os.listdir(repo.path / "snapshots")),
            sorted(str(p.relative_to(repo.path)) for p in (repo.path / "packs").rglob("*")))


def test_planted_link_to_roots_repository_is_refused_and_nothing_is_deleted(public_dir, planted):
    """The issue's row: root's `forget --keep-last 1 --prune --repo /tmp/x` where nobody made
    /tmp/x -> root's repository. Exit 14 naming the link; every snapshot and pack is still there."""
    repo = _repo(public_dir / "repo")
    before = _contents(repo)
    link = planted(repo.path)
    p = run_gpusnap("forget", "--name", "a", "--keep-last", "1", "--prune", "--repo", link)
    assert p.returncode == RepositoryError.exit_code, (p.returncode, p.stdout, p.stderr)
    assert f"{link} is a symbolic link owned by uid {NOBODY}" in p.stderr, p.stderr
    assert _contents(repo) == before
    assert len(before[0]) == 3
    # the same with the link above the repository, and for a reader
    up = planted(public_dir)
    p = run_gpusnap("prune", "--keep-last", "1", "--repo", up / "repo")
    assert p.returncode == RepositoryError.exit_code and f"{up} is a symbolic link" in p.stderr, p.stderr
    assert _contents(repo) == before
    p = run_gpusnap("ls", "--repo", link, "--json")
    assert p.returncode == RepositoryError.exit_code and "symbolic link" in p.stdout, p.stdout
    # a snapshot directory named through the link is refused the same way
    snap = repo.snapshots()[0].path.name
    p = run_gpusnap("forget", link / "snapshots" / snap, "--repo", repo.path)
    assert p.returncode == RepositoryError.exit_code and "symbolic link" in p.stderr, p.stderr
    assert _contents(repo) == before
    # named as it is, the repository works
    assert len(run_json("ls", "--repo", repo.path)["snapshots"]) == 3


def test_library_open_refuses_the_planted_link(public_dir, planted):
    repo = _repo(public_dir / "repo", names=("a",))
    link = planted(repo.path)
    with pytest.raises(RepositoryError, match="symbolic link owned by uid"):
        Repository.open(link)
    with pytest.raises(RepositoryError, match="symbolic link owned by uid"):
        Repository.open(link, create=True)


def test_roots_link_in_a_root_only_directory_is_followed(public_dir):
    """/var/run -> /run style: root owns the link and only root can write where it lies."""
    repo = _repo(public_dir / "repo")
    system = public_dir / "system"
    system.mkdir(mode=0o755)
    (system / "repo").symlink_to(repo.path)
    (system / "up").symlink_to("..")                 # a relative one, above the repository
    for via in (system / "repo", system / "up" / "repo"):
        listed = run_json("ls", "--repo", via)
        assert len(listed["snapshots"]) == 3
        assert Repository.open(via).path == repo.path   # the walked path: no link left in it
    assert run_gpusnap("verify", "--repo", system / "repo").returncode == 0


def test_roots_link_is_refused_where_others_can_write_or_when_it_leads_through_theirs(public_dir, planted):
    repo = _repo(public_dir / "repo", names=("a",))
    shared = public_dir / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    (shared / "repo").symlink_to(repo.path)          # root's, but in a directory others can write
    p = run_gpusnap("ls", "--repo", shared / "repo")
    assert p.returncode == RepositoryError.exit_code and "directory others can write" in p.stderr, p.stderr
    system = public_dir / "system"
    system.mkdir(mode=0o755)
    (system / "repo").symlink_to(planted(repo.path))  # root's link, to nobody's link
    p = run_gpusnap("ls", "--repo", system / "repo")
    assert p.returncode == RepositoryError.exit_code and f"owned by uid {NOBODY}" in p.stderr, p.stderr


def test_a_link_loop_is_refused_not_hung(public_dir):
    system = public_dir / "system"
    system.mkdir(mode=0o755)
    (system / "a").symlink_to(system / "b")
    (system / "b").symlink_to(system / "a")
    p = run_gpusnap("ls", "--repo", system / "a")
    assert p.returncode == RepositoryError.exit_code and "too many" in p.stderr, p.stderr
