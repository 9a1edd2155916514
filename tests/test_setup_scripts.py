"""scripts/debian-mirror.sh, which setup.sh and fresh-machine.sh source: the mirror of this
release's own apt sources, as exactly one line (twice printed, debootstrap was handed both
lines and the fresh-machine check failed before it began)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import ROOT

STANZA = "Types: deb\nURIs: {uri}\nSuites: {suites}\nComponents: main\n"


def mirror(tmp_path: Path, sources: str | None = None, oneline: str | None = None,
           codename: str = "bookworm") -> str:
    etc = tmp_path / "apt"
    (etc / "sources.list.d").mkdir(parents=True)
    if sources is not None:
        (etc / "sources.list.d" / "debian.sources").write_text(sources)
    if oneline is not None:
        (etc / "sources.list").write_text(oneline)
    osr = tmp_path / "os-release"
    osr.write_text(f"ID=debian\nVERSION_CODENAME={codename}\n")
    r = subprocess.run(["bash", "-c", f". {ROOT / 'scripts' / 'debian-mirror.sh'}; debian_mirror"],
                       capture_output=True, text=True, check=True,
                       env={"PATH": "/usr/bin:/bin", "GPUSNAP_APT_ETC": str(etc), "GPUSNAP_OS_RELEASE": str(osr)})
    return r.stdout


@pytest.mark.parametrize("trailing_blank", [True, False])
def test_deb822_stanzas_give_the_release_mirror_once(tmp_path, trailing_blank):
    # as Debian 12's and 13's own file: the release and its updates, a blank line, security
    text = (STANZA.format(uri="http://mirror.example/debian", suites="bookworm bookworm-updates") + "\n"
            + STANZA.format(uri="http://mirror.example/debian-security", suites="bookworm-security"))
    out = mirror(tmp_path, sources=text + ("\n" if trailing_blank else ""))
    assert out == "http://mirror.example/debian\n"


def test_the_stanza_of_this_release_is_chosen(tmp_path):
    text = (STANZA.format(uri="http://other.example/debian", suites="sid") + "\n"
            + STANZA.format(uri="http://mine.example/debian", suites="trixie trixie-updates"))
    assert mirror(tmp_path, sources=text, codename="trixie") == "http://mine.example/debian\n"


def test_one_line_sources_and_the_fallback(tmp_path):
    line = "deb [signed-by=/usr/share/keyrings/k.gpg] http://line.example/debian bookworm main\n"
    assert mirror(tmp_path / "a", oneline=line) == "http://line.example/debian\n"
    assert mirror(tmp_path / "b") == "http://deb.debian.org/debian\n"
