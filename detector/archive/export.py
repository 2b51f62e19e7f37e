"""Backfill an archive from a store: every finished snapshot the archive does not hold yet.

What the archive holds is read from the archive itself (the ``snapshot_id`` column of its
``snapshots`` files), never from the store's ``archived`` marks, so an export can fill any archive
(a new one, or one that another detector also fills) from a store opened read-only beside its
live detector, and a second export writes nothing new. It takes the archive's writer lock, so an
archive that a running detector writes is refused: that detector catches up on its own.

A store that lists its breaks (:class:`~.writer.ResolutionSource`) has those whose outcome is
known copied too, into the ``resolutions`` table, again only those the archive lacks (by
snapshot and break id), or holds only as given up while the store has the answer that came late
(:func:`~.recovery.needs_archiving`). A break still waiting for its agent's answer is left for a
later export.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from stablewatch.detector.archive.files import unlock_archive
from stablewatch.detector.archive.recovery import archived_ids, archived_outcomes, needs_archiving, repair
from stablewatch.detector.archive.writer import (
    SnapshotSource,
    finished_resolutions,
    load,
    open_archive,
    write_finished,
    write_resolution_batch,
)
from stablewatch.v1.query_pb2 import SNAPSHOT_OUTCOME_RUNNING, SnapshotSummary

__all__ = ["ExportResult", "ListingStore", "export"]

_PAGE = 1000


class ListingStore(SnapshotSource, Protocol):
    """A store that lists its snapshots, newest first (the detector's store)."""

    def list(self, page_size: int, before_id: int | None = None) -> list[SnapshotSummary]: ...


@dataclass(frozen=True)
class ExportResult:
    """What an export did."""

    exported: int  # snapshots written now
    already: int  # finished snapshots of the store that the archive held already
    batches: int
    files: int
    resolutions: int = 0  # breaks written now (files counts theirs too)
    resolutions_already: int = 0  # finished breaks of the store that the archive held already, as the store has them


def export(store: ListingStore, root: Path, batch_size: int = 1000) -> ExportResult:
    """Write every finished snapshot of `store` that the archive at `root` lacks, in batches, oldest first.

    Idempotent. ArchiveError naming the folder or file when the archive cannot be opened or written;
    the batches written before stay (a second run goes on from there).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    root = Path(root)
    lock = open_archive(root)
    try:
        repair(root)
        present = archived_ids(root)
        finished = list(_finished_ids(store))
        missing = sorted(i for i in finished if i not in present)
        exported = batches = files = 0
        for start in range(0, len(missing), batch_size):
            items = [item for i in missing[start : start + batch_size] if (item := load(store, i)) is not None]
            if items:
                files += len(write_finished(root, items))
                exported += len(items)
                batches += 1
        archived = archived_outcomes(root)
        breaks = list(finished_resolutions(store))
        new = [resolution for resolution in breaks if needs_archiving(resolution, archived)]
        new.reverse()  # oldest first, as the snapshots
        for start in range(0, len(new), batch_size):
            files += len(write_resolution_batch(root, new[start : start + batch_size]))
        return ExportResult(
            exported=exported,
            already=len(finished) - len(missing),
            batches=batches,
            files=files,
            resolutions=len(new),
            resolutions_already=len(breaks) - len(new),
        )
    finally:
        unlock_archive(lock)


def _finished_ids(store: ListingStore) -> Iterator[int]:
    """The ids of the store's finished snapshots, newest first, page by page."""
    before = None
    while page := store.list(_PAGE, before):
        for summary in page:
            if summary.outcome != SNAPSHOT_OUTCOME_RUNNING:
                yield summary.snapshot_id
        before = page[-1].snapshot_id
