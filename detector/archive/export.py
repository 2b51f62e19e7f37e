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

A snapshot the archive cannot hold (a value no column takes: a NaN attribute, a count of 2**63 or
more) is set aside as the detector's writer does: logged with its id and why, counted
(``ExportResult.set_aside``), and the rest of its batch is written. The store is not marked (it may
be open read-only), so a later export tries it again, and sets it aside again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from stablewatch.detector.archive.files import unlock_archive
from stablewatch.detector.archive.recovery import archived_ids, archived_outcomes, needs_archiving, repair
from stablewatch.detector.archive.schema import ArchiveError
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

_log = logging.getLogger(__name__)
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
    set_aside: int = 0  # finished snapshots the archive cannot hold, not exported (logged, with why)


def export(store: ListingStore, root: Path, batch_size: int = 1000) -> ExportResult:
    """Write every finished snapshot of `store` that the archive at `root` lacks, in batches, oldest first.

    Idempotent. A snapshot the archive cannot hold is logged and set aside, and the rest is written.
    ArchiveError naming the folder or file when the archive cannot be opened or written; the batches
    written before stay (a second run goes on from there).
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
        unfit: dict[int, ArchiveError] = {}
        for start in range(0, len(missing), batch_size):
            items = [item for i in missing[start : start + batch_size] if (item := load(store, i)) is not None]
            if items:
                before = len(unfit)
                written = write_finished(root, items, unfit)
                _log_set_aside(root, unfit, before)
                files += len(written)
                exported += len(items) - (len(unfit) - before)
                batches += 1 if written else 0
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
            set_aside=len(unfit),
        )
    finally:
        unlock_archive(lock)


def _log_set_aside(root: Path, unfit: dict[int, ArchiveError], first: int) -> None:
    """Log the snapshots set aside by the last batch (those of `unfit` from position `first` on)."""
    for error in list(unfit.values())[first:]:
        _log.error("archive %s: %s; it is set aside, not exported, and stays in the store", root, error)


def _finished_ids(store: ListingStore) -> Iterator[int]:
    """The ids of the store's finished snapshots, newest first, page by page."""
    before = None
    while page := store.list(_PAGE, before):
        for summary in page:
            if summary.outcome != SNAPSHOT_OUTCOME_RUNNING:
                yield summary.snapshot_id
        before = page[-1].snapshot_id
