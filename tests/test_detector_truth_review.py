"""What the detector claims about a completed snapshot, where a review found it untrue.

Each of these was shown by a test here that failed before its fix:

* RPC mode: the assembler proved a channel towards an RPC-mode member from the two states alone
  when its sender counted nothing (``n = 0``), but such a member reports each channel only after
  it checked the count against its own view of the sender (the same session, the same
  incarnation): a count of a newer session is no proof, and a message of the old one may still be
  on its way. The cut came out whole with that message missing (``Assembler.begin(confirmed_by=)``).
* The victim of a deadlock could be a wait whose wake-up was in flight, chosen because another
  wait of its node on the same target (a blocked send) kept the edge counted: the wrong wait
  broken, the deadlock left whole, and a later cut choosing another wait (victims).
* A wait target without a process was a free node outside the cut, so it released an OR wait: a
  closed cut said "no deadlock" over a real one (assembly refuses it).
* A task named as the wait-for graph names one wait of a task (``"x[wait 1]"``) was merged with
  that node: a wait on such a task was taken for a wait on another wait (assembly refuses it).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from rpc_world import Scenario, Tally, World, check_cut, scenarios

from stablewatch.detector.assembly import Assembler, Completed, PartRejected
from stablewatch.detector.evaluation import POLICIES, choose_victims, evaluate, verdict
from stablewatch.v1 import (
    WAIT_MODEL_AND,
    WAIT_MODEL_OR,
    AckPosition,
    ChannelSnapshot,
    GlobalSnapshot,
    InboundChannelState,
    LocalSnapshotPart,
    LocalState,
    OutboundCount,
    ProcessSnapshot,
    RecordedMessage,
    Wait,
    WaitNode,
)

SNAPSHOT = 11

# -- RPC mode: a channel towards a member that confirms its channels ---------------------------------------


class AssembledWorld(World):
    """RPC mode's simulator (rpc_world) with the detector's own :class:`Assembler` deciding when a
    cut is whole, every process in RPC mode; the oracle then checks each cut it returned.

    rpc_world's detector waits for the receiver's report of every channel a sender counted; the
    coordinator hands the parts to the assembler and forwards the counts of those it accepts.
    """

    def __init__(self, scenario: Scenario) -> None:
        super().__init__(scenario)
        self.assembler = Assembler()

    def start(self, x: int, y: int) -> None:
        super().start(x, y)
        self.assembler.begin(len(self.snapshots), self.names, confirmed_by=self.names)

    def take_part(self, name: str, part: LocalSnapshotPart) -> None:
        tally = self.snapshots[part.snapshot_id]
        if tally.outcome is not None:
            return  # late: the snapshot ended
        try:
            outcome = self.assembler.add_part(part, sender=name)
        except PartRejected as rejected:
            assert rejected.aborted is not None, rejected  # the cores send nothing malformed
            self.end(part.snapshot_id, "failed")
            return
        _keep(tally, name, part)
        for count in part.outbound:
            forwarded = (name, count.sent_before_marker, self.cores[name].incarnation, count.session)
            self.control[0, count.dst].append(("target", part.snapshot_id, *forwarded))
        if isinstance(outcome, Completed):
            tally.across_resets = self.resets > tally.resets_before
            self.end(part.snapshot_id, "completed")

    def end(self, snapshot_id: int, outcome: str) -> None:
        self.assembler.abort(snapshot_id, outcome)  # a core's failure ends it at the detector too
        super().end(snapshot_id, outcome)


def _keep(tally: Tally, name: str, part: LocalSnapshotPart) -> None:
    """What an accepted ``part`` tells, kept as rpc_world's detector keeps it, for the oracle."""
    if part.HasField("state"):
        tally.states[name] = part
        for count in part.outbound:
            tally.counts[name, count.dst] = (count.sent_before_marker, count.session)
    for inbound in part.inbound:
        tally.channels[inbound.src, name] = inbound


# p0 calls p2; the call ends ambiguously at p0 (its session with p2 restarts, sent = 0) while the
# request is still on its way; both record: p0 counted nothing in its new session, p2's state lists
# no channel. The request arrives after p2 recorded: in flight, missing from the cut unless p2's
# own check (a count of another session) fails the snapshot first.
_RESET_THEN_RECORD = Scenario(
    processes=3,
    units=(0, 0, 0),
    default_lifetime=40.0,
    steps=(("call", 0, 1), ("start", 0, 0), ("fail", 0, 0), ("control", 32, 0)),
)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
@example(_RESET_THEN_RECORD)
def test_every_cut_the_assembler_completes_in_rpc_mode_is_consistent(scenario: Scenario) -> None:
    world = AssembledWorld(scenario)
    world.play()
    world.settle()
    for snapshot_id, tally in world.snapshots.items():
        if tally.outcome == "completed":
            check_cut(world, snapshot_id)


