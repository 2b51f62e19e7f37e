"""The wait-for graph of a snapshot: nodes, models, the process-over-tasks rule, the in-flight and
acknowledgement rules."""

import pytest

from stablewatch.detector.evaluation.deadlock import AND, OR
from stablewatch.detector.evaluation.dot import wait_for_dot
from stablewatch.detector.evaluation.waitfor import (
    acks_in_transit,
    build_wait_for,
    find_deadlock,
    label,
    to_proto,
    waking_channels,
)
from stablewatch.v1 import (
    WAIT_MODEL_AND,
    WAIT_MODEL_OR,
    AckPosition,
    ChannelSnapshot,
    GlobalSnapshot,
    LocalState,
    ProcessSnapshot,
    RecordedMessage,
    Wait,
    WaitModel,
    WaitNode,
)


def node(text: str) -> WaitNode:
    process, _, task = text.partition("/")
    return WaitNode(process=process, task=task)


def wait(targets: str, task: str = "", model: WaitModel = WAIT_MODEL_AND) -> Wait:
    return Wait(task=task, targets=[node(t) for t in targets.split()], model=model)


def proc(pid: str, *waits: Wait, active: bool = False) -> ProcessSnapshot:
    return ProcessSnapshot(process_id=pid, state=LocalState(active=active, waits=waits))


def chan(src: str, dst: str, *no_wake: bool) -> ChannelSnapshot:
    messages = [RecordedMessage(payload=b"m", no_wake=flag) for flag in no_wake]
    return ChannelSnapshot(src=src, dst=dst, sent_before_marker=len(messages), messages=messages)


def snapshot(*processes: ProcessSnapshot, channels: tuple[ChannelSnapshot, ...] = ()) -> GlobalSnapshot:
    return GlobalSnapshot(snapshot_id=7, processes=processes, channels=channels)


def three_cycle(*channels: ChannelSnapshot) -> GlobalSnapshot:
    return snapshot(proc("P1", wait("P2")), proc("P2", wait("P3")), proc("P3", wait("P1")), channels=channels)


def test_processes_waiting_in_a_cycle() -> None:
    wf = build_wait_for(three_cycle())
    assert wf.snapshot_id == 7
    assert sorted(wf.graph.edges) == [
        (("P1", ""), ("P2", "")),
        (("P2", ""), ("P3", "")),
        (("P3", ""), ("P1", "")),
    ]
    assert all(m == AND for _, m in wf.graph.nodes(data="model"))
    found = find_deadlock(wf)
    assert found.deadlocked == [("P1", ""), ("P2", ""), ("P3", "")]
    assert found.cycle == [("P1", ""), ("P2", ""), ("P3", "")]
    assert found.knot == []
    assert found.empty_channels == [("P2", "P1"), ("P3", "P2"), ("P1", "P3")]


def test_cycle_is_rotated_to_its_smallest_node() -> None:
    wf = build_wait_for(snapshot(proc("Z", wait("B")), proc("B", wait("C")), proc("C", wait("B"))))
    assert find_deadlock(wf).cycle == [("B", ""), ("C", "")]


def test_tasks_are_nodes() -> None:
    # P1/a -> P2/x -> P1/b -> P1/a: two tasks of P1 in a cycle with a task of P2.
    s = snapshot(
        proc("P1", wait("P2/x", task="a"), wait("P1/a", task="b"), active=True),
        proc("P2", wait("P1/b", task="x"), active=True),
    )
    found = find_deadlock(build_wait_for(s))
    assert found.deadlocked == [("P1", "a"), ("P1", "b"), ("P2", "x")]
    assert found.cycle == [("P1", "a"), ("P2", "x"), ("P1", "b")]
    # P1/b -> P1/a stays inside P1: no channel.
    assert found.empty_channels == [("P2", "P1"), ("P1", "P2")]


def test_a_task_that_waits_on_nothing_is_free() -> None:
    s = snapshot(proc("P1", wait("P2/idle", task="a")), proc("P2", wait("P1/a", task="busy")))
    assert find_deadlock(build_wait_for(s)).deadlocked == []


def test_unknown_target_is_free() -> None:
    assert find_deadlock(build_wait_for(snapshot(proc("P1", wait("ghost"))))).deadlocked == []


