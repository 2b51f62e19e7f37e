"""What the phantom benchmarks share: stablewatch's observer and a naive poller run side by side,
the tally of the detector's snapshots, the poller's rounds, and the table comparing the two."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import networkx as nx
from report import median_or_none
from rich.console import Console
from rich.table import Table

from stablewatch.detector.service.detector import Detector
from stablewatch.v1 import GlobalSnapshot, query_pb2

__all__ = [
    "Observed",
    "Round",
    "comparison_table",
    "cycle_in",
    "measured_rounds",
    "naive_row",
    "poll_rounds",
    "print_problems",
    "round_p50_ms",
    "stablewatch_row",
    "watch_side_by_side",
    "watch_snapshots",
]

R = TypeVar("R", bound="Round")


@dataclass
class Observed:
    """What the detector's snapshots showed."""

    completed: int = 0
    aborted: int = 0
    abort_reasons: collections.Counter[str] = field(default_factory=collections.Counter)
    deadlocks: list[int] = field(default_factory=list)  # ids of snapshots that reported deadlock
    durations: list[float] = field(default_factory=list)  # seconds, of the complete snapshots
    ignored: int = 0  # snapshots started before the workload ran

    def p50_ms(self) -> float | None:
        """The median time a complete snapshot took, in milliseconds (3 decimals)."""
        return median_or_none([d * 1000 for d in self.durations])


@dataclass
class Round:
    """One naive poll round: every process asked, one after another."""

    started: float
    finished: float
    cycle: list[tuple[str, str]] | None  # the cycle the round's waits formed, if any


def cycle_in(graph: nx.DiGraph) -> list[tuple[str, str]] | None:
    """The edges of a cycle of ``graph`` (networkx ``find_cycle``), or None when it has none."""
    try:
        return [(u, v) for u, v, *_ in nx.find_cycle(graph)]
    except nx.NetworkXNoCycle:
        return None


async def watch_snapshots(
    detector: Detector,
    seen: Observed,
    done: asyncio.Event,
    target: int,
    check: Callable[[GlobalSnapshot], object],
    since_ns: int = 0,
) -> None:
    """Tally every snapshot the detector (in this process) publishes into ``seen``, and ``check``
    each complete one it still holds; set ``done`` once ``target`` are complete.

    Snapshots started before ``since_ns`` (wall clock) are only counted as ignored.
    """
    async for event in detector.watch():
        summary = event.results.snapshot
        if summary.started_at.ToNanoseconds() < since_ns:
            seen.ignored += 1
            continue
        if summary.outcome != query_pb2.SNAPSHOT_OUTCOME_COMPLETED:
            seen.aborted += 1
            seen.abort_reasons[summary.abort_reason.split(",")[0][:80]] += 1
            continue
        seen.completed += 1
        seen.durations.append((summary.finished_at.ToNanoseconds() - summary.started_at.ToNanoseconds()) / 1e9)
        deadlock = next(r for r in event.results.results if r.name == "deadlock")
        if deadlock.holds:
            seen.deadlocks.append(summary.snapshot_id)
        snapshot = detector.store.snapshot(summary.snapshot_id)
        if snapshot is not None:
            check(snapshot)
        if seen.completed >= target:
            done.set()


async def poll_rounds(
    poll_round: Callable[[], Awaitable[R]], rounds: list[R], stop: asyncio.Event, extra: int, pause: float
) -> None:
    """Poll rounds into ``rounds`` until ``stop``, then ``extra`` more, ``pause`` seconds apart
    (to prove the phantoms: what a poller saw has moved on since)."""
    while not stop.is_set() or extra > 0:
        if stop.is_set():
            extra -= 1
            await asyncio.sleep(pause)
        rounds.append(await poll_round())