def test_the_reset_scenario_fails_rather_than_completes() -> None:
    world = AssembledWorld(_RESET_THEN_RECORD)
    world.play()
    world.settle()
    assert world.snapshots[1].outcome == "failed"


def _state(process: str, counts: dict[str, tuple[int, int]]) -> LocalSnapshotPart:
    """``process``'s state part in RPC mode: its counts (n, session) and no channel."""
    part = LocalSnapshotPart(snapshot_id=SNAPSHOT, process_id=process, state=LocalState())
    part.outbound.extend(OutboundCount(dst=dst, sent_before_marker=n, session=s) for dst, (n, s) in counts.items())
    return part


def _channel(process: str, src: str, m: int, session: int) -> LocalSnapshotPart:
    part = LocalSnapshotPart(snapshot_id=SNAPSHOT, process_id=process)
    part.inbound.append(InboundChannelState(src=src, received_before_recording=m, session=session))
    return part


def test_a_channel_towards_a_confirming_member_waits_for_its_report_even_with_nothing_counted() -> None:
    assembler = Assembler()
    assembler.begin(SNAPSHOT, ["p", "q"], confirmed_by=["p", "q"])
    assert assembler.add_part(_state("q", {"p": (0, 1)}), sender="q") is None
    assert assembler.add_part(_state("p", {"q": (0, 0)}), sender="p") is None  # was complete here
    assert "q->p (0 of 0, not reported by p)" in assembler.missing(SNAPSHOT)
    assert assembler.add_part(_channel("q", "p", 0, 0), sender="q") is None
    outcome = assembler.add_part(_channel("p", "q", 0, 1), sender="p")
    assert isinstance(outcome, Completed)
    assert [(c.src, c.dst) for c in outcome.snapshot.channels] == [("p", "q"), ("q", "p")]


def test_a_channel_reported_in_another_session_than_its_count_is_inconsistent() -> None:
    assembler = Assembler()
    assembler.begin(SNAPSHOT, ["p", "q"], confirmed_by=["p", "q"])
    assembler.add_part(_state("q", {"p": (2, 1)}), sender="q")
    assembler.add_part(_state("p", {}), sender="p")
    with pytest.raises(PartRejected) as caught:
        assembler.add_part(_channel("p", "q", 2, 0), sender="p")  # 2 == 2, but of session 0
    assert caught.value.reason == "inconsistent_counts" and caught.value.aborted is not None
    assert "n counts session 1 of q, m session 0" in caught.value.detail


def test_a_member_that_does_not_confirm_is_proven_by_the_states_as_before() -> None:
    assembler = Assembler()
    assembler.begin(SNAPSHOT, ["p", "q"], confirmed_by=["q"])  # p in marker mode: it lists its channels
    assembler.add_part(_state("q", {"p": (0, 0)}), sender="q")
    assert assembler.add_part(_state("p", {"q": (0, 0)}), sender="p") is None  # q -> p is proven
    assert assembler.missing(SNAPSHOT) == "waiting for channels p->q (0 of 0, not reported by q)"
    assert isinstance(assembler.add_part(_channel("q", "p", 0, 0), sender="q"), Completed)


# -- the victim of a deadlock: a wait that holds it up -----------------------------------------------------


def _proc(pid: str, *waits: Wait) -> ProcessSnapshot:
    return ProcessSnapshot(process_id=pid, state=LocalState(waits=waits))


def _on(target: str, *, instance: int, began: int, flow_control: bool = False, task: str = "") -> Wait:
    return Wait(
        task=task,
        targets=[WaitNode(process=target)],
        instance=instance,
        began_at_us=began,
        flow_control=flow_control,
    )