def test_passive_process_is_an_or_waiter_over_its_tasks() -> None:
    # P2 waits on P1 itself; P1 is passive, its tasks a and b both wait on P2.
    s = snapshot(proc("P1", wait("P2", task="a"), wait("P2", task="b")), proc("P2", wait("P1")))
    wf = build_wait_for(s)
    assert wf.graph.nodes["P1", ""]["model"] == OR
    assert set(wf.graph.successors(("P1", ""))) == {("P1", "a"), ("P1", "b")}
    assert find_deadlock(wf).deadlocked == [("P1", ""), ("P1", "a"), ("P1", "b"), ("P2", "")]


def test_passive_process_progresses_if_one_task_can() -> None:
    s = snapshot(proc("P1", wait("P2", task="a"), wait("P3", task="b")), proc("P2", wait("P1")))
    assert find_deadlock(build_wait_for(s)).deadlocked == []


def test_active_process_with_waiting_tasks_is_free() -> None:
    s = snapshot(proc("P1", wait("P2", task="a"), active=True), proc("P2", wait("P1")))
    wf = build_wait_for(s)
    assert "model" not in wf.graph.nodes["P1", ""]
    assert find_deadlock(wf).deadlocked == []


def test_own_wait_beats_the_task_rule() -> None:
    s = snapshot(proc("P1", wait("P2"), wait("P3", task="a")), proc("P2", wait("P1")))
    wf = build_wait_for(s)
    assert list(wf.graph.successors(("P1", ""))) == [("P2", "")]
    assert find_deadlock(wf).deadlocked == [("P1", ""), ("P2", "")]


def test_and_waits_of_one_waiter_merge_exactly() -> None:
    s = snapshot(proc("P1", wait("P2", model=WAIT_MODEL_AND), wait("P3 P2", model=WaitModel.WAIT_MODEL_UNSPECIFIED)))
    wf = build_wait_for(s)
    assert wf.graph.nodes["P1", ""]["model"] == AND
    assert sorted(wf.graph.successors(("P1", ""))) == [("P2", ""), ("P3", "")]


@pytest.mark.parametrize("second", [WAIT_MODEL_OR, WAIT_MODEL_AND])
def test_several_waits_with_an_or_wait_each_need_to_be_met(second: WaitModel) -> None:
    # P1 needs P2, and one of P3 or P4. P4 is free, P3 waits on P1: with merged targets (AND
    # over P2, P3, P4) P1 and P3 would look deadlocked, though P1 only waits for P2 and P4.
    s = snapshot(proc("P1", wait("P3 P4", model=WAIT_MODEL_OR), wait("P2", model=second)), proc("P3", wait("P1")))
    wf = build_wait_for(s)
    assert wf.graph.nodes["P1", ""]["model"] == AND
    assert sorted(wf.graph.successors(("P1", ""))) == [("P1", "[wait 1]"), ("P1", "[wait 2]")]
    assert wf.graph.nodes["P1", "[wait 1]"]["model"] == OR
    assert find_deadlock(wf).deadlocked == []
    # With P4 gone from the OR wait, P1 and P3 wait on each other: a real deadlock.
    s = snapshot(proc("P1", wait("P3", model=WAIT_MODEL_OR), wait("P2", model=second)), proc("P3", wait("P1")))
    assert ("P1", "") in find_deadlock(build_wait_for(s)).deadlocked


def test_unspecified_model_is_and() -> None:
    s = snapshot(proc("P1", wait("P2 P3", model=WaitModel.WAIT_MODEL_UNSPECIFIED)), proc("P2", wait("P1")))
    assert find_deadlock(build_wait_for(s)).deadlocked == [("P1", ""), ("P2", "")]


def test_or_knot_from_a_snapshot() -> None:
    s = snapshot(
        proc("P1", wait("P2 P3", model=WAIT_MODEL_OR)),
        proc("P2", wait("P1", model=WAIT_MODEL_OR)),
        proc("P3", wait("P1", model=WAIT_MODEL_OR)),
        proc("P4", wait("P1 P5", model=WAIT_MODEL_OR)),
        proc("P5", wait("P4", model=WAIT_MODEL_OR)),
    )
    found = find_deadlock(build_wait_for(s))
    assert len(found.deadlocked) == 5
    assert found.knot == [("P1", ""), ("P2", ""), ("P3", "")]


def test_message_in_flight_prevents_a_false_deadlock() -> None:
    wf = build_wait_for(three_cycle(chan("P2", "P1", False)))
    assert wf.discounted == ((("P1", ""), ("P2", "")),)
    assert not wf.graph.has_edge(("P1", ""), ("P2", ""))
    assert find_deadlock(wf).deadlocked == []


