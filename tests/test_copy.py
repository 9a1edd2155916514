"""gpusnap copy: snapshots of real jobs (real CRIU) copied into a second repository, only what
it lacks sent, verified there and restored from there with the uninterrupted result; copies
interrupted (the sender SIGTERMed or SIGKILLed, the receiver SIGKILLed mid-transfer) leave no
snapshot behind and a rerun sends less than the whole; a damaged source and damaged frames
are refused with nothing committed; and the same through a real Debian sshd on 127.0.0.1,
started here with keys made here (SSHD=0 leaves that test out; without sshd it fails)."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import GPUSNAP, ROOT, checkout_bin, kill_pids, run_gpusnap, run_json, wait_for
from gpusnap.errors import CopyFailed, CorruptSnapshot, Interrupted
from gpusnap.repo import Repository
from gpusnap.repo.maint.verify import verify
from repo_helpers import PAGE, dump, read_all
from restore_helpers import job_and_two_repos, restore_and_finish


def _snapshot_dirs(repo: Path) -> list[str]:
    """What a reader of the repository sees: its snapshot directories (not .tmp-*)."""
    d = repo / "snapshots"
    return sorted(n for n in os.listdir(d) if not n.startswith(".")) if d.exists() else []


def _same_images(a, b) -> None:
    for im in a.manifest["images"]:
        assert read_all(a, im["name"]) == read_all(b, im["name"]), im["name"]


@pytest.mark.criu
def test_real_job_copied_incrementally_and_restored_from_the_copy(sample_job, tmp_path, reference):
    job, expected, a, b = job_and_two_repos(sample_job, tmp_path, reference)
    first = run_json("dump", job.pid, "--repo", a, "--name", "train")
    job.wait_steps(40)
    second = run_json("dump", job.pid, "--repo", a, "--name", "train")
    job.kill()
    one = run_json("copy", first["snapshot"], "--repo", a, "--to", b)
    assert one["copied"] == 1 and one["skipped"] == 0
    # by name: the first is there already (skipped), the second sends only what changed
    two = run_json("copy", "--name", "train", "--repo", a, "--to", b)
    assert [s["already_present"] for s in two["snapshots"]] == [True, False]
    assert two["snapshots"][0]["snapshot"] == one["snapshots"][0]["snapshot"]
    full, incr = one["bytes_sent"], two["snapshots"][1]["bytes_sent"]
    print(f"copy of a real job: first snapshot {full} bytes sent, second {incr} "
          f"({one['snapshots'][0]['bytes_raw']} bytes from CRIU each)")
    assert incr < full / 4, (full, incr)
    # the copies keep names, directory names and times, and the destination verifies clean
    assert _snapshot_dirs(b) == _snapshot_dirs(a)
    rb = Repository.open(b)
    for s in Repository.open(a).snapshots():
        c = rb.snapshot(s.path.name)
        assert c.created == s.created and c.meta["imported_from"]["id"] == s.id and c.meta["pid"] == s.meta["pid"]
    assert run_gpusnap("verify", "--repo", b).returncode == 0
    shutil.rmtree(a)                    # nothing is read from the source any more
    restore_and_finish(job, Path(second["snapshot"]).name, b, expected)


def _big_source(tmp_path, mib: int = 160):
    """A repository with one snapshot of `mib` MiB of incompressible pages (5 packs and more)."""
    repo = Repository.open(tmp_path / "a", create=True)
    images = {"pages-1.img": os.urandom(mib << 20), "core-1.img": os.urandom(5000), "big.img": os.urandom(3 << 20)}
    snap, _ = dump(repo, images, name="big", compress="none", chunk=1 << 20)
    return repo, snap


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _state(pid: int) -> str:
    try:
        st = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "gone"
    return st[st.rindex(")") + 2]


@pytest.mark.parametrize("how", ["sender-TERM", "sender-KILL", "receiver-KILL"])
def test_interrupted_copy_leaves_nothing_and_resumes(tmp_path, how):
    src, snap = _big_source(tmp_path)
    b = tmp_path / "b"
    run_gpusnap("init", "--repo", b, check=True)
    # the receiver stops (or dies) right after it named its first finished pack in an index file
    fault = "writer:checkpoint:KILL" if how == "receiver-KILL" else "writer:checkpoint:STOP"
    env = dict(os.environ, GPUSNAP_FAULT=fault)
    p = subprocess.Popen([*GPUSNAP, "copy", "big", "--repo", src.path, "--to", b, "--json"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if how != "receiver-KILL":
            wait_for(lambda: any(_state(c) == "T" for c in _children(p.pid)), "the receiver to stop at its checkpoint")
            serve = _children(p.pid)[0]
            p.send_signal(signal.SIGTERM if how == "sender-TERM" else signal.SIGKILL)
            time.sleep(0.3)
            os.kill(serve, signal.SIGCONT)
            wait_for(lambda: _state(serve) in ("gone", "Z"), "the receiver to end")
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    expect = {"sender-TERM": Interrupted.exit_code, "sender-KILL": -signal.SIGKILL,
              "receiver-KILL": CopyFailed.exit_code}[how]
    assert p.returncode == expect, (out, err)
    if how != "sender-KILL":
        assert json.loads(out)["exit_code"] == expect
    # nothing visible at the destination, and it verifies; the named packs stayed
    assert _snapshot_dirs(b) == []
    assert verify(Repository.open(b)).ok
    assert os.listdir(b / "index"), "the finished packs were not named: a rerun would send them again"
    again = run_json("copy", "big", "--repo", src.path, "--to", b)
    whole = sum(im["size"] for im in snap.manifest["images"])
    print(f"{how}: the rerun sent {again['bytes_sent']} of {whole} bytes, in {again['seconds']} s")
    assert again["copied"] == 1 and again["bytes_sent"] < whole - (30 << 20)
    rb = Repository.open(b)
    assert verify(rb).ok
    _same_images(snap, rb.snapshot(snap.path.name))


def test_two_copies_of_one_snapshot_at_once_commit_it_once(tmp_path):
    """Two catch-ups of one tiered snapshot race: both receivers find it absent and store it;
    the one that commits second finds the first's commit (docs/format.md §6) and keeps that."""
    src, snap = _big_source(tmp_path, mib=48)
    b = tmp_path / "b"
    run_gpusnap("init", "--repo", b, check=True)
    env = dict(os.environ, GPUSNAP_FAULT="writer:checkpoint:STOP")
    p = subprocess.Popen([*GPUSNAP, "copy", "big", "--repo", src.path, "--to", b, "--json"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: any(_state(c) == "T" for c in _children(p.pid)), "the first receiver to stop mid-copy")
        serve = _children(p.pid)[0]
        second = run_json("copy", "big", "--repo", src.path, "--to", b)
        assert second["copied"] == 1 and len(_snapshot_dirs(b)) == 1
        os.kill(serve, signal.SIGCONT)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 0, err
    first = json.loads(out)
    assert first["copied"] == 0 and first["skipped"] == 1, first
    assert first["snapshots"][0]["snapshot"] == second["snapshots"][0]["snapshot"]
    assert len(_snapshot_dirs(b)) == 1
    rb = Repository.open(b)
    assert verify(rb).ok
    _same_images(snap, rb.snapshots()[0])


def test_speed_and_untouched_second_copy(tmp_path):
    """A full copy of a 160 MiB snapshot, timed (docs/benchmark.md quotes it), then the same
    copy again: skipped, only the manifest travels."""
    src, snap = _big_source(tmp_path)
    run_gpusnap("init", "--repo", tmp_path / "b", check=True)
    t = time.monotonic()
    one = run_json("copy", "--all", "--repo", src.path, "--to", tmp_path / "b")
    print(f"copy of {sum(im['size'] for im in snap.manifest['images']) >> 20} MiB: {one['seconds']} s in copy, "
          f"{time.monotonic() - t:.2f} s with start-up; {one['bytes_sent']} bytes sent")
    two = run_json("copy", "--all", "--repo", src.path, "--to", tmp_path / "b")
    assert two["skipped"] == 1 and two["bytes_sent"] < 64 << 10


def test_damaged_source_is_refused_and_nothing_committed(tmp_path):
    repo = Repository.open(tmp_path / "a", create=True)
    images = {"pages-1.img": os.urandom(64 * PAGE), "core-1.img": os.urandom(5000)}
    snap, _ = dump(repo, images, name="job", compress="none")
    pack = next(p for p in (repo.path / "packs").rglob("*") if p.is_file())
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0x40            # inside a page's payload
    pack.write_bytes(bytes(data))
    b = tmp_path / "b"
    run_gpusnap("init", "--repo", b, check=True)
    proc = run_gpusnap("copy", "job", "--repo", repo.path, "--to", b)
    assert proc.returncode == CorruptSnapshot.exit_code, proc.stderr
    assert "is damaged: a page of pages-1.img fails its checksum" in proc.stderr, proc.stderr
    assert _snapshot_dirs(b) == [] and verify(Repository.open(b)).ok


def _frames(snap, image: str | None, flip: int) -> bytes:
    """What a copying gpusnap sends to copy `snap` into an empty repository (every page and
    blob wanted), with byte `flip` of `image`'s data frames changed (image None: unchanged)."""
    from gpusnap.ops.copy_wire import BYE, COMMIT, HELLO, MANIFEST, NEXT, PAGELIST, PROTOCOL, VERSION, Channel
    from gpusnap.ops.export import data_records, pages_payload

    out = io.BytesIO()
    ch = Channel(None, out, "test")
    ch.send_json(HELLO, {"protocol": PROTOCOL, "version": VERSION})
    ch.record(MANIFEST, (snap.path / "manifest").read_bytes())
    at = {}
    for im in snap.manifest["images"]:
        if im["type"] == "pages":
            ch.record(PAGELIST, snap.pagelist_bytes(im["name"]))
            at[im["name"]] = out.tell()
            data_records(ch, pages_payload(snap, im))
        else:
            ch.record(NEXT)
            at[im["name"]] = out.tell()
            data_records(ch, snap.read_image(im["name"]))
    ch.record(COMMIT)
    ch.record(BYE)
    raw = bytearray(out.getvalue())
    if image is not None:
        raw[at[image] + flip] ^= 1
    return bytes(raw)


@pytest.mark.parametrize("image,flip", [(None, 0), ("pages-1.img", 12 + 5000), ("pages-1.img", 3),
                                        ("pages-1.img", 0), ("core-1.img", 12 + 50)],
                         ids=["intact", "page", "frame-reserved", "frame-tag", "blob"])
def test_receiver_checks_every_frame(tmp_path, image, flip):
    """The receiving end in process, fed frames: a page or a blob changed in transit, or a
    frame head, is refused with exit 34 and nothing committed; intact, the snapshot is committed."""
    from gpusnap.ops.copy_wire import ERROR
    from gpusnap.ops.serve import serve

    repo = Repository.open(tmp_path / "a", create=True)
    snap, _ = dump(repo, {"pages-1.img": os.urandom(40 * PAGE), "core-1.img": os.urandom(100)}, name="job",
                   compress="none")
    b = Repository.open(tmp_path / "b", create=True)
    replies = io.BytesIO()
    code = serve(b.path, 0, io.BytesIO(_frames(snap, image, flip)), replies)
    if image is None:
        assert code == 0 and _snapshot_dirs(b.path) == [snap.path.name]
        _same_images(snap, Repository.open(b.path).snapshot(snap.path.name))
        return
    assert code == CopyFailed.exit_code
    said = replies.getvalue()
    assert said[said.rindex(bytes([ERROR, 0, 0, 0])):].count(b"the copying gpusnap broke the protocol") == 1
    assert _snapshot_dirs(b.path) == [] and verify(Repository.open(b.path)).ok


# ------------------------------------------------------------------------ through a real sshd

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def sshd(tmp_path):
    """A real OpenSSH server on 127.0.0.1 at a free high port, with a host key and a user key
    made here; -> (port, the environment for gpusnap: GPUSNAP_RSH names an ssh configuration of
    its own, so neither ~/.ssh nor the system's known hosts are read or changed)."""
    if os.environ.get("SSHD") == "0":
        pytest.skip("SSHD=0: the sshd test is switched off")
    if os.geteuid() != 0:
        pytest.skip("the sshd test runs as root (sshd must switch to the logged-in user)")
    if not (os.access("/usr/sbin/sshd", os.X_OK) and shutil.which("ssh") and shutil.which("ssh-keygen")):
        pytest.fail("openssh-server and openssh-client are not installed (scripts/test-deps.sh installs them; "
                    "SSHD=0 leaves this test out on purpose)")
    d = tmp_path / "ssh"
    d.mkdir(mode=0o700)
    for key in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", d / key], check=True)
    shutil.copy(d / "user_key.pub", d / "authorized_keys")
    port = _free_port()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host_key\nPidFile {d}/sshd.pid\n"
        f"AuthorizedKeysFile {d}/authorized_keys\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n")
    (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {(d / 'host_key.pub').read_text()}")
    (d / "ssh_config").write_text(
        f"Host 127.0.0.1\n  IdentityFile {d}/user_key\n  IdentitiesOnly yes\n  UserKnownHostsFile {d}/known_hosts\n"
        "  StrictHostKeyChecking yes\n  BatchMode yes\n  LogLevel ERROR\n")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)     # sshd's privilege separation directory
    proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", d / "sshd_config"], stdin=subprocess.DEVNULL,
                            stderr=open(d / "sshd.log", "wb"))

    def listening() -> bool:
        assert proc.poll() is None, f"sshd ended: {(d / 'sshd.log').read_text()}"
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    try:
        wait_for(listening, "sshd to listen", timeout=30)
        yield port, dict(os.environ, GPUSNAP_RSH=f"ssh -F {d}/ssh_config")
    finally:
        proc.terminate()        # the listener; each session's own sshd ends with its connection
        proc.wait(timeout=30)


