"""Open-time recovery (docs/format.md §10): after any crash or loss, index files that name
missing packs are replaced by their records that still hold and set aside in quarantine/;
and which snapshots need data the index no longer holds (shared with repair)."""

from __future__ import annotations

import os

from gpusnap.errors import CorruptSnapshot
from gpusnap.repo.format import HEX64, FormatError, parse_index
from gpusnap.repo.index import RepoIndex, index_pack_names, write_index_file
from gpusnap.repo.store import pack_sizes
from gpusnap.repo.trust import QUARANTINE, quarantine_file


def warn(msg: str, *args) -> None:
    """A warning on the "gpusnap" logger; logging is loaded only when there is one (~3 ms)."""
    import logging

    logging.getLogger("gpusnap").warning(msg, *args)


def recover(repo) -> list[str]:
    """Make the repository consistent after any crash or loss (docs/format.md §10);
    called when the writer lock is taken. By the commit order an index file names only
    packs that were durable before it, so an index naming a missing pack means data was
    lost outside gpusnap (or by a gpusnap before format revision 1.3, whose aborted
    commit could delete the packs of an index it had written). Such an index file is
    replaced by one holding its records whose packs are there, then moved to
    quarantine/; the snapshots that needed the lost data are reported. Cheap when all
    is well: the pack lists at the head of each index file and one lstat per pack.
    -> lines saying what was done (also logged)."""
    root = repo.path
    idir = root / "index"
    lists: dict[str, list[bytes]] = {}
    for n in sorted(os.listdir(idir)):
        if not HEX64.match(n):
            continue
        try:
            lists[n] = index_pack_names(idir / n)
        except (OSError, FormatError):
            continue          # a damaged index file: load() reports it, repair rebuilds
    sizes = pack_sizes(root, {ph for v in lists.values() for ph in v})
    bad = [n for n, v in lists.items() if any(sizes[ph] is None for ph in v)]
    done: list[str] = []
    lost_packs: set[bytes] = set()
    for n in bad:
        try:
            with open(idir / n, "rb") as f:
                parsed = parse_index(f.read())
        except (OSError, FormatError):
            continue
        keep: dict[bytes, list] = {}
        for b in parsed.blobs:
            size = sizes.get(b.pack)
            if size is not None and b.end <= size:
                keep.setdefault(b.pack, []).append(b)
        missing = [ph for ph in parsed.packs if sizes.get(ph) is None]
        lost_packs.update(missing)
        # the records that still hold first, then the file aside: a crash in between
        # leaves both (duplicates are legal), never fewer records than data
        res = write_index_file(root, sorted(keep.items())) if keep else None
        quarantine_file(root, idir / n)
        done.append(f"index file {n} names {len(missing)} missing pack(s) "
                    f"({', '.join(ph.hex()[:16] for ph in missing)}): moved to {QUARANTINE}/"
                    + (f", its {sum(map(len, keep.values()))} record(s) in present packs kept in "
                       f"index/{res[0].name}" if res else ""))
    if done:
        idx = repo.index(check_packs=True)
        for dirname, why in snapshots_missing_data(repo, idx).items():
            done.append(f"snapshot {dirname} is damaged: {why} (run gpusnap verify; restore another snapshot)")
        for line in done:
            warn("gpusnap: repository %s: %s", root, line)
    return done

def snapshots_missing_data(repo, idx: RepoIndex) -> dict[str, str]:
    """Snapshot dir name -> why, for every snapshot that needs pages or blobs `idx` does
    not hold (or whose manifest or page lists are unreadable)."""
    import numpy as np
    out: dict[str, str] = {}
    for p, why in repo.broken_snapshots().items():
        out[p.name] = why
    table = idx.page_table()
    for s in repo.snapshots():
        try:
            pages, data = s.referenced_page_bytes()
        except CorruptSnapshot as e:
            out[s.path.name] = str(e)
            continue
        ids = np.unique(np.frombuffer(pages, dtype="V16"))
        locs = np.frombuffer(table.get_many(ids.tobytes()), dtype=np.int64) if len(ids) else np.zeros(0, np.int64)
        missing = int((locs < 0).sum()) + sum(1 for bid in data if bid not in idx.data_loc)
        if missing:
            out[s.path.name] = f"{missing} page(s)/blob(s) it needs are lost"
    return out
