"""Human output: predicate results, snapshots and the detector's answers as rich tables, JSON and DOT."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from rich.console import Group
from rich.table import Table
from rich.text import Text

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

if TYPE_CHECKING:
    from stablewatch.detector.cli.demo import DemoReport

__all__ = [
    "WatchView",
    "demo_summary",
    "format_time",
    "is_alarming",
    "members_table",
    "predicate_table",
    "proto_dict",
    "results_report",
    "snapshot_report",
    "summary_line",
    "verdict_text",
    "verdict_word",
]


def is_alarming(result: PredicateResult) -> bool:
    """Whether a result is bad news: a deadlock, a broken conservation, a failing user predicate.

    An unknown value is never alarming: the cut could not decide it.
    """
    if result.error:
        return True
    if result.unknown:
        return False
    if result.name == "deadlock":
        return result.holds
    return result.name.startswith("conservation(") and not result.holds


def verdict_word(result: PredicateResult) -> str:
    """``yes``, ``no``, ``unknown`` or ``error``: how a result's value is shown to people."""
    if result.error:
        return "error"
    if result.unknown:
        return "unknown"
    return "yes" if result.holds else "no"


def verdict_text(result: PredicateResult, text: str | None = None) -> Text:
    """`text` (default: the verdict word) styled by the value: red for bad news, yellow for unknown."""
    word = verdict_word(result)
    if is_alarming(result):
        style = "red bold"
    elif word in ("unknown", "error"):
        style = "yellow"
    else:
        style = "green"
    return Text(word if text is None else text, style=style)


def _verdict(result: PredicateResult) -> Text:
    return verdict_text(result)


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
        cells = [_verdict(by_name[name]) if name in by_name else Text("") for name in names]
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
        table.add_row(result.name, _verdict(result), result.error or result.summary)
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
    table = Table(title=f"{len(members)} agent{'' if len(members) == 1 else 's'} attached", title_justify="left")
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
            changed = ", ".join(
                f"{c.name} became {verdict_word(PredicateResult(holds=c.holds, unknown=c.unknown))}"
                for c in event.changes
            )
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
            verdict = _verdict(result)
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


def calls_text(calls: Sequence[dict[str, str]]) -> str:
    """A cycle of calls (each a service, a method and a call) on one line, closing back to the first."""
    return " -> ".join(f"{c['service']} {c['method']}#{c['call']}" for c in [*calls, *calls[:1]])


def demo_summary(report: DemoReport) -> Group:
    """What the live demo found: the deadlock with its evidence, termination, the bank's totals."""
    lines: list[Text] = []
    if report.deadlock_detected:
        cycle = " -> ".join([*report.deadlock_cycle, report.deadlock_cycle[0]]) if report.deadlock_cycle else "?"
        lines.append(Text(f"deadlock among the philosophers: cycle {cycle}", style="red bold"))
        lines.append(Text("  every channel along the cycle was empty: no message in flight could wake anyone"))
        if report.graph_dot:
            drawn = f" and {report.graph_png}" if report.graph_png else " (install Graphviz for a PNG)"
            lines.append(Text(f"  wait-for graph: {report.graph_dot}{drawn}"))
    else:
        lines.append(Text("no deadlock was reported among the philosophers in time", style="yellow"))
    if report.shop_deadlock_detected:
        cycle = calls_text(report.shop_deadlock_calls)
        lines.append(Text(f"deadlock among the shop's gRPC services (RPC mode): {cycle}", style="red bold"))
        lines.append(Text("  each call waits on the next; the queued ones on every busy worker of their pool"))
    else:
        lines.append(Text("no deadlock was reported among the shop's gRPC services in time", style="yellow"))
    job = report.systems.get("job", {}).get("first_seen_seconds", {})
    if report.termination_detected:
        lines.append(
            Text(f"the job terminated: detected {job.get('termination', 0):.1f} s into the demo", style="green")
        )
    else:
        lines.append(Text("the job's termination was not detected in time", style="yellow"))
    totals = ", ".join(f"{name} = {total}" for name, total in sorted(report.bank_totals.items())) or "none"
    verdict = "conserved in every snapshot" if report.conservation_ok else "NOT conserved"
    lines.append(Text(f"bank totals: {totals} ({verdict})", style="green" if report.conservation_ok else "red"))
    lines.append(Text(f"{plural(report.snapshots_completed, 'snapshot')} completed in {report.seconds:.1f} s"))
    lines.append(
        Text(f"results in {report.out_dir}" + (f"; data kept in {report.data_dir}" if report.data_dir else ""))
    )
    if report.archives:
        archive = Path(next(iter(report.archives.values()))).parent
        lines.append(Text(f"every finished snapshot archived as Parquet in {archive}/<system>"))
    return Group(*lines)
