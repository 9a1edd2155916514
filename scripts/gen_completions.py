"""Write completions/ from the CLI (bash, zsh, fish). Run after changing commands or options."""

from pathlib import Path

from gpusnap.completion import SCRIPTS

out = Path(__file__).resolve().parent.parent / "completions"
out.mkdir(exist_ok=True)
for name, render in SCRIPTS.items():
    (out / name).write_text(render())
    print(f"wrote {out / name}")
