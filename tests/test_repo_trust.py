"""A repository that trusts no one (issue 8 item 2): a repository, or any directory in it,
that another user could write is refused (exit 14), and nothing inside a repository is
reached through a symlink or hard link, so a planted link never makes root truncate or
delete a file outside it. The issue's repros run as written: as `nobody`, then root's prune
or `dump --keep-last` with the real CRIU."""

import os
import pwd
import shutil
import subprocess

import pytest

from conftest import run_gpusnap, run_json
from gpusnap.errors import RepositoryError
from gpusnap.repo import Repository
from gpusnap.repo.maint.prune import execute_prune, plan_prune, snapshots_info
from gpusnap.repo.maint.verify import verify
from repo_helpers import PAGE, dump

NOBODY = pwd.getpwnam("nobody").pw_uid
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown to nobody)")


def _repo_with_history(tmp_path, n=3):
    repo = Repository.open(tmp_path / "repo", create=True)
    for k in range(n):
        dump(repo, {"pages-1.img": os.urandom(PAGE * 8) + bytes([k]) * PAGE})
    return repo


def _victim(tmp_path) -> str:
    v = tmp_path / "root-file"
    v.write_text("precious\n")
    return str(v)


def _as_nobody(*cmd):
    """Run a shell command as nobody (the attacker)."""
    subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sh", "-c", *cmd],
                   check=True)


@root_only
def test_repository_owned_by_another_user_is_refused(tmp_path):
    repo = _repo_with_history(tmp_path, 1)
    os.chown(repo.path, NOBODY, NOBODY)
    with pytest.raises(RepositoryError, match="owned by uid"):
        Repository.open(repo.path)
    p = run_gpusnap("ls", "--repo", repo.path)
    assert p.returncode == 14 and "hint" in p.stderr, p.stderr


@root_only
def test_no_repository_is_created_in_a_directory_another_user_owns(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir()
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(RepositoryError, match="owned by uid"):
        Repository.open(d, create=True)
    assert os.listdir(d) == []


@pytest.mark.parametrize("where", ["", "snapshots", "locks", "tmp", "packs", "index", "logs"])
def test_group_or_world_writable_directory_is_refused(tmp_path, where):
    repo = _repo_with_history(tmp_path, 1)
    d = repo.path / where
    d.mkdir(exist_ok=True)
    os.chmod(d, 0o777)
    with pytest.raises(RepositoryError, match="writable by"):
        Repository.open(repo.path)
    os.chmod(d, 0o770)
    with pytest.raises(RepositoryError, match="writable by group"):
        Repository.open(repo.path)
    os.chmod(d, 0o700)
    Repository.open(repo.path)


def test_pack_subdirectory_and_config_are_checked(tmp_path):
    repo = _repo_with_history(tmp_path, 1)
    sub = next((repo.path / "packs").iterdir())
    os.chmod(sub, 0o757)
    with pytest.raises(RepositoryError, match="writable by others"):
        Repository.open(repo.path)
    os.chmod(sub, 0o700)
    os.chmod(repo.path / "config", 0o666)
    with pytest.raises(RepositoryError, match="config"):
        Repository.open(repo.path)


def test_a_directory_above_the_repository_writable_by_others_is_refused(tmp_path):
    above = tmp_path / "shared"
    above.mkdir()
    repo = Repository.open(above / "repo", create=True)
    os.chmod(above, 0o777)
    with pytest.raises(RepositoryError, match="above the repository"):
        Repository.open(repo.path)
    os.chmod(above, 0o1777)           # sticky, like /tmp: nobody else can rename our entries
    Repository.open(repo.path)


@pytest.mark.parametrize("sub", ["locks", "tmp", "snapshots"])
def test_symlinked_subdirectory_is_refused(tmp_path, sub):
    repo = _repo_with_history(tmp_path, 1)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(repo.path / sub, elsewhere)
    os.symlink(elsewhere, repo.path / sub)
    with pytest.raises(RepositoryError, match="symbolic link"):
        Repository.open(repo.path)


def test_lock_file_symlink_planted_after_open_is_not_followed(tmp_path):
    """Defence in depth: a symlink or hard link that appears in locks/ after the open-time
    check (a race) is refused; the file it points at is never truncated."""
    repo = _repo_with_history(tmp_path, 1)
    victim = _victim(tmp_path)
    lp = repo.path / "locks" / "writer"
    if lp.exists():
        lp.unlink()
    os.symlink(victim, lp)
    with pytest.raises(RepositoryError, match="symbolic link"):
        with repo.writer_lock():
            pass
    lp.unlink()
    os.link(victim, lp)                 # a hard link instead
    with pytest.raises(RepositoryError, match="hard links"):
        with repo.writer_lock():
            pass
    with pytest.raises(RepositoryError):
        execute_prune(repo, plan_prune(snapshots_info(repo), 0))
    assert open(victim).read() == "precious\n"


def test_tmp_replaced_by_symlink_after_open_deletes_nothing(tmp_path):
    repo = _repo_with_history(tmp_path, 2)
    target = tmp_path / "rootdir"
    target.mkdir()
    for i in range(3):
        (target / f"f{i}").write_text("keep")
    plan = plan_prune(snapshots_info(repo), 1)
    shutil.rmtree(repo.path / "tmp")
    os.symlink(target, repo.path / "tmp")
    with pytest.raises(RepositoryError, match="symbolic link"):
        execute_prune(repo, plan)
    assert sorted(p.name for p in target.iterdir()) == ["f0", "f1", "f2"]


def test_symlink_in_snapshots_is_reported_not_followed(tmp_path):
    repo = _repo_with_history(tmp_path, 3)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "manifest").write_text("x")
    os.symlink(outside, repo.path / "snapshots" / "planted")
    assert len(repo.snapshots()) == 3
    assert any("symbolic link" in why for why in repo.broken_snapshots().values())
    res = execute_prune(repo, plan_prune(snapshots_info(repo), 1))
    assert len(res["snapshots_deleted"]) == 2 and "data_kept" not in res
    assert (repo.path / "snapshots" / "planted").is_symlink() and (outside / "manifest").exists()
    assert len(repo.snapshots()) == 1
    rep = verify(repo)
    assert [p.name for p in rep.problems] == ["planted"] and "symbolic link" in rep.problems[0].message


