"""The archive on disk: its marker file, one atomic batch of Parquet files, and reading them back.

Layout (see :mod:`.schema` for the tables)::

    ARCHIVE/_stablewatch_archive.json                 {"format": "stablewatch-archive", "schema_version": 4}
    ARCHIVE/<table>/day=YYYY-MM-DD/<batch>.parquet    one file per table, day and batch
    ARCHIVE/resolutions/day=YYYY-MM-DD/<name>.parquet  breaks, written on their own

A batch is written aside (``.<name>.parquet.tmp``, ignored by readers) and then renamed into
place, table by table, the ``snapshots`` file last: a reader never sees half a file, and a
snapshot whose ``snapshots`` row is visible has all its other rows visible too. Batch names
hold the first and last snapshot id, so a batch written twice replaces itself.

Breaks (the ``resolutions`` table) belong to no batch of snapshots: :func:`write_resolutions`
writes them the same way, aside then renamed, one file per day, named for the break ids and a
digest of the breaks and outcomes it holds (:func:`resolutions_name`), so that a file never
replaces one holding other breaks, or the same breaks with other outcomes (a late answer's row is
a new file beside the ``unanswered`` one: files are never rewritten, and a reader that takes
files as they appear sees it). What is archived is read back from the files themselves
(:func:`read_outcomes`), not from the names.

The marker holds the newest schema version written into the folder: a writer of a newer version
raises it (:func:`raise_marker`) when it opens an older archive, whose files all still read.

One process writes an archive at a time: it holds an exclusive lock on
``ARCHIVE/.stablewatch-writer.lock`` (:func:`lock_archive`), so that repairing what a crash left
(:mod:`.recovery`) never removes the files of a batch another writer is renaming into place.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from stablewatch.detector import lockfile
from stablewatch.detector.archive.schema import (
    MARKER_FILE,
    METADATA_KEY,
    SCHEMA_VERSION,
    SNAPSHOT_TABLES,
    TABLES,
    ArchiveError,
    table_from_rows,
    table_schema,
)

__all__ = [
    "LOCK_FILE",
    "batch_name",
    "batch_range",
    "ensure_archive",
    "lock_archive",
    "parquet_files",
    "raise_marker",
    "read_ids",
    "read_outcomes",
    "read_table",
    "resolutions_name",
    "unlock_archive",
    "write_batch",
    "write_resolutions",
]

_FORMAT = "stablewatch-archive"
# The snapshots table goes last, so that its rows only appear once everything they refer to has.
_WRITE_ORDER = [name for name in SNAPSHOT_TABLES if name != "snapshots"] + ["snapshots"]
_BATCH_NAME = re.compile(r"part-(\d{20})-(\d{20})\.parquet")
#: The lock a writer holds at the archive's root (a dot file: ignored by readers and by Spark).
LOCK_FILE = ".stablewatch-writer.lock"


def ensure_archive(root: Path) -> Path:
    """Create the archive folder and its marker if needed; ArchiveError if it is someone else's or newer."""
    root = Path(root)
    marker = root / MARKER_FILE
    if marker.exists():
        check_marker(root)
        return root
    try:
        root.mkdir(parents=True, exist_ok=True)
        if any(p for p in root.iterdir() if not p.name.startswith(".")):
            raise ArchiveError(f"{root} is not empty and is not a stablewatch archive (no {MARKER_FILE})")
        _write_marker(root)
    except OSError as exc:
        raise ArchiveError(f"cannot create the archive {root}: {exc.strerror or exc}") from exc
    return root


def raise_marker(root: Path) -> None:
    """Mark an archive of an older schema version as of this one, which its writer now adds files of.

    Call it holding the writer lock. ArchiveError when the marker cannot be written.
    """
    if check_marker(root) < SCHEMA_VERSION:
        try:
            _write_marker(root)
        except OSError as exc:
            raise ArchiveError(f"cannot update the archive marker {root / MARKER_FILE}: {exc.strerror or exc}") from exc


