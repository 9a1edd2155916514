"""Allows `python -m gpusnap`."""

from gpusnap.cli import run

run()
