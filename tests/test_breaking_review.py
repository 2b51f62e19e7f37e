"""A review of breaking proven deadlocks: the detector's side, pure and in-process, and the agent's.

Each test pins one way a break could be repeated, misdirected or misreported (DESIGN.md, "Breaking a
proven deadlock" and "Several detectors side by side"): a real store, the real evaluation and a
recorded ``send`` (the harness of tests/test_resolutions.py), a settable clock. On the agent's
side: wait instances across a process's runs, and the RPC-mode cores (real ``ColorCore`` objects)
serving no cut begun after a break from a recording made before it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from rpc_harness import new_agent
from settable_clock import T0, Clock
from test_resolutions import Harness, cycle_snapshot, report, wait

from stablewatch.agents import breaking
from stablewatch.agents.core import RecordState, ReportPart, SnapshotFailed
from stablewatch.agents.rpc.agent import RpcAgent
from stablewatch.agents.rpc.core import ColorCore, Stamp
from stablewatch.detector.assembly import Assembler, Completed
from stablewatch.detector.service.detector import DetectorConfig
from stablewatch.detector.service.resolutions import NothingToResolve, outcome_word
from stablewatch.detector.service.store import Store
from stablewatch.testing.detector import Running
from stablewatch.v1 import GlobalSnapshot, LocalSnapshotPart, LocalState, ProcessSnapshot, RecordedMessage, Wait
from stablewatch.v1.control_pb2 import BREAK_OUTCOME_BROKEN, BreakWait
from stablewatch.v1.ids import next_id

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
    """An agent from before instances were unique across runs counted from 1 again after a
    restart. Snapshot 10 proved b's wait 7 deadlocked; b then restarted and attached again, and its
    wait 7 (if any) may be another wait, in no proven deadlock. An operator asking to break snapshot
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


# -- the agent's side: instances across a process's runs ------------------------------------------


def _runs_first_instances(count: int) -> list[int]:
    """The first ``count`` wait instances a new run of a process hands out (a fresh interpreter)."""
    code = f"from stablewatch.agents.breaking import new_instance; print(*(new_instance() for _ in range({count})))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return [int(word) for word in done.stdout.split()]


@pytest.fixture(scope="module")
def two_runs() -> tuple[list[int], list[int]]:
    """The first instances of two runs of one process, the second started after the first ended."""
    return _runs_first_instances(3), _runs_first_instances(3)


def test_a_restarted_process_never_reuses_an_instance_of_its_earlier_run(two_runs: tuple[list[int], list[int]]) -> None:
    """A detector remembers broken waits by (process, instance) across the process's restarts: a new
    run must hand out none of the ids of the run before it (and none is 0, "unknown")."""
    first, second = two_runs
    assert len(first) == len(second) == 3 and min(first) > 0
    assert min(second) > max(first), two_runs
    assert max(second) < 2**53  # exact as a JSON number, as snapshot ids are


