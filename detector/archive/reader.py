"""Reading the archive back: whole snapshots and the breaks, for users and the pipeline, one snapshot's
rows as columns for the columnar evaluation, and a check of every file.

Snapshots and the check go batch by batch (a ``snapshots`` file and the files of the same day and batch name in the
other tables), so memory holds one batch at a time. Every file is checked as it is read
(:func:`.files.read_file`): a corrupt or foreign file, or one of a newer schema version, raises
:class:`.schema.ArchiveError` naming the file and the reason.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from stablewatch.detector.archive.files import batch_range, check_marker, parquet_files, read_file
from stablewatch.detector.archive.schema import (
    METADATA_KEY,
    SCHEMA_VERSION,
    TABLES,
    ArchiveError,
    latest_rows,
    outcome_rank,
    resolution_from_row,
    snapshot_from_rows,
    table_schema,
)
from stablewatch.v1 import GlobalSnapshot
from stablewatch.v1.query_pb2 import Resolution

if TYPE_CHECKING:
    from stablewatch.detector.evaluation.columnar import SnapshotRows

__all__ = ["ArchiveCheck", "check", "read_resolutions", "read_snapshot_rows", "read_snapshots"]

_PARTS = ("processes", "counters", "wait_edges", "channels", "messages")
# Times an agent reported (or copied from one): any int64, which a Python datetime may not hold,
# so they are read as microseconds.
_AGENT_TIMES = {"wait_edges": ("began_at",), "resolutions": ("wait_began_at", "sent_at", "reported_at")}


_BREAKS = "resolutions"


def _rows(table: pa.Table, name: str) -> list[dict[str, Any]]:
    """The rows of an archive file of table `name` as dicts, agents' times as microseconds."""
    for column in _AGENT_TIMES.get(name, ()):
        at = table.schema.get_field_index(column)
        table = table.set_column(at, column, table.column(at).cast(pa.int64()))
    return table.to_pylist()


def read_snapshots(
    root: Path, ids: Iterable[int] | None = None
) -> Iterator[tuple[dict[str, Any], GlobalSnapshot | None]]:
    """Every snapshot in the archive at `root` (or those of `ids`): its ``snapshots`` row, and the
    ``GlobalSnapshot`` rebuilt from its rows (None for an aborted one).

    In day and batch order, by id within a batch. Batch names skip the files that cannot hold any
    of `ids`. The ``results`` rows are not read: :func:`.files.read_table` reads them.
    """
    root = Path(root)
    check_marker(root)
    wanted = None if ids is None else sorted(set(ids))
    for path in parquet_files(root, "snapshots"):
        if wanted is not None and not _may_hold(path.name, wanted):
            continue
        heads = read_file(path, "snapshots").to_pylist()
        if wanted is not None:
            heads = [head for head in heads if _holds(wanted, head["snapshot_id"])]
        if not heads:
            continue
        parts: dict[str, dict[int, list[dict[str, Any]]]] = {}
        for table in _PARTS:
            rows = parts[table] = {}
            sibling = root / table / path.parent.name / path.name
            if sibling.exists():
                for row in _rows(read_file(sibling, table), table):
                    rows.setdefault(row["snapshot_id"], []).append(row)
        for head in sorted(heads, key=lambda head: head["snapshot_id"]):
            if head["outcome"] != "completed":
                yield head, None
                continue
            snapshot_id = head["snapshot_id"]
            try:
                snapshot = snapshot_from_rows(head, *(parts[table].get(snapshot_id, []) for table in _PARTS))
            except ArchiveError as error:
                raise ArchiveError(f"{path}: {error}") from None
            yield head, snapshot


