"""A process node stands for its tasks only on a cut that no message can reach (the quiet rule).

A wait on a whole process ``(P, "")`` (a process with waiting tasks and no wait of its own) is met
as soon as P is active, and a passive process becomes active on receiving any message. A first
review found deadlock true beside "not terminated, this message will wake B" for A waiting on
process B, B passive with a task waiting on A, and a message in flight to B; the fix freed B's
node for a message in flight to it. A second review found that was not enough: with another
process active (or outside the cut, which may be running), B's node was held blocked on one cut
and freed on the next, once that process had sent B a message (a deadlock true, then false: not
stable, so never proven). The quiet rule (waitfor's module doc): the node is an OR over P's tasks
only on a closed cut with no member active and no waking message anywhere; on any other it is
free. This file pins the rule: the reviewers' cases, each side of it, the same answers from the
columnar evaluation and through the detector's assembly, and a property over random cuts: a
deadlocked implicit process node comes only with a quiet cut.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from snapshot_gen import START, random_snapshot, rows_of

from stablewatch.detector.assembly import Assembler, Completed
from stablewatch.detector.evaluation import choose_victims, evaluate, verdict
from stablewatch.detector.evaluation.columnar import evaluate_rows
from stablewatch.v1 import (
    WAIT_MODEL_AND,
    WAIT_MODEL_OR,
    AckPosition,
    ChannelSnapshot,
    Evaluation,
    GlobalSnapshot,
    InboundChannelState,
    LocalSnapshotPart,
    LocalState,
    PredicateResult,
    ProcessSnapshot,
    RecordedMessage,
    Wait,
    WaitNode,
)

Node = tuple[str, str]


def _on(*targets: str, task: str = "", model: int = WAIT_MODEL_AND, instance: int = 0) -> Wait:
    """A wait of `task` on `targets` (``"P"`` or ``"P/task"``)."""
    nodes = [WaitNode(process=p, task=t) for p, _, t in (target.partition("/") for target in targets)]
    return Wait(task=task, targets=nodes, model=model, instance=instance, began_at_us=instance)


def _proc(pid: str, *waits: Wait, active: bool = False) -> ProcessSnapshot:
    return ProcessSnapshot(process_id=pid, state=LocalState(active=active, waits=waits))


def _message(src: str, dst: str, *, wakes_task: str = "", no_wake: bool = False) -> ChannelSnapshot:
    message = RecordedMessage(payload=b"m", wakes_task=wakes_task, no_wake=no_wake)
    return ChannelSnapshot(src=src, dst=dst, sent_before_marker=1, messages=[message])


def _cut(*processes: ProcessSnapshot, channels: tuple[ChannelSnapshot, ...] = ()) -> GlobalSnapshot:
    return GlobalSnapshot(snapshot_id=5, processes=processes, channels=channels)


def _reviewers_cut(sender: str, wakes_task: str, *, no_wake: bool = False, b_active: bool = False) -> GlobalSnapshot:
    """A waits on process B; B is passive (unless `b_active`), its task t waits on A; C is a passive
    member without waits; a message from `sender` to B is in flight."""
    return _cut(
        _proc("A", _on("B", instance=1)),
        _proc("B", _on("A", task="t", instance=2), active=b_active),
        _proc("C"),
        channels=(_message(sender, "B", wakes_task=wakes_task, no_wake=no_wake),),
    )


def _evaluated(snapshot: GlobalSnapshot) -> Evaluation:
    """The detector's evaluation of `snapshot`, checked to be the columnar evaluation's too."""
    evaluation = evaluate(snapshot)
    columnar = evaluate_rows(rows_of(snapshot))
    assert [r.SerializeToString(deterministic=True) for r in columnar] == [
        r.SerializeToString(deterministic=True) for r in evaluation.results
    ]
    return evaluation


def _deadlocked(result: PredicateResult) -> set[Node]:
    return {(n.process, n.task) for n in result.deadlock.deadlocked}


def _busy_receivers(result: PredicateResult) -> set[str]:
    """The processes that termination's evidence says a recorded message will wake."""
    return {c.dst for c in result.termination.busy_channels}


# -- the reviewer's case ------------------------------------------------------------------------------------


