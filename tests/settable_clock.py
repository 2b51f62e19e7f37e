"""A wall clock that tests set by hand (``clock.now = ...``), for code that takes its time as a callable."""

from __future__ import annotations

#: The wall-clock time a settable clock starts at (a fixed moment, November 2023).
T0 = 1_700_000_000.0


class Clock:
    """Returns ``now`` when called; tests move it forward by setting ``now``."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
