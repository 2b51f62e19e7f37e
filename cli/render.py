"""Human output: predicate results (true, false, unknown), snapshots and the detector's answers, as rich tables."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from rich.console import Group
from rich.table import Table
from rich.text import Text

from stablewatch.detector.evaluation import Verdict
from stablewatch.detector.evaluation.text import plural
from stablewatch.detector.service.query import outcome_name
from stablewatch.v1 import GlobalSnapshot, PredicateResult
from stablewatch.v1.query_pb2 import (
    SNAPSHOT_OUTCOME_COMPLETED,
    Member,
    SnapshotResults,
    SnapshotSummary,
    WatchEvent,
)

__all__ = [
    "WatchView",
    "format_time",
    "is_alarming",
    "members_table",
    "predicate_table",
    "proto_dict",
    "results_report",
    "snapshot_report",
    "summary_line",
    "verdict_text",
]


def is_alarming(result: PredicateResult) -> bool:
    """Whether a result is bad news: a deadlock, a broken conservation, a failing user predicate.

    An unknown value is never alarming: the cut could not decide it. A user predicate that failed
    (unknown, with its error) is, since someone has to look at it.
    """
    if result.error:
        return True
    verdict = Verdict.of(result)
    if result.name == "deadlock":
        return verdict is Verdict.TRUE
    return result.name.startswith("conservation(") and verdict is Verdict.FALSE


def verdict_text(result: PredicateResult, *, named: bool = False) -> Text:
    """The result's :class:`Verdict` (``true``, ``false``, ``unknown``), as ``name=verdict`` when `named`,
    styled by the value: red for bad news, yellow for unknown, green otherwise."""
    verdict = Verdict.of(result)
    if is_alarming(result):
        style = "red bold"
    elif verdict is Verdict.UNKNOWN:
        style = "yellow"
    else:
        style = "green"
    return Text(f"{result.name}={verdict}" if named else str(verdict), style=style)


def _holdings(snapshot: GlobalSnapshot) -> str:
    names = {name for p in snapshot.processes for name in p.state.counters}
    if len(names) == 1:  # a single counter: show just the amounts
        (name,) = names
        return " ".join(f"{p.process_id}={p.state.counters.get(name, 0)}" for p in snapshot.processes)
    return " ".join(
        f"{p.process_id}=(" + ",".join(f"{k}:{v}" for k, v in sorted(p.state.counters.items())) + ")"
        for p in snapshot.processes
    )


def snapshot_report(entries: Sequence[tuple[GlobalSnapshot, Sequence[PredicateResult]]], title: str) -> Group:
    """A table with one row per snapshot and a verdict per predicate, then the notable summaries."""
    names: list[str] = []
    for _, results in entries:
        names += [result.name for result in results if result.name not in names]
    table = Table(title=title)
    table.add_column("snapshot", justify="right")
    table.add_column("state")
    table.add_column("in flight", justify="right")
    for name in names:
        table.add_column(name)
    notes: list[Text] = []
    for snapshot, results in entries:
        by_name = {result.name: result for result in results}
        in_flight = sum(len(channel.messages) for channel in snapshot.channels)
        cells = [verdict_text(by_name[name]) if name in by_name else Text("") for name in names]
        table.add_row(str(snapshot.snapshot_id), _holdings(snapshot), str(in_flight), *cells)
        for result in results:
            style = "red" if is_alarming(result) else "dim"
            summary = result.error or result.summary
            notes.append(Text(f"  #{snapshot.snapshot_id} {result.name}: {summary}", style=style))
    return Group(table, *notes)


# -- the detector's query API: results, members, the watch table, the wait-for graph -------------------------


def proto_dict(message: Message) -> dict[str, Any]:
    """``message`` as the JSON object the CLI prints: proto field names, every plain field (false and
    zero included), and 64-bit integers as numbers where JSON can hold them exactly."""
    return MessageToDict(
        message,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        unquote_int64_if_possible=True,
    )


def format_time(timestamp: Timestamp) -> str:
    """A protobuf timestamp as local time to the millisecond; ``-`` when unset."""
    if not timestamp.seconds and not timestamp.nanos:
        return "-"
    moment = datetime.fromtimestamp(timestamp.ToNanoseconds() / 1e9).astimezone()
    return moment.isoformat(sep=" ", timespec="milliseconds")


def _duration(summary: SnapshotSummary) -> str:
    if not summary.HasField("finished_at") or not summary.HasField("started_at"):
        return ""
    seconds = (summary.finished_at.ToNanoseconds() - summary.started_at.ToNanoseconds()) / 1e9
    return f" in {seconds * 1000:.1f} ms" if seconds < 1 else f" in {seconds:.2f} s"


def summary_line(summary: SnapshotSummary) -> Text:
    """One line about a snapshot: id, outcome, when, its size, and why it was aborted."""
    outcome = outcome_name(summary.outcome)
    style = {"completed": "green", "aborted": "red", "running": "yellow"}.get(outcome, "")
    line = Text(f"snapshot #{summary.snapshot_id} ")
    line.append(outcome, style=style)
    when = summary.finished_at if summary.HasField("finished_at") else summary.started_at
    line.append(f" at {format_time(when)}{_duration(summary)}")
    if summary.outcome == SNAPSHOT_OUTCOME_COMPLETED:
        line.append(
            f": {plural(summary.processes, 'process', 'processes')}, {plural(summary.channels, 'channel')}, "
            f"{plural(summary.messages_in_flight, 'message')} in flight"
        )
    if summary.abort_reason:
        line.append(f": {summary.abort_reason}", style="red")
    return line


def predicate_table(results: Sequence[PredicateResult], title: str | None = None) -> Table:
    """One row per predicate: its name, its value (bad news in red) and its summary."""
    table = Table(title=title, title_justify="left")
    table.add_column("predicate")
    table.add_column("value")
    table.add_column("summary", overflow="fold")
    for result in results:
        table.add_row(result.name, verdict_text(result), result.error or result.summary)
    return table


def results_report(results: SnapshotResults) -> Group:
    """A snapshot's summary line, then its predicate table (when it has results)."""
    parts: list[Any] = [summary_line(results.snapshot)]
    if results.results:
        parts.append(predicate_table(results.results))
    return Group(*parts)


