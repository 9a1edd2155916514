"""Completion of option values that name things: `restore --via` (its four paths) and `--name`
(the job names in the repository: of its snapshots and of its `gpusnap run` jobs), in the real
bash and fish; and the progress bar's byte columns in the binary units of every summary."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from gpusnap.completion import CGROUPS, ENGINES, VIAS
from gpusnap.ops import restore

COMPLETIONS = Path(__file__).resolve().parent.parent / "completions"


def test_the_via_choices_are_restores():
    assert VIAS == restore.VIAS


def test_the_cgroups_choices_are_restores():
    assert CGROUPS == restore.CGROUPS


def test_the_engine_choices_are_the_engines_gpusnap_drives():
    from gpusnap.system import engines

    assert sorted(ENGINES) == sorted(engines.ENGINES)


def _repo(tmp_path: Path) -> Path:
    r = tmp_path / "repo"
    for d in ("snapshots/fold-20261130T111500Z", "snapshots/fold-20261130T121500Z-2", "snapshots/train-20261130T101500Z",
              "jobs/sweep"):
        (r / d).mkdir(parents=True)
    return r


def _bash(words: list[str]) -> list[str]:
    arr = " ".join(f"'{w}'" for w in words)
    probe = (f"source {COMPLETIONS / 'gpusnap.bash'}; COMP_WORDS=({arr}); COMP_CWORD={len(words) - 1}; "
             "_gpusnap; printf '%s\\n' \"${COMPREPLY[@]}\"")
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True, env=dict(os.environ)).stdout
    return sorted(x for x in out.splitlines() if x)


def _fish(line: str) -> list[str]:
    out = subprocess.run(["fish", "-c", f"source {COMPLETIONS / 'gpusnap.fish'}; complete -C '{line}'"],
                         capture_output=True, text=True, check=True).stdout
    return sorted(ln.split("\t")[0] for ln in out.splitlines() if ln)


def test_via_and_name_complete_in_bash(tmp_path):
    r = _repo(tmp_path)
    assert _bash(["gpusnap", "restore", "--via", ""]) == ["auto", "files", "lazy", "stream"]
    assert _bash(["gpusnap", "restore", "--via", "f"]) == ["files"]
    assert _bash(["gpusnap", "dump", "--engine", ""]) == ["docker", "podman"]
    assert _bash(["gpusnap", "restore", "--cgroups", "s"]) == ["soft", "strict"]
    assert _bash(["gpusnap", "dump", "--repo", str(r), "--name", ""]) == ["fold", "sweep", "train"]
    assert _bash(["gpusnap", "schedule", "add", "--repo", str(r), "--name", "f"]) == ["fold"]


def test_via_and_name_complete_in_fish(tmp_path):
    r = _repo(tmp_path)
    assert _fish("gpusnap restore --via ") == ["auto", "files", "lazy", "stream"]
    assert _fish(f"gpusnap dump --repo {r} --name ") == ["fold", "sweep", "train"]


def test_the_progress_bar_counts_in_binary_units():
    from rich.progress import Progress

    from gpusnap.render.progress import BytesColumn, SpeedColumn

    bar = Progress()
    tid = bar.add_task("x", total=4 << 30, completed=3 << 29)
    task = next(t for t in bar.tasks if t.id == tid)
    assert str(BytesColumn().render(task)) == "1.5 GiB/4.0 GiB"
    assert str(SpeedColumn().render(task)) == "?"


def test_schedule_add_name_offers_job_and_schedule_names(tmp_path):
    r = _repo(tmp_path)
    specs = tmp_path / "schedules"
    specs.mkdir()
    (specs / "nightly.json").write_text("{}")
    env = {**os.environ, "GPUSNAP_SCHEDULE_DIR": str(specs)}
    probe = (f"source {COMPLETIONS / 'gpusnap.bash'}; COMP_WORDS=(gpusnap schedule add --repo {r} --name ''); "
             "COMP_CWORD=6; _gpusnap; printf '%s\\n' \"${COMPREPLY[@]}\"")
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True, env=env).stdout
    assert sorted(out.split()) == ["fold", "nightly", "sweep", "train"]
    fish = subprocess.run(["fish", "-c", f"source {COMPLETIONS / 'gpusnap.fish'}; "
                           f"complete -C 'gpusnap schedule add --repo {r} --name '"],
                          capture_output=True, text=True, check=True, env=env).stdout
    assert sorted(ln.split("\t")[0] for ln in fish.splitlines()) == ["fold", "nightly", "sweep", "train"]
