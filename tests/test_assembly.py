"""Unit tests of the Assembler: the completion rule, the per-channel proof and every rejection reason."""

from __future__ import annotations

import itertools

import pytest

from stablewatch.detector.assembly import (
    REJECTION_REASONS,
    Aborted,
    Assembler,
    Completed,
    PartRejected,
    recorded_count,
    recorded_messages,
)
from stablewatch.v1 import (
    AckPosition,
    ChannelSnapshot,
    GlobalSnapshot,
    InboundChannelState,
    LocalSnapshotPart,
    LocalState,
    OutboundCount,
    ProcessSnapshot,
    RecordedMessage,
)

SNAPSHOT = 7


# -- helpers --------------------------------------------------------------------------------------


def state(tokens: int) -> LocalState:
    """A local state holding ``tokens`` tokens."""
    return LocalState(counters={"tokens": tokens})


def message(payload: bytes, tokens: int = 1, receive_index: int = 0) -> RecordedMessage:
    """A recorded message carrying ``tokens`` tokens."""
    return RecordedMessage(payload=payload, counters={"tokens": tokens}, receive_index=receive_index)


def state_part(
    process: str, outbound: dict[str, int], tokens: int = 0, snapshot_id: int = SNAPSHOT
) -> LocalSnapshotPart:
    """The part a process sends when it records: its state and n per outbound channel."""
    part = LocalSnapshotPart(snapshot_id=snapshot_id, process_id=process, state=state(tokens))
    part.outbound.extend(OutboundCount(dst=dst, sent_before_marker=n) for dst, n in outbound.items())
    return part


def channel_part(
    process: str, src: str, m: int, messages: list[RecordedMessage], snapshot_id: int = SNAPSHOT, *, open: bool = False
) -> LocalSnapshotPart:
    """A part with the receiver's end of ``src -> process``: whole (its marker came) unless ``open``."""
    part = LocalSnapshotPart(snapshot_id=snapshot_id, process_id=process)
    part.inbound.append(InboundChannelState(src=src, received_before_recording=m, messages=messages, open=open))
    return part


def good_parts() -> list[LocalSnapshotPart]:
    """Four parts that complete snapshot 7 of members a and b (a -> b has one message in flight)."""
    return [
        state_part("a", {"b": 2}, tokens=3),
        state_part("b", {"a": 1}, tokens=4),
        channel_part("b", "a", 1, [message(b"x", tokens=2, receive_index=5)]),
        channel_part("a", "b", 1, []),
    ]


def expected_snapshot() -> GlobalSnapshot:
    """The global snapshot that :func:`good_parts` assemble into."""
    return GlobalSnapshot(
        snapshot_id=SNAPSHOT,
        processes=[
            ProcessSnapshot(process_id="a", state=state(3)),
            ProcessSnapshot(process_id="b", state=state(4)),
        ],
        channels=[
            ChannelSnapshot(
                src="a",
                dst="b",
                sent_before_marker=2,
                received_before_recording=1,
                messages=[message(b"x", tokens=2, receive_index=5)],
            ),
            ChannelSnapshot(src="b", dst="a", sent_before_marker=1, received_before_recording=1),
        ],
        expected_members=["a", "b"],
    )


def started(members: tuple[str, ...] = ("a", "b")) -> Assembler:
    """An assembler collecting snapshot 7 from ``members``."""
    assembler = Assembler()
    assembler.begin(SNAPSHOT, members)
    return assembler


def feed(assembler: Assembler, parts: list[LocalSnapshotPart]) -> GlobalSnapshot:
    """Add ``parts`` from their own processes; only the last may complete the snapshot."""
    *head, last = parts
    for part in head:
        assert assembler.add_part(part, sender=part.process_id) is None
    outcome = assembler.add_part(last, sender=last.process_id)
    assert isinstance(outcome, Completed)
    return outcome.snapshot


# -- completion -----------------------------------------------------------------------------------


def test_good_parts_in_any_order_complete_with_the_same_snapshot() -> None:
    for order in itertools.permutations(good_parts()):
        assembler = started()
        assert feed(assembler, list(order)) == expected_snapshot()
        assert assembler.running == []