def members_table(members: Sequence[Member], now: float | None = None) -> Table:
    """The attached agents: process id, address, when attached, how long since the last heartbeat."""
    now = time.time() if now is None else now
    table = Table(title=f"{plural(len(members), 'agent')} attached", title_justify="left")
    table.add_column("process")
    table.add_column("address")
    table.add_column("attached")
    table.add_column("last heartbeat", justify="right")
    for member in members:
        age = now - member.last_heartbeat.ToNanoseconds() / 1e9
        table.add_row(member.process_id, member.address, format_time(member.attached_at), f"{max(age, 0):.1f} s ago")
    return table


@dataclass
class WatchRow:
    """What the watch table knows of one predicate."""

    holds: bool
    unknown: bool = False
    summary: str = ""
    error: str = ""
    since: int = 0  # the snapshot where the value last changed (0: no change seen yet)
    changed_at: int = 0  # the event number of the last change


@dataclass
class WatchView:
    """The state behind ``stablewatch watch``: predicate values, updated event by event."""

    rows: dict[str, WatchRow] = field(default_factory=dict)
    events: int = 0
    last: Text = field(default_factory=lambda: Text("waiting for the next snapshot…", style="dim"))

    def update(self, event: WatchEvent) -> None:
        """Apply one watch event (full or changes only)."""
        self.events += 1
        if event.HasField("results"):
            self.last = summary_line(event.results.snapshot)
            for result in event.results.results:
                row = self.rows.setdefault(result.name, WatchRow(result.holds))
                row.holds, row.unknown = result.holds, result.unknown
                row.summary, row.error = result.summary, result.error
        else:
            changed = ", ".join(f"{c.name} became {Verdict.of_fields(c.holds, c.unknown, None)}" for c in event.changes)
            self.last = Text(f"snapshot #{event.snapshot_id}: {changed or 'no change'}")
        for change in event.changes:
            row = self.rows.setdefault(change.name, WatchRow(change.holds))
            row.holds, row.unknown = change.holds, change.unknown
            row.since = event.snapshot_id
            row.changed_at = self.events

    def render(self) -> Group:
        table = Table(title=f"predicates ({plural(self.events, 'event')})", title_justify="left")
        table.add_column("predicate")
        table.add_column("value")
        table.add_column("since", justify="right")
        table.add_column("summary", overflow="fold")
        for name, row in self.rows.items():
            fresh = row.changed_at == self.events
            result = PredicateResult(name=name, holds=row.holds, unknown=row.unknown, error=row.error)
            verdict = verdict_text(result)
            if fresh:
                verdict.stylize("reverse")
            table.add_row(
                Text(name, style="bold" if fresh else ""),
                verdict,
                f"#{row.since}" if row.since else "",
                row.error or row.summary,
                style="on grey15" if fresh else None,
            )
        return Group(self.last, table)
