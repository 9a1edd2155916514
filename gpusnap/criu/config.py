"""CRIU's own configuration files never change what gpusnap runs.

CRIU reads options from /etc/criu/default.conf, ~/.criu/default.conf and the file named by
$CRIU_CONFIG_FILE before its command line (criu/config.c). An option there (a
--leave-stopped, an action script, a different network lock) would change a dump that
gpusnap records as made with the options it chose. gpusnap chooses every option itself, so
every CRIU it starts gets `--no-default-config` (which skips the first two) and an
environment without CRIU_CONFIG_FILE (which --no-default-config does not skip). `doctor`
names the files that exist, so that a user who wrote one knows it is not applied.
"""

from __future__ import annotations

import os
from pathlib import Path

ARGS = ["--no-default-config"]
ENV_VAR = "CRIU_CONFIG_FILE"
GLOBAL_FILE = Path("/etc/criu/default.conf")


def argv(criu: str, action: str, *args: str) -> list[str]:
    """A CRIU command line that reads no configuration file."""
    return [criu, action, *ARGS, *args]


def environ(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: ours) without the variable that names a CRIU configuration file."""
    env = dict(os.environ if base is None else base)
    env.pop(ENV_VAR, None)
    return env


def files(env: dict[str, str] | None = None) -> list[str]:
    """The CRIU configuration files that a plain `criu` run here would read (none of them
    is read by gpusnap's)."""
    env = os.environ if env is None else env
    found = [GLOBAL_FILE]
    if env.get("HOME"):
        found.append(Path(env["HOME"]) / ".criu" / "default.conf")
    if env.get(ENV_VAR):
        found.append(Path(env[ENV_VAR]))
    # os.path: a file this user may not look at (root's HOME, for a user) counts as absent
    return [str(p) for p in found if os.path.isfile(p)]