def test_processes_and_channels_are_sorted() -> None:
    assembler = started(("c", "b", "a"))
    parts = [
        state_part("c", {"b": 0, "a": 0}),
        state_part("b", {"c": 0, "a": 0}),
        state_part("a", {"c": 0, "b": 0}),
    ]
    snapshot = feed(assembler, parts)  # nothing was ever sent: the states prove every channel
    assert [process.process_id for process in snapshot.processes] == ["a", "b", "c"]
    channels = [(channel.src, channel.dst) for channel in snapshot.channels]
    assert channels == sorted(itertools.permutations("abc", 2))


def test_not_complete_without_every_member_state() -> None:
    assembler = started(("a", "b", "c"))
    for part in good_parts():
        assert assembler.add_part(part) is None  # sender unknown: accepted without the spoof check
    assert assembler.missing(SNAPSHOT) == "waiting for state of c"
    outcome = assembler.add_part(state_part("c", {}, tokens=1), sender="c")
    assert isinstance(outcome, Completed)
    assert [process.process_id for process in outcome.snapshot.processes] == ["a", "b", "c"]


def test_not_complete_without_both_ends_of_every_channel() -> None:
    assembler = started()
    parts = good_parts()
    # The receiver's end of b -> a first, before b's state (its n) is in.
    assembler.add_part(channel_part("a", "b", 1, []))
    assert assembler.missing(SNAPSHOT) == "waiting for state of a, b; channels b->a (1 of n unknown)"
    assembler.add_part(parts[0])
    assembler.add_part(parts[1])
    # b's state lists nothing of a -> b: m = 0 until its recorded message comes.
    assert assembler.missing(SNAPSHOT) == "waiting for channels a->b (0 of 2)"
    outcome = assembler.add_part(parts[2])
    assert isinstance(outcome, Completed)
    assert outcome.snapshot == expected_snapshot()


def test_a_channel_that_opened_during_the_snapshot_is_proven_by_the_senders_state() -> None:
    """a opened a -> b after recording: its state lists no a -> b, which says n = 0."""
    assembler = started()
    assembler.add_part(state_part("a", {}, tokens=3), sender="a")
    assembler.add_part(state_part("b", {"a": 1}, tokens=4), sender="b")
    assert assembler.add_part(channel_part("b", "a", 0, [], open=True), sender="b") is None
    assert assembler.missing(SNAPSHOT) == "waiting for channels b->a (0 of 1)"
    outcome = assembler.add_part(channel_part("a", "b", 1, []), sender="a")
    assert isinstance(outcome, Completed)
    channel = outcome.snapshot.channels[0]
    assert (channel.src, channel.dst, channel.sent_before_marker, len(channel.messages)) == ("a", "b", 0, 0)


def test_a_count_after_the_senders_state_must_be_zero() -> None:
    """The state lists every channel the sender had: one opened later carried nothing before its marker."""
    assembler = started(("a", "b", "c"))
    assembler.add_part(state_part("a", {"b": 0}), sender="a")
    assert assembler.add_part(only_outbound("a", "c", 0), sender="a") is None
    with pytest.raises(PartRejected) as caught:
        assembler.add_part(only_outbound("a", "x", 2), sender="a")
    assert caught.value.reason == "malformed"
    assert "channel a->x counts n=2 after its state" in caught.value.detail
    assert assembler.running == [SNAPSHOT]


def test_channels_to_non_members_are_left_out_of_the_cut() -> None:
    assembler = started()
    parts = good_parts()
    parts[0] = state_part("a", {"b": 2, "x": 3}, tokens=3)
    parts.insert(1, channel_part("a", "x", 4, [message(b"from outside")]))
    outbound_only = LocalSnapshotPart(snapshot_id=SNAPSHOT, process_id="b")
    outbound_only.outbound.append(OutboundCount(dst="y", sent_before_marker=0))
    parts.insert(0, outbound_only)
    expected = expected_snapshot()
    expected.outside_peers[:] = ["x", "y"]  # kept, so that evaluation can see the cut is open
    assert feed(assembler, parts) == expected


def test_expected_members_travel_in_the_snapshot() -> None:
    assembler = Assembler()
    assembler.begin(SNAPSHOT, ["a", "b"], expected=["c"], expected_count=4)
    snapshot = feed(assembler, good_parts())
    assert list(snapshot.expected_members) == ["a", "b", "c"]
    assert snapshot.expected_member_count == 4