def _write_marker(root: Path) -> None:
    tmp = root / f".{MARKER_FILE}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps({"format": _FORMAT, "schema_version": SCHEMA_VERSION}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MARKER_FILE)
    _sync_folders([root])


def _sync_folders(folders: Iterable[Path]) -> None:
    """Flush each folder's entries to disk: a rename is durable only once its folder is.

    The store marks a batch archived after its files are renamed into place; without this, a power
    loss could keep that mark and lose the renames (and a new day's folder) with the batch.
    """
    for folder in folders:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def check_marker(root: Path) -> int:
    """The archive's schema version; ArchiveError when `root` is not an archive or is newer than this code."""
    marker = Path(root) / MARKER_FILE
    try:
        content = json.loads(marker.read_text())
    except FileNotFoundError:
        raise ArchiveError(f"{root} is not a stablewatch archive: {MARKER_FILE} is missing") from None
    except (OSError, ValueError) as exc:
        raise ArchiveError(f"{marker}: cannot read the archive marker ({exc})") from exc
    if not isinstance(content, dict) or content.get("format") != _FORMAT:
        raise ArchiveError(f"{marker}: not a stablewatch archive marker")
    version = content.get("schema_version")
    if not isinstance(version, int) or version < 1:
        raise ArchiveError(f"{marker}: bad schema_version {version!r}")
    if version > SCHEMA_VERSION:
        raise ArchiveError(
            f"{marker}: archive schema version {version} is newer than this stablewatch reads ({SCHEMA_VERSION}); "
            "upgrade stablewatch"
        )
    return version


def batch_name(snapshot_ids: Sequence[int]) -> str:
    """The file name of a batch holding these snapshots: deterministic, so rewriting it replaces it."""
    return f"part-{min(snapshot_ids):020d}-{max(snapshot_ids):020d}.parquet"


def batch_range(name: str) -> tuple[int, int] | None:
    """The first and last snapshot id of a batch file named by :func:`batch_name`; None for other names."""
    match = _BATCH_NAME.fullmatch(name)
    return None if match is None else (int(match[1]), int(match[2]))


def lock_archive(root: Path) -> int | None:
    """Take the archive's writer lock; returns its descriptor (None where the file system has no locks).

    ArchiveError naming the holder when another process writes this archive.
    """
    path = Path(root) / LOCK_FILE
    try:
        return lockfile.take(path)
    except lockfile.Held as held:
        raise ArchiveError(
            f"the archive {root} is being written by another process (pid {held.holder}); "
            "one detector or export writes an archive at a time"
        ) from None
    except OSError as exc:
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            return None  # e.g. some FUSE mounts: the caller warns that nothing keeps a second writer out
        raise ArchiveError(f"cannot lock {path}: {exc.strerror or exc}") from exc


def unlock_archive(fd: int | None) -> None:
    """Release the lock :func:`lock_archive` took (closing the descriptor releases the flock)."""
    if fd is not None:
        os.close(fd)


def write_batch(root: Path, rows: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[Path]:
    """Write one batch of rows (table name -> rows, as :func:`.schema.snapshot_rows` makes them).

    One file per table and day, each written aside and renamed into place, ``snapshots`` last.
    Returns the files written. Raises ArchiveError (naming the file) when writing fails; what was
    already in the archive is untouched.
    """
    ids = [row["snapshot_id"] for row in rows.get("snapshots", ())]
    if not ids:
        return []
    name = batch_name(ids)
    files = [(table, day, name, day_rows) for table in _WRITE_ORDER for day, day_rows in _by_day(rows.get(table, ()))]
    return _write_files(root, files, f"batch {name}")


def resolutions_name(rows: Sequence[Mapping[str, Any]]) -> str:
    """The file name of these ``resolutions`` rows: their first and last break id, and a digest of
    the breaks (snapshot and break ids) and their outcomes, so that other breaks, or a break's
    later outcome, never get the same name (the same rows written again do)."""
    keys = sorted((row["snapshot_id"], row["resolution_id"], row["outcome"]) for row in rows)
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).hexdigest()
    ids = [row["resolution_id"] % 2**64 for row in rows]
    return f"part-{min(ids):020d}-{max(ids):020d}-{digest}.parquet"


