"""The archive writer: every finished snapshot into the Parquet archive, in batches, exactly once.

Theory of operation:

* The detector hands over every finished snapshot (completed, or aborted: only its ``snapshots``
  row) with :meth:`ArchiveWriter.add`, right after storing it. Snapshots wait in memory until
  ``batch_size`` of them are pending or the oldest has waited ``max_age`` seconds; then one
  batch is written by :func:`.files.write_batch` on a worker thread (pyarrow releases the GIL, the
  event loop keeps serving), and only after its files are in place does the store hear of it
  (``mark_archived``, on the loop: the store belongs to the loop's thread).
* The store is the source of truth. When a batch fails to write, it and everything pending are
  dropped from memory, not retried from it: they stay unarchived in the store, and the writer
  *resyncs* from the store before its next batch (after ``max_age``). It resyncs when it starts too,
  which is how what a killed detector had not flushed is written on the next start.
* Resync, with the archive's writer lock held: remove what an interrupted batch left
  (:func:`.recovery.repair`); find the unarchived snapshots that are already in the archive (a
  detector killed between the last rename and ``mark_archived``) and mark them archived instead
  of writing them again (:func:`.recovery.archived_ids`); then write the rest, oldest first,
  skipping those pending in memory. Together: every finished snapshot the store keeps is
  written once, and only once.
* Breaks of deadlocks (``Resolution``) come with :meth:`ArchiveWriter.add_resolution` once their
  outcome is known, wait in memory beside the snapshots (the same ``batch_size`` and
  ``max_age``), and are written after the next batch of snapshots (or alone) into the
  ``resolutions`` table (:func:`.files.write_resolutions`). The store marks no break archived:
  resync reads which breaks the archive holds (:func:`.recovery.archived_resolutions`) and writes
  the store's finished breaks it lacks, skipping those pending, so breaks too are written once.
  A break given up (``unanswered``) and then answered late is handed over again: while the first
  is still waiting in memory the answer takes its place (one row), and once it is written the
  answer follows as a second row, which readers take (:func:`.schema.latest_rows`); resync
  writes an answer the archive holds only as ``unanswered`` (:func:`.recovery.needs_archiving`).
  A store without ``resolutions`` (:class:`ResolutionSource`) cannot be resynced from: its
  breaks stay pending in memory across failed writes instead (at most :data:`MAX_PENDING_BREAKS`).

The archive folder may be a local path or any mounted file system whose ``rename`` is atomic
within a folder: a local disk, NFS, CephFS, Amazon EFS or FSx, Azure Files, JuiceFS, or a
Kubernetes PersistentVolume (CSI) backed by one of them. Object-store FUSE mounts are not such
file systems: Mountpoint for S3 refuses ``rename`` on general purpose buckets (batches fail with
a clear error), and s3fs, goofys or gcsfuse on a flat bucket emulate it by copy-then-delete, so a
reader could see a half-copied file. For an object store, archive to a local folder and copy the
finished files up (``aws s3 sync``, ``gcloud storage rsync``, ``rclone copy``) excluding dot-files
(``.*``: temporary files and the lock), other tables first and ``snapshots`` last; an object PUT is
atomic, so readers see whole files.

A snapshot the store deletes by retention before it is archived is lost to the archive. The
detector's retention spares unarchived snapshots (and breaks) while the archive cannot take them,
up to ten times its bounds (``Store.apply_retention`` with ``keep_unarchived``): with retention by
count, that is ten times ``max_snapshots`` snapshots, which at a few snapshots a second lasts
hours, not days. Past the bound they are deleted, and the store logs a WARNING with how many and
their ids (this writer may still hold them in memory and write them; if it fails to, they are lost).

A snapshot the archive cannot hold (a value no column takes, which the assembler refuses in a part
anyway: a NaN attribute, a uint64 of 2**63 or more) fails alone: it is logged, set aside in the
store (``set_aside``: never offered again) and the rest of its batch is written. Running out of
memory while converting one says nothing about it: the batch fails, and the resync tries it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from stablewatch.detector.archive.files import (
    ensure_archive,
    lock_archive,
    raise_marker,
    unlock_archive,
    write_batch,
    write_resolutions,
)
from stablewatch.detector.archive.recovery import archived_ids, archived_outcomes, needs_archiving, repair
from stablewatch.detector.archive.schema import (
    SNAPSHOT_TABLES,
    ArchiveError,
    RowsError,
    resolution_key,
    resolution_row,
    snapshot_rows,
    table_from_rows,
)
from stablewatch.v1 import Evaluation, GlobalSnapshot
from stablewatch.v1.query_pb2 import Resolution, SnapshotSummary

__all__ = [
    "MAX_PENDING_BREAKS",
    "ArchiveWriter",
    "ArchivingStore",
    "Finished",
    "ResolutionSource",
    "SnapshotSource",
    "finished_resolutions",
    "load",
    "open_archive",
    "write_finished",
    "write_resolution_batch",
]

_log = logging.getLogger(__name__)

#: Breaks kept in memory for a store that cannot list them, while the archive cannot be written.
MAX_PENDING_BREAKS = 10_000
_PAGE = 1000


class SnapshotSource(Protocol):
    """Where finished snapshots are read from (the detector's store)."""

    def summary(self, snapshot_id: int) -> SnapshotSummary | None: ...
    def snapshot(self, snapshot_id: int) -> GlobalSnapshot | None: ...
    def evaluation(self, snapshot_id: int) -> Evaluation | None: ...


class ArchivingStore(SnapshotSource, Protocol):
    """A store that also remembers which finished snapshots are archived."""

    def unarchived(self, limit: int, after_id: int = 0) -> list[int]: ...
    def mark_archived(self, snapshot_ids: Sequence[int]) -> None: ...
    def set_aside(self, snapshot_ids: Sequence[int]) -> None: ...


class ResolutionSource(Protocol):
    """A store that lists its breaks, newest first (the detector's store); optional for a writer."""

    def resolutions(self, page_size: int, before_id: int | None = None) -> list[Resolution]: ...


def finished_resolutions(store: object) -> Iterator[Resolution]:
    """The breaks of `store` whose outcome is known, newest first, page by page; none when the store
    does not list breaks (it is no :class:`ResolutionSource`)."""
    listing = getattr(store, "resolutions", None)
    if listing is None:
        return
    before = None
    while page := listing(_PAGE, before):
        for resolution in page:
            if resolution.HasField("reported_at"):
                yield resolution
        before = page[-1].resolution_id


@dataclass(frozen=True)
class Finished:
    """One finished snapshot: its summary, and for a completed one its snapshot and evaluation."""

    summary: SnapshotSummary
    snapshot: GlobalSnapshot | None = None
    evaluation: Evaluation | None = None

    @property
    def snapshot_id(self) -> int:
        return self.summary.snapshot_id


def load(source: SnapshotSource, snapshot_id: int) -> Finished | None:
    """Snapshot `snapshot_id` as the store holds it; None if the store no longer does (retention)."""
    summary = source.summary(snapshot_id)
    if summary is None:
        return None
    return Finished(summary, source.snapshot(snapshot_id), source.evaluation(snapshot_id))


def write_finished(
    root: Path, batch: Sequence[Finished], set_aside: dict[int, ArchiveError] | None = None
) -> list[Path]:
    """Write these snapshots as one batch (blocking; run it off the event loop); return the files.

    ArchiveError naming the file when writing fails; the archive keeps what it held. A snapshot
    the archive cannot hold (a value no column takes: a NaN attribute, a uint64 above 2**63) is an
    ArchiveError naming it; given `set_aside`, it is put there instead (by id) and the rest is written.
    """
    per_snapshot: list[tuple[int, dict[str, list]]] = []
    for item in sorted(batch, key=lambda item: item.snapshot_id):
        try:
            per_snapshot.append((item.snapshot_id, snapshot_rows(item.summary, item.snapshot, item.evaluation)))
        except MemoryError:
            raise  # says nothing about the snapshot: the batch fails, and the next resync tries it again
        except Exception as error:
            _unfit(item.snapshot_id, error, set_aside)
    try:
        return write_batch(root, _joined(per_snapshot))
    except RowsError:
        # Cheap when all is well: only now is each snapshot's share converted alone, to find the culprits.
        fit = []
        for snapshot_id, rows in per_snapshot:
            try:
                for table, table_rows in rows.items():
                    table_from_rows(table, table_rows)
            except RowsError as error:
                _unfit(snapshot_id, error, set_aside)
            else:
                fit.append((snapshot_id, rows))
        if len(fit) == len(per_snapshot):
            raise  # no snapshot alone is at fault
        return write_batch(root, _joined(fit))


def _unfit(snapshot_id: int, error: Exception, set_aside: dict[int, ArchiveError] | None) -> None:
    """Snapshot `snapshot_id` cannot be turned into rows: put it in `set_aside`, or raise ArchiveError naming it."""
    unfit = ArchiveError(f"snapshot {snapshot_id} cannot be archived: {error}")
    if set_aside is None:
        raise unfit from error
    set_aside[snapshot_id] = unfit


def _joined(per_snapshot: Sequence[tuple[int, Mapping[str, list]]]) -> dict[str, list]:
    """The rows of several snapshots, table by table, in the given order."""
    rows: dict[str, list] = {name: [] for name in SNAPSHOT_TABLES}
    for _, rows_of in per_snapshot:
        for table, table_rows in rows_of.items():
            rows[table].extend(table_rows)
    return rows


def write_resolution_batch(root: Path, resolutions: Sequence[Resolution]) -> list[Path]:
    """Write these breaks to the ``resolutions`` table (blocking; run it off the event loop); return the files.

    ArchiveError naming the file when writing fails; the archive keeps what it held.
    """
    ordered = sorted(resolutions, key=resolution_key)
    return write_resolutions(root, [resolution_row(resolution) for resolution in ordered])


def open_archive(root: Path) -> int | None:
    """Create or check the archive at `root` and take its writer lock (blocking); returns the lock.
    An archive of an older schema version is marked as of this one (its files all still read).

    ArchiveError when `root` is not an archive, is newer than this code, or has another writer.
    """
    ensure_archive(root)
    lock = lock_archive(root)
    if lock is None:
        _log.warning("the file system of %s has no locks: make sure nothing else writes this archive", root)
    try:
        raise_marker(root)  # only with the lock: an older writer may still hold the archive
    except BaseException:
        unlock_archive(lock)
        raise
    return lock


@dataclass
class _Pending:
    item: Finished
    added: float  # loop time


@dataclass
class _PendingBreak:
    resolution: Resolution
    added: float  # loop time


class ArchiveWriter:
    """Writes every finished snapshot of `store` to the archive at `root`; see the module docstring.

    Use it from the event loop that owns the store: ``await start()``, ``add(...)`` for every
    finished snapshot, ``add_resolution(...)`` for every break whose outcome is known,
    ``await close()`` (which flushes what is pending).
    """

    def __init__(self, root: Path, store: ArchivingStore, *, batch_size: int = 500, max_age: float = 300.0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        if not max_age > 0:
            raise ValueError(f"max_age must be above 0 seconds, not {max_age}")
        self.root = Path(root)
        self.batch_size = batch_size
        self.max_age = max_age
        self._store = store
        self._pending: list[_Pending] = []
        self._pending_ids: set[int] = set()
        self._breaks: list[_PendingBreak] = []
        self._break_keys: set[tuple[int, int]] = set()
        self._writing_breaks = 0  # the first this many of _breaks are being written now
        self._resyncs_breaks = callable(getattr(store, "resolutions", None))
        self._behind = False  # the store holds unarchived snapshots that are not pending: resync
        self._retry_at = 0.0
        self._closing = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lock: int | None = None
        #: Snapshots written so far by this writer (for logs and tests).
        self.written = 0
        #: Breaks written so far by this writer.
        self.resolutions_written = 0

    async def start(self) -> None:
        """Open the archive, write what the store holds unarchived, then batch what :meth:`add` gives.

        ArchiveError (naming the folder or file) when the archive cannot be opened: not an archive,
        a newer one, or another writer's. Failing to write is logged and retried, as later on: the
        detector detects, and the store keeps the snapshots meanwhile.
        """
        self._lock = await asyncio.to_thread(open_archive, self.root)
        try:
            await self._resync()
        except Exception as error:
            self._failed(error)
        except BaseException:  # cancelled: let the archive go
            unlock_archive(self._lock)
            self._lock = None
            raise
        self._task = asyncio.ensure_future(self._run())  # only now: one batch at a time

    def add(
        self, summary: SnapshotSummary, snapshot: GlobalSnapshot | None = None, evaluation: Evaluation | None = None
    ) -> None:
        """Queue one finished snapshot (stored already); never blocks. Ignored after :meth:`close`:
        the store keeps it unarchived and the next start writes it."""
        snapshot_id = summary.snapshot_id
        if self._task is None or self._closing or snapshot_id in self._pending_ids:
            return
        self._pending.append(_Pending(Finished(summary, snapshot, evaluation), asyncio.get_running_loop().time()))
        self._pending_ids.add(snapshot_id)
        if len(self._pending) == 1 or len(self._pending) >= self.batch_size:
            self._wake.set()

    def add_resolution(self, resolution: Resolution) -> None:
        """Queue one break whose outcome is known (its agent answered, or the detector gave up on an
        answer; stored already); never blocks. It is written with the next batch, into the
        ``resolutions`` table, partitioned by the day it was sent. A break queued again (same
        snapshot and break id: answered late after it was given up) replaces the one waiting, or
        follows it when that one is being written. Ignored after :meth:`close`: a store that lists
        its breaks has it, and the next start writes it."""
        key = resolution_key(resolution)
        if self._task is None or self._closing:
            return
        copy = Resolution()
        copy.CopyFrom(resolution)  # the detector may go on changing its own
        if key in self._break_keys:
            for pending in self._breaks[self._writing_breaks :]:
                if resolution_key(pending.resolution) == key:
                    pending.resolution = copy  # the earlier word was never written: only the last is
                    return
            # The earlier one is being written: this one is written after it, and read instead.
        self._breaks.append(_PendingBreak(copy, asyncio.get_running_loop().time()))
        self._break_keys.add(key)
        if len(self._breaks) == 1 or len(self._breaks) >= self.batch_size:
            self._wake.set()

    @property
    def pending(self) -> int:
        """Snapshots waiting in memory for their batch."""
        return len(self._pending)

    @property
    def pending_resolutions(self) -> int:
        """Breaks waiting in memory to be written."""
        return len(self._breaks)

    async def close(self) -> None:
        """Write everything pending, stop, and release the archive. Harmless to call twice."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        unlock_archive(self._lock)
        self._lock = None

    # -- the flusher task ------------------------------------------------------------------------

    def _due(self) -> float | None:
        """Loop time at which the next batch (or resync) is due; None: nothing to do."""
        if self._closing and (self._pending or self._breaks or self._behind):
            return 0.0
        if self._behind:
            return self._retry_at
        if len(self._pending) >= self.batch_size or len(self._breaks) >= self.batch_size:
            return 0.0
        oldest = [pending[0].added for pending in (self._pending, self._breaks) if pending]
        return min(oldest) + self.max_age if oldest else None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = self._due()
            if due is None and self._closing:
                return
            delay = None if due is None else due - loop.time()
            if delay is not None and delay <= 0:
                if not await self._step() and self._closing:
                    return  # one last try failed: the store keeps the rest for the next start
                continue
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)

    async def _step(self) -> bool:
        """Resync if behind, then write one batch of what is pending, and the pending breaks; False
        when that failed."""
        try:
            if self._behind:
                await self._resync()
            if self._pending:
                batch, self._pending = self._pending[: self.batch_size], self._pending[self.batch_size :]
                items = [pending.item for pending in batch]
                self._pending_ids.difference_update(item.snapshot_id for item in items)
                await self._write(items)
            if self._breaks:
                breaks = self._breaks[: self.batch_size]
                self._writing_breaks = len(breaks)
                await self._write_breaks([pending.resolution for pending in breaks])
                # Only now: a break added meanwhile stays pending; one that failed is kept (below).
                del self._breaks[: len(breaks)]
                self._break_keys = {resolution_key(pending.resolution) for pending in self._breaks}
        except Exception as error:  # whatever it was, the store still has the snapshots
            self._failed(error)
            return False
        finally:
            self._writing_breaks = 0
        return True

    def _failed(self, error: Exception) -> None:
        """Log a failed write or resync, and resync in ``max_age`` seconds."""
        # What is pending is in the store too: the resync writes it, and memory stays bounded.
        self._pending.clear()
        self._pending_ids.clear()
        if self._resyncs_breaks:
            self._breaks.clear()
            self._break_keys.clear()
        elif len(self._breaks) > MAX_PENDING_BREAKS:  # nowhere else to find them: keep the newest
            dropped = self._breaks[: len(self._breaks) - MAX_PENDING_BREAKS]
            del self._breaks[: len(dropped)]
            self._break_keys = {resolution_key(pending.resolution) for pending in self._breaks}
            _log.error("archive %s: %d breaks dropped, not archived: too many wait in memory", self.root, len(dropped))
        self._behind = True
        self._retry_at = asyncio.get_running_loop().time() + self.max_age
        log = _log.error if isinstance(error, ArchiveError) else _log.exception
        log(
            "archive %s: %s; the snapshots stay in the store, unarchived (retention spares them up to its "
            "bound), and writing is tried again in %g s",
            self.root,
            error,
            self.max_age,
        )

    async def _write(self, items: list[Finished]) -> None:
        unfit: dict[int, ArchiveError] = {}
        try:
            files = await asyncio.to_thread(write_finished, self.root, items, unfit)
        finally:
            self._set_aside(unfit)  # even when the rest failed to write: these never will be
        written = [item.snapshot_id for item in items if item.snapshot_id not in unfit]
        self._store.mark_archived(written)
        self.written += len(written)
        _log.debug("archived %d snapshots in %d files", len(written), len(files))

    def _set_aside(self, unfit: Mapping[int, ArchiveError]) -> None:
        """Log the snapshots the archive cannot hold, and have the store stop offering them."""
        if not unfit:
            return
        for error in unfit.values():
            _log.error("archive %s: %s; it is set aside, never archived, and stays in the store", self.root, error)
        self._store.set_aside(sorted(unfit))

    async def _write_breaks(self, resolutions: list[Resolution]) -> None:
        files = await asyncio.to_thread(write_resolution_batch, self.root, resolutions)
        self.resolutions_written += len(resolutions)
        _log.debug("archived %d breaks in %d files", len(resolutions), len(files))

    async def _resync(self) -> None:
        """Set the archive right after a crash or a failure, and write what the store has unarchived."""
        first = self._store.unarchived(1)
        removed = await asyncio.to_thread(repair, self.root)
        if removed:
            _log.info("archive %s: removed %d files of an interrupted batch", self.root, len(removed))
        if first:
            present = await asyncio.to_thread(archived_ids, self.root, first[0])
            self._store.mark_archived(sorted(present))
        caught_up = 0
        after = 0
        while ids := self._store.unarchived(self.batch_size, after):
            after = ids[-1]
            # No await between the query and this filter: a snapshot stored meanwhile is pending.
            wanted = [i for i in ids if i not in self._pending_ids]
            items = [item for i in wanted if (item := load(self._store, i)) is not None]
            if items:
                await self._write(items)
                caught_up += len(items)
        if caught_up:
            _log.info("archive %s: wrote %d snapshots the store held unarchived", self.root, caught_up)
        if self._resyncs_breaks:
            await self._resync_breaks()
        self._behind = False

    async def _resync_breaks(self) -> None:
        """Write the store's finished breaks that the archive lacks (or holds as given up only, when
        the store has their late answer) and that are not pending."""
        present = await asyncio.to_thread(archived_outcomes, self.root)
        # No await between the listing and this filter: a break finished meanwhile is pending.
        missing = [
            resolution
            for resolution in finished_resolutions(self._store)
            if needs_archiving(resolution, present) and resolution_key(resolution) not in self._break_keys
        ]
        missing.reverse()  # oldest first
        for start in range(0, len(missing), self.batch_size):
            await self._write_breaks(missing[start : start + self.batch_size])
        if missing:
            _log.info("archive %s: wrote %d breaks the archive lacked", self.root, len(missing))
