"""The snapshot schedule keeps its timetable (pure arithmetic; no clock is read here)."""

from __future__ import annotations

import pytest

from stablewatch.detector.service.scheduler import Scheduler, next_tick


def test_a_late_tick_does_not_delay_the_next() -> None:
    # A tick taken 30 ms late (a busy loop) leaves the next one where the timetable has it.
    assert next_tick(previous=1.0, now=1.03, period=0.1) == pytest.approx(1.1)


def test_lag_does_not_accumulate_over_many_ticks() -> None:
    due, lag = 0.0, 0.02
    for _ in range(100):
        due = next_tick(due, due + lag, 0.1)  # every tick taken 20 ms late
    assert due == pytest.approx(10.0)  # 100 periods, not 100 x (period + lag)


def test_a_schedule_far_behind_skips_what_it_missed_instead_of_bursting() -> None:
    # Stalled for half a second: one tick at once, then the period again, not five back to back.
    first = next_tick(previous=0.0, now=0.5, period=0.1)
    assert first == pytest.approx(0.5)  # due now
    assert next_tick(first, now=0.501, period=0.1) == pytest.approx(0.6)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"interval": 0}, "interval must be positive"),
        ({"interval": 1, "jitter": 1}, "jitter must be in"),
        ({"interval": 1, "max_concurrent": 0}, "max_concurrent must be at least 1"),
    ],
)
def test_bad_settings_are_refused_with_what_was_wrong(options: dict[str, float], message: str) -> None:
    async def take() -> None:
        return None

    with pytest.raises(ValueError, match=message):
        Scheduler(take, **options)
