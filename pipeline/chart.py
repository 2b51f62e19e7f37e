"""The history chart: deadlocked processes and channel backlog over time, as one PNG (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: the chart is a file

import matplotlib.dates as mdates
import matplotlib.pyplot as plt
import pyarrow as pa
from matplotlib.ticker import MaxNLocator

from stablewatch.detector.evaluation.text import plural

__all__ = ["draw_history"]


def draw_history(timeline: pa.Table, deadlock_episodes: pa.Table, path: Path) -> Path:
    """Draw `timeline` (from :func:`~stablewatch.pipeline.history.timeline`) to the PNG at `path`.

    Top: the number of deadlocked processes per snapshot, each deadlock episode shaded from its
    first snapshot to its end (or its last snapshot while ongoing). Bottom: messages in flight
    over all channels and on the busiest channel. Returns `path`.
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
        top.set_ylabel("deadlocked processes")
        episodes = plural(deadlock_episodes.num_rows, "deadlock episode")
        top.set_title(f"stablewatch history: {plural(len(times), 'snapshot')}, {episodes}")
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
