"""Shell completions, the one mechanism (the shipped scripts in completions/): current with
the CLI, and completing in the real bash, zsh and fish what a user types: commands, options,
codecs after --compress, snapshot names from the repository (--repo on the line or
$GPUSNAP_REPO), schedule names. zsh is driven through a pseudo-terminal with a real TAB."""

import os
import pty
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import run_gpusnap
from gpusnap.completion import CODECS, SCRIPTS

COMPLETIONS = Path(__file__).resolve().parent.parent / "completions"
SNAPS = ["train-20261130T101500Z", "train-20261130T111500Z", "fold-20261130T111500Z"]


@pytest.fixture
def repo(tmp_path):
    """A repository as completion sees it: only snapshots/ directory names are read."""
    r = tmp_path / "repo"
    for s in SNAPS:
        (r / "snapshots" / s).mkdir(parents=True)
    (r / "snapshots" / ".tmp-train-1-2").mkdir()     # a dump in progress: never offered
    specs = tmp_path / "schedules"
    specs.mkdir()
    (specs / "nightly.json").write_text("{}")
    return r


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_completions_are_current(name):
    committed = (COMPLETIONS / name).read_text()
    assert committed == SCRIPTS[name](), f"completions/{name} is stale: run `make completions`"


def test_typer_completion_is_off():
    """One mechanism: no --install-completion with different behaviour."""
    assert "--install-completion" not in run_gpusnap("--help", check=True).stdout


def _bash(words: list[str], env: dict | None = None) -> list[str]:
    arr = " ".join(f"'{w}'" for w in words)
    probe = (f"source {COMPLETIONS / 'gpusnap.bash'}; COMP_WORDS=({arr}); COMP_CWORD={len(words) - 1}; "
             "_gpusnap; printf '%s\\n' \"${COMPREPLY[@]}\"")
    e = dict(os.environ)
    e.update(env or {})
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True, env=e).stdout
    return sorted(x for x in out.splitlines() if x)


def test_bash(repo):
    assert _bash(["gpusnap", "du"]) == ["dump"]
    assert _bash(["gpusnap", "dump", "--ex"]) == ["--exit"]
    assert _bash(["gpusnap", "schedule", "a"]) == ["add"]
    assert _bash(["gpusnap", "dump", "--compress", ""]) == sorted(CODECS)
    assert _bash(["gpusnap", "dump", "--compress", "z"]) == ["zstd"]
    assert _bash(["gpusnap", "restore", "--repo", str(repo), "tr"]) == ["train", *SNAPS[:2]]
    for cmd in ("inspect", "verify", "forget", "export"):
        assert _bash(["gpusnap", cmd, "f"], env={"GPUSNAP_REPO": str(repo)}) == ["fold", SNAPS[2]]
    assert _bash(["gpusnap", "restore", "tr"], env={"GPUSNAP_REPO": str(repo / "nowhere")}) == []
    got = _bash(["gpusnap", "schedule", "rm", ""], env={"GPUSNAP_SCHEDULE_DIR": str(repo.parent / "schedules")})
    assert "nightly" in got and "add" not in got and not [w for w in got if not w.startswith("-") and w != "nightly"]
    assert _bash(["gpusnap", "ls", "--repo", str(repo)[:-2]]) == [str(repo)]


@pytest.mark.skipif(not shutil.which("fish"), reason="fish is not installed (scripts/setup.sh installs it)")
def test_fish(repo):
    def complete(line: str, env=None) -> list[str]:
        e = dict(os.environ)
        e.update(env or {})
        cmd = f"source {COMPLETIONS / 'gpusnap.fish'}; complete -C {line!r}"
        out = subprocess.run(["fish", "-c", cmd], capture_output=True, text=True, check=True, env=e).stdout
        return sorted(ln.split("\t")[0] for ln in out.splitlines() if ln)

    subprocess.run(["fish", "-n", str(COMPLETIONS / "gpusnap.fish")], check=True)
    assert complete("gpusnap du") == ["dump"]
    assert complete("gpusnap dump --compress ") == sorted(CODECS)
    assert complete(f"gpusnap restore --repo {repo} tr") == ["train", *SNAPS[:2]]
    for cmd in ("inspect", "verify", "forget", "export"):
        assert complete(f"gpusnap {cmd} f", env={"GPUSNAP_REPO": str(repo)}) == ["fold", SNAPS[2]]
    assert complete("gpusnap schedule rm ", env={"GPUSNAP_SCHEDULE_DIR": str(repo.parent / "schedules")}) == ["nightly"]


def _zsh_tab(typed: str, want: str, env: dict) -> str:
    """Type `typed` + TAB into an interactive zsh with the shipped completion; return what
    the terminal shows once `want` appears (or after 20 s, then the assertion says why)."""
    pid, fd = pty.fork()
    if pid == 0:
        os.environ.update(env)
        os.environ["TERM"] = "dumb"
        os.execvp("zsh", ["zsh", "-f", "-i"])
    out = b""

    def pump(until: bytes) -> None:
        nonlocal out
        end = time.monotonic() + 20
        while time.monotonic() < end and until not in out.replace(b"\x07", b""):
            r, _, _ = select.select([fd], [], [], 0.1)
            if r:
                try:
                    out += os.read(fd, 65536)
                except OSError:
                    return

    try:
        os.write(fd, f"fpath=({COMPLETIONS} $fpath); autoload -Uz compinit; compinit -u -D; "
                     "PS1=\"$(echo R)EADY> \"\n".encode())
        pump(b"READY> ")
        out = b""
        os.write(fd, f"{typed}\t".encode())
        pump(want.encode())
        return out.replace(b"\x07", b"").decode(errors="replace")
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(fd)


@pytest.mark.skipif(not shutil.which("zsh"), reason="zsh is not installed (scripts/setup.sh installs it)")
def test_zsh(repo):
    env = {"GPUSNAP_REPO": str(repo), "GPUSNAP_SCHEDULE_DIR": str(repo.parent / "schedules")}
    shown = _zsh_tab("gpusnap dump --compress ", "shuffle2-zstd", env)
    assert all(c in shown for c in CODECS), shown
    shown = _zsh_tab(f"gpusnap restore --repo {repo} tr", "repo train", env)   # the name, the common prefix
    assert "fold" not in shown, shown
    shown = _zsh_tab(f"gpusnap restore --repo {repo} train-20261130T1", "T111500Z", env)   # ambiguous: listed
    assert SNAPS[0] in shown and SNAPS[1] in shown and "fold" not in shown, shown
    shown = _zsh_tab("gpusnap inspect fold-", SNAPS[2], env)     # unique: completed in place
    assert SNAPS[2] in shown, shown
    shown = _zsh_tab("gpusnap schedule rm ni", "nightly", env)
    assert "nightly" in shown, shown
    shown = _zsh_tab("gpusnap forg", "forget", env)
    assert "forget" in shown, shown
