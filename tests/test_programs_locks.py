"""A sqlite writer inside an open transaction (it holds the database's file locks) is dumped,
killed, restored, and commits: the row is in the database afterwards."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import kill_pids, run_gpusnap, run_json
from gpusnap.system import filelocks, proc

pytestmark = pytest.mark.criu

WRITER = r"""
import os, sqlite3, sys, time
db_path, go, out = sys.argv[1:4]
db = sqlite3.connect(db_path, isolation_level=None)
db.execute("BEGIN IMMEDIATE")              # takes the RESERVED lock: other writers must wait
db.execute("INSERT INTO t VALUES (?)", ("written inside the transaction",))
print("in transaction", flush=True)
while not os.path.exists(go):
    time.sleep(0.05)
db.execute("COMMIT")
n = db.execute("SELECT count(*) FROM t").fetchone()[0]
with open(out, "w") as f:
    f.write(f"committed {n}\n")
"""


def _wait_for(path: Path, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.05)
    raise AssertionError(f"{path} did not appear within {timeout} s")


def test_sqlite_writer_in_a_transaction_commits_after_restore(tmp_path, repo):
    db_path = tmp_path / "data.db"
    with sqlite3.connect(db_path) as db:
        db.execute("CREATE TABLE t (x TEXT)")
        db.execute("INSERT INTO t VALUES ('before')")
    db.close()
    go, out, log = tmp_path / "go", tmp_path / "out", tmp_path / "writer.log"
    with open(log, "w") as logf:
        p = subprocess.Popen([sys.executable, "-c", WRITER, str(db_path), str(go), str(out)],
                             stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True)
    restored: list[int] = []
    try:
        assert _wait_for(log) == "in transaction"
        locks = filelocks.file_locks([p.pid])
        assert any(lk["kind"] == "POSIX" and lk["path"] == str(db_path) for lk in locks), locks
        doc = run_gpusnap("doctor", p.pid)
        assert "file locks" in doc.stdout and "--file-locks" in doc.stdout, doc.stdout

        info = run_json("dump", p.pid, "--repo", repo, "--exit")
        assert not info["job_running"]
        p.wait(timeout=30)
        assert proc.wait_gone([p.pid], 30) == []
        # the lock died with the job: another writer could now take it (we do not: the journal
        # of the open transaction must stay as the snapshot saw it)
        assert not [lk for lk in filelocks.file_locks([p.pid])]

        res = run_json("restore", info["snapshot"], "--repo", repo)
        restored = res["pids"]
        # the restored writer holds the lock again: a second writer cannot start a transaction
        other = sqlite3.connect(db_path, timeout=0, isolation_level=None)
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            other.execute("BEGIN IMMEDIATE")
        other.close()
        go.touch()
        assert _wait_for(out) == "committed 2"
        with sqlite3.connect(db_path) as db:
            rows = [r[0] for r in db.execute("SELECT x FROM t ORDER BY rowid")]
        assert rows == ["before", "written inside the transaction"]
    finally:
        kill_pids(restored)
        if p.poll() is None:
            p.kill()
            p.wait()


def test_flock_holder_keeps_its_lock_across_restore(tmp_path, repo):
    target = tmp_path / "locked"
    target.write_text("x")
    out = tmp_path / "out"
    code = (f"import fcntl,os,time,sys; f=open({str(target)!r},'r+'); fcntl.flock(f, fcntl.LOCK_EX); "
            f"print('ready',flush=True)\nwhile not os.path.exists({str(tmp_path / 'go')!r}): time.sleep(0.05)\n"
            f"open({str(out)!r},'w').write('done')")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         text=True, start_new_session=True)
    restored: list[int] = []
    try:
        assert p.stdout.readline().strip() == "ready"
        info = run_json("dump", p.pid, "--repo", repo, "--exit")
        p.wait(timeout=30)
        res = run_json("restore", info["snapshot"], "--repo", repo)
        restored = res["pids"]
        import fcntl

        with open(target, "r+") as f:
            with pytest.raises(BlockingIOError):
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        (tmp_path / "go").touch()
        assert _wait_for(out) == "done"
    finally:
        kill_pids(restored)
        if p.poll() is None:
            p.kill()
            p.wait()


HOLDER = r"""
import fcntl, os, struct, sys, time
a, b, c = (open(p, "r+b") for p in sys.argv[1:4])
fcntl.flock(a, fcntl.LOCK_EX)                       # flock: the open file's
fcntl.lockf(b, fcntl.LOCK_EX)                       # POSIX: the process's
F_OFD_SETLK = 37
fcntl.fcntl(c, F_OFD_SETLK, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0) + bytes(4))   # OFD
print("locked", flush=True)
time.sleep(60)
"""


def test_every_kind_of_lock_is_seen_through_the_holders_open_files(tmp_path):
    """flock, POSIX and OFD locks all show in the holder's /proc/PID/fdinfo, which is what
    file_locks reads (it reads /proc/locks only where an fdinfo cannot be read: that
    file's first read costs an RCU grace period)."""
    paths = [tmp_path / n for n in ("flock", "posix", "ofd")]
    for p in paths:
        p.write_bytes(b"x" * 16)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, *map(str, paths)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        found = {(lk["kind"], lk["path"]) for lk in filelocks.file_locks([holder.pid])}
        assert {("FLOCK", str(paths[0])), ("POSIX", str(paths[1])), ("OFDLCK", str(paths[2]))} <= found, found
    finally:
        holder.kill()
        holder.wait()