def test_missing_for_a_snapshot_that_is_not_running() -> None:
    assembler = started()
    assert assembler.missing(8) == "snapshot 8 is not running"
    assert assembler.missing(SNAPSHOT) == "waiting for state of a, b"
    feed(assembler, good_parts())
    assert assembler.missing(SNAPSHOT) == f"snapshot {SNAPSHOT} is not running"


def test_begin_refuses_reuse_and_empty_members() -> None:
    assembler = started()
    with pytest.raises(ValueError, match="already begun"):
        assembler.begin(SNAPSHOT, ["a"])
    feed(assembler, good_parts())
    with pytest.raises(ValueError, match="already begun"):
        assembler.begin(SNAPSHOT, ["a"])
    with pytest.raises(ValueError, match="non-empty member ids"):
        assembler.begin(8, [])
    with pytest.raises(ValueError, match="non-empty member ids"):
        assembler.begin(9, ["a", ""])
    assert assembler.running == []


def test_running_lists_snapshots_in_order() -> None:
    assembler = Assembler()
    for snapshot_id in (5, 2, 9):
        assembler.begin(snapshot_id, ["a"])
    assert assembler.running == [2, 5, 9]
    assembler.abort(5, "deadline")
    assert assembler.running == [2, 9]


# -- rejections -----------------------------------------------------------------------------------


def outbound_twice() -> LocalSnapshotPart:
    """a's state part that lists a -> b twice."""
    part = state_part("a", {"b": 2}, tokens=3)
    part.outbound.append(OutboundCount(dst="b", sent_before_marker=2))
    return part


def inbound_twice() -> LocalSnapshotPart:
    """b's part that lists a -> b twice."""
    part = channel_part("b", "a", 1, [message(b"x")])
    part.inbound.append(InboundChannelState(src="a", received_before_recording=2))
    return part


def only_state(process: str, tokens: int) -> LocalSnapshotPart:
    """A part with a state and no channel."""
    return LocalSnapshotPart(snapshot_id=SNAPSHOT, process_id=process, state=state(tokens))


def only_outbound(process: str, dst: str, n: int) -> LocalSnapshotPart:
    """A part with one outbound count and no state."""
    part = LocalSnapshotPart(snapshot_id=SNAPSHOT, process_id=process)
    part.outbound.append(OutboundCount(dst=dst, sent_before_marker=n))
    return part


# (reason, how many good parts come first, the bad part, its sender, what the message must name)
REJECTIONS = [
    ("malformed", 0, state_part("", {"b": 2}), None, "<no process id>"),
    ("malformed", 1, state_part("b", {"a": 1, "b": 0}), "b", "from b"),
    ("malformed", 0, state_part("a", {"": 1}), "a", "from a"),
    ("malformed", 2, channel_part("b", "b", 0, []), "b", "from b"),
    ("malformed", 2, channel_part("b", "", 0, []), "b", "from b"),
    ("malformed", 0, outbound_twice(), "a", "from a"),
    ("malformed", 2, inbound_twice(), "b", "from b"),
    ("unknown_snapshot", 1, state_part("b", {"a": 1}, snapshot_id=99), "b", "from b"),
    ("not_member", 1, state_part("z", {"a": 0}), "z", "from z"),
    ("spoofed", 1, state_part("b", {"a": 1}, tokens=4), "a", "from b"),
    ("spoofed", 0, state_part("", {}), "a", "<no process id>"),
    ("duplicate_part", 1, only_state("a", 100), "a", "from a"),
    ("duplicate_part", 1, only_outbound("a", "b", 5), "a", "from a"),
    ("duplicate_part", 3, channel_part("b", "a", 2, []), "b", "from b"),
]


