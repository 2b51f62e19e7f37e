"""A review of breaking exactly once across policies: an operator's order at a detector whose
choice differs from the replicas' policy, and a break whose breaking raises at the agent
(DESIGN.md, "Breaking a proven deadlock" and "Several detectors side by side").

The detectors are :class:`test_resolutions.Harness` objects (real store, real evaluation, a
recorded ``send``, a settable clock); an agent is its real :class:`PolicyAgreement` and
:class:`BreakDispatcher` over a small wait source, answering as the control client does (the
refusal first, then the dispatcher). The raising case also goes over a real control stream.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from fake_detector import Agent, FakeDetector, session
from settable_clock import T0, Clock
from test_resolutions import Harness, cycle_snapshot

from polling import async_poll, run
from stablewatch.agents.breaking import BreakDispatcher, Broken, Doorbell, OpenWait, PolicyAgreement
from stablewatch.detector.service.resolutions import outcome_word
from stablewatch.detector.service.store import Store
from stablewatch.v1.control_pb2 import (
    BREAK_OUTCOME_ALREADY_BROKEN,
    BREAK_OUTCOME_BROKEN,
    BREAK_OUTCOME_FAILED,
    BREAK_OUTCOME_GONE,
    BREAK_OUTCOME_POLICIES_DISAGREE,
    BreakReport,
    BreakWait,
)
from stablewatch.v1.query_pb2 import Resolution

pytestmark = pytest.mark.timeout(60)

# cycle_snapshot: a's wait 1 (task x, the older) and b's wait 7 (task y, the younger) wait on each other.
OLDEST, YOUNGEST = ("a", 1), ("b", 7)


class Waits:
    """One process's waits as a wait source: each broken at most once; ``fail`` makes breaking raise
    after the wait was marked broken (as a source whose waiter could not be told)."""

    def __init__(self, *instances: int, fail: bool = False) -> None:
        self.doorbell = Doorbell()
        self.broken: set[int] = set()
        self._instances = set(instances)
        self._fail = fail

    def break_wait(self, order: BreakWait) -> Broken | None:
        if order.instance not in self._instances:
            return None
        if order.instance in self.broken:
            return Broken(BREAK_OUTCOME_ALREADY_BROKEN, "broken before")
        self.broken.add(order.instance)
        if self._fail:
            raise RuntimeError("the waiter's loop is closed")
        return Broken(BREAK_OUTCOME_BROKEN, "ABORTED")

    def open_waits(self) -> list[OpenWait]:
        return []

    def idle(self) -> bool:
        return True


class Process:
    """An agent attached to detectors that stated ``policies`` (address -> policy)."""

    def __init__(self, waits: Waits, policies: dict[str, str]) -> None:
        self.waits = waits
        self.agreement = PolicyAgreement()
        for detector, policy in policies.items():
            self.agreement.stated(detector, policy)
        self.dispatcher = BreakDispatcher([waits])

    def answer(self, order: BreakWait) -> BreakReport:
        """What the control client answers: the agreement's refusal, else the dispatcher's report."""
        return self.agreement.refusal(order) or self.dispatcher.handle(order)


def deliver(detector: Harness, processes: dict[str, Process], start: int = 0) -> list[Resolution]:
    """Deliver the detector's orders sent from ``start`` on to their processes and hand back each report."""
    done = []
    for process, order in detector.sent[start:]:
        resolution = detector.resolutions.reported(process, processes[process].answer(order))
        assert resolution is not None
        done.append(resolution)
    return done


def two_processes(policies: dict[str, str]) -> dict[str, Process]:
    return {"a": Process(Waits(1), policies), "b": Process(Waits(7), policies)}


def victims(processes: dict[str, Process]) -> list[tuple[str, int]]:
    return sorted((name, i) for name, p in processes.items() for i in p.waits.broken)


# -- (a) an operator's order at a detector whose choice is not the replicas' policy ------------------


