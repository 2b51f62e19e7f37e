"""What the benchmarks share to measure and report: timings, percentiles and spreads, interleaved
rounds, their tables, and the JSON line each benchmark ends with."""

from __future__ import annotations

import gc
import json
import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from rich.table import Table

__all__ = [
    "interleaved",
    "json_line",
    "median_or_none",
    "medians_and_spreads",
    "percentile",
    "quiet_teardown",
    "rounds_row",
    "rounds_table",
    "spread",
    "spread_row",
    "timed",
]

T = TypeVar("T")
C = TypeVar("C")


def timed(func: Callable[[], T]) -> tuple[float, T]:
    """Wall-clock seconds of one call of ``func`` (after a garbage collection), and its result."""
    gc.collect()
    start = time.perf_counter()
    result = func()
    return time.perf_counter() - start, result


def percentile(values: Sequence[float], fraction: float) -> float:
    """The value below which ``fraction`` of ``values`` fall (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered) + 0.5) - 1))]


def spread(values: Sequence[float], digits: int | None = None) -> list[float]:
    """[lowest, highest] of ``values``, rounded to ``digits`` (None: to whole numbers)."""
    return [round(min(values), digits), round(max(values), digits)]


def median_or_none(values: Sequence[float], digits: int = 3) -> float | None:
    """The median of ``values`` rounded to ``digits``; None when there are none."""
    return round(statistics.median(values), digits) if values else None


def interleaved(cases: Mapping[str, C], rounds: int, measure: Callable[[str, C], float]) -> dict[str, list[float]]:
    """``measure(name, case)`` of every case in turn, ``rounds`` times, so the machine's noise hits them alike."""
    results: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, case in cases.items():
            results[name].append(measure(name, case))
    return results


def medians_and_spreads(results: Mapping[str, Sequence[float]], unit: str, digits: int) -> dict[str, object]:
    """Per case of ``results``: ``<case>_<unit>`` (the median over rounds) and ``<case>_spread``."""
    figures: dict[str, object] = {}
    for name, values in results.items():
        figures[f"{name}_{unit}"] = round(statistics.median(values), digits)
        figures[f"{name}_spread"] = spread(values, digits)
    return figures


def spread_row(values: Sequence[float], form: str) -> list[str]:
    """Cells of a case: its median, lowest and highest round, each formatted with ``form``."""
    return [format(value, form) for value in (statistics.median(values), min(values), max(values))]


def rounds_table(title: str, rounds: int) -> Table:
    """A table with a row per figure: ``case``, its ``median``, one column per round, its ``target``."""
    table = Table(title=title)
    table.add_column("case")
    table.add_column("median", justify="right")
    for number in range(rounds):
        table.add_column(f"round {number + 1}", justify="right")
    table.add_column("target", justify="right")
    return table


def print_whole(table: Table, width: int) -> None:
    """Print ``table`` at least ``width`` columns wide, and wider if its rows need it (many rounds),
    so that no case name or figure is wrapped."""
    from rich.console import Console

    needed = Console(width=100_000).measure(table).maximum
    Console(width=max(width, needed)).print(table)


def rounds_row(
    table: Table, label: str, values: Sequence[float], form: str, target: str = "", median: float | None = None
) -> None:
    """Add a :func:`rounds_table` row: ``median`` (by default, that of ``values``) and every round."""
    middle = statistics.median(values) if median is None else median
    table.add_row(label, format(middle, form), *(format(value, form) for value in values), target)


def json_line(figures: Mapping[str, object]) -> None:
    """Print the benchmark's last line: its figures as one JSON object."""
    print(json.dumps(figures), flush=True)


def quiet_teardown() -> None:
    """Keep the detector's errors during teardown off the output.

    As agents leave, the snapshots in flight abort and their late parts are rejected: expected,
    and not part of the measurement.
    """
    logging.getLogger("stablewatch").setLevel(logging.ERROR)