def write_resolutions(root: Path, rows: Sequence[Mapping[str, Any]]) -> list[Path]:
    """Write ``resolutions`` rows (as :func:`.schema.resolution_row` makes them), one file per day.

    Each file is written aside and renamed into place, as a batch's are. Returns the files
    written; ArchiveError (naming the file) when writing fails, the archive keeping what it held.
    """
    files = [("resolutions", day, resolutions_name(day_rows), day_rows) for day, day_rows in _by_day(rows)]
    return _write_files(root, files, f"{len(rows)} resolutions")


def _by_day(rows: Iterable[Mapping[str, Any]]) -> list[tuple[str, list[Mapping[str, Any]]]]:
    by_day: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        by_day.setdefault(row["day"], []).append(row)
    return sorted(by_day.items())


_File = tuple[str, str, str, Sequence[Mapping[str, Any]]]  # table, day, name, rows


def _write_files(root: Path, files: Sequence[_File], what: str) -> list[Path]:
    """Write each (table, day, name, rows) aside, then rename them all into place in that order.

    ArchiveError naming `what` when writing fails, :class:`.schema.RowsError` when a value does not
    fit its column; either way no temporary file is left behind.
    """
    staged: list[tuple[Path, Path]] = []
    try:
        for table, day, name, day_rows in files:
            folder = root / table / f"day={day}"
            folder.mkdir(parents=True, exist_ok=True)
            final = folder / name
            tmp = folder / f".{name}.tmp"
            arrow = table_from_rows(table, day_rows).drop_columns(["day"])
            arrow = arrow.replace_schema_metadata({METADATA_KEY: str(SCHEMA_VERSION).encode()})
            staged.append((tmp, final))  # before writing: a write that fails (disk full) leaves part of it
            pq.write_table(arrow, tmp, compression="zstd")
        landed = 0
        for tmp, final in staged:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            # A file stream (``pipeline follow``) takes files in modification-time order, at
            # millisecond resolution: each file lands at least a millisecond after the one before,
            # so a batch spanning midnight is taken day by day, the order its snapshots finished in.
            landed = max(time.time_ns(), landed + 1_000_000)
            os.utime(tmp, ns=(landed, landed))
            os.replace(tmp, final)
        # Each day's folder, then the folders that may have gained a day's folder or a table's.
        days = dict.fromkeys(final.parent for _, final in staged)
        _sync_folders([*days, *dict.fromkeys(day.parent for day in days), root])
    except BaseException as exc:
        for tmp, _ in staged:
            with contextlib.suppress(OSError):  # the error that brought us here is the one to report
                tmp.unlink(missing_ok=True)
        if isinstance(exc, (OSError, pa.ArrowException)):
            raise ArchiveError(f"cannot write {what} to {root}: {exc}") from exc
        raise
    return [final for _, final in staged]


def parquet_files(root: Path, table: str) -> list[Path]:
    """The visible Parquet files of `table` (temporary files are skipped), in day and batch order."""
    if table not in TABLES:
        raise ArchiveError(f"there is no table {table!r} in a stablewatch archive (tables: {', '.join(TABLES)})")
    folder = Path(root) / table
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob("day=*/*.parquet") if not p.name.startswith("."))