def _cut(*, reply_in_flight: bool) -> GlobalSnapshot:
    """P's send to Q is blocked on a full window (wait 1) while P waits for Q's reply (wait 2);
    Q waits on P. Before P receives the reply, it is in flight and meets wait 2; after, wait 2 is
    gone. Wait 1 holds the deadlock on both cuts."""
    waits = [_on("Q", instance=1, began=100, flow_control=True)]
    channels = []
    if reply_in_flight:
        waits.append(_on("Q", instance=2, began=200))
        reply = RecordedMessage(payload=b"r")
        channels.append(ChannelSnapshot(src="Q", dst="P", sent_before_marker=1, messages=[reply]))
    processes = [_proc("P", *waits), _proc("Q", _on("P", instance=7, began=50))]
    return GlobalSnapshot(snapshot_id=1, processes=processes, channels=channels)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_wait_whose_wake_up_is_in_flight_is_never_the_victim(policy: str) -> None:
    chosen = []
    for cut in (_cut(reply_in_flight=True), _cut(reply_in_flight=False)):
        evaluation = evaluate(cut)
        assert verdict(evaluation.results[0]) == "true"
        chosen.append([(v.process, v.instance) for v in choose_victims(cut, evaluation.wait_for, policy)])
    expected = [("P", 1)] if policy == "youngest" else [("Q", 7)]
    assert chosen == [expected, expected]  # the same wait on both cuts, never the one about to wake


def _met(snapshot: GlobalSnapshot, process: str, wait: Wait, target: str) -> bool:
    """Whether a message in flight or an acknowledgement in transit meets ``wait`` of ``process`` on
    ``target``, from the rules' words (DESIGN.md's in-flight rule; waitfor's acknowledgement rule)."""
    channel = (process, target) if wait.flow_control else (target, process)
    for c in snapshot.channels:
        if (c.src, c.dst) != channel:
            continue
        if not wait.flow_control:
            return any(not m.no_wake and m.wakes_task in ("", wait.task) for m in c.messages)
        if not (c.HasField("receiver_acked") and c.HasField("sender_ack_seen")):
            return False
        r, s = c.receiver_acked, c.sender_ack_seen
        same = (r.sender_incarnation, r.receiver_incarnation) == (s.sender_incarnation, s.receiver_incarnation)
        return same and r.next_seq > s.next_seq
    return False


@st.composite
def _tangles(draw: st.DrawFn) -> GlobalSnapshot:
    """A ring of processes, each with several waits, most of them on the next one, ordinary and
    flow-control alike, and channels with waking messages, heartbeats and acknowledgements in
    transit: what makes one wait of a deadlocked node met while another keeps its edge counted."""
    pids = [f"P{i}" for i in range(draw(st.integers(2, 4)))]
    processes = []
    instance = 0
    for pid in pids:
        state = LocalState()
        others = [p for p in pids if p != pid]
        following = pids[(pids.index(pid) + 1) % len(pids)]  # most waits go round the ring
        for _ in range(draw(st.integers(1, 3))):
            instance += 1
            targets = [following] if draw(st.integers(0, 2)) else draw(st.lists(st.sampled_from(others), min_size=1))
            wait = Wait(
                task=draw(st.sampled_from(["", "", "t"])),
                targets=[WaitNode(process=t) for t in targets],
                model=WAIT_MODEL_OR if draw(st.integers(0, 7)) == 0 else WAIT_MODEL_AND,
                flow_control=draw(st.integers(0, 2)) > 0,
                instance=instance,
                began_at_us=draw(st.integers(0, 3)),
            )
            state.waits.append(wait)
        processes.append(ProcessSnapshot(process_id=pid, state=state))
    channels = []
    for src in pids:
        for dst in pids:
            if src == dst or draw(st.integers(0, 3)) == 0:
                continue
            messages = [
                RecordedMessage(no_wake=draw(st.integers(0, 3)) == 0, wakes_task=draw(st.sampled_from(["", "t", "u"])))
                for _ in range(draw(st.integers(0, 2)))
            ]
            channel = ChannelSnapshot(src=src, dst=dst, sent_before_marker=len(messages), messages=messages)
            if draw(st.integers(0, 3)) == 0:  # where acknowledgements stood: one in transit, or none
                seen = AckPosition(sender_incarnation=1, receiver_incarnation=2, next_seq=1)
                channel.sender_ack_seen.CopyFrom(seen)
                channel.receiver_acked.CopyFrom(
                    AckPosition(sender_incarnation=1, receiver_incarnation=2, next_seq=draw(st.integers(1, 2)))
                )
            channels.append(channel)
    return GlobalSnapshot(snapshot_id=1, processes=processes, channels=channels)