def test_heartbeat_in_flight_does_not_prevent_the_deadlock() -> None:
    wf = build_wait_for(three_cycle(chan("P2", "P1", True, True)))
    assert wf.discounted == ()
    assert find_deadlock(wf).deadlocked == [("P1", ""), ("P2", ""), ("P3", "")]
    assert waking_channels(three_cycle(chan("P2", "P1", True, False))) == {("P2", "P1")}


def test_message_in_the_other_direction_does_not_count() -> None:
    wf = build_wait_for(three_cycle(chan("P1", "P2", False)))
    assert find_deadlock(wf).deadlocked == [("P1", ""), ("P2", ""), ("P3", "")]


def test_in_flight_rule_discounts_every_task_of_the_receiver() -> None:
    s = snapshot(
        proc("P1", wait("P2/x", task="a"), wait("P2/x", task="b")),
        proc("P2", wait("P1/a P1/b", task="x")),
        channels=(chan("P2", "P1", False),),
    )
    wf = build_wait_for(s)
    assert set(wf.discounted) == {(("P1", "a"), ("P2", "x")), (("P1", "b"), ("P2", "x"))}
    assert find_deadlock(wf).deadlocked == []


@pytest.mark.parametrize("into_cycle", [True, False])
def test_ten_thousand_long_chain_of_processes(into_cycle: bool) -> None:
    n = 10_000
    processes = [proc(f"P{i}", wait(f"P{i + 1}")) for i in range(n)]
    processes.append(proc(f"P{n}", wait("P0" if into_cycle else "free")))
    wf = build_wait_for(snapshot(*processes))
    found = find_deadlock(wf)
    assert len(found.deadlocked) == (n + 1 if into_cycle else 0)
    assert len(found.cycle) == (n + 1 if into_cycle else 0)
    assert len(to_proto(wf, found).edges) == n + 1
    dot = wait_for_dot(to_proto(wf, found))
    assert dot.count("fontcolor=red") == dot.count("penwidth=2") == (n + 1 if into_cycle else 0)


def test_to_proto() -> None:
    s = snapshot(
        proc("P1", wait("P2 P3", model=WAIT_MODEL_OR)),
        proc("P2", wait("P1")),
        channels=(chan("P3", "P1", False),),
    )
    message = to_proto(build_wait_for(s))
    assert message.snapshot_id == 7
    assert [(n.process, n.task) for n in message.nodes] == [("P1", ""), ("P2", ""), ("P3", "")]
    edges = {(e.waiter.process, e.target.process): (e.model, e.discounted) for e in message.edges}
    # P1 needs P2 or P3, and a waking message from P3 is on its way: P1 is released, all its
    # edges are set aside, and P2 (waiting on P1) is not deadlocked either.
    assert edges == {
        ("P1", "P2"): (WAIT_MODEL_OR, True),
        ("P2", "P1"): (WAIT_MODEL_AND, False),
        ("P1", "P3"): (WAIT_MODEL_OR, True),
    }
    assert not message.deadlock.deadlocked

    s = snapshot(proc("P1", wait("P2 P3", model=WAIT_MODEL_OR)), proc("P2", wait("P1")), proc("P3", wait("P1")))
    evidence = to_proto(build_wait_for(s)).deadlock
    assert [n.process for n in evidence.deadlocked] == ["P1", "P2", "P3"]
    assert [n.process for n in evidence.cycle] == ["P1", "P2"]
    assert [n.process for n in evidence.knot] == ["P1", "P2", "P3"]
    assert [(c.src, c.dst) for c in evidence.empty_channels] == [("P2", "P1"), ("P1", "P2")]
    assert evidence.separate_deadlocks == 1


def test_to_dot() -> None:
    s = snapshot(
        proc("P1", wait("P2")),
        proc("P2", wait('q"x', model=WAIT_MODEL_OR), wait("P1", task="t")),
        proc("P3", wait("P2")),
        channels=(chan("P2", "P3", False),),
    )
    dot = wait_for_dot(to_proto(build_wait_for(s)))
    assert dot.startswith('digraph "waitfor 7" {')
    # Nodes are n0, n1, ... in (process, task) order: P1, P2, P2/t, P3, q"x; the name is the label.
    assert 'n0 [label="P1"];' in dot  # not deadlocked: P2 is an OR waiter with a free target
    assert 'n1 [label="P2", shape=diamond];' in dot
    assert 'n4 [label="q\\"x"];' in dot
    assert 'n3 -> n1 [style=dashed, color=grey, label="in flight"];' in dot

    dot = wait_for_dot(to_proto(build_wait_for(three_cycle())))
    assert 'n0 [label="P1", color=red, fontcolor=red];' in dot
    assert "n2 -> n0 [color=red, penwidth=2];" in dot


