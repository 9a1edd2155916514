"""`make install` (what set-up runs) and `make uninstall`: gpusnap is a command on PATH for root
and for users, runs without the checkout (a copy in /opt/gpusnap/venv), its completions load in
bash, zsh and fish from the system's directories, and uninstall removes every file it put there.
The test leaves the machine installed (it installs again at the end)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT
from gpusnap import __version__

pytestmark = pytest.mark.criu     # root: it installs into /usr/local and /opt

CLEAN = ["env", "-i", "HOME=/", "PATH=/usr/local/bin:/usr/bin:/bin"]
MANIFEST = Path("/opt/gpusnap/installed")
SYSTEM = {"bash": Path("/usr/share/bash-completion/completions/gpusnap"),
          "zsh": Path("/usr/local/share/zsh/site-functions/_gpusnap"),
          "fish": Path("/usr/share/fish/vendor_completions.d/gpusnap.fish")}


def _make(target: str) -> None:
    # `make install` would run the whole set-up first; its install step is this script
    subprocess.run(["bash", "scripts/install.sh", target], cwd=ROOT, check=True, capture_output=True, timeout=600)


@pytest.fixture(scope="module")
def installed():
    _make("install")
    yield
    _make("install")


def _sh(line: str, *, user: str | None = None, cwd: str = "/") -> subprocess.CompletedProcess:
    who = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"] if user else []
    return subprocess.run([*CLEAN, *who, "sh", "-c", line], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_gpusnap_is_a_command_for_root_and_for_users(installed, tmp_path):
    assert _sh("command -v gpusnap").stdout.strip() == "/usr/local/bin/gpusnap"
    for user in (None, "nobody"):
        r = _sh("gpusnap --version", user=user)
        assert (r.returncode, r.stdout) == (0, f"gpusnap {__version__}\n"), (user, r.stderr)
    # a directory holding a `gpusnap` package where the user stands never replaces the real one
    (tmp_path / "gpusnap").mkdir()
    (tmp_path / "gpusnap" / "__main__.py").write_text("print('decoy')\n")
    r = _sh("gpusnap --version", cwd=str(tmp_path))
    assert r.stdout == f"gpusnap {__version__}\n", r.stdout


def test_the_installed_command_runs_without_the_checkout(installed):
    """The checkout (and the .venv it links) hidden under an empty tmpfs: gpusnap still runs, its
    native parts found in /usr/local/lib/gpusnap."""
    hide = sorted({str(ROOT.parent), str(Path(os.path.realpath(ROOT / ".venv")).parent.parent)}, key=len,
                  reverse=True)                               # the deeper first: a mount hides what is below
    mounts = " && ".join(f"mount -t tmpfs none {d}" for d in hide)
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", *CLEAN, "sh", "-c",
                        f"{mounts} && test ! -e {ROOT}/gpusnap && gpusnap doctor --json"],
                       capture_output=True, text=True, cwd="/", timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    for name in ("page library", "post-dump gate"):
        assert checks[name]["status"] == "ok" and "/usr/local/lib/gpusnap/" in checks[name]["detail"], checks[name]


def test_completions_load_from_the_system_directories(installed):
    # bash: what bash-completion's loader does for `gpusnap` (source completions/<command>)
    r = subprocess.run([*CLEAN, "bash", "-c", f"source {SYSTEM['bash']}; COMP_WORDS=(gpusnap resto); COMP_CWORD=1; "
                        "_gpusnap; echo ${COMPREPLY[@]}"], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["restore"], r.stderr
    # zsh: compinit finds _gpusnap on its default fpath
    r = subprocess.run([*CLEAN, "zsh", "-f", "-c", "autoload -U compinit && compinit -u -D && print -r -- $_comps[gpusnap]"],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "_gpusnap", (r.stdout, r.stderr)
    # fish: autoloaded from vendor_completions.d on the first completion
    r = subprocess.run([*CLEAN, "fish", "-c", "complete -C 'gpusnap resto'"],
                       capture_output=True, text=True, timeout=60)
    assert [ln.split("\t")[0] for ln in r.stdout.splitlines()] == ["restore"], (r.stdout, r.stderr)


def test_uninstall_removes_every_installed_file(installed):
    entries = [p for p in MANIFEST.read_text().split() if p]
    files = [Path(p) for p in entries]
    # a directory the install made may since hold another package's files (fish installed
    # after gpusnap: /usr/share/fish/): uninstall leaves such a one, and only such a one
    shared = {Path(p) for p in entries if p.endswith("/") and os.path.isdir(p)
              and any(str(q) not in entries and f"{q}/" not in entries for q in Path(p).iterdir())}
    assert all(p.exists() for p in files)
    assert Path("/usr/local/bin/gpusnap") in files and Path("/opt/gpusnap/venv") in files
    assert set(SYSTEM.values()) <= set(files)
    _make("uninstall")
    try:
        assert [p for p in files if p.exists() and p not in shared] == []
        assert not MANIFEST.exists()
        assert shutil.which("gpusnap", path="/usr/local/bin:/usr/bin:/bin") is None
        assert Path("/usr/local/sbin/criu").exists()          # set-up's CRIU stays
    finally:
        _make("install")
    assert _sh("gpusnap --version").returncode == 0
