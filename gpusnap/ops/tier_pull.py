"""Restoring from an ssh:// tier (`restore NAME --copy-to ssh://…`, `slurm-run --copy-to ssh://…`
after a requeue): the other machine's snapshots are listed through ssh (`gpusnap ls --json`
there), and the one chosen is pulled into this repository first: `gpusnap copy DIR --to -`
runs there (the sending half of the copy protocol on its stdin and stdout, ops/copy.py), and
this side receives as `serve` does (ops/serve.py): only what this repository lacks travels,
every page and blob is checked as it arrives, the snapshot commits atomically. The restore
then reads it from here like any other snapshot."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from gpusnap.errors import CopyFailed, GpusnapError

LIST_TIMEOUT_S = 120
_DIR = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,200}")


def remote_candidates(to: str, remote_gpusnap: str | None, name: str) -> list[tuple[str, float]]:
    """The snapshots of `name` in the repository `to` names, newest first: (directory, created).
    What comes back is untrusted: a directory name that is not one is left out."""
    from gpusnap.ops.copy_peer import remote_command

    argv = remote_command(to, remote_gpusnap, ["ls", "--json"])
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=LIST_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as e:
        raise CopyFailed(f"cannot list the snapshots in {to}: {e}") from None
    try:
        out = json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        out = {}
    if p.returncode or not isinstance(out.get("snapshots"), list):
        why = out.get("message") or p.stderr.strip()[-400:] or f"exit status {p.returncode}"
        raise CopyFailed(f"cannot list the snapshots in {to}: {why}")
    found = []
    for s in out["snapshots"]:
        if not isinstance(s, dict) or s.get("name") != name:
            continue
        d, created = s.get("dir"), s.get("created")
        if isinstance(d, str) and _DIR.fullmatch(d) and isinstance(created, (int, float)):
            found.append((d, float(created)))
    return sorted(found, key=lambda c: -c[1])


def pull(root: Path, to: str, remote_gpusnap: str | None, snap_dir: str, lock_wait: float | None = None) -> str:
    """Copy snapshot `snap_dir` of the repository `to` into the one at `root`. -> the path of the
    snapshot here (received now, or found here already). Raises CopyFailed (or the error the
    other end reported, as its class) when it does not arrive whole; nothing is committed then."""
    from gpusnap.ops.copy_peer import Peer, remote_command
    from gpusnap.ops.serve import conversation

    peer = Peer(remote_command(to, remote_gpusnap, ["copy", snap_dir, "--to", "-"]), f"the gpusnap of {to}")
    got: list[str] = []
    try:
        conversation(peer.channel, root, lock_wait, got)
    except (BrokenPipeError, ConnectionResetError):
        raise peer.lost() from None
    except CopyFailed as e:
        if getattr(e, "closed", False) and not got:
            raise peer.gone() from None
        if not got:
            raise
    except GpusnapError as e:
        e.message = f"pulling {snap_dir} from {to}: {e.message.removeprefix('destination: ')}"
        raise
    finally:
        peer.close()
    if not got:
        raise CopyFailed(f"pulling {snap_dir} from {to}: the other end sent no snapshot")
    return got[0]
