"""What a cut may claim: whole-system predicates are unknown on an open cut, never true.

DESIGN.md, "A cut covers the whole system, or it proves less".
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from samples import proc
from snapshot_gen import START, random_snapshot

from stablewatch.detector.evaluation import coverage, evaluate, new_baselines, verdict
from stablewatch.detector.evaluation.cut import describe_missing
from stablewatch.v1 import (
    WAIT_MODEL_AND,
    WAIT_MODEL_OR,
    AckPosition,
    ChannelSnapshot,
    Evaluation,
    GlobalSnapshot,
    LocalState,
    ProcessSnapshot,
    RecordedMessage,
    Wait,
    WaitNode,
)


def verdicts(evaluation: Evaluation) -> dict[str, str]:
    return {r.name: verdict(r) for r in evaluation.results}


def test_a_closed_cut_decides_everything() -> None:
    s = GlobalSnapshot(snapshot_id=1, processes=[proc("A", tokens=2), proc("B", tokens=3)], expected_members=["A", "B"])
    assert coverage(s).closed
    assert verdicts(evaluate(s, {"tokens": 5})) == {
        "deadlock": "false",
        "termination": "true",
        "conservation(tokens)": "true",
    }


def test_an_expected_member_missing_makes_termination_and_conservation_unknown() -> None:
    # The worker W is still working, but its control stream is down: it is not in the cut.
    s = GlobalSnapshot(
        snapshot_id=1, processes=[proc("A", tokens=2), proc("B", tokens=3)], expected_members=["A", "B", "W"]
    )
    cut = coverage(s)
    assert not cut.closed and list(cut.missing_processes) == ["W"]
    evaluation = evaluate(s, {"tokens": 10})
    assert verdicts(evaluation) == {
        "deadlock": "false",  # neither A nor B waits on anything: W cannot close a cycle with them
        "termination": "unknown",
        "conservation(tokens)": "unknown",
    }
    termination = evaluation.results[1]
    assert list(termination.missing_processes) == ["W"]
    assert "1 process missing from the cut (W)" in termination.summary
    assert not termination.holds


def test_a_process_named_only_by_a_channel_or_a_wait_opens_the_cut() -> None:
    by_channel = GlobalSnapshot(snapshot_id=1, processes=[proc("A"), proc("B")], outside_peers=["client"])
    by_wait = GlobalSnapshot(snapshot_id=1, processes=[proc("A", "db"), proc("B")])
    for s, missing in ((by_channel, ["client"]), (by_wait, ["db"])):
        assert list(coverage(s).missing_processes) == missing
        assert verdicts(evaluate(s))["termination"] == "unknown"


def test_an_expected_count_opens_the_cut_until_enough_processes_report() -> None:
    s = GlobalSnapshot(snapshot_id=1, processes=[proc("A"), proc("B")], expected_member_count=3)
    cut = coverage(s)
    assert not cut.closed and cut.missing_unnamed == 1
    assert describe_missing(cut) == "1 more expected process did not report"
    s.expected_member_count = 2
    assert coverage(s).closed


def test_activity_is_a_fact_on_any_cut() -> None:
    s = GlobalSnapshot(snapshot_id=1, processes=[proc("A", active=True)], expected_members=["A", "W"])
    assert verdicts(evaluate(s))["termination"] == "false"
    busy = GlobalSnapshot(
        snapshot_id=1,
        processes=[proc("A"), proc("B")],
        channels=[ChannelSnapshot(src="A", dst="B", sent_before_marker=1, messages=[RecordedMessage(payload=b"go")])],
        expected_members=["A", "B", "W"],
    )
    assert verdicts(evaluate(busy))["termination"] == "false"


def test_a_deadlock_among_members_is_real_on_an_open_cut() -> None:
    s = GlobalSnapshot(snapshot_id=1, processes=[proc("A", "B"), proc("B", "A")], expected_members=["A", "B", "W"])
    result = evaluate(s).results[0]
    assert verdict(result) == "true"
    assert [n.process for n in result.deadlock.cycle] == ["A", "B"]


def test_no_deadlock_among_members_that_wait_only_on_members_is_false_on_an_open_cut() -> None:
    # A client without an agent calls into a ring: A's handler waits on B's, B's on C, which works.
    # The client is only a channel's other end, W an expected member that did not report.
    ring = [
        ProcessSnapshot(process_id="A", state=LocalState(waits=[Wait(task="h1", targets=[WaitNode(process="B")])])),
        ProcessSnapshot(process_id="B", state=LocalState(waits=[Wait(task="h1", targets=[WaitNode(process="C")])])),
        proc("C", active=True),
    ]
    s = GlobalSnapshot(snapshot_id=1, processes=ring, outside_peers=["client"], expected_members=["A", "B", "C", "W"])
    assert list(coverage(s).missing_processes) == ["W", "client"]
    evaluation = evaluate(s, {"tokens": 0})
    assert verdicts(evaluation) == {"deadlock": "false", "termination": "false", "conservation(tokens)": "unknown"}
    result = evaluation.results[0]
    assert not result.unknown and not result.missing_processes
    assert result.summary.startswith("no deadlock among the processes in the cut, none waits outside it")
    # All passive, nothing in flight: termination is what the open cut cannot decide, and so are
    # the waits on whole processes (A's on B): closed, the cut may be quiet, where B's node is an
    # OR over its tasks (the quiet rule), which the missing processes decide.
    s.processes[2].state.active = False
    result = evaluate(s).results[0]
    assert verdicts(evaluate(s)) == {"deadlock": "unknown", "termination": "unknown"}
    assert "1 wait edge to whole processes of it, all passive" in result.summary
    # Waits on tasks are decided whatever the missing processes do.
    for process, target in zip(s.processes[:2], ("B", "C"), strict=True):
        process.state.waits[0].targets[0].task = "h1" if target == "B" else ""
    assert verdicts(evaluate(s)) == {"deadlock": "false", "termination": "unknown"}


def test_an_or_wait_released_by_a_message_in_flight_waits_on_no_one_outside() -> None:
    # A needs B or X; B's reply is on its way, so A is released and its wait on X is set aside.
    s = GlobalSnapshot(
        snapshot_id=1,
        processes=[proc("A", "B", "X", model=WAIT_MODEL_OR), proc("B")],
        channels=[ChannelSnapshot(src="B", dst="A", sent_before_marker=1, messages=[RecordedMessage(payload=b"r")])],
    )
    assert list(coverage(s).missing_processes) == ["X"]
    assert verdicts(evaluate(s))["deadlock"] == "false"


@pytest.mark.parametrize(
    "processes",
    [
        [proc("A", "X"), proc("B")],  # directly
        [proc("A", "B"), proc("B", "X")],  # through another member
        [proc("A", "B"), proc("B", "C", "X"), proc("C")],  # one of an AND wait's targets
    ],
    ids=["direct", "through-a-member", "and"],
)
def test_a_member_waiting_on_a_process_outside_the_cut_leaves_deadlock_unknown(processes: list) -> None:
    # X may wait on A, closing a cycle the cut cannot see.
    s = GlobalSnapshot(snapshot_id=1, processes=processes)
    result = evaluate(s).results[0]
    assert verdict(result) == "unknown" and list(result.missing_processes) == ["X"]
    assert "1 wait edge to outside it" in result.summary


def test_a_deadlock_among_members_beside_a_wait_outside_is_true() -> None:
    s = GlobalSnapshot(snapshot_id=1, processes=[proc("A", "B"), proc("B", "A"), proc("C", "X")])
    result = evaluate(s).results[0]
    assert verdict(result) == "true" and not result.missing_processes


def _close(rng: random.Random, snapshot: GlobalSnapshot) -> GlobalSnapshot:
    """`snapshot` with a random state for every process it lacks, and random channels to, from and
    among them; the members' states and the channels among members are left as they are."""
    cut = coverage(snapshot)
    missing = [*cut.missing_processes, *(f"U{i}" for i in range(cut.missing_unnamed))]
    members = [p.process_id for p in snapshot.processes]
    closed = GlobalSnapshot()
    closed.CopyFrom(snapshot)
    for pid in missing:
        state = LocalState(active=rng.random() < 0.2)
        for _ in range(rng.choice([0, 1, 1, 2, 3])):
            wait = Wait(task=rng.choice(TASKS), model=rng.choice(MODELS), flow_control=rng.random() < 0.1)
            for _ in range(rng.randint(1, 3)):
                wait.targets.append(WaitNode(process=rng.choice(members + missing), task=rng.choice(TASKS)))
            state.waits.append(wait)
        closed.processes.append(ProcessSnapshot(process_id=pid, state=state))
    ends = members + missing
    for src, dst in {(rng.choice(ends), rng.choice(missing)) for _ in range(3)} | {
        (rng.choice(missing), rng.choice(ends)) for _ in range(3)
    }:
        if src == dst:
            continue
        messages = [
            RecordedMessage(payload=b"m", no_wake=rng.random() < 0.3, wakes_task=rng.choice(["", "t0", "t1"]))
            for _ in range(rng.choice([0, 1, 2]))
        ]
        channel = ChannelSnapshot(src=src, dst=dst, sent_before_marker=len(messages), messages=messages)
        if rng.random() < 0.3:  # an acknowledgement in transit back to src
            channel.receiver_acked.CopyFrom(AckPosition(sender_incarnation=1, receiver_incarnation=1, next_seq=2))
            channel.sender_ack_seen.CopyFrom(AckPosition(sender_incarnation=1, receiver_incarnation=1, next_seq=1))
        closed.channels.append(channel)
    del closed.outside_peers[:]
    closed.expected_members[:] = [*closed.expected_members, *missing]
    closed.expected_member_count = 0
    return closed