@settings(max_examples=1000, deadline=None, derandomize=True)
@given(_tangles())
def test_every_victim_waits_unmet_on_its_own_deadlock(snapshot: GlobalSnapshot) -> None:
    evaluation = evaluate(snapshot)
    waits = {(p.process_id, w.instance): w for p in snapshot.processes for w in p.state.waits}
    for policy in POLICIES:
        for victim in choose_victims(snapshot, evaluation.wait_for, policy):
            wait = waits[victim.process, victim.instance]
            held = [
                t.process
                for t in wait.targets
                if (t.process, t.task) in victim.component and not _met(snapshot, victim.process, wait, t.process)
            ]
            assert held, f"{policy} broke {victim.process}'s wait {victim.instance}, which holds nothing up"


# -- waits that would mean something else than they say ---------------------------------------------------


def _parts(*states: tuple[str, LocalState]) -> list[LocalSnapshotPart]:
    return [LocalSnapshotPart(snapshot_id=SNAPSHOT, process_id=p, state=s) for p, s in states]


def _first_rejection(parts: list[LocalSnapshotPart]) -> PartRejected | GlobalSnapshot:
    """Feed ``parts`` to a fresh snapshot of their processes: the first rejection, or the cut."""
    assembler = Assembler()
    assembler.begin(SNAPSHOT, [part.process_id for part in parts])
    for part in parts:
        try:
            outcome = assembler.add_part(part, sender=part.process_id)
        except PartRejected as rejected:
            return rejected
    assert isinstance(outcome, Completed)
    return outcome.snapshot


def test_a_wait_target_without_a_process_is_malformed() -> None:
    # A needs B or "nobody", B needs A: a deadlock, which the empty target (a free node outside the
    # cut, which coverage does not count) turned into "no deadlock" on a closed cut.
    a = LocalState(waits=[Wait(targets=[WaitNode(process=""), WaitNode(process="B")], model=WAIT_MODEL_OR)])
    b = LocalState(waits=[Wait(targets=[WaitNode(process="A")])])
    found = _first_rejection(_parts(("A", a), ("B", b)))
    assert isinstance(found, PartRejected), verdict(evaluate(found).results[0])
    assert found.reason == "malformed" and "the wait target '' names no process" in found.detail


@pytest.mark.parametrize("where", ["task", "target"])
def test_a_task_named_as_one_wait_of_a_task_is_malformed(where: str) -> None:
    # P's task x waits on C or D, and on E; its two waits are the nodes "x[wait 1]" and "x[wait 2]".
    # C and D wait on each other; B and E are free. Q waits on a task of P's named "x[wait 1]",
    # which waits on B (or which P does not report: free either way): Q is not deadlocked, yet it
    # was taken for a wait on x's first wait, and reported deadlocked.
    p = LocalState(
        active=True,
        waits=[Wait(task="x", targets=[WaitNode(process="C"), WaitNode(process="D")], model=WAIT_MODEL_OR)]
        + [Wait(task="x", targets=[WaitNode(process="E")])]
        + ([Wait(task="x[wait 1]", targets=[WaitNode(process="B")])] if where == "task" else []),
    )
    states = [
        ("P", p),
        ("Q", LocalState(waits=[Wait(targets=[WaitNode(process="P", task="x[wait 1]")])])),
        ("C", LocalState(waits=[Wait(targets=[WaitNode(process="D")])])),
        ("D", LocalState(waits=[Wait(targets=[WaitNode(process="C")])])),
        ("B", LocalState(active=True)),
        ("E", LocalState(active=True)),
    ]
    found = _first_rejection(_parts(*states))
    deadlocked = [] if isinstance(found, PartRejected) else evaluate(found).results[0].deadlock.deadlocked
    assert isinstance(found, PartRejected), [(n.process, n.task) for n in deadlocked]
    assert found.reason == "malformed"
    assert "the task 'x[wait 1]' is named as the detector names one wait of a task" in found.detail


def test_a_wait_of_a_model_the_detector_does_not_know_is_malformed() -> None:
    # A newer agent's model, say 3: counted as AND (the most blocking), A and B would be reported
    # deadlocked, though that model may need only one of the targets, and C is free.
    states = [
        ("A", LocalState(waits=[Wait(targets=[WaitNode(process="B"), WaitNode(process="C")], model=3)])),
        ("B", LocalState(waits=[Wait(targets=[WaitNode(process="A")])])),
        ("C", LocalState(active=True)),
    ]
    found = _first_rejection(_parts(*states))
    assert isinstance(found, PartRejected), evaluate(found).results[0].summary
    assert found.reason == "malformed"
    assert "the wait model '3' is not one this detector knows (AND or OR)" in found.detail