def test_label() -> None:
    assert label(("P1", "")) == "P1"
    assert label(("P1", "t")) == "P1/t"
    # An RPC call's task starts with its method's slash: no doubled slash.
    assert label(("orders", "/shop.Orders/Place#client:1")) == "orders /shop.Orders/Place#client:1"


# -- the acknowledgement rule: a flow-control wait with an acknowledgement in transit ----------


def ack(next_seq: int, sender: int = 1, receiver: int = 2) -> AckPosition:
    return AckPosition(sender_incarnation=sender, receiver_incarnation=receiver, next_seq=next_seq)


def ack_race(acked: AckPosition | None, seen: AckPosition | None) -> GlobalSnapshot:
    """S's send is blocked on R's full window (flow control), R waits on S, channel S -> R is empty,
    with the acknowledgement positions of S -> R at the two recordings."""
    blocked = Wait(targets=[node("R")], model=WAIT_MODEL_AND, flow_control=True)
    channel = ChannelSnapshot(src="S", dst="R", sent_before_marker=5, received_before_recording=5)
    if acked is not None:
        channel.receiver_acked.CopyFrom(acked)
    if seen is not None:
        channel.sender_ack_seen.CopyFrom(seen)
    return snapshot(proc("S", blocked), proc("R", wait("S")), channels=(channel,))


def test_an_acknowledgement_in_transit_releases_a_flow_control_wait() -> None:
    # R consumed its queue and acknowledged up to 6 before recording; S had seen only 3.
    race = ack_race(ack(6), ack(3))
    assert acks_in_transit(race) == {("S", "R")}
    wf = build_wait_for(race)
    assert list(wf.graph.edges) == [(("R", ""), ("S", ""))]
    assert wf.discounted == ((("S", ""), ("R", "")),)
    assert find_deadlock(wf).deadlocked == []
    edges = {(label(e.waiter), label(e.target)): e.discounted for e in to_proto(wf).edges}
    assert edges == {("R", "S"): False, ("S", "R"): True}


@pytest.mark.parametrize(
    ("acked", "seen"),
    [
        (ack(3), ack(3)),  # S has seen every acknowledgement: R holds the window
        (ack(3), ack(6)),  # S is ahead (R's recording came first): nothing in transit
        (ack(6, receiver=9), ack(3)),  # R restarted: positions of different incarnations
        (ack(6, sender=9), ack(3)),  # S restarted
        (ack(6), None),  # S had received no acknowledgement
        (None, ack(3)),  # R had sent none (or its part carries none)
        (None, None),  # agents that do not report positions
    ],
)
def test_without_an_acknowledgement_in_transit_the_flow_control_cycle_is_a_deadlock(
    acked: AckPosition | None, seen: AckPosition | None
) -> None:
    wf = build_wait_for(ack_race(acked, seen))
    assert wf.discounted == ()
    assert wf.graph.edges[("S", ""), ("R", "")] == {"flow_control": True}
    deadlock = find_deadlock(wf)
    assert deadlock.deadlocked == [("R", ""), ("S", "")]
    assert deadlock.empty_channels == [("S", "R")]  # R -> S only: the flow-control edge names no channel


def test_an_acknowledgement_satisfies_flow_control_waits_only() -> None:
    # S waits on R for a message (not flow control): an acknowledgement to S wakes no one.
    race = ack_race(ack(6), ack(3))
    race.processes[0].state.waits[0].flow_control = False
    race.processes[0].state.waits[0].targets[0].process = "R"
    wf = build_wait_for(race)
    assert wf.discounted == ()
    assert find_deadlock(wf).deadlocked == [("R", ""), ("S", "")]
    # And an acknowledgement on R -> S (the other direction) does not release S's wait on R.
    race = ack_race(None, None)
    race.channels.append(ChannelSnapshot(src="R", dst="S", receiver_acked=ack(6), sender_ack_seen=ack(3)))
    assert find_deadlock(build_wait_for(race)).deadlocked == [("R", ""), ("S", "")]
