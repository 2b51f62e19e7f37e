"""The jobs' terminal summaries, with rich: what a person reads after ``evaluate`` or ``history``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from stablewatch.detector.evaluation import Verdict
from stablewatch.detector.evaluation.text import plural
from stablewatch.pipeline.story import duration_text

__all__ = ["ReportedHistory", "evaluate_report", "history_report"]

_ROWS = 10  # rows shown per table; the Parquet tables have them all


class ReportedHistory(Protocol):
    """What :func:`history_report` reads of a history job's outcome
    (:class:`~stablewatch.pipeline.history.History` is the one; this module does not import it)."""

    @property
    def tables(self) -> Mapping[str, pa.Table]: ...

    @property
    def out(self) -> Path: ...

    @property
    def chart(self) -> Path | None: ...

    @property
    def first_at(self) -> datetime | None: ...

    @property
    def last_at(self) -> datetime | None: ...


def _when(moment: datetime | None) -> str:
    return "—" if moment is None else moment.strftime("%Y-%m-%d %H:%M:%S")


def _duration(seconds: float | None) -> str:
    """A duration to read, in milliseconds below a second (a snapshot takes a few): never ``0 s``."""
    return "—" if seconds is None else duration_text(seconds)


def _terminated(terminations: list[dict[str, Any]]) -> str:
    if not terminations:
        return "; never terminated"
    first = _when(terminations[0]["began_at"])
    return (
        f"; terminated by {first}"
        if len(terminations) == 1
        else f"; terminated {len(terminations)} times, first by {first}"
    )


def _names(names: Sequence[str] | None, shown: int = 6) -> str:
    names = list(names or [])
    return ", ".join(names[:shown]) + (f", … ({len(names) - shown} more)" if len(names) > shown else "")


#: Columns whose cells are never cut nor wrapped: snapshot ids are read whole.
_WHOLE = frozenset({"snapshots", "snapshot"})


def _table(title: str, columns: Sequence[str], rows: list[list[Any]], total: int) -> Table:
    table = Table(title=title if total <= len(rows) else f"{title} ({len(rows)} of {total})", title_justify="left")
    for column in columns:
        table.add_column(column, no_wrap=column in _WHOLE)
    for row in rows:
        table.add_row(*(str(cell) for cell in row))
    return table


def evaluate_report(verdicts: pa.Table, evaluated: int, aborted: int, large: int, rounds: int, out: str) -> Group:
    """The ``evaluate`` summary: how many snapshots, and each predicate's true/false/unknown counts.

    `verdicts` has columns ``name`` and one per :class:`Verdict` word (one row per predicate).
    `large` snapshots were evaluated from their rows (archived without their blob), their graphs
    reduced on DataFrames in `rounds` rounds first when too large to take whole.
    """
    line = f"evaluated {evaluated} snapshots ({aborted} aborted, not evaluated)"
    if large:
        line += f"; {plural(large, 'snapshot')} evaluated from {'its' if large == 1 else 'their'} rows"
        if rounds:
            line += f", reduced on DataFrames in {plural(rounds, 'round')} first"
    table = _table(
        "predicates",
        ["predicate", *Verdict],
        [[r["name"], *(r[word] for word in Verdict)] for r in verdicts.to_pylist()],
        verdicts.num_rows,
    )
    return Group(Text(line), table, Text(f"results: {out}", style="dim"))


def history_report(history: ReportedHistory) -> Group:
    """The ``history`` summary: the headline, then deadlock episodes, recurring processes, the deadlocks
    broken (only when there were breaks), termination, conservation, snapshot outcomes and the
    busiest channels; a table with no rows is one line instead."""
    t = history.tables
    deadlocks = t["deadlock_episodes"].to_pylist()
    ongoing = sum(1 for e in deadlocks if e["ongoing"])
    terminations = t["termination_episodes"].to_pylist()
    breaks = t["breaks"].to_pylist() if "breaks" in t else []
    broken = sum(1 for b in breaks if b["outcome"] == "broken")
    head = Text.assemble(
        (plural(t["timeline"].num_rows, "snapshot"), "bold"),
        f" from {_when(history.first_at)} to {_when(history.last_at)} UTC; ",
        (plural(len(deadlocks), "deadlock episode"), "bold red" if deadlocks else "bold green"),
        f" ({ongoing} ongoing)" if ongoing else "",
        *([("; ", ""), (f"{plural(broken, 'deadlock')} broken", "bold"), (f" ({_of(breaks)})", "")] if breaks else []),
        _terminated(terminations),
    )
    parts: list[RenderableType] = [head]
    recurring = t["recurring_processes"].to_pylist()
    if not deadlocks and not recurring:
        parts.append(Text("no deadlock episode"))
    else:
        parts.extend(_deadlock_tables(deadlocks, recurring, with_breaks=bool(breaks)))
    if breaks:
        parts.extend(_break_tables(breaks, t["breaks_over_time"].to_pylist()))
    if not terminations:
        parts.append(Text("no termination episode"))
    else:
        parts.append(_termination_table(terminations))
    counters = t["conservation_summary"].to_pylist()
    if not counters:
        parts.append(Text("conservation: no completed snapshot held a counter, so there was nothing to check"))
    else:
        parts.append(_conservation_table(counters))
    outcomes = t["snapshot_outcomes"].to_pylist()
    parts.append(
        _table(
            "snapshot outcomes",
            ["outcome", "abort kind", "snapshots", "p50", "p99", "max"],
            [
                [
                    o["outcome"],
                    o["abort_kind"],
                    o["snapshots"],
                    _duration(o["seconds_p50"]),
                    _duration(o["seconds_p99"]),
                    _duration(o["seconds_max"]),
                ]
                for o in outcomes
            ],
            len(outcomes),
        )
    )
    channels = sorted(t["channel_backlog"].to_pylist(), key=lambda c: (-c["messages_p99"], c["src"], c["dst"]))
    if not channels:
        parts.append(Text("channels: no completed snapshot held a channel"))
    else:
        parts.append(_channels_table(channels))
    written = f"tables: {history.out / 'history'}"
    if history.chart is not None:
        written += f"; chart: {history.chart}"
    parts.append(Text(written, style="dim"))
    return Group(*parts)


def _of(breaks: list[dict[str, Any]]) -> str:
    """How the breaks ended, e.g. ``3 breaks: 2 broken, 1 gone``."""
    outcomes = Counter(b["outcome"] for b in breaks)
    counted = ", ".join(f"{n} {word.replace('_', ' ')}" for word, n in sorted(outcomes.items()))
    return f"{plural(len(breaks), 'break')}: {counted}"


def _deadlock_tables(
    deadlocks: list[dict[str, Any]], recurring: list[dict[str, Any]], with_breaks: bool = False
) -> list[Table]:
    """The deadlock episodes (with their breaks when there were any) and the processes most often deadlocked."""
    columns = ["#", "began (after → by)", "ended by", "lasted", "snapshots", "processes", "tasks"]
    episodes = _table(
        "deadlock episodes",
        columns + (["broken"] if with_breaks else []),
        [
            [
                e["episode"],
                f"{_when(e['began_after'])} → {_when(e['began_at'])}",
                "ongoing" if e["ongoing"] else _when(e["ended_at"]),
                _duration(e["duration_seconds"]),
                f"{e['first_snapshot_id']}..\n{e['last_snapshot_id']} ({e['snapshots']})",  # one id a line
                _names(e["processes"]),
                _names(e["tasks"]),
                *([f"{e.get('broken') or 0} of {e.get('breaks') or 0}"] if with_breaks else []),
            ]
            for e in deadlocks[:_ROWS]
        ],
        len(deadlocks),
    )
    processes = _table(
        "processes most often deadlocked",
        ["process", "snapshots", "episodes", "first seen", "last seen"],
        [
            [r["process"], r["snapshots"], r["episodes"], _when(r["first_seen_at"]), _when(r["last_seen_at"])]
            for r in recurring[:_ROWS]
        ],
        len(recurring),
    )
    return [episodes, processes]


def _seconds(seconds: float | None) -> str:
    """A short time, to the millisecond (a break's recovery is often well under a second)."""
    if seconds is None:
        return "—"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds:.2f} s" if seconds < 10 else _duration(seconds)