def _open(path: Path) -> tuple[pq.ParquetFile, int]:
    """An archive file opened, and its schema version, checked; ArchiveError naming the file otherwise."""
    try:
        file = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise ArchiveError(f"{path}: not a readable Parquet file ({exc})") from exc
    metadata = file.schema_arrow.metadata or {}
    version = metadata.get(METADATA_KEY)
    if version is None:
        raise ArchiveError(f"{path}: not a stablewatch archive file (no {METADATA_KEY.decode()} metadata)")
    try:
        number = int(version)
    except ValueError:
        raise ArchiveError(f"{path}: bad schema version {version!r}") from None
    if number > SCHEMA_VERSION:
        raise ArchiveError(
            f"{path}: schema version {number} is newer than this stablewatch reads ({SCHEMA_VERSION}); "
            "upgrade stablewatch"
        )
    return file, number


def read_file(path: Path, table: str) -> pa.Table:
    """One archive file as an Arrow table with its ``day`` column; ArchiveError naming the file if it
    is corrupt, foreign, or of a newer schema version. A file of an older version gets the columns
    added since, null."""
    file, version = _open(path)
    expected = _file_schema(path, table, version)
    try:
        arrow = file.read()
    except (OSError, pa.ArrowException) as exc:
        raise ArchiveError(f"{path}: corrupt Parquet file ({exc})") from exc
    if not arrow.schema.remove_metadata().equals(expected):
        raise ArchiveError(f"{path}: its columns do not match the {table} table of schema version {version}")
    day = path.parent.name.removeprefix("day=")
    arrow = arrow.append_column("day", pa.array([day] * arrow.num_rows, pa.string()))
    if version < SCHEMA_VERSION:
        columns = {name: arrow[name] for name in arrow.column_names}
        nulls = {f.name: pa.nulls(arrow.num_rows, f.type) for f in TABLES[table] if f.name not in columns}
        arrow = pa.table({f.name: columns.get(f.name, nulls.get(f.name)) for f in TABLES[table]}, schema=TABLES[table])
    return arrow


def _file_schema(path: Path, table: str, version: int) -> pa.Schema:
    """The columns a file of `table` and schema `version` has (no ``day``); ArchiveError naming `path`."""
    try:
        expected = table_schema(table, version)
    except ArchiveError as error:
        raise ArchiveError(f"{path}: {error}") from None
    return expected.remove(expected.get_field_index("day"))


def read_outcomes(path: Path) -> list[tuple[int, int, str]]:
    """The (snapshot id, break id, outcome) of every row of one ``resolutions`` file, read alone (cheap)."""
    file, version = _open(path)
    columns = ["snapshot_id", "resolution_id", "outcome"]
    expected = _file_schema(path, "resolutions", version)
    schema = file.schema_arrow
    if any(n not in schema.names or schema.field(n).type != expected.field(n).type for n in columns):
        raise ArchiveError(f"{path}: its columns do not match the resolutions table of schema version {version}")
    try:
        read = file.read(columns=columns)
    except (OSError, pa.ArrowException) as exc:
        raise ArchiveError(f"{path}: corrupt Parquet file ({exc})") from exc
    return list(zip(*(read.column(i).to_pylist() for i in range(3)), strict=True))


def read_ids(path: Path) -> list[int]:
    """The ``snapshot_id`` column of one archive file, read alone (cheap); ArchiveError as :func:`read_file`."""
    file, _ = _open(path)
    schema = file.schema_arrow
    if "snapshot_id" not in schema.names or schema.field("snapshot_id").type != pa.int64():
        raise ArchiveError(f"{path}: it has no int64 snapshot_id column, as every archive table does")
    try:
        return file.read(columns=["snapshot_id"]).column(0).to_pylist()
    except (OSError, pa.ArrowException) as exc:
        raise ArchiveError(f"{path}: corrupt Parquet file ({exc})") from exc


def read_table(root: Path, table: str, files: Iterable[Path] | None = None) -> pa.Table:
    """All rows of `table` in the archive at `root` (or of the given files), checked file by file."""
    check_marker(root)
    tables = [read_file(path, table) for path in (parquet_files(root, table) if files is None else files)]
    if not tables:
        return TABLES[table].empty_table()
    return pa.concat_tables(tables)