@pytest.mark.criu
def test_copy_through_a_real_sshd(sample_job, tmp_path, reference, sshd):
    port, env = sshd
    job, expected, a, b = job_and_two_repos(sample_job, tmp_path, reference)
    snap = run_json("dump", job.pid, "--repo", a, "--name", "remote")
    job.kill()
    remote = checkout_bin(tmp_path) / "gpusnap"      # this checkout's gpusnap as one program path
    to = f"ssh://root@127.0.0.1:{port}{b}"
    res = run_json("copy", "--all", "--repo", a, "--to", to, "--remote-gpusnap", remote, env=env)
    assert res["copied"] == 1 and res["snapshots"][0]["snapshot"] == str(b / "snapshots" / Path(snap["snapshot"]).name)
    print(f"through sshd: {res['bytes_sent']} bytes sent in {res['seconds']} s")
    again = run_json("copy", "--all", "--repo", a, "--to", to, "--remote-gpusnap", remote, env=env)
    assert again["skipped"] == 1
    # errors at the other end keep their exit code; an unknown host key is refused by ssh
    proc = run_gpusnap("copy", "--all", "--repo", a, "--to", f"ssh://root@127.0.0.1:{port}{tmp_path}/none",
                       "--remote-gpusnap", remote, env=env)
    assert proc.returncode == 14 and "no gpusnap repository" in proc.stderr, proc.stderr
    bad_env = dict(env, GPUSNAP_RSH=env["GPUSNAP_RSH"] + f" -o UserKnownHostsFile={tmp_path}/empty")
    proc = run_gpusnap("copy", "--all", "--repo", a, "--to", to, "--remote-gpusnap", remote, env=bad_env)
    assert proc.returncode == CopyFailed.exit_code and "exited with status 255" in proc.stderr, proc.stderr
    assert run_gpusnap("verify", "--repo", b).returncode == 0
    shutil.rmtree(a)
    restore_and_finish(job, "remote", b, expected)