@pytest.mark.parametrize("wakes_task", ["", "t", "u"])  # any wait of B, B's waiting task, another task of B
@pytest.mark.parametrize("sender", ["A", "C", "X"])  # the target, another member, a process outside the cut
def test_a_message_that_will_wake_the_passive_process_ends_its_deadlock(sender: str, wakes_task: str) -> None:
    snapshot = _reviewers_cut(sender, wakes_task)
    evaluation = _evaluated(snapshot)
    deadlock, termination = evaluation.results[0], evaluation.results[1]
    assert verdict(termination) == "false"
    assert _busy_receivers(termination) == {"B"}
    assert verdict(deadlock) != "true", deadlock.summary
    assert _deadlocked(deadlock) == set()
    assert choose_victims(snapshot, evaluation.wait_for, "youngest") == []
    # B counts as active: its node is free, no OR over its tasks (no edge out of it, counted or not).
    assert [e for e in evaluation.wait_for.edges if (e.waiter.process, e.waiter.task) == ("B", "")] == []


# -- each side of the rule ----------------------------------------------------------------------------------


def test_without_a_message_the_deadlock_stands() -> None:
    evaluation = _evaluated(_cut(_proc("A", _on("B")), _proc("B", _on("A", task="t")), _proc("C")))
    assert verdict(evaluation.results[0]) == "true"
    assert _deadlocked(evaluation.results[0]) == {("A", ""), ("B", ""), ("B", "t")}
    assert verdict(evaluation.results[1]) == "true"  # everyone passive, nothing in flight


@pytest.mark.parametrize("wakes_task", ["", "t"])
def test_a_message_that_wakes_no_one_keeps_the_deadlock(wakes_task: str) -> None:
    evaluation = _evaluated(_reviewers_cut("C", wakes_task, no_wake=True))
    assert verdict(evaluation.results[0]) == "true"
    assert _deadlocked(evaluation.results[0]) == {("A", ""), ("B", ""), ("B", "t")}
    assert verdict(evaluation.results[1]) == "true"  # a heartbeat wakes no one


def test_an_active_process_anywhere_frees_every_process_node() -> None:
    # A and B as above; C is active. C may send B a message at any time, waking B, so the cycle
    # through B's node is not stable: neither this cut nor the next, after C sent, says true.
    processes = (_proc("A", _on("B", instance=1)), _proc("B", _on("A", task="t", instance=2)))
    before = _evaluated(_cut(*processes, _proc("C", active=True)))
    after = _evaluated(_cut(*processes, _proc("C", active=True), channels=(_message("C", "B"),)))
    for evaluation in (before, after):
        assert verdict(evaluation.results[0]) == "false", evaluation.results[0].summary
        assert choose_victims(_cut(*processes), evaluation.wait_for, "youngest") == []
    # B itself active: free, with the message and without it.
    for channels in ((), (_message("C", "B"),)):
        snapshot = _cut(_proc("A", _on("B")), _proc("B", _on("A", task="t"), active=True), channels=channels)
        assert verdict(_evaluated(snapshot).results[0]) == "false"
    # Tasks keep their own waits whatever is active: a cycle of tasks stands.
    tasks = _cut(_proc("A", _on("B/t", task="a")), _proc("B", _on("A/a", task="t")), _proc("C", active=True))
    assert _deadlocked(_evaluated(tasks).results[0]) == {("A", "a"), ("B", "t")}


def test_a_waking_message_from_outside_the_cut_is_not_lost_through_the_assembly() -> None:
    # B recorded a message from X, which is not a member: assembly keeps only the channels between
    # members, but the cut is open (X may be running, and will wake B), so B's node is free.
    assembler = Assembler()
    assembler.begin(1, ["A", "B"])
    a_state = LocalState(waits=[Wait(task="a1", targets=[WaitNode(process="B")], instance=1, began_at_us=10)])
    b_state = LocalState(waits=[Wait(task="b1", targets=[WaitNode(process="A")], instance=2, began_at_us=20)])
    assert assembler.add_part(LocalSnapshotPart(snapshot_id=1, process_id="A", state=a_state)) is None
    part = LocalSnapshotPart(snapshot_id=1, process_id="B", state=b_state)
    part.inbound.append(InboundChannelState(src="X", messages=[RecordedMessage(payload=b"go")]))
    done = assembler.add_part(part)
    assert isinstance(done, Completed) and list(done.snapshot.outside_peers) == ["X"]
    evaluation = _evaluated(done.snapshot)
    assert verdict(evaluation.results[0]) != "true", evaluation.results[0].summary
    assert choose_victims(done.snapshot, evaluation.wait_for, "youngest") == []