def test_repo_that_is_a_file_is_a_clean_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("not a repo")
    for args in (["ls"], ["verify"], ["prune", "--keep-last", "1"]):
        p = run_gpusnap(*args, "--repo", f)
        assert p.returncode == 14, (args, p.returncode, p.stderr)
        assert "Traceback" not in p.stderr and "is a file" in p.stderr
    j = run_gpusnap("ls", "--repo", f, "--json")
    assert j.returncode == 14 and j.stdout.count("\n") == 1


@pytest.fixture
def public_dir():
    """A root-owned 0755 directory under /tmp that `nobody` can reach (pytest's tmp_path is
    0700)."""
    import tempfile
    d = tempfile.mkdtemp(prefix="gpusnap-trust-", dir="/tmp")
    os.chmod(d, 0o755)
    yield __import__("pathlib").Path(d)
    shutil.rmtree(d, ignore_errors=True)


@root_only
@pytest.mark.criu
@pytest.mark.parametrize("attack", ["locks", "tmp"])
def test_a_link_planted_in_a_user_writable_repository_is_refused_to_root(tmp_path, sample_job, attack, public_dir):
    """A repository a normal user can write, the user plants a symlink,
    root's next prune / dump --keep-last refuses (exit 14) and the victim is untouched."""
    repo = public_dir / "repo"
    run_gpusnap("init", "--repo", repo, check=True)
    job = sample_job(steps=5000, mb=8, threads=1, step_ms=20)
    job.wait_steps(3)
    run_gpusnap("dump", job.pid, "--repo", repo, "--name", "a", "--quiet", check=True)
    # the clumsy set-up the issue found: a repository in a folder `nobody` owns, mode 0777
    subprocess.run(["chown", "-R", "nobody:", str(repo)], check=True)
    os.chmod(repo, 0o777)
    victim_dir = tmp_path / "rootdir"
    victim_dir.mkdir()
    (victim_dir / "important").write_text("precious\n")
    victim = victim_dir / "important"
    if attack == "locks":
        _as_nobody(f"mv {repo}/locks {repo}/locks.old && mkdir {repo}/locks && ln -s {victim} {repo}/locks/writer")
    else:
        _as_nobody(f"mv {repo}/tmp {repo}/tmp.old && ln -s {victim_dir} {repo}/tmp")
    p = run_gpusnap("prune", "--keep-last", "1", "--repo", repo)
    assert p.returncode == 14 and "refusing" in p.stderr, p.stderr
    p = run_gpusnap("dump", job.pid, "--repo", repo, "--name", "a", "--keep-last", "1", "--quiet")
    assert p.returncode == 14, p.stderr
    assert victim.read_text() == "precious\n"
    assert job.alive()
    # once root takes the repository back (and removes the plant), it works again
    subprocess.run(["chown", "-R", "root:", str(repo)], check=True)
    os.chmod(repo, 0o700)
    if attack == "locks":
        shutil.rmtree(repo / "locks")
    else:
        os.unlink(repo / "tmp")
    os.rename(repo / f"{attack}.old", repo / attack)
    run_gpusnap("dump", job.pid, "--repo", repo, "--name", "a", "--keep-last", "1", "--quiet", check=True)
    assert [s["name"] for s in run_json("ls", "--repo", repo)["snapshots"]] == ["a"]
    assert run_gpusnap("verify", "--repo", repo).returncode == 0


def test_log_symlink_is_not_followed(tmp_path):
    """A symlink planted in logs/ is never written through: the log goes elsewhere."""
    from gpusnap.repo import logs as repo_logs
    repo = _repo_with_history(tmp_path, 1)
    victim = _victim(tmp_path)
    (repo.path / "logs").mkdir(mode=0o700, exist_ok=True)
    os.symlink(victim, repo.path / "logs" / "x-dump.log")
    src = tmp_path / "criu.log"
    src.write_text("criu log\n")
    kept = repo_logs.keep_log(repo.path, src, "x-dump")
    assert kept and not kept.startswith(str(repo.path)) and open(kept).read() == "criu log\n"
    assert open(victim).read() == "precious\n"
    assert repo_logs.keep_log(repo.path, src, "y-dump") == str(repo.path / "logs" / "y-dump.log")
