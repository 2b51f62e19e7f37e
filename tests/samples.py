"""Hand-built global snapshots, predicate results and evaluations that several test files share."""

from __future__ import annotations

from google.protobuf.struct_pb2 import Struct

from stablewatch.v1 import (
    WAIT_MODEL_AND,
    AckPosition,
    ChannelRef,
    ChannelSnapshot,
    ConservationEvidence,
    CounterHolding,
    CutCoverage,
    DeadlockEvidence,
    Evaluation,
    GlobalSnapshot,
    LocalState,
    PredicateResult,
    ProcessSnapshot,
    RecordedMessage,
    TerminationEvidence,
    Wait,
    WaitForGraph,
    WaitNode,
)

__all__ = ["evaluation", "global_snapshot", "predicate_results", "proc"]


def proc(pid: str, *waits_on: str, active: bool = False, model: int = 0, **counters: int) -> ProcessSnapshot:
    """Process `pid` waiting (with `model`) on the processes `waits_on`, holding `counters`."""
    waits = [Wait(targets=[WaitNode(process=t) for t in waits_on], model=model)] if waits_on else []
    return ProcessSnapshot(process_id=pid, state=LocalState(active=active, waits=waits, counters=counters))


def global_snapshot(snapshot_id: int) -> GlobalSnapshot:
    """Two processes waiting on each other, one token in flight each way and a free-form attribute."""
    attributes = Struct()
    attributes.update({"role": "bank", "shards": [1, 2], "ok": True})
    a = LocalState(
        active=False,
        waits=[Wait(targets=[WaitNode(process="b")], model=WAIT_MODEL_AND)],
        counters={"tokens": 7},
        attributes=attributes,
    )
    b = LocalState(waits=[Wait(task="t1", targets=[WaitNode(process="a")])], counters={"tokens": 3})
    snapshot = GlobalSnapshot(
        snapshot_id=snapshot_id,
        processes=[ProcessSnapshot(process_id="a", state=a), ProcessSnapshot(process_id="b", state=b)],
        channels=[
            ChannelSnapshot(
                src="a",
                dst="b",
                sent_before_marker=5,
                received_before_recording=3,
                messages=[
                    RecordedMessage(payload=b"x", counters={"tokens": 1}, receive_index=4),
                    RecordedMessage(payload=b"\x00\xff", no_wake=True, receive_index=6),
                ],
                # Incarnations use all 64 bits; the sender's position is unknown on b -> a.
                receiver_acked=AckPosition(sender_incarnation=2**64 - 1, receiver_incarnation=2**63, next_seq=9),
                sender_ack_seen=AckPosition(sender_incarnation=2**64 - 1, receiver_incarnation=2**63, next_seq=7),
            ),
            ChannelSnapshot(
                src="b",
                dst="a",
                sent_before_marker=2,
                received_before_recording=1,
                messages=[
                    RecordedMessage(payload=b"y", counters={"tokens": 2}),
                ],
                receiver_acked=AckPosition(sender_incarnation=5, receiver_incarnation=6, next_seq=0),
            ),
            ChannelSnapshot(src="a", dst="c"),
        ],
    )
    snapshot.started_at.FromNanoseconds(1_700_000_000_123_456_789)
    snapshot.completed_at.FromNanoseconds(1_700_000_001_000_000_001)
    return snapshot


def predicate_results(deadlock: bool = True) -> list[PredicateResult]:
    """One result of each evidence kind, including a failed user predicate."""
    details = Struct()
    details.update({"worst": "a", "score": 0.5})
    nodes = [WaitNode(process="a"), WaitNode(process="b", task="t1")]
    return [
        PredicateResult(
            name="deadlock",
            holds=deadlock,
            summary="2 nodes deadlocked" if deadlock else "no deadlock",
            deadlock=DeadlockEvidence(
                deadlocked=nodes if deadlock else [],
                cycle=nodes if deadlock else [],
                empty_channels=[ChannelRef(src="b", dst="a")] if deadlock else [],
            ),
        ),
        PredicateResult(
            name="conservation(tokens)",
            holds=False,
            summary="drift -1",
            conservation=ConservationEvidence(
                counter="tokens",
                expected=14,
                observed=13,
                drift=-1,
                holdings=[
                    CounterHolding(process="a", amount=7),
                    CounterHolding(channel=ChannelRef(src="a", dst="b"), amount=1),
                ],
            ),
        ),
        PredicateResult(name="termination", holds=False, termination=TerminationEvidence(active_processes=["b"])),
        PredicateResult(name="user.score", holds=True, details=details),
        PredicateResult(name="user.broken", holds=False, error="ZeroDivisionError: division by zero"),
    ]


def evaluation(snapshot_id: int, results: list[PredicateResult]) -> Evaluation:
    """An evaluation of `snapshot_id` with these results and a one-edge wait-for graph."""
    graph = WaitForGraph(snapshot_id=snapshot_id, nodes=[WaitNode(process="a"), WaitNode(process="b")])
    graph.edges.add(waiter=WaitNode(process="a"), target=WaitNode(process="b"))
    return Evaluation(snapshot_id=snapshot_id, results=results, wait_for=graph, coverage=CutCoverage(closed=True))
