"""The GPUSNAP_* variables gpusnap reads, read in one place.

`current()` is this process's Settings: made once at start-up by the command line (load(),
in cli.main), so every part of one command sees the same values; in library use (the demo,
tests that call functions in-process) it is read from the environment when asked. Values
stay the strings that were set: each is parsed where it is used, by that setting's rule,
and a command-line option that stands for one (--lock-wait for GPUSNAP_LOCK_WAIT) wins
there. What each one means is in docs/environment.md, the one list;
tests/test_docs_env.py keeps NAMES and that list equal, and tests/test_layout.py keeps
every other module from reading them from the environment itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

# for users (tuning, measuring), then test-only (a moved system path, a test hook)
USER = ("GPUSNAP_REPO", "GPUSNAP_LOCK_WAIT", "GPUSNAP_LOCK_STALE", "GPUSNAP_CRIU", "GPUSNAP_PLUGIN_DIR", "GPUSNAP_NATIVE_LIB",
        "GPUSNAP_GATE", "GPUSNAP_STAGING_BUDGET", "GPUSNAP_COMPRESS_THREADS", "GPUSNAP_RESTORE_THREADS",
        "GPUSNAP_RESTORE_IMAGES", "GPUSNAP_CALL_TIMEOUT_MS", "GPUSNAP_SCHEDULER", "GPUSNAP_GPU_PROBE",
        "GPUSNAP_INGEST_OVERLAP", "GPUSNAP_PACK_DIRECT", "GPUSNAP_STAGING_DIRECT", "GPUSNAP_CAPTURE_PIPE", "GPUSNAP_SERVE_VMSPLICE",
        "GPUSNAP_ARENA_THP", "GPUSNAP_DUMP_OOM_SCORE_ADJ", "GPUSNAP_SPARSE_RESTORE", "GPUSNAP_LAZY_PAUSE", "GPUSNAP_RSH")
TEST_ONLY = ("GPUSNAP_FAULT", "GPUSNAP_TEST_HOLD", "GPUSNAP_TEST_HOOK", "GPUSNAP_STAGING_NAMED", "GPUSNAP_ARENA_GUARD",
             "GPUSNAP_LOCK_DIR", "GPUSNAP_SCHEDULE_DIR", "GPUSNAP_LOG_DIR", "GPUSNAP_CRON_DIR",
             "GPUSNAP_SYSTEMD_DIR", "GPUSNAP_CRON_DAEMONS", "GPUSNAP_SYSTEMD_RUN_DIR", "GPUSNAP_PID1_NAMES")
NAMES = USER + TEST_ONLY


@dataclass(frozen=True)
class Settings:
    values: Mapping[str, str]       # the variables that are set, by name

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Settings":
        return cls({n: env[n] for n in NAMES if n in env})

    def get(self, name: str, default: str | None = None) -> str | None:
        if name not in NAMES:
            raise KeyError(f"{name} is not a gpusnap setting (gpusnap/settings.py NAMES)")
        return self.values.get(name, default)


_loaded: Settings | None = None


def load(env: Mapping[str, str] | None = None) -> Settings:
    """Read the settings once, at start-up: from then on current() is this object."""
    global _loaded
    _loaded = Settings.from_env(os.environ if env is None else env)
    return _loaded


def unload() -> None:
    global _loaded
    _loaded = None


def current() -> Settings:
    return _loaded if _loaded is not None else Settings.from_env(os.environ)


def get(name: str, default: str | None = None) -> str | None:
    """current().get(name, default): the value of one setting, or `default` when unset."""
    return current().get(name, default)