def test_an_open_cut_whose_members_are_all_quiet_leaves_waits_on_whole_processes_unknown() -> None:
    # Closed, with X passive and nothing in flight, the cut is quiet and A and B are deadlocked.
    # Without X's part (expected by name or by number), that is what X decides: neither true
    # (X may be running) nor false.
    a, b = _proc("A", _on("B", instance=1)), _proc("B", _on("A", task="t", instance=2))
    assert verdict(_evaluated(_cut(a, b, _proc("X"))).results[0]) == "true"
    for open_cut in (
        GlobalSnapshot(snapshot_id=5, processes=[a, b], expected_members=["A", "B", "X"]),
        GlobalSnapshot(snapshot_id=5, processes=[a, b], expected_member_count=3),
    ):
        result = _evaluated(open_cut).results[0]
        assert verdict(result) == "unknown", result.summary
        assert "whether those processes are ever woken depends on the processes outside it" in result.summary


def test_an_acknowledgement_in_transit_keeps_the_cut_from_being_quiet() -> None:
    # X's send to Y is released by an acknowledgement on its way back: X will run again, and may
    # send B a message, so A's wait on process B is not blocked for good.
    blocked = Wait(task="x", targets=[WaitNode(process="Y")], flow_control=True, instance=3, began_at_us=3)
    channel = ChannelSnapshot(src="X", dst="Y", sent_before_marker=5, received_before_recording=5)
    channel.receiver_acked.CopyFrom(AckPosition(sender_incarnation=1, receiver_incarnation=2, next_seq=6))
    channel.sender_ack_seen.CopyFrom(AckPosition(sender_incarnation=1, receiver_incarnation=2, next_seq=3))
    y = _proc("Y")
    y.state.handler_waits = True  # Y's handler is in a run that waits: it takes nothing queued
    processes = (_proc("A", _on("B", instance=1)), _proc("B", _on("A", task="t", instance=2)), y)
    evaluation = _evaluated(_cut(*processes, _proc("X", blocked), channels=(channel,)))
    assert verdict(evaluation.results[0]) == "false", evaluation.results[0].summary
    # Without the acknowledgement nothing is on its way: the cut is quiet, and A and B are deadlocked.
    channel.ClearField("receiver_acked")
    assert verdict(_evaluated(_cut(*processes, _proc("X", blocked), channels=(channel,))).results[0]) == "true"
    # Unless Y's handler will take what is queued: then Y acknowledges, and X's send goes on.
    y.state.handler_waits = False
    assert verdict(_evaluated(_cut(*processes, _proc("X", blocked), channels=(channel,))).results[0]) == "false"


def test_a_wait_the_process_declares_is_met_only_by_its_targets() -> None:
    """The rule is about a passive process's implicit node: a wait that B declares itself is met by
    the in-flight rule alone (a message from one of its targets). B will take C's message, and still
    wait on A: deadlock and "not terminated" are both true."""
    snapshot = _cut(_proc("A", _on("B")), _proc("B", _on("A")), _proc("C"), channels=(_message("C", "B"),))
    evaluation = _evaluated(snapshot)
    assert verdict(evaluation.results[0]) == "true"
    assert _deadlocked(evaluation.results[0]) == {("A", ""), ("B", "")}
    assert verdict(evaluation.results[1]) == "false"


@pytest.mark.parametrize("wakes_task", ["", "t", "u"])
def test_a_message_frees_the_process_node_not_its_tasks(wakes_task: str) -> None:
    """B will be active, so a wait on B itself is not blocked; but B's task t waits on A's task a,
    which waits on t: the message from C meets neither wait, and they stay deadlocked."""
    snapshot = _cut(
        _proc("A", _on("B/t", task="a"), _on("B", task="b")),
        _proc("B", _on("A/a", task="t")),
        _proc("C"),
        channels=(_message("C", "B", wakes_task=wakes_task),),
    )
    evaluation = _evaluated(snapshot)
    assert verdict(evaluation.results[0]) == "true"
    assert _deadlocked(evaluation.results[0]) == {("A", "a"), ("B", "t")}
    assert verdict(evaluation.results[1]) == "false"


