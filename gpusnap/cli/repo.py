"""Commands that make, read or maintain the repository: init, ls, inspect, verify, repair, prune, forget.

Each parses, calls one library operation, and hands the result to render.snapshots /
render.maint through the one output (render.output.OUTPUT); a damaged result comes back
from the library as an error of the hierarchy, which sets the exit code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from gpusnap.cli.common import (JsonOpt, KeepLastHelp, LockWaitOpt, PruneUncopiedOpt, RepoOpt, open_snapshot,
                                open_writer_repo, repo_root)

from gpusnap.render.output import OUTPUT


def init_cmd(repo: Optional[Path] = RepoOpt, json_: bool = JsonOpt) -> None:
    """Create a repository (private: 0700), at --repo DIR or the default location.

    dump, run, import and schedule add make one by themselves only at the default location
    ($GPUSNAP_REPO, else /var/lib/gpusnap); anywhere else a repository is made with init first, so that a
    mistyped --repo is an error and never a new, empty repository."""
    from gpusnap.repo.repository import Repository

    repository = Repository.init(repo_root(repo, create=True))
    result = {"repository": str(repository.path), "id": repository.config["id"]}
    OUTPUT.emit(result, lambda: OUTPUT.out.print(f"created repository {result['repository']}", markup=False))


def ls_cmd(
    repo: Optional[Path] = RepoOpt,
    name: Optional[str] = typer.Option(None, "--name", help="Only snapshots with this name."),
    json_: bool = JsonOpt,
) -> None:
    """List snapshots with their unique and shared sizes, and the repository's totals."""
    from gpusnap.ops import ls
    from gpusnap.render import snapshots as show

    result = ls.snapshots(repo_root(repo), name=name)
    OUTPUT.emit(result, lambda: show.snapshot_list(result, OUTPUT, name=name))


def inspect(
    snapshot: str = typer.Argument(..., metavar="DIR|NAME"),
    repo: Optional[Path] = RepoOpt,
    images: bool = typer.Option(False, "--images", help="Also list CRIU's image files with their page statistics."),
    json_: bool = JsonOpt,
) -> None:
    """Show a snapshot: processes with command lines and cwd, open files (do they still match
    the disk?), sockets, memory, page statistics, sizes, GPU information."""
    from gpusnap.ops import inspect as inspect_op
    from gpusnap.render import snapshots as show

    report = inspect_op.describe(*open_snapshot(snapshot, repo))
    OUTPUT.emit(report, lambda: show.inspect(report, OUTPUT, images=images))


def verify(
    snapshot: Optional[str] = typer.Argument(None, metavar="[DIR|NAME]", help="Only this snapshot."),
    repo: Optional[Path] = RepoOpt,
    structure_only: bool = typer.Option(False, "--structure-only", help="Skip reading back every stored byte."),
    json_: bool = JsonOpt,
) -> None:
    """Check every checksum. Exit 0 only when all holds; otherwise name what is damaged."""
    from gpusnap.ops import verify as verify_op
    from gpusnap.render import maint as show

    report = verify_op.verify(snapshot, repo, read_data=not structure_only)
    OUTPUT.emit(report, lambda: show.verify(report, OUTPUT), failure=verify_op.verify_failure(report))


def repair(
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="Say what would change; change nothing."),
    read_data: bool = typer.Option(False, "--read-data",
                                   help="Decompress and check every blob, not only the packs' names."),
    repo: Optional[Path] = RepoOpt,
    json_: bool = JsonOpt,
) -> None:
    """Rebuild the index from the packs; set aside index files that name missing data.

    The packs are the truth: what they hold is indexed again, index files that are damaged
    or name data in no pack go to REPO/quarantine/. No pack is deleted. Exit 19 when some
    snapshot still needs data that no pack holds.
    """
    from gpusnap.ops import repair as repair_op
    from gpusnap.render import maint as show

    report = repair_op.repair(repo, dry_run=dry_run, read_data=read_data)
    OUTPUT.emit(report, lambda: show.repair(report, OUTPUT), failure=repair_op.repair_failure(report))


def prune(
    keep_last: Optional[int] = typer.Option(None, "--keep-last", metavar="N", min=0, help=KeepLastHelp),
    name: Optional[str] = typer.Option(None, "--name", help="Only snapshots with this name."),
    all_: bool = typer.Option(False, "--all", help="Allow --keep-last 0: delete every snapshot of --name."),
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="Say what would go; change nothing."),
    prune_uncopied: bool = PruneUncopiedOpt,
    repo: Optional[Path] = RepoOpt,
    json_: bool = JsonOpt,
    lock_wait: Optional[float] = LockWaitOpt,
) -> None:
    """Free the stored data no snapshot needs; with --keep-last, first delete old snapshots
    (never one not yet copied to its --copy-to repository, unless --prune-uncopied).

    `gpusnap forget` drops chosen snapshots; prune then frees their data.
    """
    from gpusnap.ops import prune as prune_op
    from gpusnap.render import maint as show

    keep_last = prune_op.check_args(keep_last, name, all_)
    result = prune_op.prune(open_writer_repo(repo, lock_wait, dry_run), keep_last=keep_last, name=name, dry_run=dry_run,
                            prune_uncopied=prune_uncopied)
    OUTPUT.emit(result, lambda: show.prune(result, OUTPUT))


def forget(
    snapshots: Optional[list[str]] = typer.Argument(None, metavar="[SNAP]...",
                                                    help="Snapshot directories, directory names or ids."),
    name: Optional[str] = typer.Option(None, "--name", help="With --keep-last: only snapshots of this name."),
    keep_last: Optional[int] = typer.Option(None, "--keep-last", metavar="N", min=0, help=KeepLastHelp),
    all_: bool = typer.Option(False, "--all", help="Forget every snapshot of --name."),
    prune_: bool = typer.Option(False, "--prune", help="Then free the data nothing needs any more."),
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="Say what would go; change nothing."),
    repo: Optional[Path] = RepoOpt,
    json_: bool = JsonOpt,
    lock_wait: Optional[float] = LockWaitOpt,
) -> None:
    """Drop snapshots: the named ones, or all but the newest N of each name.

    Their data stays in the repository until `gpusnap prune` (or `--prune`) frees what no
    remaining snapshot needs.
    """
    from gpusnap.ops import forget as forget_mod
    from gpusnap.render import maint as show

    repository = open_writer_repo(repo, lock_wait, dry_run)
    result = forget_mod.forget(repository, list(snapshots or []), name=name, keep_last=keep_last, all_=all_,
                               dry_run=dry_run, prune=prune_)
    OUTPUT.emit(result, lambda: show.forget(result, OUTPUT))
