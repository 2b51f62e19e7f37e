"""The history chart: deadlocked processes, the deadlocks broken, and channel backlog over time, as one
PNG (matplotlib, Agg)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: the chart is a file

import matplotlib.dates as mdates
import matplotlib.pyplot as plt
import pyarrow as pa
from matplotlib.ticker import MaxNLocator

from stablewatch.detector.evaluation.text import plural

__all__ = ["draw_history"]


def draw_history(timeline: pa.Table, deadlock_episodes: pa.Table, path: Path, breaks: pa.Table | None = None) -> Path:
    """Draw `timeline` (from :func:`~stablewatch.pipeline.history.timeline`) to the PNG at `path`.

    Top: the number of deadlocked processes per snapshot, each deadlock episode shaded from its
    first snapshot to its end (or its last snapshot while ongoing), and with `breaks` (from
    :func:`~stablewatch.pipeline.history.breaks`) a dashed line where each deadlock was broken
    (its agent's answer). Bottom: messages in flight over all channels and on the busiest
    channel. Returns `path`.
    """
    times = timeline.column("started_at").to_pylist()
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True, constrained_layout=True)
    try:
        top.step(times, timeline.column("deadlocked_processes").to_pylist(), where="post", color="tab:red")
        for began, last, ended in zip(
            deadlock_episodes.column("began_at").to_pylist(),
            deadlock_episodes.column("last_seen_at").to_pylist(),
            deadlock_episodes.column("ended_at").to_pylist(),
            strict=True,
        ):
            top.axvspan(began, ended or last, color="tab:red", alpha=0.12, linewidth=0)
        broken = _broken_at(breaks)
        for n, moment in enumerate(broken):
            top.axvline(moment, color="black", linestyle="--", linewidth=1, label="deadlock broken" if n == 0 else None)
        if broken:
            top.legend(loc="upper left")
        top.set_ylabel("deadlocked processes")
        title = f"stablewatch history: {plural(len(times), 'snapshot')}, "
        title += plural(deadlock_episodes.num_rows, "deadlock episode")
        if broken:
            title += f", {plural(len(broken), 'deadlock')} broken"
        top.set_title(title)
        top.grid(alpha=0.3)

        bottom.plot(times, timeline.column("messages_in_flight").to_pylist(), label="all channels")
        bottom.plot(times, timeline.column("busiest_channel_messages").to_pylist(), label="busiest channel")
        bottom.set_ylabel("messages in flight")
        bottom.set_xlabel("snapshot start (UTC)")
        bottom.legend(loc="upper left")
        bottom.grid(alpha=0.3)
        for axes in (top, bottom):  # counts: whole numbers, from zero
            axes.set_ylim(bottom=0, top=max(1.0, axes.get_ylim()[1]) * 1.1)
            axes.yaxis.set_major_locator(MaxNLocator(integer=True))
        locator = mdates.AutoDateLocator()
        bottom.xaxis.set_major_locator(locator)
        bottom.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=100)
    finally:
        plt.close(figure)
    return path


def _broken_at(breaks: pa.Table | None) -> list[datetime]:
    """When each wait reported broken was answered (the deadlock ending), in order."""
    if breaks is None or not breaks.num_rows:
        return []
    rows = zip(breaks.column("outcome").to_pylist(), breaks.column("reported_at").to_pylist(), strict=True)
    return sorted(at for outcome, at in rows if outcome == "broken" and at is not None)
