"""Where gpusnap finds its own files (the CRIU plugin directory)."""

from __future__ import annotations

from gpusnap import settings
from pathlib import Path

PLUGIN_NAME = "gpusnap_cuda.so"
SYSTEM_PLUGIN_DIR = Path("/usr/local/lib/gpusnap/plugins")


def source_root() -> Path:
    """The checkout gpusnap runs from (the directory holding pyproject.toml)."""
    return Path(__file__).resolve().parents[2]


def plugin_dir() -> Path:
    """The directory passed to CRIU as --libdir.

    $GPUSNAP_PLUGIN_DIR if set, else <source tree>/build/plugins when it exists (a development
    checkout built with CMake), else /usr/local/lib/gpusnap/plugins.
    """
    env = settings.get("GPUSNAP_PLUGIN_DIR")
    if env:
        return Path(env)
    dev = source_root() / "build" / "plugins"
    if dev.is_dir():
        return dev
    return SYSTEM_PLUGIN_DIR


def plugin_path() -> Path:
    """The CUDA plugin inside plugin_dir() (it may not exist)."""
    return plugin_dir() / PLUGIN_NAME