def test_an_operators_break_chosen_by_another_policy_than_the_replicas_is_refused(tmp_path: Path, clock: Clock) -> None:
    """Replica d0 runs ``--resolve oldest``; replica d1 runs without ``--resolve`` (it states
    ``off``, which agrees with any). Both snapshots show the deadlock; d0 breaks a's wait 1 (the
    oldest). An operator then asks d1 to resolve its snapshot, begun before that break: d1 holds
    no break of it and chooses b's wait 7 (youngest), a second victim of the same deadlock. The agent
    refuses it, and the operator's record says why and where to look."""
    processes = two_processes({"d0:1": "oldest", "d1:1": "off"})
    d0 = Harness(Store(tmp_path / "d0"), clock, policy="oldest")
    d1 = Harness(Store(tmp_path / "d1"), clock, policy=None)
    d0.complete(cycle_snapshot(10), T0 - 1)
    assert d1.complete(cycle_snapshot(11), T0 - 1) == []  # d1 breaks nothing unasked
    [automatic] = deliver(d0, processes)
    assert outcome_word(automatic) == "broken" and (automatic.process_id, automatic.instance) == OLDEST

    clock.now = T0 + 1
    [asked] = d1.resolutions.resolve(11, "operator")
    assert (asked.process_id, asked.instance, asked.policy) == (*YOUNGEST, "operator")
    [answered] = deliver(d1, processes)
    assert victims(processes) == [OLDEST], "two victims of one deadlock"
    assert d1.sent[0][1].chosen_by == "youngest"
    assert outcome_word(answered) == "policies_disagree"
    assert "chosen by youngest" in answered.detail and "oldest at d0:1" in answered.detail
    assert d1.metric("stablewatch_deadlocks_resolved_total", outcome="policies_disagree") == 1


@pytest.mark.parametrize("outcome", [BREAK_OUTCOME_ALREADY_BROKEN, BREAK_OUTCOME_GONE])
def test_an_operator_at_a_detector_without_resolve_gets_already_broken_when_its_choice_is_the_replicas(
    tmp_path: Path, clock: Clock, outcome: int
) -> None:
    """The same with d0 on ``youngest``: the operator's order at d1 names the wait d0 broke, and
    the agent says so (already broken while its waiter is in it, gone once it left)."""
    processes = two_processes({"d0:1": "youngest", "d1:1": "off"})
    d0 = Harness(Store(tmp_path / "d0"), clock, policy="youngest")
    d1 = Harness(Store(tmp_path / "d1"), clock, policy=None)
    d0.complete(cycle_snapshot(10), T0 - 1)
    d1.complete(cycle_snapshot(11), T0 - 1)
    assert [outcome_word(r) for r in deliver(d0, processes)] == ["broken"]
    if outcome == BREAK_OUTCOME_GONE:
        processes["b"] = Process(Waits(), {"d0:1": "youngest", "d1:1": "off"})  # the victim left its wait
    d1.resolutions.resolve(11, "operator")
    [answered] = deliver(d1, processes)
    assert (answered.process_id, answered.instance, answered.outcome) == (*YOUNGEST, outcome)


def test_an_operators_order_still_goes_through_while_the_automatic_policies_disagree(
    tmp_path: Path, clock: Clock
) -> None:
    """d0 ``youngest``, d1 ``oldest``: every automatic break is refused, so an operator's order
    (here at d1, chosen by oldest) is the only break, and is carried out."""
    processes = two_processes({"d0:1": "youngest", "d1:1": "oldest"})
    d0 = Harness(Store(tmp_path / "d0"), clock, policy="youngest")
    d1 = Harness(Store(tmp_path / "d1"), clock, policy="oldest")
    d0.complete(cycle_snapshot(10), T0 - 1)
    d1.complete(cycle_snapshot(11), T0 - 1)
    assert [outcome_word(r) for r in deliver(d0, processes) + deliver(d1, processes)] == ["policies_disagree"] * 2
    clock.now = T0 + 1
    d1.resolutions.resolve(11, "operator")
    [answered] = deliver(d1, processes, start=1)
    assert outcome_word(answered) == "broken" and victims(processes) == [OLDEST]


# -- (b) a break whose breaking raises at the agent ------------------------------------------------


