"""Human output: predicate results and snapshots as rich tables."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group
from rich.table import Table
from rich.text import Text

from stablewatch.v1 import GlobalSnapshot, PredicateResult

__all__ = ["is_alarming", "snapshot_report"]


def is_alarming(result: PredicateResult) -> bool:
    """Whether a result is bad news: a deadlock, a broken conservation, a failing user predicate."""
    if result.error:
        return True
    if result.name == "deadlock":
        return result.holds
    return result.name.startswith("conservation(") and not result.holds


def _verdict(result: PredicateResult) -> Text:
    if result.error:
        return Text("error", style="yellow")
    return Text("yes" if result.holds else "no", style="red bold" if is_alarming(result) else "green")


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
