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

The archive folder may be a local path or any mounted file system whose ``rename`` is atomic
within a folder: a local disk, NFS, CephFS, Amazon EFS or FSx, Azure Files, JuiceFS, or a
Kubernetes PersistentVolume (CSI) backed by one of them. Object-store FUSE mounts are not such
file systems: Mountpoint for S3 refuses ``rename`` on general purpose buckets (batches fail with
a clear error), and s3fs, goofys or gcsfuse on a flat bucket emulate it by copy-then-delete, so a
reader could see a half-copied file. For an object store, archive to a local folder and copy the
finished files up (``aws s3 sync``, ``gcloud storage rsync``, ``rclone copy``) excluding dot-files
(``.*``: temporary files and the lock), other tables first and ``snapshots`` last; an object PUT is
atomic, so readers see whole files.

A snapshot the store deletes by retention before it is archived is lost to the archive; with the
default retention (days) and batch age (minutes) that needs the archive to fail for days.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from stablewatch.detector.archive.files import ensure_archive, lock_archive, unlock_archive, write_batch
from stablewatch.detector.archive.recovery import archived_ids, repair
from stablewatch.detector.archive.schema import TABLES, ArchiveError, snapshot_rows
from stablewatch.v1 import Evaluation, GlobalSnapshot
from stablewatch.v1.query_pb2 import SnapshotSummary

__all__ = ["ArchiveWriter", "ArchivingStore", "Finished", "SnapshotSource", "load", "open_archive", "write_finished"]

_log = logging.getLogger(__name__)


class SnapshotSource(Protocol):
    """Where finished snapshots are read from (the detector's store)."""

    def summary(self, snapshot_id: int) -> SnapshotSummary | None: ...
    def snapshot(self, snapshot_id: int) -> GlobalSnapshot | None: ...
    def evaluation(self, snapshot_id: int) -> Evaluation | None: ...


class ArchivingStore(SnapshotSource, Protocol):
    """A store that also remembers which finished snapshots are archived."""

    def unarchived(self, limit: int, after_id: int = 0) -> list[int]: ...
    def mark_archived(self, snapshot_ids: Sequence[int]) -> None: ...


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


def write_finished(root: Path, batch: Sequence[Finished]) -> list[Path]:
    """Write these snapshots as one batch (blocking; run it off the event loop); return the files.

    ArchiveError naming the file when writing fails; the archive keeps what it held.
    """
    rows: dict[str, list] = {name: [] for name in TABLES}
    for item in sorted(batch, key=lambda item: item.snapshot_id):
        for table, table_rows in snapshot_rows(item.summary, item.snapshot, item.evaluation).items():
            rows[table].extend(table_rows)
    return write_batch(root, rows)


def open_archive(root: Path) -> int | None:
    """Create or check the archive at `root` and take its writer lock (blocking); returns the lock.

    ArchiveError when `root` is not an archive, is newer than this code, or has another writer.
    """
    ensure_archive(root)
    lock = lock_archive(root)
    if lock is None:
        _log.warning("the file system of %s has no locks: make sure nothing else writes this archive", root)
    return lock


@dataclass
class _Pending:
    item: Finished
    added: float  # loop time


class ArchiveWriter:
    """Writes every finished snapshot of `store` to the archive at `root`; see the module docstring.

    Use it from the event loop that owns the store: ``await start()``, ``add(...)`` for every
    finished snapshot, ``await close()`` (which flushes what is pending).
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
        self._behind = False  # the store holds unarchived snapshots that are not pending: resync
        self._retry_at = 0.0
        self._closing = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lock: int | None = None
        #: Snapshots written so far by this writer (for logs and tests).
        self.written = 0

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

    @property
    def pending(self) -> int:
        """Snapshots waiting in memory for their batch."""
        return len(self._pending)

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
        if self._closing and (self._pending or self._behind):
            return 0.0
        if self._behind:
            return self._retry_at
        if not self._pending:
            return None
        if len(self._pending) >= self.batch_size:
            return 0.0
        return self._pending[0].added + self.max_age

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
        """Resync if behind, then write one batch of what is pending; False when that failed."""
        try:
            if self._behind:
                await self._resync()
            if self._pending:
                batch, self._pending = self._pending[: self.batch_size], self._pending[self.batch_size :]
                items = [pending.item for pending in batch]
                self._pending_ids.difference_update(item.snapshot_id for item in items)
                await self._write(items)
        except Exception as error:  # whatever it was, the store still has the snapshots
            self._failed(error)
            return False
        return True

    def _failed(self, error: Exception) -> None:
        """Log a failed write or resync, and resync in ``max_age`` seconds."""
        # What is pending is in the store too: the resync writes it, and memory stays bounded.
        self._pending.clear()
        self._pending_ids.clear()
        self._behind = True
        self._retry_at = asyncio.get_running_loop().time() + self.max_age
        log = _log.error if isinstance(error, ArchiveError) else _log.exception
        log("archive %s: %s; the snapshots stay in the store and are written later", self.root, error)

    async def _write(self, items: list[Finished]) -> None:
        files = await asyncio.to_thread(write_finished, self.root, items)
        self._store.mark_archived([item.snapshot_id for item in items])
        self.written += len(items)
        _log.debug("archived %d snapshots in %d files", len(items), len(files))

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
        self._behind = False