def test_a_raising_wait_source_is_answered_failed_with_its_error_over_the_control_stream(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The dispatcher is the control client's ``on_break``. Before, a source that raised made the
    client answer ``gone`` ("not waiting here"), though the wait was marked broken; now the
    answer is ``failed`` with the error, which the agent logs."""
    waits = Waits(7, fail=True)
    dispatcher = BreakDispatcher([waits])
    detector = FakeDetector()

    async def scenario() -> BreakReport:
        async with session(detector, Agent(), on_break=dispatcher.handle):
            await async_poll(lambda: detector.attached("p1"), "the agent to attach")
            detector.break_wait("p1", 7, break_id=5)
            return await async_poll(lambda: detector.report(5), "the break's report")

    with caplog.at_level(logging.ERROR, logger="stablewatch.agents.breaking"):
        answer = run(scenario())
    assert answer.outcome == BREAK_OUTCOME_FAILED, answer
    assert "RuntimeError: the waiter's loop is closed" in answer.detail
    assert any("breaking wait 7" in r.getMessage() and r.exc_info for r in caplog.records)


def test_a_control_clients_own_on_break_that_raises_is_answered_failed() -> None:
    """An embedder's ``on_break`` on a bare control client that raises: failed with its error, not
    gone (it may have broken the wait, and a detector told "gone" would name another victim)."""

    def on_break(order: BreakWait) -> BreakReport:
        raise RuntimeError("lost the waiter")

    detector = FakeDetector()

    async def scenario() -> BreakReport:
        async with session(detector, Agent(), on_break=on_break):
            await async_poll(lambda: detector.attached("p1"), "the agent to attach")
            detector.break_wait("p1", 7, break_id=6)
            return await async_poll(lambda: detector.report(6), "the break's report")

    answer = run(scenario())
    assert answer.outcome == BREAK_OUTCOME_FAILED, answer
    assert "lost the waiter" in answer.detail


def test_an_on_broken_that_raises_is_answered_failed_and_the_wait_stays_broken_once() -> None:
    """The wait was broken but the agent's own follow-up (``on_broken``) raised: failed, not gone;
    a second order for it says it was broken before."""

    def on_broken(order: BreakWait) -> None:
        raise ValueError("core not told")

    waits = Waits(7)
    dispatcher = BreakDispatcher([waits], on_broken=on_broken)
    first = dispatcher.handle(BreakWait(break_id=1, instance=7, knows_failed=True))
    assert first.outcome == BREAK_OUTCOME_FAILED and "ValueError: core not told" in first.detail
    assert dispatcher.handle(BreakWait(break_id=2, instance=7)).outcome == BREAK_OUTCOME_ALREADY_BROKEN
    assert waits.broken == {7}


def test_a_failed_break_gives_its_deadlock_no_other_victim(store: Store, clock: Clock) -> None:
    """The detector names b's wait 7; breaking it raises at b. A later cut that still shows the
    deadlock names no other wait (a's 1 would be a second victim if the first try did break 7);
    after the refusal pause it names wait 7 again, and the agent answers it broken before. The
    failure is recorded, counted and published with the agent's error."""
    processes = {"a": Process(Waits(1), {"d0:1": "youngest"}), "b": Process(Waits(7, fail=True), {"d0:1": "youngest"})}
    h = Harness(store, clock)
    h.complete(cycle_snapshot(10), T0 - 1)
    [failed] = deliver(h, processes)
    assert outcome_word(failed) == "failed" and "the waiter's loop is closed" in failed.detail
    assert h.metric("stablewatch_deadlocks_resolved_total", outcome="failed") == 1
    assert outcome_word(h.published[-1]) == "failed"

    clock.now = T0 + 2
    assert h.complete(cycle_snapshot(11), T0 + 1) == []  # begun after the report: still no other victim
    clock.now = T0 + 100
    h.complete(cycle_snapshot(12), T0 + 99)  # after the pause: the same wait again
    assert [(p, o.instance) for p, o in h.sent] == [YOUNGEST, YOUNGEST]
    [again] = deliver(h, processes, start=1)
    assert outcome_word(again) == "already_broken"
    assert victims(processes) == [YOUNGEST]


def test_a_detector_that_does_not_know_failed_is_answered_policies_disagree() -> None:
    """An older detector cannot name BREAK_OUTCOME_FAILED (and would take the wait as settled):
    it gets the refusal it already treats as "nothing known broken", with the error."""
    waits = Waits(7, fail=True)
    answer = BreakDispatcher([waits]).handle(BreakWait(break_id=1, instance=7))  # no knows_failed
    assert answer.outcome == BREAK_OUTCOME_POLICIES_DISAGREE, answer
    assert "RuntimeError: the waiter's loop is closed" in answer.detail
