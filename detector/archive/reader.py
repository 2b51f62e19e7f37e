"""Reading the archive back: whole snapshots, for users and the pipeline, and a check of every file.

Both go batch by batch (a ``snapshots`` file and the files of the same day and batch name in the
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

from stablewatch.detector.archive.files import batch_range, check_marker, parquet_files, read_file
from stablewatch.detector.archive.schema import TABLES, ArchiveError, snapshot_from_rows
from stablewatch.v1 import GlobalSnapshot

__all__ = ["ArchiveCheck", "check", "read_snapshots"]

_PARTS = ("processes", "counters", "wait_edges", "channels", "messages")


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
                for row in read_file(sibling, table).to_pylist():
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
    """What :func:`check` found: files and rows per table, and the snapshots by outcome."""

    schema_version: int
    files: dict[str, int] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)


def check(root: Path) -> ArchiveCheck:
    """Read every file of the archive at `root`, and count; ArchiveError naming the first bad file.

    A snapshot id found in two ``snapshots`` rows is an error too (the archive holds each once).
    """
    root = Path(root)
    found = ArchiveCheck(schema_version=check_marker(root))
    seen: dict[int, Path] = {}
    outcomes: Counter[str] = Counter()
    for table in TABLES:
        paths = parquet_files(root, table)
        found.files[table] = len(paths)
        found.rows[table] = 0
        for path in paths:
            arrow = read_file(path, table)
            found.rows[table] += arrow.num_rows
            if table != "snapshots":
                continue
            outcomes.update(arrow.column("outcome").to_pylist())
            for snapshot_id in arrow.column("snapshot_id").to_pylist():
                if snapshot_id in seen:
                    raise ArchiveError(
                        f"{path}: snapshot {snapshot_id} is archived twice (also in {seen[snapshot_id]})"
                    )
                seen[snapshot_id] = path
    found.outcomes = dict(sorted(outcomes.items()))
    return found
