"""Reading the archive back: whole snapshots and the breaks, for users and the pipeline, and a check
of every file.

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
from typing import Any

import pyarrow as pa

from stablewatch.detector.archive.files import batch_range, check_marker, parquet_files, read_file
from stablewatch.detector.archive.schema import TABLES, ArchiveError, resolution_from_row, snapshot_from_rows
from stablewatch.v1 import GlobalSnapshot
from stablewatch.v1.query_pb2 import Resolution

__all__ = ["ArchiveCheck", "check", "read_resolutions", "read_snapshots"]

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


def read_resolutions(root: Path) -> list[Resolution]:
    """Every break in the archive at `root`, as the ``Resolution`` the detector archived, oldest
    first (by break id, then snapshot id). ArchiveError naming a bad file."""
    root = Path(root)
    check_marker(root)
    rows = [row for path in parquet_files(root, _BREAKS) for row in _rows(read_file(path, _BREAKS), _BREAKS)]
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
    """What :func:`check` found: files and rows per table, the snapshots by outcome, the breaks by outcome."""

    schema_version: int
    files: dict[str, int] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    resolutions: dict[str, int] = field(default_factory=dict)


def check(root: Path) -> ArchiveCheck:
    """Read every file of the archive at `root`, and count; ArchiveError naming the first bad file.

    A snapshot id found in two ``snapshots`` rows is an error too (the archive holds each once),
    and so is a break (snapshot and break id) found in two ``resolutions`` rows.
    """
    root = Path(root)
    found = ArchiveCheck(schema_version=check_marker(root))
    seen: dict[int, Path] = {}
    seen_breaks: dict[tuple[int, int], Path] = {}
    outcomes: Counter[str] = Counter()
    breaks: Counter[str] = Counter()
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
                breaks.update(arrow.column("outcome").to_pylist())
                for key in zip(*(arrow.column(n).to_pylist() for n in ("snapshot_id", "resolution_id")), strict=True):
                    if key in seen_breaks:
                        raise ArchiveError(
                            f"{path}: break {key[1] % 2**64} of snapshot {key[0] % 2**64} is archived twice "
                            f"(also in {seen_breaks[key]})"
                        )
                    seen_breaks[key] = path
    found.outcomes = dict(sorted(outcomes.items()))
    found.resolutions = dict(sorted(breaks.items()))
    return found
