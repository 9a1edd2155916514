"""Allows `python -m gpusnap`."""

from gpusnap.cli import main

main()
