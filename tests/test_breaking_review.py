"""A review of breaking proven deadlocks: the detector's side, pure and in-process.

Each test pins one way a break could be repeated, misdirected or misreported (DESIGN.md, "Breaking a
proven deadlock" and "Several detectors side by side"): a real store, the real evaluation and a
recorded ``send`` (the harness of tests/test_resolutions.py), a settable clock.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from settable_clock import T0, Clock
from test_resolutions import Harness, cycle_snapshot, report

from stablewatch.detector.service.detector import DetectorConfig
from stablewatch.detector.service.resolutions import NothingToResolve, outcome_word
from stablewatch.detector.service.store import Store
from stablewatch.testing.detector import Running
from stablewatch.v1.control_pb2 import BREAK_OUTCOME_BROKEN

pytestmark = pytest.mark.timeout(60)


def test_a_break_that_was_never_sent_does_not_move_the_deadlock_to_another_victim(store: Store, clock: Clock) -> None:
    """The victim's process was not attached when its break was due: nothing reached it, so its
    wait is as breakable as before. A later cut that still shows the deadlock must name the same
    wait, the one every other detector names too, not the next candidate: that would make two
    victims of one deadlock (this detector's second choice, and another detector's first)."""
    h = Harness(store, clock, attached=False)
    [unsent] = h.complete(cycle_snapshot(10), T0 - 1)
    assert outcome_word(unsent) == "not_attached" and (unsent.process_id, unsent.instance) == ("b", 7)
    h.attached = True
    clock.now = T0 + 1
    h.complete(cycle_snapshot(11), T0 + 0.5)  # b is back, still waiting: same deadlock, same cut
    assert [(p, o.instance) for p, o in h.sent] == [("b", 7)]
    _, order = h.sent[0]
    broken = h.resolutions.reported("b", report(order, BREAK_OUTCOME_BROKEN))
    assert broken is not None and outcome_word(broken) == "broken"


def test_an_operator_cannot_break_a_wait_of_a_process_that_reattached_since_the_snapshot(
    store: Store, clock: Clock
) -> None:
    """Instances are unique only within one run of a process: one that restarted counts from 1
    again. Snapshot 10 proved b's wait 7 deadlocked; b then restarted and attached again, and its
    wait 7 (if any) is another wait, in no proven deadlock. An operator asking to break snapshot
    10's deadlock must be refused for b, and nothing sent."""
    h = Harness(store, clock, policy=None)
    h.complete(cycle_snapshot(10), T0 - 1)
    attached_at = {"a": T0 - 5, "b": T0}  # b came back after snapshot 10 started
    h.resolutions.attached_at = attached_at.get
    with pytest.raises(NothingToResolve, match=r"'b' attached again after snapshot 10 started"):
        h.resolutions.resolve(10, "CN=alice")
    assert h.sent == [] and store.resolutions(10) == []
    # Attached all along: the wait is the one the snapshot recorded, and it is broken.
    attached_at["b"] = T0 - 5
    [resolution] = h.resolutions.resolve(10, "CN=alice")
    assert [(p, o.instance) for p, o in h.sent] == [("b", 7)] and resolution.instance == 7


def test_a_break_left_pending_by_a_detector_that_stopped_is_finished_when_it_starts_again(tmp_path: Path) -> None:
    """A detector that stops (or is killed) between a break and its report never hears the report:
    it comes on the stream that ended with it. Started again on the same data, it must not list
    that break as pending for ever, unarchived and uncounted: it gives it up, saying why."""
    data = tmp_path / "data"
    with Store(data) as store:
        now = time.time()  # recent: retention at the start keeps it
        h = Harness(store, Clock(now))
        [pending] = h.complete(cycle_snapshot(10), now - 1)
        assert outcome_word(pending) == "pending"
    running = Running(DetectorConfig(data_dir=data, listen="127.0.0.1:0", metrics_port=None, interval=None))
    try:
        stored = running.on_loop(lambda: running.detector.store.resolution(pending.resolution_id))
        assert stored is not None and outcome_word(stored) == "unanswered", stored
        assert "restarted" in stored.detail
        assert running.metric("stablewatch_deadlocks_resolved_total", outcome="unanswered") == 1
    finally:
        running.stop()


def test_an_operator_cannot_break_on_a_running_or_aborted_snapshot(store: Store, clock: Clock) -> None:
    """Only a completed cut proves anything: a snapshot still running, or aborted (whatever parts
    it holds), is refused as unknown, and no break goes out."""
    h = Harness(store, clock, policy=None)
    store.begin(10, T0 - 2, 2)  # running
    store.begin(11, T0 - 1, 2)
    store.abort(11, "b did not report in time", T0, "deadline")
    for snapshot_id in (10, 11):
        with pytest.raises(KeyError, match=f"snapshot {snapshot_id} is not a completed snapshot"):
            h.resolutions.resolve(snapshot_id, "CN=alice")
    assert h.sent == [] and store.resolutions(10) == []
