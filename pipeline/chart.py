"""The history charts, as PNG files (matplotlib, Agg).

* :func:`draw_history` — one archive: deadlocked processes, the deadlocks broken, and channel
  backlog over time.
* :func:`draw_lanes` — several systems side by side, one lane each on a shared time axis: the
  lane's background shows the system's phases (running, deadlocked, terminated, conservation
  violated; :mod:`.story`), its line the work done (or the deadlocks broken, or a conserved
  counter's total), ticks at the bottom the deadlocks broken, and its title the story's sentence.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: the chart is a file

import matplotlib.dates as mdates
import matplotlib.pyplot as plt
import pyarrow as pa
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from stablewatch.detector.evaluation.text import plural
from stablewatch.pipeline.story import DEADLOCKED, RUNNING, STATES, TERMINATED, VIOLATED, Story

__all__ = ["draw_history", "draw_lanes", "lanes_figure"]

#: Each phase's background colour in a lane.
STATE_COLOURS = {RUNNING: "tab:green", DEADLOCKED: "tab:red", TERMINATED: "tab:blue", VIOLATED: "tab:orange"}
_LANE_INCHES = 1.9  # height of one lane
_TITLE_CHARACTERS = 120  # a lane's sentence is wrapped at this width


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
        deadlocked = [math.nan if v is None else v for v in timeline.column("deadlocked_processes").to_pylist()]
        top.step(times, deadlocked, where="post", color="tab:red")  # a gap where the deadlock is undecided
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


def _seconds_since(moment: datetime, start: datetime) -> float:
    return (moment - start).total_seconds()


def lanes_figure(stories: Sequence[Story]) -> Figure:
    """The figure of :func:`draw_lanes`: one axes per story, top to bottom, x in seconds since the
    first snapshot of any. The caller closes it (``plt.close``)."""
    starts = [story.first_at for story in stories if story.first_at is not None]
    start = min(starts) if starts else datetime.now()
    height = _LANE_INCHES * max(1, len(stories)) + 1.0
    figure, axes = plt.subplots(
        max(1, len(stories)), 1, figsize=(12, height), sharex=True, constrained_layout=True, squeeze=False
    )
    lanes = [row[0] for row in axes]
    states_seen: set[str] = set()
    for lane, story in zip(lanes, stories, strict=False):
        _draw_lane(lane, story, start)
        states_seen.update(phase.state for phase in story.phases)
    snapshots = sum(story.snapshots for story in stories)
    figure.suptitle(
        f"stablewatch history: {plural(len(stories), 'system')}, {plural(snapshots, 'snapshot')}, "
        f"from {start:%Y-%m-%d %H:%M:%S} UTC"
    )
    clock = start.strftime("%H:%M:%S.%f")[:-3]  # to the millisecond
    lanes[-1].set_xlabel(f"seconds since the first snapshot ({clock} UTC)")
    handles = [Patch(color=STATE_COLOURS[s], alpha=0.3, label=s) for s in STATES if s in states_seen]
    if any(story.broken_at for story in stories):
        handles.append(Patch(color="black", label="deadlock broken (tick)"))
    if handles:
        figure.legend(handles=handles, loc="outside lower center", ncols=len(handles), frameon=False)
    return figure


def _draw_lane(lane: plt.Axes, story: Story, start: datetime) -> None:
    """One system: its phases as background, its line(s), ticks where deadlocks were broken, its sentence."""
    for phase in story.phases:
        began, ended = _seconds_since(phase.began_at, start), _seconds_since(phase.ended_at, start)
        if ended <= began:  # a last phase of one snapshot: a sliver, still seen
            ended = began + 0.02
        lane.axvspan(began, ended, color=STATE_COLOURS[phase.state], alpha=0.18, linewidth=0)
    top = 1.0
    for n, series in enumerate(story.series):
        xs = [_seconds_since(at, start) for at in series.times]
        lane.step(xs, series.values, where="post", color=f"C{n}", linewidth=1.8, label=series.label)
        top = max(top, *series.values) if series.values else top
        if series.expected is not None:
            lane.axhline(series.expected, color=f"C{n}", linestyle=":", linewidth=1)
            top = max(top, series.expected)
    if story.broken_at:
        xs = [_seconds_since(at, start) for at in story.broken_at]
        lane.vlines(xs, 0, 0.12, transform=lane.get_xaxis_transform(), color="black", linewidth=0.8)
    lane.set_ylim(bottom=0, top=top * 1.18)
    lane.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=4))
    label = ", ".join(series.label for series in story.series)
    lane.set_ylabel(f"{story.system}\n{label}", fontsize=9)
    lane.yaxis.label.set_fontweight("bold")
    title = textwrap.fill(f"{story.system}: {story.sentence}", _TITLE_CHARACTERS)
    lane.set_title(title, loc="left", fontsize=9)
    lane.grid(alpha=0.3)


def draw_lanes(stories: Sequence[Story], path: Path) -> Path:
    """Draw `stories` (from :func:`~stablewatch.pipeline.story.tell`), one lane each, to the PNG at
    `path`; see the module doc. Returns `path`."""
    figure = lanes_figure(stories)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=100)
    finally:
        plt.close(figure)
    return path
