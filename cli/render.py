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
from stablewatch.detector.evaluation.waitfor import label
from stablewatch.detector.service.query import outcome_name
from stablewatch.detector.service.resolutions import outcome_word
from stablewatch.v1 import GlobalSnapshot, PredicateResult, WaitNode
from stablewatch.v1.query_pb2 import (
    SNAPSHOT_OUTCOME_COMPLETED,
    Member,
    Resolution,
    SnapshotResults,
    SnapshotSummary,
    WatchEvent,
)

__all__ = [
    "WatchView",
    "format_duration",
    "format_time",
    "is_alarming",
    "members_table",
    "predicate_table",
    "proto_dict",
    "resolution_dict",
    "resolution_line",
    "resolutions_table",
    "resolve_report",
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


def snapshot_report(entries: Sequence[tuple[GlobalSnapshot, Sequence[PredicateResult]]], title: str | Text) -> Group:
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
        table.add_row(str(snapshot.snapshot_id), Text(_holdings(snapshot)), str(in_flight), *cells)
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


def format_duration(seconds: float) -> str:
    """``12.3 ms`` below a second, ``1.23 s`` from there."""
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _duration(summary: SnapshotSummary) -> str:
    if not summary.HasField("finished_at") or not summary.HasField("started_at"):
        return ""
    seconds = (summary.finished_at.ToNanoseconds() - summary.started_at.ToNanoseconds()) / 1e9
    return f" in {format_duration(seconds)}"


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
        # The detector's strings are text, never Rich markup: "A/t[wait 1]" stays whole, "[/]" is no tag.
        table.add_row(Text(result.name), verdict_text(result), Text(result.error or result.summary))
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
        table.add_row(
            Text(member.process_id), Text(member.address), format_time(member.attached_at), f"{max(age, 0):.1f} s ago"
        )
    return table


# -- breaks of deadlocks (ResolveDeadlock, ListResolutions, Watch) ------------------------------------------

#: How each outcome of a break looks: it worked, it was not needed, it was refused (the deadlock
#: stays until the detectors' --resolve policies agree), or nobody knows what became of it.
_OUTCOME_STYLES = {
    "broken": "green",
    "gone": "yellow",
    "already_broken": "yellow",
    "policies_disagree": "red",
    "failed": "red",
    "unanswered": "red",
    "not_attached": "red",
    "pending": "cyan",
}


def resolution_dict(resolution: Resolution) -> dict[str, Any]:
    """A break as the CLI prints it in JSON: the message's fields, with ``outcome`` as a word of
    :func:`~stablewatch.detector.service.resolutions.outcome_word` (broken, gone, already_broken,
    policies_disagree, failed, unanswered, not_attached, or pending while the agent's report may still come)."""
    return {**proto_dict(resolution), "outcome": outcome_word(resolution)}


def _victim(resolution: Resolution) -> str:
    return label(WaitNode(process=resolution.process_id, task=resolution.task))


def _outcome_text(resolution: Resolution) -> Text:
    word = outcome_word(resolution)
    return Text(word, style=_OUTCOME_STYLES.get(word, ""))


def _report_time(resolution: Resolution) -> str:
    """From the break's sending to its report (or to the detector giving up); empty while pending."""
    if not resolution.HasField("reported_at") or not resolution.HasField("sent_at"):
        return ""
    seconds = (resolution.reported_at.ToNanoseconds() - resolution.sent_at.ToNanoseconds()) / 1e9
    return format_duration(max(seconds, 0.0))


def resolution_line(resolution: Resolution) -> Text:
    """One line about a break: which wait, why, and what became of it.

    ``break #4 of wait 17 of b/y (youngest, snapshot #12): broken after 3.2 ms``; a pending break
    names the deadlock it is for, a finished one the agent's detail.
    """
    line = Text(
        f"break #{resolution.resolution_id} of wait {resolution.instance} of {_victim(resolution)} "
        f"({resolution.policy}, snapshot #{resolution.snapshot_id}): "
    )
    line.append_text(_outcome_text(resolution))
    after = _report_time(resolution)
    if after:
        line.append(f" after {after}")
    if resolution.detail:
        line.append(f": {resolution.detail}", style="dim")
    elif not resolution.HasField("reported_at"):
        line.append(f"; deadlock {resolution.deadlock}", style="dim")
    return line


def resolutions_table(resolutions: Sequence[Resolution], title: str | None = None) -> Table:
    """The breaks, one row each, in the order given (ListResolutions: newest first): the break, when
    it was sent, the snapshot that proved the deadlock, the victim wait, the policy and who asked,
    the outcome and how long the report took, and the deadlock with the agent's detail."""
    table = Table(title=title, title_justify="left")
    table.add_column("break", justify="right", no_wrap=True)
    # Folded, not cut short, in a narrow terminal: ids and times are read whole.
    table.add_column("sent", overflow="fold")
    table.add_column("snapshot", justify="right", overflow="fold")
    table.add_column("victim", overflow="fold")
    table.add_column("policy, requested by", overflow="fold")
    table.add_column("outcome, report", overflow="fold")
    table.add_column("deadlock, detail", overflow="fold")
    for resolution in resolutions:
        evidence = Text(resolution.deadlock)
        if resolution.detail:
            evidence.append(f"\n{resolution.detail}", style="dim")
        outcome = _outcome_text(resolution)
        if after := _report_time(resolution):
            outcome.append(f"\nafter {after}")
        table.add_row(
            f"#{resolution.resolution_id}",
            format_time(resolution.sent_at),
            f"#{resolution.snapshot_id}",
            Text(f"wait {resolution.instance} of {_victim(resolution)}"),
            Text(resolution.policy).append(f"\n{resolution.requested_by}", style="dim"),
            outcome,
            evidence,
        )
    return table


def resolve_report(snapshot_id: int, resolutions: Sequence[Resolution]) -> Group:
    """What ``stablewatch resolve`` did: per break sent, the victim wait and the deadlock it ends."""
    sent = [r for r in resolutions if outcome_word(r) != "not_attached"]
    parts: list[Any] = [
        Text(f"snapshot #{snapshot_id}: sent {plural(len(sent), 'break')} for {plural(len(resolutions), 'deadlock')}")
    ]
    for resolution in resolutions:
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold")
        grid.add_column(overflow="fold")
        grid.add_row("victim", Text(f"wait {resolution.instance} of {_victim(resolution)}"))
        grid.add_row("wait began", format_time(resolution.wait_began_at))
        grid.add_row("deadlock", Text(resolution.deadlock))
        grid.add_row("policy", Text(f"{resolution.policy} (requested by {resolution.requested_by})"))
        grid.add_row("outcome", _outcome_text(resolution) + Text(f": {resolution.detail}" if resolution.detail else ""))
        parts += [Text(f"break #{resolution.resolution_id}", style="bold"), grid]
    if sent:
        report = "the victims' agents report what they did: see `stablewatch resolutions` or `stablewatch watch`"
        parts.append(Text(report, style="dim"))
    return Group(*parts)


_BREAKS_SHOWN = 5  # the watch view's latest breaks


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
    #: The latest breaks of deadlocks by id, oldest first (a break's report replaces its sending).
    breaks: dict[int, Resolution] = field(default_factory=dict)
    #: The newest completed snapshot whose results the table shows (0: none yet). Concurrent
    #: snapshots finish in any order: an older one that finishes later is streamed too, but the
    #: latest results (and the changes) stay the newest's, and so does the table.
    newest: int = 0
    #: A dim line under the header about the last older snapshot that finished late (None: none).
    late: Text | None = None

    def update(self, event: WatchEvent) -> None:
        """Apply one watch event (full or changes only, or a break sent or answered)."""
        self.events += 1
        if event.HasField("resolution"):
            resolution = event.resolution
            self.breaks.pop(resolution.resolution_id, None)
            self.breaks[resolution.resolution_id] = resolution
            while len(self.breaks) > _BREAKS_SHOWN:
                del self.breaks[next(iter(self.breaks))]
            return
        if event.HasField("results"):
            summary = event.results.snapshot
            if summary.snapshot_id < self.newest:
                # Older than the results shown: not the latest (the detector's changes, gauges and
                # GetLatestResults stay the newest's), so neither the header nor the rows take it.
                self.late = Text(
                    f"snapshot #{summary.snapshot_id} {outcome_name(summary.outcome)} after a newer one "
                    f"(#{self.newest}); not the latest",
                    style="dim",
                )
            else:
                self.last, self.late = summary_line(summary), None
                if summary.outcome == SNAPSHOT_OUTCOME_COMPLETED:
                    self.newest = summary.snapshot_id
                for result in event.results.results:
                    row = self.rows.setdefault(result.name, WatchRow(result.holds))
                    row.holds, row.unknown = result.holds, result.unknown
                    row.summary, row.error = result.summary, result.error
        else:
            changed = ", ".join(f"{c.name} became {Verdict.of_fields(c.holds, c.unknown, None)}" for c in event.changes)
            self.last, self.late = Text(f"snapshot #{event.snapshot_id}: {changed or 'no change'}"), None
        for change in event.changes:  # always the newest snapshot's
            row = self.rows.setdefault(change.name, WatchRow(change.holds))
            row.holds, row.unknown = change.holds, change.unknown
            # The stream's first event states the values as they are, not when they came to be.
            row.since = 0 if change.first and self.events == 1 else event.snapshot_id
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
                Text(row.error or row.summary),
                style="on grey15" if fresh else None,
            )
        head = [self.last] if self.late is None else [self.last, self.late]
        if not self.breaks:
            return Group(*head, table)
        breaks = [resolution_line(resolution) for resolution in self.breaks.values()]
        return Group(*head, table, Text("breaks of deadlocks", style="bold"), *breaks)