@pytest.mark.parametrize(
    ("reason", "accepted", "bad", "sender", "names"),
    REJECTIONS,
    ids=[f"{case[0]}-{number}" for number, case in enumerate(REJECTIONS)],
)
def test_rejection_names_the_snapshot_and_process_and_keeps_accepted_parts(
    reason: str, accepted: int, bad: LocalSnapshotPart, sender: str | None, names: str
) -> None:
    if reason == "spoofed" and not bad.process_id:
        reason = "malformed"  # an empty process id is malformed before it can be spoofed
    assembler = started()
    parts = good_parts()
    for part in parts[:accepted]:
        assert assembler.add_part(part, sender=part.process_id) is None
    with pytest.raises(PartRejected) as caught:
        assembler.add_part(bad, sender=sender)
    error = caught.value
    assert error.reason == reason
    assert reason in REJECTION_REASONS
    assert error.aborted is None
    snapshot_id = bad.snapshot_id
    assert f"snapshot {snapshot_id}" in error.detail
    assert names in error.detail
    assert str(error) == f"{reason}: {error.detail}"
    # Nothing accepted before was disturbed: the good parts still complete the same snapshot.
    assert assembler.running == [SNAPSHOT]
    assert feed(assembler, parts[accepted:]) == expected_snapshot()


def test_part_after_completion_is_late() -> None:
    assembler = started()
    feed(assembler, good_parts())
    with pytest.raises(PartRejected, match="already finished") as caught:
        assembler.add_part(channel_part("a", "b", 1, []), sender="a")
    assert caught.value.reason == "late"
    assert f"part of snapshot {SNAPSHOT} from a" in caught.value.detail


def test_part_after_abort_is_late_and_abort_names_the_reason() -> None:
    assembler = started()
    parts = good_parts()
    assembler.add_part(parts[0], sender="a")
    assert assembler.abort(SNAPSHOT, "deadline passed") == Aborted(SNAPSHOT, "deadline passed")
    assert assembler.running == []
    with pytest.raises(PartRejected) as caught:
        assembler.add_part(parts[1], sender="b")
    assert caught.value.reason == "late"
    assert f"snapshot {SNAPSHOT} from b" in caught.value.detail


def test_fail_aborts_a_running_snapshot_once() -> None:
    assembler = started()
    assembler.add_part(good_parts()[0], sender="a")
    aborted = assembler.fail(SNAPSHOT, "b", "recorded bytes exceeded the bound")
    assert aborted == Aborted(SNAPSHOT, "process b failed: recorded bytes exceeded the bound")
    assert assembler.running == []
    assert assembler.fail(SNAPSHOT, "a", "again") is None
    assert assembler.fail(123, "a", "never started") is None
    with pytest.raises(PartRejected) as caught:
        assembler.add_part(good_parts()[1], sender="b")
    assert caught.value.reason == "late"


@pytest.mark.parametrize("sender_first", [True, False], ids=["sender-first", "receiver-first"])
@pytest.mark.parametrize(
    ("m", "recorded"), [(1, 0), (0, 3), (2, 1)], ids=["too-few", "too-many-recorded", "too-many-received"]
)
def test_inconsistent_counts_abort_the_snapshot(sender_first: bool, m: int, recorded: int) -> None:
    assembler = started()
    sender_end = state_part("a", {"b": 2}, tokens=3)
    receiver_end = channel_part("b", "a", m, [message(b"r%d" % i) for i in range(recorded)])
    first, second = (sender_end, receiver_end) if sender_first else (receiver_end, sender_end)
    assert assembler.add_part(first, sender=first.process_id) is None
    with pytest.raises(PartRejected) as caught:
        assembler.add_part(second, sender=second.process_id)
    error = caught.value
    assert error.reason == "inconsistent_counts"
    assert f"snapshot {SNAPSHOT} channel a->b" in error.detail
    assert f"m={m} + recorded={recorded} {'>' if m + recorded > 2 else '!='} n=2" in error.detail
    assert error.aborted == Aborted(SNAPSHOT, error.detail)
    assert assembler.running == []
    for part in good_parts():
        with pytest.raises(PartRejected) as later:
            assembler.add_part(part, sender=part.process_id)
        assert later.value.reason == "late"


def test_a_consistent_channel_is_not_checked_against_an_unrelated_one() -> None:
    """The proof pairs each channel's own ends: b -> a's n does not judge a -> b."""
    assembler = started()
    assembler.add_part(state_part("b", {"a": 5}), sender="b")
    assert assembler.add_part(channel_part("b", "a", 1, [message(b"x")]), sender="b") is None
    assert assembler.add_part(state_part("a", {"b": 2}), sender="a") is None


# -- channels reported open, then continued -------------------------------------------------------