def _break_tables(breaks: list[dict[str, Any]], buckets: list[dict[str, Any]]) -> list[Table]:
    """The deadlocks broken per time bucket, and the last breaks one by one."""
    over_time = _table(
        "deadlocks broken",
        [
            "from",
            "broken",
            "gone",
            "already broken",
            "policies disagree",
            "failed",
            "unanswered",
            "victims",
            "recovery p50",
            "max",
        ],
        [
            [
                _when(b["bucket_start"]),
                b["broken"],
                b["gone"],
                b["already_broken"],
                b["policies_disagree"],
                b["failed"],
                b["unanswered"] + b["pending"],
                _names(b["victims"]),
                _seconds(b["recovery_p50"]),
                _seconds(b["recovery_max"]),
            ]
            for b in buckets[:_ROWS]
        ],
        len(buckets),
    )
    last = breaks[-_ROWS:]
    one_by_one = _table(
        "last breaks",
        ["sent", "snapshot", "victim", "chosen by", "outcome", "recovery"],
        [
            [
                _when(b["sent_at"]),
                b["snapshot_id"],
                b["victim"],
                b["policy"] if b["requested_by"] == "detector" else b["requested_by"],
                b["outcome"].replace("_", " "),
                _seconds(b["recovery_seconds"]),
            ]
            for b in last
        ],
        len(breaks),
    )
    return [over_time, one_by_one]


def _termination_table(terminations: list[dict[str, Any]]) -> Table:
    return _table(
        "termination",
        ["#", "terminated (after → by)", "snapshot", "until"],
        [
            [
                e["episode"],
                f"{_when(e['began_after'])} → {_when(e['began_at'])}",
                e["first_snapshot_id"],
                "still terminated" if e["ongoing"] else _when(e["ended_at"]),
            ]
            for e in terminations[:_ROWS]
        ],
        len(terminations),
    )


def _conservation_table(counters: list[dict[str, Any]]) -> Table:
    return _table(
        "conservation",
        ["counter", "expected", "held", "violated", "unknown", "max |drift|", "last drift", "first violation"],
        [
            [
                c["counter"],
                c["expected"],
                c["held"],
                c["violated"],
                c["unknown"],
                c["max_abs_drift"],
                c["last_drift"],
                _when(c["first_violation_at"]),
            ]
            for c in counters
        ],
        len(counters),
    )


def _channels_table(channels: list[dict[str, Any]]) -> Table:
    return _table(
        "busiest channels (messages in flight per snapshot)",
        ["channel", "p50", "p90", "p99", "max", "bytes p99"],
        [
            [
                f"{c['src']} → {c['dst']}",
                c["messages_p50"],
                c["messages_p90"],
                c["messages_p99"],
                c["messages_max"],
                c["bytes_p99"],
            ]
            for c in channels[:5]
        ],
        len(channels),
    )
