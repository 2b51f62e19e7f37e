"""A real detector on its own event-loop thread, for tests and benchmarks that attach agents to it.

    running = Running(DetectorConfig(data_dir=tmp, listen="127.0.0.1:0", metrics_port=None, interval=None))
    agent = Agent("P", detector=running.detector.address)   # attach agents to it as usual
    running.call(running.detector.trigger())                # run its coroutines from the test's thread
    running.stop()

Each method returns once the detector's loop has done the work.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from stablewatch.agents.loop_thread import LoopThread
from stablewatch.detector.service.detector import Detector, DetectorConfig

__all__ = ["Running"]

T = TypeVar("T")


class Running:
    """A started Detector (``detector``) on its own event-loop thread (``loop``), so that synchronous
    test code, or an agent on another loop, can use it."""

    def __init__(self, config: DetectorConfig) -> None:
        self._loop_thread = LoopThread("stablewatch-detector")
        self.loop, self.thread = self._loop_thread.loop, self._loop_thread.thread
        self._loop_thread.start()
        self.detector = Detector(config)
        self.call(self.detector.start())

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        """Run ``coroutine`` on the detector's loop and return its result (fails after ``timeout`` seconds)."""
        return self._loop_thread.run(coroutine, timeout)

    def on_loop(self, function: Callable[[], T]) -> T:
        """Run ``function`` on the detector's thread (the store belongs to it)."""

        async def run() -> T:
            return function()

        return self.call(run())

    def metric(self, name: str, **labels: str) -> float:
        """The value of a sample in the detector's metrics registry; 0 when it has none yet."""
        value = self.detector.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def stop(self) -> None:
        """Stop the detector, then its loop and thread."""
        try:
            self.call(self.detector.stop())
        finally:
            self._loop_thread.stop(10)
