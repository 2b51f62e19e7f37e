"""What each system went through, told from its history tables: its phases, its chart lane, one sentence.

Theory of operation. A system's completed snapshots, in start order (the ``timeline`` table of
:mod:`.history`), each say one *state*:

* ``deadlocked`` — the deadlock predicate held;
* ``violated`` — a conserved counter was off (a conservation result false);
* ``terminated`` — termination held;
* ``running`` — deadlock and termination were both false: the system went about its work.

A snapshot that decides none of them (an open cut: unknown) has no state and, as in the episodes
of :mod:`.history`, neither ends nor extends a phase. A *phase* is a run of snapshots in one
state. Phases tile the time line: each lasts from its first snapshot's start to the next phase's
first snapshot's start; the last one lasts to its last snapshot's start, and goes on.

:func:`tell` turns one system's history tables into a :class:`Story`: its phases, the line its
chart lane draws (:class:`Series`: the ``progress`` attribute's total when one is named, else the
deadlocks broken so far when there were breaks, else each conserved counter's total, else the
deadlocked nodes), when deadlocks were broken, and one sentence, e.g. ``running 3.1 s (meals 0 →
212), then deadlocked to the end (2.0 s): P0, P1, P2, P3, P4``. A history of more than
:data:`NARRATED` phases is summed up instead (``deadlocked 45 times (longest 320 ms), running in
between``). :func:`~stablewatch.pipeline.chart.draw_lanes` draws one lane per story, and
:func:`stories_report` prints the sentences. Pure functions over Arrow tables: no Spark.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pyarrow as pa
from rich.console import Group
from rich.table import Table
from rich.text import Text

from stablewatch.detector.evaluation import Verdict
from stablewatch.detector.evaluation.text import names, plural

__all__ = [
    "DEADLOCKED",
    "NARRATED",
    "RUNNING",
    "STATES",
    "TERMINATED",
    "VIOLATED",
    "Phase",
    "Series",
    "Story",
    "duration_text",
    "phases",
    "stories_report",
    "tell",
]

RUNNING = "running"
DEADLOCKED = "deadlocked"
TERMINATED = "terminated"
VIOLATED = "violated"
STATES = (RUNNING, DEADLOCKED, TERMINATED, VIOLATED)  # in the order a chart's legend lists them
NARRATED = 3  # at most this many phases are told one by one; more are summed up


def duration_text(seconds: float) -> str:
    """A duration to read: ``7.5 ms``, ``320 ms``, ``3.1 s``, ``2.5 min``, ``1.2 h`` (never ``0 s``)."""
    if seconds < 0.01:
        return f"{seconds * 1000:.1f} ms"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


@dataclass(frozen=True)
class Phase:
    """A run of snapshots in one state, from its first snapshot's start to ``ended_at``."""

    state: str
    began_at: datetime
    ended_at: datetime  # the next phase's first snapshot's start, or this one's last snapshot's (last phase)
    snapshots: int
    last: bool  # the history ends in this phase

    @property
    def seconds(self) -> float:
        return (self.ended_at - self.began_at).total_seconds()


@dataclass(frozen=True)
class Series:
    """One line of a lane: `label`'s value at each moment (a step that holds until the next)."""

    label: str
    times: tuple[datetime, ...]
    values: tuple[float, ...]
    expected: float | None = None  # a conserved counter's expected total, drawn dashed


@dataclass(frozen=True)
class Story:
    """One system's history as its chart lane and its sentence."""

    system: str
    snapshots: int  # completed snapshots
    phases: tuple[Phase, ...]
    sentence: str
    series: tuple[Series, ...]
    broken_at: tuple[datetime, ...]  # when each wait reported broken was answered
    first_at: datetime | None
    last_at: datetime | None

    def as_dict(self) -> dict[str, Any]:
        """The story as JSON-ready data: the sentence and each phase's state, start, length and snapshots."""
        return {
            "system": self.system,
            "snapshots": self.snapshots,
            "sentence": self.sentence,
            "phases": [
                {
                    "state": phase.state,
                    "began_at": phase.began_at.isoformat(),
                    "seconds": round(phase.seconds, 4),
                    "snapshots": phase.snapshots,
                }
                for phase in self.phases
            ],
        }


def _state(row: Mapping[str, Any]) -> str | None:
    """The state one timeline row says, None when it decides none (see the module doc)."""
    if row.get("deadlock") == Verdict.TRUE:
        return DEADLOCKED
    if row.get("conservation") == Verdict.FALSE:
        return VIOLATED
    if row.get("termination") == Verdict.TRUE:
        return TERMINATED
    if row.get("deadlock") == Verdict.FALSE and row.get("termination") == Verdict.FALSE:
        return RUNNING
    return None


