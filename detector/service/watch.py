"""The watch stream's fan-out: every published result goes to every watcher, with what changed.

A watcher that falls :data:`QUEUE_LIMIT` events behind is cut off (its stream ends) rather than
letting the detector's memory grow. Each watcher belongs to an identity (who opened it), so that
the detector can bound the streams one client holds. A predicate's value is one of true, false and
unknown; a change from any of them to another is a change. Breaks of deadlocks go to every
watcher too, as events of their own (``WatchEvent.resolution``), when sent and when answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from stablewatch.detector.evaluation.verdict import Verdict
from stablewatch.v1 import PredicateResult
from stablewatch.v1.query_pb2 import PredicateChange, Resolution, SnapshotResults, WatchEvent

__all__ = ["QUEUE_LIMIT", "WatchHub"]

QUEUE_LIMIT = 1000


class WatchHub:
    """Publishes results to watchers and remembers each predicate's last value."""

    def __init__(self, last: SnapshotResults | None = None) -> None:
        self._watchers: dict[asyncio.Queue[WatchEvent | None], str] = {}  # queue -> its identity
        self._last: dict[str, Verdict] = {}  # name -> its last verdict
        if last is not None:
            self._last = {r.name: Verdict.of(r) for r in last.results}

    @property
    def watchers(self) -> int:
        """Watch streams open now."""
        return len(self._watchers)

    def watchers_of(self, identity: str) -> int:
        """Watch streams `identity` holds open now (a scan: there are at most ``max_watchers``)."""
        return sum(1 for owner in self._watchers.values() if owner == identity)

    def changes(self, results: Sequence[PredicateResult]) -> list[PredicateChange]:
        """The predicates whose value `results` change, and remember the new values."""
        changes = []
        for result in results:
            value = Verdict.of(result)  # a failed user predicate is unknown, not false
            previous = self._last.get(result.name)
            if previous != value:
                changes.append(
                    PredicateChange(
                        name=result.name,
                        holds=value is Verdict.TRUE,
                        unknown=value is Verdict.UNKNOWN,
                        previous_holds=previous is Verdict.TRUE,
                        previous_unknown=previous is Verdict.UNKNOWN,
                        first=previous is None,
                    )
                )
            self._last[result.name] = value
        return changes

    def publish(self, results: SnapshotResults, changes: list[PredicateChange]) -> None:
        """Queue one event for every watcher; cut off those too far behind."""
        self._send(WatchEvent(results=results, changes=changes, snapshot_id=results.snapshot.snapshot_id))

    def publish_resolution(self, resolution: Resolution) -> None:
        """Queue a break of a deadlock (sent, or answered) for every watcher."""
        self._send(WatchEvent(resolution=resolution, snapshot_id=resolution.snapshot_id))

    def _send(self, event: WatchEvent) -> None:
        for queue in list(self._watchers):
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:
                del self._watchers[queue]
                _end(queue)

    async def subscribe(self, current: SnapshotResults | None = None, identity: str = "") -> AsyncIterator[WatchEvent]:
        """`current` first (every value in it marked ``first``), then every event published from
        now on, until :meth:`close`: a watcher sees the present state at once, not only changes.
        The stream counts for `identity` (:meth:`watchers_of`) from its first step to its end."""
        queue: asyncio.Queue[WatchEvent | None] = asyncio.Queue(QUEUE_LIMIT)
        if current is not None:
            values = [_first(r.name, Verdict.of(r)) for r in current.results]
            queue.put_nowait(WatchEvent(results=current, changes=values, snapshot_id=current.snapshot.snapshot_id))
        self._watchers[queue] = identity
        try:
            while (event := await queue.get()) is not None:
                yield event
        finally:
            self._watchers.pop(queue, None)

    def close(self) -> None:
        """End every watch stream."""
        for queue in list(self._watchers):
            _end(queue)


def _end(queue: asyncio.Queue[WatchEvent | None]) -> None:
    """End a watch stream: drop what it has not read yet and queue the end."""
    while not queue.empty():
        queue.get_nowait()
    queue.put_nowait(None)


def _first(name: str, value: Verdict) -> PredicateChange:
    """A predicate's present value, as a watcher's first event gives it."""
    return PredicateChange(name=name, holds=value is Verdict.TRUE, unknown=value is Verdict.UNKNOWN, first=True)
