"""From a review (read only) of the predicates besides deadlock: a blocked send about to go on.

A send blocked on the full window whose flow-control wait the acknowledgement rule meets (an
acknowledgement in transit back to the sender, or a receiver whose handler will take what is
queued) is about to go on: its task resumes and may send anything. The deadlock evaluation set the
edge aside, yet termination said true on such a cut (the sender recorded itself passive, nothing
waking on any channel), and the quiet rule took it for quiet. Termination is now false, with the
channel as evidence (``released_sends``), and the cut is not quiet, in the row, columnar and
light (large snapshot) evaluations alike.
"""

from __future__ import annotations

import pyarrow as pa
from snapshot_gen import rows_of

from stablewatch.detector.evaluation import evaluate, result_named, verdict
from stablewatch.detector.evaluation.columnar import LIGHT_WAIT_COLUMNS, SnapshotRows, evaluate_rows, light_facts
from stablewatch.v1 import (
    AckPosition,
    ChannelRef,
    ChannelSnapshot,
    GlobalSnapshot,
    LocalState,
    ProcessSnapshot,
    RecordedMessage,
    Wait,
    WaitNode,
)


def send_blocked_on_q(task: str = "") -> LocalState:
    """P, passive, its send to Q blocked on the full window Q held when P recorded."""
    return LocalState(waits=[Wait(task=task, targets=[WaitNode(process="Q")], flow_control=True, instance=1)])


def ack_in_transit() -> GlobalSnapshot:
    """Q consumed its queue, acknowledged all 8 messages and recorded with nothing queued; P had
    seen 4 acknowledged when it recorded. Both passive, no message on any channel, a closed cut."""
    incarnations = {"sender_incarnation": 1, "receiver_incarnation": 2}
    channel = ChannelSnapshot(
        src="P",
        dst="Q",
        sent_before_marker=8,
        received_before_recording=8,
        receiver_acked=AckPosition(next_seq=8, **incarnations),
        sender_ack_seen=AckPosition(next_seq=4, **incarnations),
    )
    return GlobalSnapshot(
        snapshot_id=1,
        processes=[
            ProcessSnapshot(process_id="P", state=send_blocked_on_q()),
            ProcessSnapshot(process_id="Q", state=LocalState(handler_waits=False)),
        ],
        channels=[channel],
        expected_members=["P", "Q"],
    )


def consumer_will_release() -> GlobalSnapshot:
    """Q's full queue holds only P's heartbeats, and Q's handler is idle: it takes them and
    acknowledges, and P's send goes on."""
    heartbeats = [RecordedMessage(payload=b"hb", no_wake=True) for _ in range(2)]
    return GlobalSnapshot(
        snapshot_id=2,
        processes=[
            ProcessSnapshot(process_id="P", state=send_blocked_on_q()),
            ProcessSnapshot(process_id="Q", state=LocalState(handler_waits=False)),
        ],
        channels=[ChannelSnapshot(src="P", dst="Q", sent_before_marker=2, messages=heartbeats)],
        expected_members=["P", "Q"],
    )


def test_a_blocked_send_about_to_go_on_is_no_termination() -> None:
    for snapshot in (ack_in_transit(), consumer_will_release()):
        evaluation = evaluate(snapshot)
        assert evaluation.coverage.closed
        assert [e.discounted for e in evaluation.wait_for.edges] == [True]  # the send will go on
        termination = result_named(evaluation, "termination")
        assert termination is not None and verdict(termination) == "false", termination.summary
        assert list(termination.termination.released_sends) == [ChannelRef(src="P", dst="Q")]
        assert "1 blocked send about to go on (P -> Q)" in termination.summary
        assert evaluate_rows(rows_of(snapshot))[1] == termination
        assert light_facts(light_rows(snapshot)).termination == termination


def light_rows(snapshot: GlobalSnapshot) -> SnapshotRows:
    """The rows of `snapshot` as the archive's reader gives them for a snapshot too large to
    evaluate whole: of the wait edges, only the columns :func:`light_facts` reads."""
    rows = rows_of(snapshot)
    edges = rows.wait_edges
    for index, field in enumerate(edges.schema):
        if field.name not in LIGHT_WAIT_COLUMNS:
            edges = edges.set_column(index, field, pa.nulls(edges.num_rows, field.type))
    return SnapshotRows(rows.head, rows.processes, rows.counters, edges, rows.channels, rows.messages)


def test_a_send_still_held_leaves_termination_as_it_was() -> None:
    # Q's handler is in a run that waits: nothing releases P's send, and no one is about to act.
    snapshot = consumer_will_release()
    snapshot.processes[1].state.handler_waits = True
    termination = result_named(evaluate(snapshot), "termination")
    assert termination is not None and verdict(termination) == "true"
    assert not termination.termination.released_sends


def test_a_blocked_send_about_to_go_on_keeps_the_cut_from_being_quiet() -> None:
    # R2's task waits on R as a whole and R's task on R2's: on a quiet cut R's node stands for its
    # one task and the cycle R2/t -> R -> R/r -> R2/t is a deadlock. But P's task "pump" is about
    # to send (Q's handler takes what is queued), and may then send to R, which makes R active
    # and meets R2's wait: the cut is not quiet, and no deadlock holds on it.
    snapshot = consumer_will_release()
    snapshot.processes[0].state.CopyFrom(send_blocked_on_q("pump"))
    for process, task, target in (("R", "r", WaitNode(process="R2", task="t")), ("R2", "t", WaitNode(process="R"))):
        state = LocalState(waits=[Wait(task=task, targets=[target])])
        snapshot.processes.append(ProcessSnapshot(process_id=process, state=state))
    snapshot.expected_members.extend(["R", "R2"])
    assert verdict(evaluate(snapshot).results[0]) == "false"
    assert verdict(evaluate_rows(rows_of(snapshot))[0]) == "false"
    held = GlobalSnapshot()
    held.CopyFrom(snapshot)
    held.processes[1].state.handler_waits = True  # Q's handler waits: nothing can reach R again
    assert verdict(evaluate(held).results[0]) == "true"
    assert verdict(evaluate_rows(rows_of(held))[0]) == "true"
