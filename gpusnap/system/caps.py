"""Capabilities: this process's effective set, and the one rule for who may run CRIU (root, or
CAP_CHECKPOINT_RESTORE together with CAP_SYS_PTRACE), shared by the preflight, doctor and
the runner, so none of them says ready where another refuses."""

from __future__ import annotations

import os
import re

CAP_SYS_PTRACE = 19
CAP_SYS_RESOURCE = 24
CAP_CHECKPOINT_RESTORE = 40


def cap_eff(status_text: str | None = None) -> int:
    """CapEff from /proc/self/status (or from `status_text`, a status file's text)."""
    if status_text is None:
        from gpusnap.system import proc

        return int(proc.status("self").get("CapEff", "0") or "0", 16)
    m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)", status_text, re.M)
    return int(m.group(1), 16) if m else 0


def has_cap(bit: int, caps: int | None = None) -> bool:
    return bool(((cap_eff() if caps is None else caps) >> bit) & 1)


def may_run_criu(caps: int | None = None) -> bool:
    """Root, or both CAP_CHECKPOINT_RESTORE and CAP_SYS_PTRACE effective (CRIU's non-root mode)."""
    if os.geteuid() == 0:
        return True
    caps = cap_eff() if caps is None else caps
    return has_cap(CAP_CHECKPOINT_RESTORE, caps) and has_cap(CAP_SYS_PTRACE, caps)