async def watch_side_by_side(
    observe: Callable[[asyncio.Event], Awaitable[object]],
    poll: Callable[[asyncio.Event], Awaitable[object]],
    max_seconds: float,
) -> tuple[bool, float]:
    """Run ``observe(done)`` and ``poll(stop)`` until the observer sets ``done``, ``max_seconds``
    pass, or either fails; then stop the poller (it finishes its round) and cancel the observer.

    Returns whether the observer finished, and the ``time.monotonic()`` at which watching ended.
    An error of either is raised after both are stopped.
    """
    done, stop = asyncio.Event(), asyncio.Event()
    observer = asyncio.ensure_future(observe(done))
    naive = asyncio.ensure_future(poll(stop))
    waiting = asyncio.ensure_future(done.wait())
    try:
        await asyncio.wait({waiting, observer, naive}, timeout=max_seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ended = time.monotonic()
        finished = done.is_set()
        waiting.cancel()
        stop.set()
        try:
            await asyncio.wait_for(naive, 30)
        finally:
            observer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await observer
    return finished, ended


def comparison_table(title: str, rate: str) -> Table:
    """The table of the two detectors, one row each (:func:`stablewatch_row`, :func:`naive_row`)."""
    table = Table(title=title)
    for column in ("detector", "observations", "deadlocks reported", rate, "notes"):
        table.add_column(column, justify="right")
    return table


def stablewatch_row(seen: Observed, interval: float, notes: str) -> list[str]:
    """The stablewatch row: snapshots, deadlocks reported and their rate, aborts, p50, ``notes``."""
    reported = len(seen.deadlocks)
    durations = [d * 1000 for d in seen.durations]
    return [
        f"stablewatch (snapshots every {interval:g} s)",
        f"{seen.completed} snapshots",
        str(reported),
        f"{reported / max(1, seen.completed):.2%}",
        f"{seen.aborted} aborted; p50 {statistics.median(durations) if durations else 0:.1f} ms each; {notes}",
    ]


def naive_row(name: str, rounds: Sequence[Round], reported: int, notes: str) -> list[str]:
    """The naive poller's row: rounds, deadlocks reported and their rate, ``notes``, round p50."""
    skews = [(r.finished - r.started) * 1000 for r in rounds]
    return [
        name,
        f"{len(rounds)} poll rounds",
        str(reported),
        f"{reported / max(1, len(rounds)):.2%}",
        f"{notes}; round p50 {statistics.median(skews) if skews else 0:.1f} ms",
    ]


def measured_rounds(rounds: Sequence[R], until: float) -> tuple[list[R], list[int]]:
    """The rounds that finished by ``until`` (monotonic), and the indexes of those that found a cycle."""
    measured = [r for r in rounds if r.finished <= until]
    return measured, [i for i, r in enumerate(measured) if r.cycle is not None]


def round_p50_ms(rounds: Sequence[Round]) -> float | None:
    """The median time a poll round took, in milliseconds (3 decimals)."""
    return median_or_none([(r.finished - r.started) * 1000 for r in rounds])


def print_problems(
    console: Console,
    seen: Observed,
    problems: Sequence[str],
    *,
    finished: bool,
    elapsed: float,
    target: int,
    moving: bool,
    not_moving: str,
) -> None:
    """Under the table: the abort reasons, then in red ``problems``, the deadlocks stablewatch
    reported, an early stop, and ``not_moving`` when the workload had stopped moving."""
    if seen.abort_reasons:
        console.print("aborted snapshots: " + "; ".join(f"{n} x {r}" for r, n in seen.abort_reasons.most_common(5)))
    for problem in problems:
        console.print(f"[red]{problem}[/red]")
    if seen.deadlocks:
        console.print(f"[red]BUG: stablewatch reported deadlock in snapshots {seen.deadlocks[:20]}[/red]")
    if not finished:
        console.print(
            f"[red]stopped early (time limit or the watch stream ended) after {elapsed:.1f} s "
            f"with {seen.completed} of {target} snapshots[/red]"
        )
    if not moving:
        console.print(f"[red]{not_moving}[/red]")
