"""Docker's checkpoint directory stored in the archive form of docs/format.md §12 and made again
(repo/archive.py store_dir / write_dir), with no engine: the same images and layout a tar of
`checkpoint/` gives, pages deduplicated, every byte and mode back, and a layout that would put
anything outside the new directory refused as a damaged snapshot."""

from __future__ import annotations

import io
import json
import os
import tarfile

import pytest

from gpusnap.errors import CorruptSnapshot
from gpusnap.repo import Repository, archive

PAGE = 4096


def _checkpoint(d) -> dict[str, bytes]:
    d.mkdir(mode=0o700)
    files = {"pages-1.img": b"".join(bytes([i % 251 + 1]) * PAGE for i in range(64)),
             "core-1.img": b"core" * 100, "descriptors.json": b'["/dev/null"]'}
    for n, data in files.items():
        (d / n).write_bytes(data)
        os.chmod(d / n, 0o600 if n.endswith(".json") else 0o644)
    return files


def _store(repo, fill) -> object:
    with repo.writer_lock():
        w = repo.new_snapshot("ctr", compress="lz4", meta={"container": {"engine": "docker", "id": "a" * 64,
                                                                         "name": "ctr", "image": "img"}})
        fill(w)
        return w.commit(), w.stats


def test_a_checkpoint_directory_is_stored_as_its_tar_would_be_and_comes_back_whole(tmp_path):
    repo = Repository.init(tmp_path / "repo")
    files = _checkpoint(tmp_path / "cp")
    snap, _ = _store(repo, lambda w: archive.store_dir(w, tmp_path / "cp"))
    members = archive.layout(snap)
    assert [m["path"] for m in members] == ["checkpoint", "checkpoint/core-1.img", "checkpoint/descriptors.json",
                                            "checkpoint/pages-1.img"]
    assert all(m.get("image") == m["path"].split("/")[1] for m in members[1:])
    # the same directory as a tar (Podman's form) gives the same layout
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(tmp_path / "cp", arcname="checkpoint", recursive=False)
        for n in sorted(files):
            tar.add(tmp_path / "cp" / n, arcname=f"checkpoint/{n}")
    buf.seek(0)
    snap2, stats2 = _store(repo, lambda w: archive.store(w, buf))
    assert archive.layout(snap2) == members
    assert stats2["pages_dedup"] == 64                        # the pages were stored once
    out = tmp_path / "out" / "cp"
    out.parent.mkdir()
    assert archive.write_dir(snap, out) == sum(map(len, files.values()))
    for n, data in files.items():
        assert (out / n).read_bytes() == data
        assert os.stat(out / n).st_mode & 0o777 == os.stat(tmp_path / "cp" / n).st_mode & 0o777
    assert os.stat(out).st_mode & 0o777 == 0o700
    with pytest.raises(FileExistsError):                      # never into a directory already there
        archive.write_dir(snap, out)


@pytest.mark.parametrize("bad", ["../escape.img", "sub/x.img", "archive.x"])
def test_a_layout_that_leaves_the_checkpoint_directory_is_a_damaged_snapshot(tmp_path, bad):
    repo = Repository.init(tmp_path / "repo")

    def fill(w):
        s = w.image_sink("core-1.img")
        s.write(b"x" * 10)
        s.close()
        s = w.image_sink(archive.LAYOUT)
        s.write(json.dumps({"version": 1, "members": [
            {"path": "checkpoint", "kind": "dir", "mode": 0o700, "uid": 0, "gid": 0, "uname": "", "gname": "", "mtime": 0},
            {"path": f"checkpoint/{bad}", "kind": "file", "mode": 0o644, "uid": 0, "gid": 0, "uname": "",
             "gname": "", "mtime": 0, "image": "core-1.img", "size": 10}]}).encode())
        s.close()

    snap, _ = _store(repo, fill)
    with pytest.raises(CorruptSnapshot):
        archive.write_dir(snap, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "escape.img").exists()