def read_snapshot_rows(root: Path, snapshot_id: int, waits: bool = True) -> SnapshotRows:
    """The rows of completed snapshot `snapshot_id` in the archive at `root`, as Arrow columns: the
    columns the columnar evaluation reads (:data:`~stablewatch.detector.evaluation.columnar.COLUMNS`)
    and no others, only this snapshot's rows (the row groups of other snapshots are skipped).
    Without `waits`, of the wait edges only the columns the results besides the wait-for graph
    need are read (:data:`~stablewatch.detector.evaluation.columnar.LIGHT_WAIT_COLUMNS`; the
    others null).

    What :func:`stablewatch.detector.evaluation.columnar.evaluate_rows` evaluates without rebuilding
    the ``GlobalSnapshot``: a snapshot of a million processes reads in a second. ArchiveError
    naming the file when one is corrupt, foreign or newer, and when the snapshot is not in the
    archive or was aborted.
    """
    # numpy, which the columnar evaluation needs, only for a caller of this function.
    from stablewatch.detector.evaluation.columnar import COLUMNS, LIGHT_WAIT_COLUMNS, SnapshotRows

    root = Path(root)
    check_marker(root)
    for path in parquet_files(root, "snapshots"):
        ids = batch_range(path.name)
        if ids is not None and not ids[0] <= snapshot_id <= ids[1]:
            continue
        names = [f.name for f in TABLES["snapshots"] if f.name not in ("snapshot", "day")]
        heads = _columns(path, "snapshots", names, snapshot_id)
        if not heads.num_rows:
            continue
        # The lists of names stay Arrow arrays: a million expected members are one column, not a million strs.
        head: dict[str, Any] = {
            name: heads[name][0].values if pa.types.is_list(heads.schema.field(name).type) else heads[name][0].as_py()
            for name in heads.column_names
        }
        head["day"] = path.parent.name.removeprefix("day=")
        if head["outcome"] != "completed":
            raise ArchiveError(f"{path}: snapshot {snapshot_id} was {head['outcome']}: it has no global state")
        tables = {}
        for table, columns in COLUMNS.items():
            sibling = root / table / path.parent.name / path.name
            wanted = list(LIGHT_WAIT_COLUMNS) if table == "wait_edges" and not waits else list(columns)
            read = _columns(sibling, table, wanted, snapshot_id) if sibling.exists() else None
            if read is None:
                read = TABLES[table].empty_table().select(wanted)
            for name in columns:
                if name not in wanted:
                    read = read.append_column(
                        TABLES[table].field(name), pa.nulls(read.num_rows, TABLES[table].field(name).type)
                    )
            tables[table] = read.select(list(columns))
        return SnapshotRows(head, **tables)
    raise ArchiveError(f"{root}: snapshot {snapshot_id} is not in the archive")


def _columns(path: Path, table: str, columns: list[str], snapshot_id: int) -> pa.Table:
    """`columns` of the rows of `snapshot_id` in one file of `table`, checked as :func:`.files.read_file`
    checks a whole file; a column added after the file's schema version reads as nulls."""
    try:
        file = pq.ParquetFile(path)
        version_text = (file.schema_arrow.metadata or {}).get(METADATA_KEY)
    except (OSError, pa.ArrowException) as exc:
        raise ArchiveError(f"{path}: not a readable Parquet file ({exc})") from exc
    if version_text is None or not version_text.isdigit():
        raise ArchiveError(f"{path}: not a stablewatch archive file (no {METADATA_KEY.decode()} metadata)")
    version = int(version_text)
    if version > SCHEMA_VERSION:
        raise ArchiveError(
            f"{path}: schema version {version} is newer than this stablewatch reads ({SCHEMA_VERSION}); "
            "upgrade stablewatch"
        )
    try:
        expected = table_schema(table, version)
    except ArchiveError as error:
        raise ArchiveError(f"{path}: {error}") from None
    schema = file.schema_arrow
    present = [name for name in columns if name in expected.names]
    if any(name not in schema.names or schema.field(name).type != expected.field(name).type for name in present):
        raise ArchiveError(f"{path}: its columns do not match the {table} table of schema version {version}")
    try:
        wanted = list(dict.fromkeys(["snapshot_id", *present]))
        read = pq.read_table(path, columns=wanted, filters=[("snapshot_id", "==", snapshot_id)])
    except (OSError, pa.ArrowException) as exc:
        raise ArchiveError(f"{path}: corrupt Parquet file ({exc})") from exc
    read = read.filter(pc.equal(read["snapshot_id"], snapshot_id))  # whatever the row-group statistics let through
    return pa.table(
        {
            name: read[name] if name in present else pa.nulls(read.num_rows, TABLES[table].field(name).type)
            for name in columns
        }
    )