def open_state(
    process: str, outbound: dict[str, int], src: str, m: int, messages: list[RecordedMessage]
) -> LocalSnapshotPart:
    """A state part that lists ``src -> process`` as it stood at the recording, still open."""
    part = state_part(process, outbound)
    part.inbound.append(InboundChannelState(src=src, received_before_recording=m, messages=messages, open=True))
    return part


def test_an_open_channel_is_proven_when_its_last_message_in_flight_is_reported() -> None:
    assembler = started()
    assert assembler.add_part(state_part("a", {"b": 3}), sender="a") is None
    assert assembler.add_part(open_state("b", {}, "a", 1, [message(b"x")]), sender="b") is None
    assert assembler.missing(SNAPSHOT) == "waiting for channels a->b (2 of 3)"
    outcome = assembler.add_part(channel_part("b", "a", 1, [message(b"y")]), sender="b")
    assert isinstance(outcome, Completed)
    channel = outcome.snapshot.channels[0]
    assert (channel.received_before_recording, [m.payload for m in channel.messages]) == (1, [b"x", b"y"])


def test_an_open_channel_that_already_meets_n_needs_no_marker() -> None:
    assembler = started()
    assembler.add_part(state_part("a", {"b": 2}), sender="a")
    outcome = assembler.add_part(open_state("b", {}, "a", 1, [message(b"x")]), sender="b")
    assert isinstance(outcome, Completed)
    assert [m.payload for m in outcome.snapshot.channels[0].messages] == [b"x"]


def test_a_continuation_in_the_same_part_is_merged_in_order() -> None:
    """Parts queued together are merged by the agent: the open piece and its continuation in one part."""
    assembler = started()
    assembler.add_part(state_part("a", {"b": 3}), sender="a")
    part = open_state("b", {}, "a", 1, [message(b"x")])
    part.inbound.append(InboundChannelState(src="a", received_before_recording=1, messages=[message(b"y")]))
    outcome = assembler.add_part(part, sender="b")
    assert isinstance(outcome, Completed)
    assert [m.payload for m in outcome.snapshot.channels[0].messages] == [b"x", b"y"]


@pytest.mark.parametrize("sender_first", [True, False], ids=["sender-first", "receiver-first"])
def test_an_open_channel_past_n_is_inconsistent_at_once(sender_first: bool) -> None:
    assembler = started()
    parts = [state_part("a", {"b": 1}), open_state("b", {}, "a", 1, [message(b"x")])]
    first, second = parts if sender_first else parts[::-1]
    assembler.add_part(first, sender=first.process_id)
    with pytest.raises(PartRejected) as caught:
        assembler.add_part(second, sender=second.process_id)
    assert caught.value.reason == "inconsistent_counts"
    assert "channel a->b is inconsistent: m=1 + recorded=1 > n=1" in caught.value.detail
    assert caught.value.aborted is not None and assembler.running == []


def test_a_continuation_must_follow_an_open_piece_with_the_same_m() -> None:
    assembler = started()
    assembler.add_part(state_part("a", {"b": 3}), sender="a")
    assembler.add_part(open_state("b", {}, "a", 1, []), sender="b")
    with pytest.raises(PartRejected) as caught:
        assembler.add_part(channel_part("b", "a", 2, [message(b"x")]), sender="b")
    assert caught.value.reason == "malformed"
    assert "channel a->b continues with m=2, not m=1" in caught.value.detail
    assert assembler.add_part(channel_part("b", "a", 1, [message(b"x")], open=True), sender="b") is None
    outcome = assembler.add_part(channel_part("b", "a", 1, [message(b"y")]), sender="b")
    assert isinstance(outcome, Completed)
    assert [m.payload for m in outcome.snapshot.channels[0].messages] == [b"x", b"y"]


# -- recorded messages by column ------------------------------------------------------------------


def column_piece(
    src: str, m: int, runs: list[tuple[int, list[bytes]]], **extras: dict[str, object]
) -> InboundChannelState:
    """An inbound channel with its messages by column: ``runs`` of (first arrival index, payloads);
    ``extras`` by position, as ``p<position>={...}``."""
    piece = InboundChannelState(src=src, received_before_recording=m)
    for first, payloads in runs:
        piece.payloads.extend(payloads)
        piece.run_starts.append(first)
        piece.run_lengths.append(len(payloads))
    for name, fields in extras.items():
        piece.extras.add(position=int(name.removeprefix("p")), **fields)  # type: ignore[arg-type]
    return piece


