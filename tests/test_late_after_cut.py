"""A late part reporting a channel that opened after a completed cut is harmless, and excused.

The sender heard the snapshot ended and opened a channel without its marker; the receiver, not
told yet, recorded the channel's first message and reported it after the snapshot completed. A
CI run counted three such parts as rejections (tests/test_examples.py's bank). A channel the cut
did count stays a rejection: a message past its n would mean a broken FIFO.
"""

from __future__ import annotations

import pytest

from stablewatch.agents.core import AppMessage, ReportPart, SnapshotCore, apply_recording
from stablewatch.detector.assembly import Assembler, Completed, PartRejected
from stablewatch.detector.service.coordinator import Coordinator
from stablewatch.v1 import LocalSnapshotPart, LocalState


def parts(actions: tuple) -> list[LocalSnapshotPart]:
    return [action.part for action in actions if isinstance(action, ReportPart)]


def completed(assembler: Assembler, cores: list[SnapshotCore], snapshot_id: int) -> None:
    """Take snapshot ``snapshot_id`` of ``cores`` and check that it completed."""
    assembler.begin(snapshot_id, [core.process_id for core in cores])
    outcome = None
    for core in cores:
        actions = core.start_snapshot(snapshot_id, now=0.0, lifetime=10.0)
        for part in parts(apply_recording(core, actions, lambda _: LocalState(active=True))):
            outcome = assembler.add_part(part, sender=part.process_id) or outcome
    assert isinstance(outcome, Completed)


def late_part(assembler: Assembler, receiver: SnapshotCore, src: str) -> LocalSnapshotPart:
    """The part ``receiver`` reports for a message from ``src``, refused as late."""
    (part,) = parts(receiver.receive_message(src, AppMessage(b"transfer", {"tokens": 247}, False)))
    with pytest.raises(PartRejected) as rejected:
        assembler.add_part(part, sender=receiver.process_id)
    assert rejected.value.reason == "late"
    return part


def test_a_message_on_a_channel_opened_after_the_cut_is_excused() -> None:
    a, b, assembler = SnapshotCore("A"), SnapshotCore("B"), Assembler()
    completed(assembler, [a, b], 512)  # no channel yet: the two states prove the cut
    a.finish_snapshot(512)  # A hears the end first; B not yet
    assert a.open_outbound("B") == ()  # no marker of 512 on the new channel
    a.send("B")
    part = late_part(assembler, b, "A")
    assert part.inbound[0].open and part.inbound[0].received_before_recording == 0
    assert assembler.after_the_cut(part)


def test_a_message_on_a_channel_the_cut_counted_is_not_excused() -> None:
    a, b, assembler = SnapshotCore("A", outbound=["B"]), SnapshotCore("B"), Assembler()
    completed(assembler, [a, b], 512)  # A -> B counted: n = 0
    a.finish_snapshot(512)
    a.send("B")  # the marker is not delivered: as if the message overtook it
    assert not assembler.after_the_cut(late_part(assembler, b, "A"))


def test_the_coordinator_counts_no_rejection_for_it_and_one_for_a_counted_channel() -> None:
    rejections: list[PartRejected] = []
    coordinator = Coordinator(on_rejected=rejections.append)
    assembler = coordinator._assembler
    a, b = SnapshotCore("A"), SnapshotCore("B")
    completed(assembler, [a, b], 512)
    a.finish_snapshot(512)
    a.open_outbound("B")
    a.send("B")
    (part,) = parts(b.receive_message("A", AppMessage(b"transfer", {"tokens": 247}, False)))
    coordinator._add_part(part, "B")
    assert rejections == []
    counted = SnapshotCore("C", outbound=["D"]), SnapshotCore("D")
    completed(assembler, list(counted), 640)
    counted[0].finish_snapshot(640)
    counted[0].send("D")
    (part,) = parts(counted[1].receive_message("C", AppMessage(b"transfer", {"tokens": 1}, False)))
    coordinator._add_part(part, "D")
    assert [r.reason for r in rejections] == ["late"]