def test_the_instance_counter_starts_at_the_clocks_microseconds_and_never_at_0() -> None:
    now_ns = 1_700_000_000_123_456_789
    later = breaking.instance_counter(lambda: now_ns)
    assert [later(), later()] == [now_ns // 1000, now_ns // 1000 + 1]
    assert breaking.instance_counter(lambda: 0)() == 1


def _b_and_a_deadlocked(snapshot_id: int, a_wait: Wait, b_wait: Wait) -> GlobalSnapshot:
    processes = [
        ProcessSnapshot(process_id="a", state=LocalState(active=True, waits=[a_wait])),
        ProcessSnapshot(process_id="b", state=LocalState(active=True, waits=[b_wait])),
    ]
    return GlobalSnapshot(snapshot_id=snapshot_id, processes=processes, expected_members=["a", "b"])


def test_after_a_victim_restarts_two_detectors_name_the_same_wait_of_a_new_deadlock(
    tmp_path: Path, clock: Clock, two_runs: tuple[list[int], list[int]]
) -> None:
    """The review's scenario (tests of /tmp/rv_two): detector 1 broke b's wait; b restarted and
    deadlocked again, its new wait the youngest. Had the new run reused the broken wait's id,
    detector 1 would skip the wait it names as broken before, while detector 2 breaks it: two
    victims. With the instances of two real runs, both detectors name b's new wait."""
    (b_old, *_), (b_new, *_) = two_runs
    d1 = Harness(Store(tmp_path / "d1"), clock)
    d2 = Harness(Store(tmp_path / "d2"), clock)  # the other replica, same policy
    d1.complete(_b_and_a_deadlocked(10, wait("x", ("b", "y"), 1, 1_000), wait("y", ("a", "x"), b_old, 2_000)), T0 - 1)
    assert [(p, o.instance) for p, o in d1.sent] == [("b", b_old)]
    clock.now = T0
    d1.resolutions.reported("b", report(d1.sent[0][1]))
    a_wait, b_wait = wait("x", ("b", "y"), 20, 5_000_000), wait("y", ("a", "x"), b_new, 6_000_000)
    d1.complete(_b_and_a_deadlocked(30, a_wait, b_wait), T0 + 10)
    d2.complete(_b_and_a_deadlocked(31, a_wait, b_wait), T0 + 10)
    named = [(p, o.instance) for p, o in d1.sent[1:]], [(p, o.instance) for p, o in d2.sent]
    assert named == ([("b", b_new)], [("b", b_new)]), f"two victims of one deadlock: {named}"


# -- the agent's side (RPC mode): no cut begun after a break is served a recording from before it --

SKEW = 0.5  # detector 2's clock is ahead of detector 1's (and of real time), well within max_skew


class _Proc:
    """One RPC-mode process of the review's scenario: its real ColorCore and its application waits."""

    def __init__(self, name: str, waits: list[Wait]) -> None:
        self.name = name
        self.core = ColorCore(name, incarnation=1)
        self.waits = waits
        self.failures: dict[int, str] = {}

    def break_wait(self) -> None:
        """The agent breaks its wait: it leaves the state at once, and the core hears of it."""
        self.waits = []
        self.core.wait_broken()

    def start(self, snapshot_id: int, now: float) -> list[LocalSnapshotPart]:
        return self._carry_out(self.core.start_snapshot(snapshot_id, now=now, lifetime=30))

    def _carry_out(self, actions: tuple[object, ...]) -> list[LocalSnapshotPart]:
        parts: list[LocalSnapshotPart] = []
        for action in actions:
            if isinstance(action, RecordState):
                state = LocalState(active=True, waits=self.waits)
                parts += self._carry_out(self.core.record_state(action.snapshot_id, state))
            elif isinstance(action, ReportPart):
                parts.append(action.part)
            elif isinstance(action, SnapshotFailed):
                self.failures[action.snapshot_id] = action.reason
        return parts


def _take(assembler: Assembler, procs: list[_Proc], snapshot_id: int, now: float) -> GlobalSnapshot | None:
    """Start ``snapshot_id`` at every process: the completed cut, or None if a process failed it."""
    assembler.begin(snapshot_id, [p.name for p in procs], confirmed_by=[p.name for p in procs])
    done = None
    for proc in procs:
        for part in proc.start(snapshot_id, now):
            out = assembler.add_part(part, sender=proc.name)
            if isinstance(out, Completed):
                done = out.snapshot
    failed = any(snapshot_id in proc.failures for proc in procs)
    assert (done is None) == failed, (snapshot_id, [proc.failures for proc in procs])
    return done


def _ring() -> tuple[list[_Proc], _Proc]:
    """The review's deadlock: a's wait 1 on b and b's wait 7 (the youngest) on a; and b."""
    b = _Proc("b", [wait("y", ("a", "x"), 7, 2_000)])
    return [_Proc("a", [wait("x", ("b", "y"), 1, 1_000)]), b], b


def test_a_cut_begun_after_the_report_is_not_served_the_other_detectors_pre_break_recording(
    store: Store, clock: Clock
) -> None:
    """The review's scenario: detector 1 breaks b's wait 7. Detector 2 (clock ahead) had every
    process record for its id k2 just before the break; detector 1's next id k1, started after
    the report, is below k2. Served from k2's recording it would show the broken deadlock whole,
    and detector 1 would break a's wait too. b fails k1 instead, saying why; the next cuts of
    both detectors are recorded afresh and show no deadlock."""
    procs, b = _ring()
    detector1 = Harness(store, clock)
    asm1, asm2 = Assembler(), Assembler()
    k0 = next_id(0, 100_000_000, 0)
    s0 = _take(asm1, procs, k0, 100.0)
    assert s0 is not None
    clock.now = 100.01
    detector1.complete(s0, 100.0)
    assert [(p, o.instance) for p, o in detector1.sent] == [("b", 7)]
    k2 = next_id(0, int((100.02 + SKEW) * 1e6), 1)
    assert _take(asm2, procs, k2, 100.02) is not None  # both record for k2, b still waiting
    b.break_wait()
    clock.now = 100.04
    order = detector1.sent[0][1]
    assert detector1.resolutions.reported("b", report(order))

    k1 = next_id(k0, 100_100_000, 0)
    assert k0 < k1 < k2
    assert _take(asm1, procs, k1, 100.10) is None  # started after the report: not served k2's recording
    assert "before a wait of this process was broken" in b.failures[k1]
    assert len(detector1.sent) == 1  # no cut, no second victim
    # Detector 2's next id and detector 1's once its clock passes k2: recorded afresh, no deadlock.
    k3 = next_id(k2, int((100.2 + SKEW) * 1e6), 1)
    s3 = _take(asm2, procs, k3, 100.2)
    k4 = next_id(k1, int(100.8 * 1e6), 0)
    assert k3 < k4
    s4 = _take(asm1, procs, k4, 100.8)
    assert s3 is not None and s4 is not None
    for cut in (s3, s4):
        assert [w.instance for p in cut.processes for w in p.state.waits] == [1]  # a's only
    clock.now = 100.81
    assert detector1.complete(s4, 100.8) == [] and len(detector1.sent) == 1


def test_when_the_other_detector_broke_the_wait_no_later_cut_names_a_second_victim(store: Store, clock: Clock) -> None:
    """The review's variant: detector 2 (clock ahead) proved the deadlock on k2 and broke b's wait
    7. Detector 1's cuts begun since have ids below k2: served from k2's recording they named b's
    wait 7 (already broken) and then a's wait 1, a second victim. Now they fail at b."""
    procs, b = _ring()
    detector1 = Harness(store, clock)
    asm1, asm2 = Assembler(), Assembler()
    k2 = next_id(0, int(100.5 * 1e6), 1)
    assert _take(asm2, procs, k2, 100.0) is not None
    b.break_wait()  # detector 2's break of b's wait 7
    k1 = next_id(0, int(100.10 * 1e6), 0)
    k1b = next_id(k1, int(100.30 * 1e6), 0)
    assert k1 < k1b < k2
    for snapshot_id, now in ((k1, 100.10), (k1b, 100.30)):
        assert _take(asm1, procs, snapshot_id, now) is None
        assert "before a wait of this process was broken" in b.failures[snapshot_id]
    assert detector1.sent == []


def test_after_a_break_no_start_of_either_detector_is_served_a_recording_from_before_it() -> None:
    """At the core: b recorded (0, k2] for a stamp of color k2 (detector 2's) while its wait 7 held;
    then the wait is broken. Neither detector 2's own start of k2, arriving late, nor detector 1's
    start of a smaller id is served that recording; a claim made before the break goes on; an id
    above the color records afresh."""
    b = _Proc("b", [wait("y", ("a", "x"), 7, 2_000)])
    k1, k2 = next_id(0, 100_000_000, 0), next_id(0, 100_500_000, 1)
    stamp = Stamp(k2, 1, 0, "a")
    b._carry_out(b.core.receive(stamp, RecordedMessage(), now=100.0, wall=100.0))
    assert b.core.recorded_ranges == [(0, k2)]
    earlier = next_id(0, 99_000_000, 0)
    assert [part.state.waits[0].instance for part in b.start(earlier, 100.0)] == [7]  # claimed before the break
    b.break_wait()
    for snapshot_id in (k2, k1):
        assert b.start(snapshot_id, 100.1) == []
        assert "before a wait of this process was broken" in b.failures[snapshot_id]
    assert earlier in b.core.active_snapshots and earlier not in b.failures
    k3 = next_id(k2, 100_600_000, 1)
    [fresh] = b.start(k3, 100.2)
    assert fresh.snapshot_id == k3 and list(fresh.state.waits) == []
    assert b.core.recorded_ranges == [(0, k2), (k2, k3)]


def test_the_rpc_agent_tells_its_core_of_a_break_before_its_report() -> None:
    """Through the agent's dispatcher (what the control stream calls for a ``BreakWait``): after an
    application wait is broken, a start below the color, which the recording from before the
    break would have served, fails at once, and no part goes out for it."""
    agent = new_agent("b")
    try:
        parts: list[LocalSnapshotPart] = []
        agent.on_part(parts.append)
        with agent.state.waiting("a", task="y") as held:
            agent.start_snapshot(2_000)
            [before] = [part for part in parts if part.snapshot_id == 2_000]
            assert [w.instance for w in before.state.waits] == [held.instance]
            failed = _failed(agent)
            answer = agent.breaks.handle(BreakWait(break_id=1, snapshot_id=2_000, instance=held.instance))
            assert answer.outcome == BREAK_OUTCOME_BROKEN
            agent.start_snapshot(1_000)
            assert [part for part in parts if part.snapshot_id == 1_000] == []
            assert _failed(agent) == failed + 1
    finally:
        agent.stop()


def _failed(agent: RpcAgent) -> float:
    return agent.metrics.registry.get_sample_value("stablewatch_agent_rpc_snapshots_failed_total") or 0.0