def test_messages_by_column_become_the_same_recorded_messages_in_arrival_order() -> None:
    piece = column_piece("a", 1, [(5, [b"x", b"y"]), (9, [b"z"])], p1={"counters": {"tokens": 2}}, p2={"no_wake": True})
    piece.messages.add(payload=b"w", receive_index=3)  # the message form comes first
    assert recorded_count(piece) == 4
    assert recorded_messages(piece) == [
        RecordedMessage(payload=b"w", receive_index=3),
        RecordedMessage(payload=b"x", receive_index=5),
        RecordedMessage(payload=b"y", counters={"tokens": 2}, receive_index=6),
        RecordedMessage(payload=b"z", no_wake=True, receive_index=9),
    ]
    assembler = started()
    assembler.add_part(state_part("a", {"b": 5}), sender="a")
    part = state_part("b", {})
    part.inbound.append(piece)
    outcome = assembler.add_part(part, sender="b")
    assert isinstance(outcome, Completed)
    assert list(outcome.snapshot.channels[0].messages) == recorded_messages(piece)


@pytest.mark.parametrize(
    ("piece", "problem"),
    [
        (column_piece("a", 0, [(1, [b"x"])]), None),
        (InboundChannelState(src="a", payloads=[b"x"], run_starts=[1], run_lengths=[2]), "runs of [2]"),
        (InboundChannelState(src="a", payloads=[b"x"], run_starts=[1, 2], run_lengths=[1]), "runs of [1]"),
        (column_piece("a", 0, [(1, [b"x"])], p1={"no_wake": True}), "extras at [1] for 1 messages"),
        (InboundChannelState(src="a", payloads=[b"x"], run_starts=[1], run_lengths=[1], extras=[{}, {}]), "at [0, 0]"),
    ],
    ids=["good", "short-runs", "runs-unpaired", "extras-outside", "extras-twice"],
)
def test_a_malformed_column_form_is_rejected_and_nothing_taken(piece: InboundChannelState, problem: str | None) -> None:
    assembler = started()
    part = state_part("b", {})
    part.inbound.append(piece)
    if problem is None:
        assert assembler.add_part(part, sender="b") is None
        return
    with pytest.raises(PartRejected) as caught:
        assembler.add_part(part, sender="b")
    assert caught.value.reason == "malformed"
    assert "channel a->b" in caught.value.detail and problem in caught.value.detail
    assert assembler.missing(SNAPSHOT) == "waiting for state of a, b"


def test_the_message_bound_counts_messages_by_column() -> None:
    assembler = Assembler(max_part_messages=2)
    assembler.begin(SNAPSHOT, ["a", "b"])
    part = state_part("b", {})
    part.inbound.append(column_piece("a", 0, [(1, [b"x", b"y", b"z"])]))
    with pytest.raises(PartRejected) as caught:
        assembler.add_part(part, sender="b")
    assert caught.value.reason == "too_many_messages" and "records 3 messages" in caught.value.detail


def test_a_channel_reported_again_after_it_was_proven_is_in_the_snapshot_as_last_reported() -> None:
    """a counts n = 0 on a -> b and b's state does not list it (m = 0): proven, and built into the
    snapshot at once. A later report of it that adds nothing but b's acknowledgement position is
    still what the completed snapshot holds, once."""
    assembler = started(("a", "b", "c"))
    assembler.add_part(state_part("a", {"b": 0}), sender="a")
    assembler.add_part(state_part("b", {}), sender="b")
    acked = AckPosition(sender_incarnation=1, receiver_incarnation=2, next_seq=3)
    late = LocalSnapshotPart(snapshot_id=SNAPSHOT, process_id="b")
    late.inbound.add(src="a", acked=acked)
    assert assembler.add_part(late, sender="b") is None
    outcome = assembler.add_part(state_part("c", {}), sender="c")
    assert isinstance(outcome, Completed)
    (channel,) = outcome.snapshot.channels
    assert (channel.src, channel.dst, channel.receiver_acked) == ("a", "b", acked)