def read_resolutions(root: Path) -> list[Resolution]:
    """Every break in the archive at `root`, as the ``Resolution`` the detector archived last, oldest
    first (by break id, then snapshot id): a break given up and then answered late has two rows,
    and reads as its answer (:func:`.schema.latest_rows`). ArchiveError naming a bad file."""
    root = Path(root)
    check_marker(root)
    rows = [row for path in parquet_files(root, _BREAKS) for row in _rows(read_file(path, _BREAKS), _BREAKS)]
    rows = latest_rows(rows)
    rows.sort(key=lambda row: (row["resolution_id"] % 2**64, row["snapshot_id"] % 2**64))
    return [resolution_from_row(row) for row in rows]


def _holds(wanted: list[int], snapshot_id: int) -> bool:
    at = bisect.bisect_left(wanted, snapshot_id)
    return at < len(wanted) and wanted[at] == snapshot_id


def _may_hold(name: str, wanted: list[int]) -> bool:
    ids = batch_range(name)
    if ids is None:
        return True
    at = bisect.bisect_left(wanted, ids[0])
    return at < len(wanted) and wanted[at] <= ids[1]


@dataclass
class ArchiveCheck:
    """What :func:`check` found: files and rows per table, the snapshots by outcome, the breaks by the
    outcome they read as (one each), and how many of them were answered after they were given up."""

    schema_version: int
    files: dict[str, int] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    resolutions: dict[str, int] = field(default_factory=dict)
    late_answers: int = 0


def check(root: Path) -> ArchiveCheck:
    """Read every file of the archive at `root`, and count; ArchiveError naming the first bad file.

    A snapshot id found in two ``snapshots`` rows is an error too (the archive holds each once),
    and so is a break (snapshot and break id) found in two ``resolutions`` rows, but for one case:
    an ``unanswered`` (or ``pending``) row and an agent's answer that came late (a break has at
    most one of each).
    """
    root = Path(root)
    found = ArchiveCheck(schema_version=check_marker(root))
    seen: dict[int, Path] = {}
    # Per break: its answer's row and its other row (given up, or pending), by where each was seen.
    seen_breaks: dict[tuple[int, int], dict[bool, tuple[str, Path]]] = {}
    outcomes: Counter[str] = Counter()
    for table in TABLES:
        paths = parquet_files(root, table)
        found.files[table] = len(paths)
        found.rows[table] = 0
        for path in paths:
            arrow = read_file(path, table)
            found.rows[table] += arrow.num_rows
            if table == "snapshots":
                outcomes.update(arrow.column("outcome").to_pylist())
                for snapshot_id in arrow.column("snapshot_id").to_pylist():
                    if snapshot_id in seen:
                        raise ArchiveError(
                            f"{path}: snapshot {snapshot_id} is archived twice (also in {seen[snapshot_id]})"
                        )
                    seen[snapshot_id] = path
            elif table == "resolutions":
                columns = (arrow.column(n).to_pylist() for n in ("snapshot_id", "resolution_id", "outcome"))
                for snapshot_id, resolution_id, outcome in zip(*columns, strict=True):
                    rows_of = seen_breaks.setdefault((snapshot_id, resolution_id), {})
                    answered = outcome_rank(outcome) == 2
                    if answered in rows_of:
                        raise ArchiveError(
                            f"{path}: break {resolution_id % 2**64} of snapshot {snapshot_id % 2**64} is archived "
                            f"twice (also in {rows_of[answered][1]})"
                        )
                    rows_of[answered] = (outcome, path)
    found.outcomes = dict(sorted(outcomes.items()))
    breaks = Counter(rows_of[max(rows_of)][0] for rows_of in seen_breaks.values())
    found.resolutions = dict(sorted(breaks.items()))
    found.late_answers = sum(len(rows_of) == 2 for rows_of in seen_breaks.values())
    return found