@pytest.mark.criu
def test_restore_pulls_the_newest_snapshot_from_an_ssh_tier(sample_job, tmp_path, reference, sshd):
    """`restore NAME --copy-to ssh://…` after the node's repository was lost: the newest snapshot
    of NAME there is listed through ssh, pulled here (checked on arrival) and restored; an older
    one here does not win over it, and a tier nobody answers leaves this repository's."""
    port, env = sshd
    job, expected, a, b = job_and_two_repos(sample_job, tmp_path, reference)
    remote = checkout_bin(tmp_path) / "gpusnap"
    to = f"ssh://root@127.0.0.1:{port}{b}"
    first = run_json("dump", job.pid, "--repo", a, "--name", "train")
    job.wait_steps(20)
    second = run_json("dump", job.pid, "--repo", a, "--name", "train")
    run_json("copy", "--all", "--repo", a, "--to", to, "--remote-gpusnap", remote, env=env)
    job.kill()
    shutil.rmtree(a)                                   # the node's repository is lost ...
    run_gpusnap("init", "--repo", a, check=True)
    run_json("copy", Path(first["snapshot"]).name, "--repo", b, "--to", a)    # ... but for an older snapshot
    restored = run_json("restore", "train", "--repo", a, "--copy-to", to, "--remote-gpusnap", remote, env=env)
    try:
        assert restored["pid"] == job.pid
        assert Path(restored["snapshot"]).name == Path(second["snapshot"]).name, restored
        assert Path(restored["snapshot"]).parent == a / "snapshots"     # pulled here, restored from here
        assert job.result() == expected
    finally:
        kill_pids(job.pids)
    pulled = Repository.open(a).snapshot(Path(second["snapshot"]).name)
    assert pulled.meta["imported_from"]["id"] == Repository.open(b).snapshot(pulled.path.name).id
    assert run_gpusnap("verify", "--repo", a).returncode == 0
    # the tier cannot be reached: this repository's newest is restored, and the output says why
    bad = dict(env, GPUSNAP_RSH=env["GPUSNAP_RSH"] + f" -o UserKnownHostsFile={tmp_path}/empty")
    p = run_gpusnap("restore", "train", "--repo", a, "--copy-to", to, "--remote-gpusnap", remote, "--json",
                    "--via", "files", env=bad)
    try:
        out = json.loads(p.stdout)
        assert p.returncode == 0 and out["pid"] == job.pid, p.stderr
        assert Path(out["snapshot"]).name == Path(second["snapshot"]).name
        assert any("cannot list the snapshots in" in n for n in out["notes"]), out["notes"]
    finally:
        kill_pids(job.pids)
