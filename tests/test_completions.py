"""The committed completions match the CLI; bash and fish accept them and complete commands."""

import shutil
import subprocess
from pathlib import Path

import pytest

from gpusnap.completion import SCRIPTS

COMPLETIONS = Path(__file__).resolve().parent.parent / "completions"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_completions_are_current(name):
    committed = (COMPLETIONS / name).read_text()
    assert committed == SCRIPTS[name](), f"completions/{name} is stale: run `make completions`"


def test_bash_completion_completes_commands_and_options():
    script = COMPLETIONS / "gpusnap.bash"
    probe = (f"source {script}; COMP_WORDS=(gpusnap du); COMP_CWORD=1; _gpusnap; echo ${{COMPREPLY[@]}}; "
             "COMP_WORDS=(gpusnap dump --ex); COMP_CWORD=2; _gpusnap; echo ${COMPREPLY[@]}; "
             "COMP_WORDS=(gpusnap schedule a); COMP_CWORD=2; _gpusnap; echo ${COMPREPLY[@]}")
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "dump"
    assert out[1] == "--exit"
    assert out[2] == "add"


@pytest.mark.skipif(not shutil.which("fish"), reason="fish is not installed")
def test_fish_accepts_its_script():
    subprocess.run(["fish", "-n", str(COMPLETIONS / "gpusnap.fish")], check=True)
