"""The deadlock predicate against an independently written oracle, on random mixed AND/OR snapshots.

The oracle is a naive fixpoint over the declared waits, written from DESIGN.md's words and not
from the graph code: a waiter is released when each of its waits is met; a wait is met when it
has no targets, or (AND) every target is released or has a waking message in flight to the
waiter, or (OR) any one is. A process with waiting tasks and no wait of its own stands for
anything it may do: it is a waiter only on a quiet cut (every process named anywhere is a
member, every expected member reported, none is active, no channel holds a message that is not
``no_wake`` nor an acknowledgement on its way back), where it is released when one of its tasks
is; on any other cut a message may still reach it and make it active, and it is free. Anything
that waits on nothing, and any process outside the cut, is free. A flow-control wait is never
met by a message in flight; its target is met instead when an acknowledgement is on its way back
to the waiter: on the channel from the waiter's process to the target's, the receiver had
acknowledged further at its recording than the sender had seen at its own, both positions known
and of the same incarnations; or when the target will consume: it is a member with no wait of
its own (task "", with a target). Whatever is never released is deadlocked.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from stablewatch.detector.evaluation import evaluate
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
    WaitNode,
)

Node = tuple[str, str]


def oracle(snapshot: GlobalSnapshot) -> set[Node]:
    """The deadlocked waiters of `snapshot`, by plain fixpoint iteration (see the module docstring)."""
    waits: dict[Node, list[Wait]] = {}
    members = {p.process_id for p in snapshot.processes}
    named = set(snapshot.expected_members) | set(snapshot.outside_peers)
    named |= {t.process for p in snapshot.processes for w in p.state.waits for t in w.targets if t.process}
    named |= {c.src for c in snapshot.channels} | {c.dst for c in snapshot.channels}
    closed = named <= members and snapshot.expected_member_count <= len(members)
    for p in snapshot.processes:
        for w in p.state.waits:
            waits.setdefault((p.process_id, w.task), []).append(w)

    def wakes(src: str, dst: str, task: str) -> bool:
        for c in snapshot.channels:
            if c.src == src and c.dst == dst:
                return any(not m.no_wake and m.wakes_task in ("", task) for m in c.messages)
        return False

    def acknowledged(src: str, dst: str) -> bool:
        for c in snapshot.channels:
            if c.src == src and c.dst == dst and c.HasField("receiver_acked") and c.HasField("sender_ack_seen"):
                r, s = c.receiver_acked, c.sender_ack_seen
                same = r.sender_incarnation == s.sender_incarnation and r.receiver_incarnation == s.receiver_incarnation
                return same and r.next_seq > s.next_seq
        return False

    def consumes(process: str) -> bool:
        """A member whose handler is free: it says so (``handler_waits`` false), or says nothing
        (an older agent) and records no wait of its own (task "", with a target)."""
        for p in snapshot.processes:
            if p.process_id == process:
                if p.state.HasField("handler_waits"):
                    return not p.state.handler_waits
                return not any(not w.task and w.targets for w in p.state.waits)
        return False

    quiet = (
        closed
        and not any(p.state.active for p in snapshot.processes)
        and not any(not m.no_wake for c in snapshot.channels for m in c.messages)
        and not any(acknowledged(c.src, c.dst) for c in snapshot.channels)
        # a blocked send whose receiver will consume goes on, and its task may then send anything
        and not any(
            w.flow_control and any(consumes(t.process) for t in w.targets)
            for p in snapshot.processes
            for w in p.state.waits
        )
    )
    passive_with_tasks = {
        p.process_id
        for p in snapshot.processes
        if quiet and any(w.task for w in p.state.waits) and (p.process_id, "") not in waits
    }
    waiters = set(waits) | {(pid, "") for pid in passive_with_tasks}
    released: set[Node] = set()

    def free(node: Node) -> bool:
        return node not in waiters or node in released

    changed = True
    while changed:
        changed = False
        for waiter in sorted(waiters - released):
            pid, task = waiter
            if waiter in waits:
                ok = True
                for w in waits[waiter]:
                    met = [
                        free((t.process, t.task))
                        or (
                            (acknowledged(pid, t.process) or consumes(t.process))
                            if w.flow_control
                            else wakes(t.process, pid, task)
                        )
                        for t in w.targets
                    ]
                    if met and not (any(met) if w.model == WAIT_MODEL_OR else all(met)):
                        ok = False
            else:  # a process with waiting tasks on a quiet cut: released when one of its tasks is
                ok = any(free(t) for t in waits if t[0] == pid and t[1])
            if ok:
                released.add(waiter)
                changed = True
    return waiters - released


@dataclass(frozen=True)
class Shape:
    """Bounds of the random snapshots."""

    processes: int = 5
    tasks: int = 2


@st.composite
def snapshots(draw: st.DrawFn, shape: Shape = Shape()) -> GlobalSnapshot:
    """Random mixed AND/OR waits between processes and tasks, with messages in flight that do and do
    not wake, some aimed at one task (waiting or not), some sent from outside the cut, flow-control
    waits, acknowledgement positions, and targets outside the cut."""
    n = draw(st.integers(2, shape.processes))
    pids = [f"P{i}" for i in range(n)]
    tasks = {pid: [f"t{k}" for k in range(draw(st.integers(0, shape.tasks)))] for pid in pids}
    nodes: list[Node] = [(pid, "") for pid in pids] + [(pid, t) for pid in pids for t in tasks[pid]]
    targets_pool = [*nodes, ("outside", "")]
    processes = []
    for pid in pids:
        state = LocalState(active=draw(st.booleans()))
        handler_waits = draw(st.sampled_from([None, True, False]))  # None: an older agent's
        if handler_waits is not None:
            state.handler_waits = handler_waits
        for task in ["", *tasks[pid]]:
            for _ in range(draw(st.integers(0, 2))):
                targets = draw(st.lists(st.sampled_from(targets_pool), max_size=3, unique=True))
                state.waits.append(
                    Wait(
                        task=task,
                        model=draw(st.sampled_from([WAIT_MODEL_AND, WAIT_MODEL_OR])),
                        targets=[WaitNode(process=p, task=t) for p, t in targets],
                        flow_control=draw(st.booleans()) and draw(st.booleans()),
                    )
                )
        processes.append(ProcessSnapshot(process_id=pid, state=state))
    channels = []
    for src in [*pids, "outside"]:
        for dst in pids:
            if src == dst or not draw(st.booleans()):
                continue
            messages = [
                RecordedMessage(
                    payload=b"m",
                    no_wake=draw(st.booleans()),
                    wakes_task=draw(st.sampled_from(["", "", "other", *tasks[dst]])),
                )
                for _ in range(draw(st.integers(0, 2)))
            ]
            channel = ChannelSnapshot(src=src, dst=dst, sent_before_marker=len(messages), messages=messages)
            # Acknowledgement positions: unknown at either end, or the receiver's behind, level or
            # ahead, of the same incarnations or not.
            seen, ahead = draw(st.integers(0, 3)), draw(st.integers(-1, 2))
            if draw(st.booleans()):
                seen_at_sender = AckPosition(sender_incarnation=1, receiver_incarnation=2, next_seq=seen)
                channel.sender_ack_seen.CopyFrom(seen_at_sender)
            if draw(st.booleans()):
                receiver = draw(st.sampled_from([2, 2, 2, 3]))
                channel.receiver_acked.CopyFrom(
                    AckPosition(sender_incarnation=1, receiver_incarnation=receiver, next_seq=max(0, seen + ahead))
                )
            channels.append(channel)
    return GlobalSnapshot(snapshot_id=1, processes=processes, channels=channels)


def deadlocked(snapshot: GlobalSnapshot) -> set[Node]:
    """The deadlocked process and task nodes the predicate reports (the nodes of individual waits aside)."""
    result = evaluate(snapshot).results[0]
    assert result.name == "deadlock"
    return {(n.process, n.task) for n in result.deadlock.deadlocked if "[wait " not in n.task}


@settings(max_examples=600, deadline=None, derandomize=True)
@given(snapshots())
def test_deadlock_matches_the_oracle(snapshot: GlobalSnapshot) -> None:
    assert deadlocked(snapshot) == oracle(snapshot)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(snapshots())
def test_the_evidence_is_a_cycle_of_blocked_edges_among_deadlocked_nodes(snapshot: GlobalSnapshot) -> None:
    evaluation = evaluate(snapshot)
    evidence = evaluation.results[0].deadlock
    dead = {(n.process, n.task) for n in evidence.deadlocked}
    cycle = [(n.process, n.task) for n in evidence.cycle]
    assert bool(cycle) == bool(dead) == evaluation.results[0].holds
    counted = {
        ((e.waiter.process, e.waiter.task), (e.target.process, e.target.task))
        for e in evaluation.wait_for.edges
        if not e.discounted
    }
    for waiter, target in zip(cycle, cycle[1:] + cycle[:1], strict=True):
        assert waiter in dead and target in dead
        assert (waiter, target) in counted


def _snapshot(*processes: ProcessSnapshot, channels: tuple[ChannelSnapshot, ...] = ()) -> GlobalSnapshot:
    return GlobalSnapshot(snapshot_id=1, processes=processes, channels=channels)


def _waits(pid: str, *waits: Wait) -> ProcessSnapshot:
    return ProcessSnapshot(process_id=pid, state=LocalState(waits=waits))


def _on(*names: str, model: int = WAIT_MODEL_AND) -> Wait:
    return Wait(targets=[WaitNode(process=name) for name in names], model=model)


def test_a_waking_message_from_one_target_releases_an_or_waiter() -> None:
    """The minimal case of issue 9: W waits (OR) on q and r; q and r each wait (AND) on W; a waking
    message from q to W is in flight. W will receive it and wake: no deadlock."""
    snapshot = _snapshot(
        _waits("W", _on("q", "r", model=WAIT_MODEL_OR)),
        _waits("q", _on("W")),
        _waits("r", _on("W")),
        channels=(ChannelSnapshot(src="q", dst="W", sent_before_marker=1, messages=[RecordedMessage(payload=b"x")]),),
    )
    result = evaluate(snapshot).results[0]
    assert not result.holds, result.summary
    assert oracle(snapshot) == set()


def test_a_message_for_another_task_does_not_release_a_wait() -> None:
    """C's task caller and S wait on each other; S's message to C wakes C's task other. caller stays
    deadlocked with S; C itself will be active (other runs), so C's node is not deadlocked."""
    wait = Wait(task="caller", targets=[WaitNode(process="S")])
    snapshot = _snapshot(
        ProcessSnapshot(process_id="C", state=LocalState(waits=[wait])),
        _waits("S", Wait(targets=[WaitNode(process="C", task="caller")])),
        channels=(
            ChannelSnapshot(
                src="S", dst="C", sent_before_marker=1, messages=[RecordedMessage(payload=b"r", wakes_task="other")]
            ),
        ),
    )
    assert deadlocked(snapshot) == {("C", "caller"), ("S", "")} == oracle(snapshot)
    snapshot.channels[0].messages[0].no_wake = True  # a heartbeat: C stays passive, its node blocked
    assert deadlocked(snapshot) == {("C", "caller"), ("C", ""), ("S", "")} == oracle(snapshot)


def test_an_acknowledgement_in_transit_releases_a_flow_control_wait() -> None:
    """The race: S is blocked sending to R (R held the window); R consumed and acknowledged before
    it recorded, the acknowledgement not yet at S when S recorded; then R waited on S."""
    blocked = Wait(targets=[WaitNode(process="R")], flow_control=True)
    channel = ChannelSnapshot(src="S", dst="R", sent_before_marker=4, received_before_recording=4)
    channel.sender_ack_seen.CopyFrom(AckPosition(sender_incarnation=1, receiver_incarnation=2, next_seq=2))
    channel.receiver_acked.CopyFrom(AckPosition(sender_incarnation=1, receiver_incarnation=2, next_seq=4))
    snapshot = _snapshot(_waits("S", blocked), _waits("R", _on("S")), channels=(channel,))
    assert deadlocked(snapshot) == set() == oracle(snapshot)
    channel = snapshot.channels[0]
    channel.receiver_acked.next_seq = 2  # every acknowledgement arrived: R holds the window
    assert deadlocked(snapshot) == {("S", ""), ("R", "")} == oracle(snapshot)