TASKS = ["", "", "t0", "t1"]
MODELS = [WAIT_MODEL_AND, WAIT_MODEL_OR, 0]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.integers(min_value=0, max_value=2**32))
def test_no_deadlock_on_an_open_cut_survives_any_closing(seed: int) -> None:
    """Deadlock false on an open cut: however the processes it lacks turn out, no member is deadlocked.

    (Processes outside may still deadlock among themselves: the cut says nothing about them.)
    """
    rng = random.Random(seed)
    snapshot = random_snapshot(rng, seed, START)
    snapshot.expected_members.append("W")  # open, whatever else it names
    result = evaluate(snapshot).results[0]
    if verdict(result) != "false":
        return
    members = {p.process_id for p in snapshot.processes}
    for _ in range(5):
        closed = _close(rng, snapshot)
        assert coverage(closed).closed
        deadlocked = evaluate(closed).results[0].deadlock.deadlocked
        assert not [n for n in deadlocked if n.process in members], closed


def test_the_closing_property_sees_enough_open_cuts_decided_false() -> None:
    """The property above is not vacuous: many of its open cuts are decided false, some with waits."""
    decided = []
    for seed in range(300):
        snapshot = random_snapshot(random.Random(seed), seed, START)
        snapshot.expected_members.append("W")
        result = evaluate(snapshot).results[0]
        if verdict(result) == "false":
            decided.append(result.summary)
    assert len(decided) >= 60
    assert sum(" 0 wait edges" not in summary for summary in decided) >= 30


def test_an_or_wait_on_a_process_outside_the_cut_is_never_blocked() -> None:
    # A needs B or X; B needs A; X is outside the cut and may well answer.
    s = GlobalSnapshot(snapshot_id=1, processes=[proc("A", "B", "X", model=WAIT_MODEL_OR), proc("B", "A")])
    result = evaluate(s).results[0]
    assert not result.deadlock.deadlocked
    assert verdict(result) == "unknown"  # no deadlock among members, but X may wait on A


def test_a_baseline_is_taken_only_from_a_closed_cut() -> None:
    partial = GlobalSnapshot(snapshot_id=1, processes=[proc("A", tokens=2)], expected_members=["A", "B"])
    evaluation = evaluate(partial)
    assert verdicts(evaluation)["conservation(tokens)"] == "unknown"
    assert new_baselines(evaluation) == {}
    whole = GlobalSnapshot(snapshot_id=2, processes=[proc("A", tokens=2), proc("B", tokens=3)])
    assert new_baselines(evaluate(whole)) == {"tokens": 5}