def test_an_or_wait_on_a_process_a_message_will_wake_is_released_too() -> None:
    snapshot = _cut(
        _proc("A", _on("B", "C", model=WAIT_MODEL_OR)),
        _proc("B", _on("A", task="t")),
        _proc("C", _on("A")),
        channels=(_message("C", "B", wakes_task="t"),),  # from C, naming t: meets no wait; wakes B
    )
    assert verdict(_evaluated(snapshot).results[0]) == "false"


# -- the rule over random cuts ------------------------------------------------------------------------------


def _implicit(snapshot: GlobalSnapshot) -> set[str]:
    """The processes whose node ``(P, "")`` is the OR over their tasks: no wait of their own, some task waiting."""
    tasks = {p.process_id for p in snapshot.processes for w in p.state.waits if w.task}
    own = {p.process_id for p in snapshot.processes for w in p.state.waits if not w.task}
    return tasks - own


def _assert_the_rule_holds(snapshot: GlobalSnapshot) -> None:
    """The rule as a property of one cut: a deadlocked implicit node ``(P, "")`` comes only with a
    quiet cut: closed, no member active, and no channel that termination's evidence lists as busy
    (none holds a message that will wake its receiver). So a deadlock never holds a process blocked
    as a process while anything could still send it a message."""
    evaluation = _evaluated(snapshot)
    deadlock, termination = evaluation.results[0], evaluation.results[1]
    blocked = {p for p, t in _deadlocked(deadlock) if not t} & _implicit(snapshot)
    if blocked:
        assert evaluation.coverage.closed, deadlock.summary
        assert not any(p.state.active for p in snapshot.processes), deadlock.summary
        assert not _busy_receivers(termination), (deadlock.summary, termination.summary)


@st.composite
def _around_passive_processes(draw: st.DrawFn) -> GlobalSnapshot:
    """Random cuts built around the reviewer's shape: processes waiting on each other's process
    nodes and tasks, AND and OR, mostly passive, with task waits and no own wait, and messages in
    flight that wake any wait, one task (waiting or not), or nobody, from members and outsiders."""
    pids = [f"P{i}" for i in range(draw(st.integers(2, 5)))]
    nodes = [f"{p}{t}" for p in pids for t in ("", "", "/t", "/u")]
    processes = []
    for pid in pids:
        waits = []
        for task in draw(st.lists(st.sampled_from(["", "t", "t", "u"]), max_size=3)):
            targets = draw(st.lists(st.sampled_from([*nodes, "X"]), min_size=1, max_size=2, unique=True))
            waits.append(_on(*targets, task=task, model=draw(st.sampled_from([WAIT_MODEL_AND, WAIT_MODEL_OR]))))
        processes.append(_proc(pid, *waits, active=draw(st.integers(0, 4)) == 0))
    channels = []
    for src, dst in draw(st.lists(st.tuples(st.sampled_from([*pids, "X"]), st.sampled_from(pids)), unique=True)):
        if src == dst:
            continue
        messages = [
            RecordedMessage(payload=b"m", no_wake=draw(st.integers(0, 2)) == 0, wakes_task=wakes)
            for wakes in draw(st.lists(st.sampled_from(["", "t", "u", "v"]), max_size=2))
        ]
        channels.append(ChannelSnapshot(src=src, dst=dst, sent_before_marker=len(messages), messages=messages))
    return _cut(*processes, channels=tuple(channels))


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(_around_passive_processes())
def test_a_deadlocked_process_node_comes_only_with_a_quiet_cut(snapshot: GlobalSnapshot) -> None:
    _assert_the_rule_holds(snapshot)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_a_deadlocked_process_node_comes_only_with_a_quiet_cut_in_generated_snapshots(seed: int) -> None:
    _assert_the_rule_holds(random_snapshot(random.Random(seed), 1, START))