def phases(timeline: pa.Table) -> list[Phase]:
    """The phases of `timeline` (rows in start order, with ``started_at``, ``deadlock``,
    ``termination`` and ``conservation`` verdicts): O(rows)."""
    runs: list[tuple[str, datetime, datetime, int]] = []  # state, first start, last start, snapshots
    for row in timeline.to_pylist():
        state = _state(row)
        if state is None:
            continue
        at = row["started_at"]
        if runs and runs[-1][0] == state:
            runs[-1] = (state, runs[-1][1], at, runs[-1][3] + 1)
        else:
            runs.append((state, at, at, 1))
    return [
        Phase(state, began, runs[n + 1][1] if n + 1 < len(runs) else last, count, n + 1 == len(runs))
        for n, (state, began, last, count) in enumerate(runs)
    ]


def _value_at(series: Series, moment: datetime) -> float | None:
    """The series' value at `moment`: its latest point at or before it (its first point before any)."""
    value = series.values[0] if series.values else None
    for at, point in zip(series.times, series.values, strict=True):
        if at > moment:
            break
        value = point
    return value


def _number(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() else f"{value:g}"


def _phase_text(phase: Phase, count: int, progress: Series | None, involved: str) -> str:
    """One phase told: its state, how long, what progressed during it; the deadlocked at the end."""
    if count == 1:
        text = f"{phase.state} throughout ({duration_text(phase.seconds)}, {plural(phase.snapshots, 'snapshot')})"
    elif phase.last:
        text = f"{phase.state} to the end ({duration_text(phase.seconds)})"
    else:
        text = f"{phase.state} {duration_text(phase.seconds)}"
    if progress is not None and phase.state == RUNNING:
        before, after = _value_at(progress, phase.began_at), _value_at(progress, phase.ended_at)
        if before is not None and after is not None and after != before:
            text += f" ({progress.label} {_number(before)} → {_number(after)})"
    if phase.state == DEADLOCKED and phase.last and involved:
        text += f": {involved}"
    return text


def _summed_up(found: Sequence[Phase], progress: Series | None) -> str:
    """Many phases in a few words: how it began, how often it was in each other state (and running
    again in between), how it ended, and the progress over the whole history."""
    first, last = found[0], found[-1]
    parts = [f"{first.state} {duration_text(first.seconds)}"] if first.state == RUNNING else []
    for state in (DEADLOCKED, VIOLATED, TERMINATED):
        times = [phase for phase in found if phase.state == state]
        if times:
            longest = max(phase.seconds for phase in times)
            parts.append(f"{state} {plural(len(times), 'time')} (longest {duration_text(longest)})")
    text = ", then ".join(parts[:2]) + "".join(f", {part}" for part in parts[2:])
    if any(phase.state == RUNNING for phase in found[1:]):
        text += " and running again in between"
    text += f", {last.state} at the end"
    if progress is not None and progress.values and progress.values[-1] != progress.values[0]:
        text += f"; {progress.label} {_number(progress.values[0])} → {_number(progress.values[-1])} in all"
    return text


def tell(system: str, tables: Mapping[str, pa.Table], progress: str | None = None) -> Story:
    """The story of `system` from its history tables (``timeline``, ``conservation``, ``breaks``,
    ``attributes``, ``deadlock_episodes``); `progress` names an attribute whose total over the
    processes tells the work done (e.g. ``meals``). See the module doc."""
    timeline = tables["timeline"]
    found = phases(timeline)
    times = timeline.column("started_at").to_pylist()
    first_at, last_at = (times[0], times[-1]) if times else (None, None)
    broken_at = _broken_at(tables.get("breaks"))
    series = _series(tables, progress, broken_at, first_at)
    progress_line = series[0] if progress is not None and series and series[0].label == progress else None
    episodes = tables["deadlock_episodes"].to_pylist() if "deadlock_episodes" in tables else []
    involved = names(list(episodes[-1]["tasks"] or episodes[-1]["processes"] or [])) if episodes else ""
    if not found:
        sentence = f"no snapshot decided its state ({plural(len(times), 'snapshot')})"
    elif len(found) <= NARRATED:
        sentence = ", then ".join(_phase_text(p, len(found), progress_line, involved) for p in found)
    else:
        sentence = _summed_up(found, progress_line)
    clauses = [sentence, *_broken_clause(tables.get("breaks")), *_conservation_clauses(tables, found, len(times))]
    return Story(system, len(times), tuple(found), "; ".join(clauses), series, broken_at, first_at, last_at)


def _broken_at(breaks: pa.Table | None) -> tuple[datetime, ...]:
    if breaks is None or not breaks.num_rows:
        return ()
    rows = zip(breaks.column("outcome").to_pylist(), breaks.column("reported_at").to_pylist(), strict=True)
    return tuple(sorted(at for outcome, at in rows if outcome == "broken" and at is not None))


def _broken_clause(breaks: pa.Table | None) -> list[str]:
    if breaks is None or not breaks.num_rows:
        return []
    broken = sum(outcome == "broken" for outcome in breaks.column("outcome").to_pylist())
    text = f"{plural(broken, 'deadlock')} broken"
    return [text if broken == breaks.num_rows else f"{text} ({plural(breaks.num_rows, 'break')} sent)"]


def _conservation_clauses(tables: Mapping[str, pa.Table], found: Sequence[Phase], snapshots: int) -> list[str]:
    """A counter's word: when it was off (always told), or that it held (told of a system that only ran).

    "Conserved in all" is said only when it held in every one of the `snapshots` completed
    snapshots; otherwise how many of them decided it, and why the others did not (an open cut
    left it unknown, or the snapshot did not hold the counter): an unknown is never a "held".
    """
    if "conservation" not in tables:
        return []
    by_counter: dict[str, list[dict[str, Any]]] = {}
    for row in tables["conservation"].to_pylist():
        by_counter.setdefault(row["counter"], []).append(row)
    clauses = []
    only_ran = [phase.state for phase in found] == [RUNNING]
    for counter, rows in sorted(by_counter.items()):
        violated = [row for row in rows if row["verdict"] == Verdict.FALSE]
        held = [row for row in rows if row["verdict"] == Verdict.TRUE]
        if violated:
            worst = max(violated, key=lambda row: abs(row["drift"]))
            clauses.append(f"{counter} off in {plural(len(violated), 'snapshot')} (drift up to {worst['drift']:+d})")
        elif only_ran and held:
            total = held[-1]["observed"]
            if len(held) == snapshots:
                clauses.append(f"{counter} = {total} conserved in all {plural(len(held), 'snapshot')}")
            else:
                unknown = sum(row["verdict"] == Verdict.UNKNOWN for row in rows)
                without = snapshots - len({row["snapshot_id"] for row in rows})
                why = [f"{unknown} unknown"] * bool(unknown) + [f"{without} without it"] * bool(without > 0)
                clauses.append(
                    f"{counter} = {total} conserved in {len(held)} of {plural(snapshots, 'snapshot')}"
                    + (f" ({', '.join(why)})" if why else "")
                )
    return clauses


def _series(
    tables: Mapping[str, pa.Table], progress: str | None, broken_at: Sequence[datetime], first_at: datetime | None
) -> tuple[Series, ...]:
    """The lane's line(s), by the first rule that applies (see the module doc)."""
    if progress is not None and "attributes" in tables:
        rows = [row for row in tables["attributes"].to_pylist() if row["attribute"] == progress]
        if rows:
            return (Series(progress, tuple(r["started_at"] for r in rows), tuple(float(r["total"]) for r in rows)),)
    if broken_at and first_at is not None:
        start = min(first_at, broken_at[0])
        counts = tuple(float(n) for n in range(len(broken_at) + 1))
        return (Series("deadlocks broken", (start, *broken_at), counts),)
    counters: dict[str, list[dict[str, Any]]] = {}
    for row in tables["conservation"].to_pylist() if "conservation" in tables else []:
        if row["verdict"] != Verdict.UNKNOWN:
            counters.setdefault(row["counter"], []).append(row)
    if counters:
        return tuple(
            Series(
                counter,
                tuple(r["started_at"] for r in rows),
                tuple(float(r["observed"]) for r in rows),
                expected=float(rows[-1]["expected"]),
            )
            for counter, rows in sorted(counters.items())
        )
    timeline = tables["timeline"]
    column = "deadlocked_nodes" if "deadlocked_nodes" in timeline.column_names else "deadlocked_processes"
    values = tuple(math.nan if v is None else float(v) for v in timeline.column(column).to_pylist())  # undecided: a gap
    return (Series("deadlocked", tuple(timeline.column("started_at").to_pylist()), values),)


def stories_report(systems: Sequence[Mapping[str, Any]], chart: str | None, out: str) -> Group:
    """The stories as a table to read: each system (a :meth:`Story.as_dict`), its snapshots and
    what happened; then where the tables and the chart are."""
    table = Table(title="what each system went through", title_justify="left")
    table.add_column("system", no_wrap=True)
    table.add_column("snapshots", justify="right", no_wrap=True)
    table.add_column("what happened", overflow="fold")
    for system in systems:
        table.add_row(system["system"], str(system["snapshots"]), system["sentence"])
    written = f"tables: {out}/<system>/history" + (f"; chart: {chart}" if chart else "")
    return Group(table, Text(written, style="dim"))
