"""What a writer that died leaves in the archive, and how the next writer sets it right.

A batch appears file by file (:func:`.files.write_batch`): every other table's files are renamed
into place first, then the ``snapshots`` files, one per day. A writer killed on the way leaves

1. temporary files (``.part-*.parquet.tmp``), never visible to readers;
2. files of other tables for a (day, batch) whose ``snapshots`` file never appeared: rows of
   snapshots that are not in the archive. Written again later, possibly in a batch of another
   name, they would be counted twice;
3. a complete batch that its store never heard of (killed between the last rename and
   ``mark_archived``): those snapshots are in the archive and must not be written again.

Breaks (``resolutions``, written by :func:`.files.write_resolutions`) leave less: temporary
files (1), and of breaks sent on several days, the files of some days and not the others. Each
visible file is whole and stands alone, so nothing visible is removed; the breaks it holds are
found by :func:`archived_resolutions` and not written again, and the rest are. A break archived
as ``unanswered`` whose agent's answer came late is written again, once, with its answer
(:func:`archived_outcomes` says what each break reads as; :func:`needs_archiving` decides).

:func:`repair` removes 1 and 2; :func:`archived_ids` finds 3. All must run with the archive's
writer lock held (:func:`.files.lock_archive`), before anything new is written.
"""

from __future__ import annotations

from pathlib import Path

from stablewatch.detector.archive.files import batch_range, parquet_files, read_ids, read_outcomes
from stablewatch.detector.archive.schema import (
    SNAPSHOT_TABLES,
    TABLES,
    ArchiveError,
    outcome_rank,
    resolution_key,
    resolution_outcome,
)
from stablewatch.v1.query_pb2 import Resolution

__all__ = ["archived_ids", "archived_outcomes", "archived_resolutions", "needs_archiving", "repair"]


def repair(root: Path) -> list[Path]:
    """Remove the temporary files and the files of unfinished batches; return what was removed.

    Only files named as :func:`.files.write_batch` names them are touched. O(files in the archive)
    directory entries, no file is read.
    """
    root = Path(root)
    removed = []
    for table in TABLES:
        for tmp in (root / table).glob("day=*/.part-*.parquet.tmp"):
            _remove(tmp)
            removed.append(tmp)
    finished = {(p.parent.name, p.name) for p in parquet_files(root, "snapshots")}
    for table in SNAPSHOT_TABLES:
        if table == "snapshots":
            continue
        for path in parquet_files(root, table):
            if batch_range(path.name) is not None and (path.parent.name, path.name) not in finished:
                _remove(path)
                removed.append(path)
    return removed


def archived_ids(root: Path, since: int = 0) -> set[int]:
    """The ids of the snapshots in the archive, from batches that hold any id >= `since`.

    Reads only the ``snapshot_id`` column of the ``snapshots`` files whose name says they may hold
    such an id. ArchiveError naming the file when one cannot be read.
    """
    found: set[int] = set()
    for path in parquet_files(root, "snapshots"):
        ids = batch_range(path.name)
        if ids is None or ids[1] >= since:
            found.update(read_ids(path))
    return found


def archived_resolutions(root: Path) -> set[tuple[int, int]]:
    """The breaks in the archive, as (snapshot id, break id) (:func:`.schema.resolution_key`).

    Reads those two columns of every ``resolutions`` file (breaks are few). ArchiveError naming
    the file when one cannot be read.
    """
    return set(archived_outcomes(root))


def archived_outcomes(root: Path) -> dict[tuple[int, int], str]:
    """Each break in the archive (:func:`.schema.resolution_key`) and the outcome it reads as: of its
    rows, the most final (:func:`.schema.outcome_rank`). Reads three columns of every
    ``resolutions`` file; ArchiveError naming the file when one cannot be read.
    """
    found: dict[tuple[int, int], str] = {}
    for path in parquet_files(root, "resolutions"):
        for snapshot_id, resolution_id, outcome in read_outcomes(path):
            key = (snapshot_id, resolution_id)
            if key not in found or outcome_rank(outcome) > outcome_rank(found[key]):
                found[key] = outcome
    return found


def needs_archiving(resolution: Resolution, archived: dict[tuple[int, int], str]) -> bool:
    """Whether a finished break must be written to an archive holding `archived`
    (:func:`archived_outcomes`): it is not there, or only as a less final outcome (given up on,
    and then answered late). A row written for it then is what readers take."""
    word = archived.get(resolution_key(resolution))
    return word is None or outcome_rank(resolution_outcome(resolution)) > outcome_rank(word)


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        raise ArchiveError(f"cannot remove {path}, left by an interrupted batch: {exc.strerror or exc}") from exc
