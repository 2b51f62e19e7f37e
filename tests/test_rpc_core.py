"""Tests of the RPC-mode protocol core (Lai–Yang coloring): scripted events, then a simulator.

The first half feeds scripted events to :class:`ColorCore` and checks the actions, one rule at a
time. The second half drives several cores with random calls, delivered out of order, random
ambiguous call failures and concurrent snapshots, and checks every completed cut with an oracle
written from the definition of a consistent cut, not from the core's rules (the simulator and the
oracle are rpc_world.py's).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from core_actions import only_part
from hypothesis import HealthCheck, given, settings
from rpc_world import UNITS, WALL, Scenario, World, play_checked, random_scenario, scenarios

from stablewatch.agents.core import (
    LOCAL_ID_BASE,
    LocalProtocolError,
    RecordState,
    RemoteProtocolError,
    SnapshotFailed,
)
from stablewatch.agents.rpc.calls import request_entry, split_request
from stablewatch.agents.rpc.core import (
    DEFAULT_MAX_SKEW,
    STAMP_KEY,
    Action,
    ColorCore,
    StaleStamp,
    Stamp,
)
from stablewatch.v1 import InboundChannelState, LocalSnapshotPart, LocalState, RecordedMessage

# -- helpers --------------------------------------------------------------------------------------


def state(units: int = 0) -> LocalState:
    """A local state holding ``units``."""
    return LocalState(counters={UNITS: units})


def message(payload: bytes = b"", **fields: Any) -> RecordedMessage:
    """A message as a channel state would hold it."""
    return RecordedMessage(payload=payload, **fields)


def record(core: ColorCore, actions: Sequence[Action], captured: LocalState | None = None) -> list[Action]:
    """Carry out the RecordState among ``actions`` with ``captured`` and splice in what it returns."""
    resolved: list[Action] = []
    for action in actions:
        if isinstance(action, RecordState):
            resolved.extend(core.record_state(action.snapshot_id, captured or state()))
        else:
            resolved.append(action)
    return resolved


def deliver(
    receiver: ColorCore,
    stamp: Stamp,
    payload: bytes = b"",
    *,
    now: float = 0.0,
    captured: LocalState | None = None,
) -> list[Action]:
    """Deliver a message with ``stamp`` to ``receiver``, recording first if it asks to."""
    return record(receiver, receiver.receive(stamp, message(payload), now=now, wall=WALL), captured)


def call(sender: ColorCore, receiver: ColorCore, payload: bytes = b"", **kwargs: Any) -> list[Action]:
    """Send one message from ``sender`` and deliver it at once."""
    return deliver(receiver, sender.send(receiver.process_id), payload, **kwargs)


def start(core: ColorCore, snapshot_id: int, *, now: float = 0.0, lifetime: float | None = None) -> list[Action]:
    """Start ``snapshot_id`` at ``core``, recording an empty state if it asks to."""
    return record(core, core.start_snapshot(snapshot_id, now=now, lifetime=lifetime))


def failures(actions: Sequence[Action]) -> dict[int, str]:
    """Reason per snapshot id of every SnapshotFailed among ``actions``."""
    return {action.snapshot_id: action.reason for action in actions if isinstance(action, SnapshotFailed)}


def outbound(part: LocalSnapshotPart) -> dict[str, tuple[int, int]]:
    """(n, session) per destination in ``part``."""
    return {count.dst: (count.sent_before_marker, count.session) for count in part.outbound}


def channel(part: LocalSnapshotPart) -> InboundChannelState:
    assert len(part.inbound) == 1, f"expected one channel in {part}"
    return part.inbound[0]


def payloads(state_: InboundChannelState) -> list[bytes]:
    return [recorded.payload for recorded in state_.messages]


def target(core: ColorCore, sender: ColorCore, snapshot_id: int, sent: int, session: int | None = None) -> list[Action]:
    """The detector forwards ``sender``'s count ``sent`` (in its current session unless given) to ``core``."""
    session = sender.session(core.process_id) if session is None else session
    return list(core.channel_target(snapshot_id, sender.process_id, sent, sender.incarnation, session))


def observe(core: ColorCore) -> tuple[object, ...]:
    """Everything the driver can see of ``core``: unchanged means nothing happened."""
    counts = tuple(
        (peer, core.session(peer), core.view(peer), core.sent_count(peer), core.received_count(peer))
        for peer in core.peers()
    )
    return (core.color, counts, core.active_snapshots, core.recorded_ranges, core.next_deadline)


def trio(**options: Any) -> tuple[ColorCore, ColorCore, ColorCore]:
    return tuple(ColorCore(name, incarnation=i + 1, **options) for i, name in enumerate("pqr"))  # type: ignore[return-value]


# -- stamps ---------------------------------------------------------------------------------------


def test_stamp_round_trip_keeps_a_process_id_with_dots() -> None:
    stamp = Stamp(1_700_000_000_000_000, 42, 3, "orders.shop.svc:8080")
    assert stamp.encode() == "1700000000000000.42.3.orders.shop.svc:8080"
    assert Stamp.decode(stamp.encode()) == stamp
    assert Stamp.decode(stamp.encode().encode("ascii")) == stamp
    assert STAMP_KEY == "stablewatch-stamp"  # gRPC metadata keys are lower case


@pytest.mark.parametrize(
    "text",
    [
        "",
        "1.2.3",  # no process id
        "1.2.3.",  # empty process id
        "1..3.p",
        "-1.2.3.p",
        "1.+2.3.p",
        " 1.2.3.p",
        "1_0.2.3.p",
        "0x1.2.3.p",
        "١.2.3.p",  # an Arabic-Indic digit: int() would take it
        "1.2.3.p\n",
        str(1 << 64) + ".0.0.p",
        "9" * 4000 + ".0.0.p",
        b"\xff.0.0.p",
    ],
)
def test_stamp_decode_rejects_malformed_text(text: str | bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        Stamp.decode(text)


def test_a_request_entry_carries_its_sequence_number_and_stamp_in_one() -> None:
    stamp = Stamp(5, 1, 0, "orders:8080")
    key, value = request_entry(stamp, 17)
    assert (key, value) == (STAMP_KEY, "17:5.1.0.orders:8080")
    assert split_request(value) == ("17", "5.1.0.orders:8080")
    assert split_request(value.encode()) == ("17", b"5.1.0.orders:8080")
    assert Stamp.decode(split_request(value)[1]) == stamp


@pytest.mark.parametrize(
    "value", ["5.1.0.orders:8080", ":5.1.0.p", "x:5.1.0.p", "١:5.1.0.p", "9" * 21 + ":5.1.0.p", ""]
)
def test_a_request_entry_without_a_sequence_number_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="seq:color"):
        split_request(value)


# -- sends, starts and parts ----------------------------------------------------------------------


def test_send_counts_and_stamps_color_incarnation_session() -> None:
    p, _, _ = trio()
    assert p.send("q") == Stamp(0, 1, 0, "p")
    start(p, 5)
    assert p.send("q") == Stamp(5, 1, 0, "p")
    assert p.sent_count("q") == 2 and p.peers() == ["q"]
    with pytest.raises(LocalProtocolError):
        p.send("p")


def test_the_stamp_sent_moves_with_the_color_and_with_either_side_s_session() -> None:
    p, q, _ = trio()
    first = p.send("q")
    assert p.send("q") is first  # one Stamp per color and session, not per message
    start(p, 5)
    assert p.send("q") == Stamp(5, 1, 0, "p")
    p.reset_peer("q", "UNAVAILABLE")
    assert p.send("q") == Stamp(5, 1, 1, "p")
    q.reset_peer("p", "UNAVAILABLE")
    q.reset_peer("p", "UNAVAILABLE")
    call(q, p)  # q's session 2, above p's own: p adopts it for its direction too
    assert p.send("q") == Stamp(5, 1, 2, "p")


def test_receive_checked_counts_a_stamp_checked_before_and_changes_nothing_otherwise() -> None:
    p, q, _ = trio()
    stamp = q.send("p")
    before = observe(p)
    assert p.receive_checked(stamp, message()) is None  # never checked: receive() must run
    assert observe(p) == before
    assert deliver(p, stamp) == []
    assert p.receive_checked(q.send("p"), message()) == ()  # the same stamp again
    assert p.received_count("q") == 2
    start(q, 4)
    above = q.send("p")  # color 4: p must record before it is delivered, which needs the clock
    assert p.receive_checked(above, message()) is None and observe(p)[0] == 0


def test_receive_checked_records_a_message_below_a_running_recording() -> None:
    p, q, _ = trio()
    stamp = q.send("p")
    deliver(p, stamp)
    start(p, 3)
    assert p.receive_checked(q.send("p"), message(b"late")) == ()
    assert payloads(channel(only_part(target(p, q, 3, sent=2)))) == [b"late"]


def test_receive_checked_leaves_a_stamp_gone_stale_since_its_check_to_receive() -> None:
    p, q, _ = trio()
    first = q.send("p")
    straggler = q.send("p")  # the same stamp object: checked once first arrives
    assert straggler is first
    deliver(p, first)
    q.reset_peer("p", "UNAVAILABLE")
    start(q, 2)
    start(p, 2)
    target(p, q, 2, sent=0)  # names q's session 1: p adopts it, with no stamp of it yet
    before = observe(p)
    assert p.receive_checked(straggler, message()) is None
    assert observe(p) == before
    with pytest.raises(StaleStamp):
        p.receive(straggler, message(), now=0.0, wall=WALL)


def test_start_records_once_and_reports_a_count_for_every_peer() -> None:
    p, _, r = trio()
    p.send("q")
    p.send("q")
    call(r, p)
    actions = p.start_snapshot(7, now=0.0)
    assert actions == (RecordState(7),)
    part = only_part(p.record_state(7, state(9)))
    assert part.snapshot_id == 7 and part.process_id == "p"
    assert part.state.counters[UNITS] == 9
    assert outbound(part) == {"q": (2, 0), "r": (0, 0)}  # r only sent to p: n = 0, still forwarded
    assert not part.inbound
    assert p.color == 7 and p.active_snapshots == [7]
    assert p.start_snapshot(7, now=1.0) == ()  # idempotent


def test_record_state_misuse_raises_local_protocol_error() -> None:
    p, q, _ = trio()
    with pytest.raises(LocalProtocolError):
        p.record_state(3, state())  # nothing to record
    p.start_snapshot(3, now=0.0)
    with pytest.raises(LocalProtocolError):
        p.record_state(4, state())  # not the color asked for
    events: list[Callable[[], object]] = [
        lambda: p.send("q"),
        lambda: p.receive(q.send("p"), message(), now=0.0, wall=WALL),
        lambda: p.start_snapshot(9, now=0.0),
        lambda: p.channel_target(3, "q", 0, 2, 0),
        lambda: p.reset_peer("q", "UNAVAILABLE"),
        lambda: p.expire(100.0),
        lambda: p.finish_snapshot(3),
        p.new_epoch,
    ]
    for event in events:
        with pytest.raises(LocalProtocolError):
            event()
    assert only_part(p.record_state(3, state())).snapshot_id == 3
    assert p.send("q").color == 3  # and the core works on


def test_bad_arguments_are_local_protocol_errors() -> None:
    with pytest.raises(LocalProtocolError):
        ColorCore("", incarnation=1)
    with pytest.raises(LocalProtocolError):
        ColorCore("p", incarnation=-1)
    with pytest.raises(LocalProtocolError):
        ColorCore("p", incarnation=1, max_recordings=0)
    p = ColorCore("p", incarnation=1)
    for snapshot_id in (0, LOCAL_ID_BASE):
        with pytest.raises(LocalProtocolError):
            p.start_snapshot(snapshot_id, now=0.0)
    with pytest.raises(LocalProtocolError):
        p.start_snapshot(1, now=0.0, lifetime=-1.0)


# -- jumps ----------------------------------------------------------------------------------------


def test_higher_color_records_before_the_message_is_delivered() -> None:
    p, q, _ = trio()
    call(q, p, b"before")
    start(q, 7)
    actions = p.receive(q.send("p"), message(b"after"), now=0.0, wall=WALL)
    assert actions == (RecordState(7),)
    assert p.record_state(7, state()) == ()  # no start claimed 7 here yet: nothing to report
    assert p.recorded_ranges == [(0, 7)] and p.color == 7
    assert p.received_count("q") == 2
    only_part(p.start_snapshot(7, now=0.0))
    # q sent 1 before recording 7, and p received it before recording: the channel is empty.
    inbound = channel(only_part(target(p, q, 7, sent=1)))
    assert inbound.received_before_recording == 1 and not inbound.messages


def test_one_jump_serves_every_id_of_its_range_also_ids_learned_later() -> None:
    p, q, r = trio()
    call(q, p)
    start(q, 10)
    deliver(p, q.send("p"), captured=state(4))  # p jumps 0 -> 10 before this delivery
    call(r, p, b"a")  # color 0: in flight for every id of the jump
    start(r, 6)
    call(r, p, b"b")  # color 6: in flight for ids 7 .. 10 only
    # Starts for 5 and 10 arrive after the stamp: both are served from the one capture.
    five, ten = only_part(p.start_snapshot(5, now=0.0)), only_part(p.start_snapshot(10, now=0.0))
    assert five.state == ten.state == state(4)
    assert outbound(five) == outbound(ten) == {"q": (0, 0)}  # r was not known yet
    assert p.recorded_ranges == [(0, 10)] and p.active_snapshots == [5, 10]
    # r's counts: 1 message sent before it recorded 5 (jump 0 -> 6), 2 before it recorded 10.
    assert payloads(channel(only_part(target(p, r, 5, sent=1)))) == [b"a"]
    start(r, 10)
    assert payloads(channel(only_part(target(p, r, 10, sent=2)))) == [b"a", b"b"]
    assert channel(only_part(target(p, q, 10, sent=1))).received_before_recording == 1


def test_start_for_an_id_already_passed_and_forgotten_fails() -> None:
    p, q, _ = trio(default_lifetime=10.0)
    start(q, 8)
    deliver(p, q.send("p"), now=0.0)
    assert p.next_deadline == 10.0  # unclaimed: kept default_lifetime
    assert p.expire(10.0) == ()  # no start claimed it: dropped without a report
    assert p.recorded_ranges == [] and p.color == 8
    reason = failures(p.start_snapshot(5, now=11.0))[5]
    assert "passed 5" in reason
    assert p.start_snapshot(5, now=12.0) == ()  # remembered: refused once


def test_stamp_at_or_below_the_color_records_nothing_new() -> None:
    p, q, _ = trio()
    start(p, 5)
    start(q, 5)
    assert deliver(p, q.send("p")) == []
    assert p.recorded_ranges == [(0, 5)]


# -- completion by targets ------------------------------------------------------------------------


def test_target_completes_at_once_when_every_message_arrived() -> None:
    p, q, _ = trio()
    call(q, p, b"x")
    start(q, 3)
    start(p, 3)
    inbound = channel(only_part(target(p, q, 3, sent=1)))
    assert inbound.src == "q" and inbound.received_before_recording == 1 and not inbound.messages
    assert inbound.session == 0


def test_target_completes_when_the_missing_messages_arrive() -> None:
    p, q, _ = trio()
    late = [q.send("p"), q.send("p")]  # sent before q records 3; delivered after p records
    start(q, 3)
    after = q.send("p")  # color 3: not in flight for 3
    start(p, 3)
    assert target(p, q, 3, sent=2) == []
    assert deliver(p, late[1], b"second") == []
    assert deliver(p, after, b"after") == []
    inbound = channel(only_part(deliver(p, late[0], b"first")))
    assert payloads(inbound) == [b"second", b"first"]  # arrival order
    assert [recorded.receive_index for recorded in inbound.messages] == [1, 3]


def test_recorded_messages_keep_their_fields() -> None:
    p, q, _ = trio()
    stamp = q.send("p")
    start(q, 3)
    start(p, 3)
    fields = {"counters": {UNITS: 4}, "wakes_task": "call#p:1", "payload": b"resp"}
    p.receive(stamp, message(**fields), now=0.0, wall=WALL)
    recorded = channel(only_part(target(p, q, 3, sent=1))).messages[0]
    assert recorded.counters[UNITS] == 4 and recorded.wakes_task == "call#p:1" and recorded.payload == b"resp"
    assert recorded.receive_index == 1


def test_message_is_built_only_when_recorded() -> None:
    p, q, _ = trio()
    built: list[int] = []

    def build() -> RecordedMessage:
        built.append(1)
        return message(b"m")

    p.receive(q.send("p"), build, now=0.0, wall=WALL)  # nothing recording
    start(p, 2)
    p.receive(q.send("p"), build, now=0.0, wall=WALL)  # recorded for 2
    start(q, 2)
    p.receive(q.send("p"), build, now=0.0, wall=WALL)  # color 2: recorded nowhere
    assert len(built) == 1


def test_a_count_beyond_the_target_fails_the_snapshot() -> None:
    p, q, _ = trio()
    call(q, p)
    call(q, p)
    start(p, 3)
    reason = failures(target(p, q, 3, sent=1))[3]
    assert "2 messages counted, q sent 1" in reason


def test_a_message_after_the_channel_completed_fails_the_snapshot() -> None:
    p, q, _ = trio()
    extra = q.send("p")  # q's count will (wrongly) leave it out
    start(q, 3)
    start(p, 3)
    only_part(target(p, q, 3, sent=0))
    assert "more messages than q counted" in failures(deliver(p, extra))[3]


def test_target_from_a_peer_first_heard_of_after_the_jump() -> None:
    p, _, r = trio()
    in_flight = r.send("p")  # r is unknown to p when p records
    start(r, 4)
    assert outbound(only_part(start(p, 4))) == {}
    assert target(p, r, 4, sent=1) == []  # m = 0: waits for it
    inbound = channel(only_part(deliver(p, in_flight, b"late")))
    assert inbound.received_before_recording == 0 and payloads(inbound) == [b"late"]
    assert p.view("r") == (3, 0)


def test_targets_for_unknown_finished_or_repeated_snapshots() -> None:
    p, q, _ = trio()
    assert "not started here" in failures(target(p, q, 9, sent=0))[9]
    assert target(p, q, 9, sent=0) == []  # refused once, then remembered
    start(p, 10)
    only_part(target(p, q, 10, sent=0))
    assert "second target" in failures(target(p, q, 10, sent=0))[10]
    p.finish_snapshot(10)
    assert target(p, q, 10, sent=0) == []
    with pytest.raises(RemoteProtocolError):
        p.channel_target(11, "p", 0, 1, 0)  # a channel to itself
    with pytest.raises(RemoteProtocolError):
        p.channel_target(11, "q", -1, 1, 0)


def test_target_of_an_older_session_fails_the_snapshot() -> None:
    p, q, _ = trio()
    call(q, p)
    q.reset_peer("p", "DEADLINE_EXCEEDED")  # q -> session 1
    call(q, p)  # p adopts session 1
    start(p, 3)
    reason = failures(target(p, q, 3, sent=1, session=0))[3]
    assert "session 0" in reason and "session 1" in reason


# -- sessions, incarnations, stale messages -------------------------------------------------------


def test_reset_peer_restarts_our_count_and_fails_recordings_that_counted_the_peer() -> None:
    p, q, r = trio()
    call(p, q)
    call(q, p)
    start(p, 3)  # counts q
    start(r, 4)
    deliver(p, r.send("p"))  # jump 3 -> 4 counts q as well
    start(p, 4)
    p.finish_snapshot(3)
    assert p.active_snapshots == [4]
    reason = failures(p.reset_peer("q", "call to q ended in UNAVAILABLE"))[4]
    assert "UNAVAILABLE" in reason and "restarted" in reason
    assert p.session("q") == 1 and p.sent_count("q") == 0
    assert p.received_count("q") == 1  # q's session with us goes on until q moves
    assert p.send("q").session == 1
    assert p.reset_peer("q", "again") == ()  # the recording failed already
    assert failures(p.start_snapshot(4, now=0.0)) == {}  # running (failed), not reported twice


def test_reset_spares_recordings_that_never_counted_the_peer() -> None:
    p, _, r = trio()
    call(r, p)
    start(p, 3)
    assert p.reset_peer("q", "UNAVAILABLE") == ()  # q was unknown at the jump
    part = only_part(target(p, r, 3, sent=1))
    assert channel(part).received_before_recording == 1


def test_one_reset_restarts_both_directions_through_the_peer() -> None:
    p, q, _ = trio()
    call(p, q)
    call(q, p)
    p.reset_peer("q", "UNAVAILABLE")
    call(p, q)  # q adopts p's session 1: both of q's counts restart, q's session rises to 1
    assert q.view("p") == (1, 1) and q.received_count("p") == 1
    assert q.session("p") == 1 and q.sent_count("p") == 0
    call(q, p)  # and p adopts q's
    assert p.view("q") == (2, 1) and p.received_count("q") == 1 and p.sent_count("q") == 1


def test_a_higher_session_is_adopted_and_fails_recordings_that_counted_the_peer() -> None:
    p, q, _ = trio()
    call(q, p)
    start(p, 3)
    q.reset_peer("p", "CANCELLED")
    actions = call(q, p)
    assert "q moved to session 1" in failures(actions)[3]
    assert p.view("q") == (2, 1) and p.received_count("q") == 1 and p.session("q") == 1


def test_a_new_incarnation_is_adopted_with_a_session_neither_side_used() -> None:
    p, q, _ = trio()
    call(p, q)
    call(q, p)
    start(p, 3)
    restarted = ColorCore("q", incarnation=20)
    actions = call(restarted, p)
    assert "q restarted (incarnation 20)" in failures(actions)[3]
    assert p.view("q") == (20, 0) and p.received_count("q") == 1
    assert p.session("q") == 1 and p.sent_count("q") == 0
    call(p, restarted)
    assert restarted.view("p") == (1, 1) and restarted.session("p") == 1


def test_a_target_with_a_newer_session_is_adopted() -> None:
    p, q, _ = trio()
    call(q, p)
    start(p, 3)
    q.reset_peer("p", "UNAVAILABLE")
    start(q, 3)
    actions = target(p, q, 3, sent=0)
    assert "q moved to session 1" in failures(actions)[3]
    assert p.view("q") == (2, 1) and p.received_count("q") == 0


@pytest.mark.parametrize("kind", ["session", "incarnation"])
def test_stale_messages_are_refused_and_change_nothing(kind: str) -> None:
    p, q, _ = trio()
    start(q, 5)
    old = q.send("p")  # color 5: it would make p record, were it delivered
    if kind == "session":
        q.reset_peer("p", "UNAVAILABLE")
        start(p, 2)
        only_part(target(p, q, 2, sent=0))  # names q's session 1
    else:
        call(ColorCore("q", incarnation=30), p)
        start(p, 2)
    before = observe(p)
    with pytest.raises(StaleStamp):
        p.receive(old, message(), now=0.0, wall=WALL)
    assert observe(p) == before
    assert p.color == 2 and p.recorded_ranges == [(0, 2)]


def test_a_stale_message_would_be_missing_from_a_completed_cut_so_it_is_refused() -> None:
    p, q, _ = trio()
    straggler = q.send("p")  # session 0, color 0: still in flight when both record 4
    q.reset_peer("p", "call ended in DEADLINE_EXCEEDED")
    call(q, p)  # session 1: p adopts it
    start(q, 4)
    start(p, 4)
    # q sent 1 message of session 1 before recording, and p received it before recording.
    assert payloads(channel(only_part(target(p, q, 4, sent=1)))) == []
    # The cut says the channel was empty, yet the straggler was sent before q recorded and arrives
    # after p did: delivered (even uncounted), it would make the reported cut wrong.
    with pytest.raises(StaleStamp):
        p.receive(straggler, message(), now=0.0, wall=WALL)


def test_our_own_reset_leaves_the_peer_s_messages_in_flight_valid() -> None:
    p, q, _ = trio()
    call(q, p)
    in_flight = q.send("p")
    p.reset_peer("q", "call ended in UNAVAILABLE")
    assert deliver(p, in_flight) == []  # q's session 0 goes on until q moves: counted, not stale
    assert p.received_count("q") == 2 and p.view("q") == (2, 0)


def test_a_snapshot_after_a_reset_completes_once_both_sides_moved() -> None:
    p, q, _ = trio()
    lost = q.send("p")  # never arrives: q's count for session 0 can never match
    p.reset_peer("q", "call ended in UNAVAILABLE")
    call(p, q)
    in_flight = q.send("p")  # session 1, sent before q records
    start(q, 6)
    start(p, 6)
    assert target(p, q, 6, sent=1) == []
    assert payloads(channel(only_part(deliver(p, in_flight, b"x")))) == [b"x"]
    assert lost.session == 0


# -- bad stamps -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stamp",
    [
        Stamp(-1, 2, 0, "q"),
        Stamp(5, -2, 0, "q"),
        Stamp(5, 2, -1, "q"),
        Stamp(5, 2, 1 << 64, "q"),
        Stamp(LOCAL_ID_BASE, 2, 0, "q"),
        Stamp(int((WALL + DEFAULT_MAX_SKEW) * 1_000_000) + 1, 2, 0, "q"),
        Stamp(5, 2, 0, ""),
        Stamp(5, 2, 0, "p"),  # this process's own id
    ],
)
def test_bad_stamps_raise_and_change_nothing(stamp: Stamp) -> None:
    p, q, _ = trio()
    call(q, p)
    start(p, 3)
    call(q, p)
    before = observe(p)
    with pytest.raises(RemoteProtocolError):
        p.receive(stamp, message(), now=0.0, wall=WALL)
    assert observe(p) == before
    assert p.color == 3 and p.recorded_ranges == [(0, 3)]  # no recording started


def test_a_color_up_to_the_skew_is_accepted() -> None:
    p, _, _ = trio()
    top = int((WALL + DEFAULT_MAX_SKEW) * 1_000_000)
    assert p.receive(Stamp(top, 2, 0, "q"), message(), now=0.0, wall=WALL) == (RecordState(top),)


# -- deadlines, bounds, finish, epochs ------------------------------------------------------------


def test_a_snapshot_expires_at_its_lifetime() -> None:
    p, q, _ = trio(default_lifetime=50.0)
    start(p, 3, now=10.0, lifetime=5.0)
    start(p, 4, now=10.0)  # default lifetime
    assert p.next_deadline == 15.0
    assert p.expire(14.9) == ()
    reason = failures(p.expire(15.0))[3]
    assert "deadline" in reason
    assert p.active_snapshots == [4] and p.next_deadline == 60.0
    assert target(p, q, 3, sent=0) == []  # forgotten as finished
    assert failures(p.expire(60.0)).keys() == {4}
    assert p.recorded_ranges == [] and p.next_deadline is None


def test_an_expired_snapshot_that_failed_goes_quietly() -> None:
    p, q, _ = trio()
    call(q, p)
    start(p, 3, lifetime=5.0)
    p.reset_peer("q", "UNAVAILABLE")
    assert p.expire(5.0) == ()


def test_max_recordings_bounds_running_snapshots_and_kept_jumps() -> None:
    p, q = ColorCore("p", incarnation=1, max_recordings=2), ColorCore("q", incarnation=2)
    start(p, 1)
    start(p, 2)
    assert "2 snapshots are running" in failures(p.start_snapshot(3, now=0.0))[3]
    start(q, 10)
    assert p.receive(q.send("p"), message(), now=0.0, wall=WALL) == ()  # every kept jump is claimed
    assert p.color == 10 and p.recorded_ranges == [(0, 1), (1, 2)]  # the color rose, unrecorded
    p.finish_snapshot(1)
    assert "no kept recording covers it" in failures(p.start_snapshot(10, now=0.0))[10]
    # Jumps no snapshot claims make room for new ones, the oldest first.
    start(q, 20)
    deliver(p, q.send("p"))
    assert p.recorded_ranges == [(1, 2), (10, 20)]
    p.finish_snapshot(2)
    for color in (30, 40):
        start(q, color)
        deliver(p, q.send("p"))
    assert p.recorded_ranges == [(20, 30), (30, 40)]
    only_part(p.start_snapshot(25, now=0.0))
    assert only_part(start(p, 50)).snapshot_id == 50  # a start, too, makes room rather than being refused
    assert p.recorded_ranges == [(20, 30), (40, 50)]
    p.finish_snapshot(25)
    assert "no kept recording covers it" in failures(p.start_snapshot(35, now=0.0))[35]


def test_max_recorded_bytes_fails_the_jump_and_its_later_claims() -> None:
    p, q, _ = trio(max_recorded_bytes=100)
    stamps = [q.send("p") for _ in range(3)]
    start(q, 9)
    deliver(p, q.send("p"))  # jump 0 -> 9
    start(p, 4)
    assert p.receive(stamps[0], message(b"x" * 60), now=0.0, wall=WALL) == ()
    reason = failures(p.receive(stamps[1], message(b"x" * 60), now=0.0, wall=WALL))[4]
    assert "recorded bytes exceeded the bound" in reason
    assert p.receive(stamps[2], message(b"x" * 60), now=0.0, wall=WALL) == ()  # no longer recorded
    assert "recorded bytes" in failures(p.start_snapshot(9, now=0.0))[9]


def test_finish_forgets_a_snapshot_and_its_jump_stays_until_its_deadline() -> None:
    p, q, _ = trio(default_lifetime=10.0)
    start(q, 8)
    deliver(p, q.send("p"), now=1.0)  # the jump (0, 8], kept until 11.0 unless claimed longer
    only_part(p.start_snapshot(5, now=2.0))
    only_part(p.start_snapshot(8, now=2.0))
    p.finish_snapshot(5)
    assert p.recorded_ranges == [(0, 8)] and p.active_snapshots == [8]
    assert p.start_snapshot(5, now=2.0) == ()  # late start of a finished snapshot
    p.finish_snapshot(8)
    assert p.recorded_ranges == [(0, 8)] and p.active_snapshots == [] and p.next_deadline == 11.0
    assert target(p, q, 8, sent=0) == []
    # Another detector's id in its range, started after the last claim ended, is served from it.
    late = only_part(p.start_snapshot(7, now=3.0))
    assert late.snapshot_id == 7 and late.state == state()
    assert p.expire(11.0) == () and p.recorded_ranges == [(0, 8)]  # claimed: kept past its own deadline
    p.finish_snapshot(7)
    assert p.expire(11.0) == () and p.recorded_ranges == [] and p.next_deadline is None
    assert "no kept recording covers it" in failures(p.start_snapshot(6, now=11.0))[6]


def test_new_epoch_drops_its_spaces_snapshots_but_keeps_the_color_and_the_jumps() -> None:
    """Detector 1 (ids 1 mod 128) starts again on a fresh store; detector 0's snapshot runs on."""
    p, q, _ = trio()
    start(p, 128)  # detector 0: the jump (0, 128]
    p.finish_snapshot(128)
    start(p, 129)  # detector 1: the jump (128, 129]
    p.finish_snapshot(129)
    start(p, 384)  # detector 0, running: the jump (129, 384]
    only_part(p.start_snapshot(257, now=0.0))  # detector 1, running, served from the same jump
    call(q, p, b"in flight")
    p.new_epoch(1)
    assert p.active_snapshots == [384] and p.color == 384
    assert p.recorded_ranges == [(0, 128), (128, 129), (129, 384)]
    assert "not started here" in failures(target(p, q, 257, sent=1))[257]  # 257 is unknown now
    assert p.start_snapshot(128, now=0.0) == ()  # detector 0's finished ids are remembered
    # Detector 1's ids run again, served from the kept jumps; detector 0's snapshot completes.
    assert only_part(p.start_snapshot(129, now=0.0)).snapshot_id == 129
    assert [part.snapshot_id for part in target(p, q, 384, sent=0)] == [384]
    p.new_epoch()  # detector 0's turn: its running snapshot goes, detector 1's stays
    assert p.active_snapshots == [129] and p.color == 384
    with pytest.raises(LocalProtocolError, match="replica"):
        p.new_epoch(128)


# -- the simulator (rpc_world.py) ----------------------------------------------------------------


def run(scenario: Scenario) -> World:
    """Play ``scenario`` to the end and check every completed cut."""
    return play_checked(World(scenario))


@settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_every_completed_cut_is_consistent_exact_and_conserves_units(scenario: Scenario) -> None:
    run(scenario)


def test_the_simulation_completes_cuts_with_messages_in_flight_and_after_resets() -> None:
    """The property above is not vacuous: many cuts complete, with channels and after resets."""
    rng = random.Random(13)
    seen: Counter[str] = Counter()
    for _ in range(30):
        world = run(random_scenario(rng))
        seen["stale"] += world.stale
        for tally in world.snapshots.values():
            seen[str(tally.outcome)] += 1
            if tally.outcome == "completed":
                seen["in flight"] += any(channel.messages for channel in tally.channels.values())
                seen["after a reset"] += any(session > 0 for _, session in tally.counts.values())
                seen["across a reset"] += tally.across_resets
    assert seen["completed"] >= 60 and seen["failed"] >= 10, seen
    assert seen["in flight"] >= 40 and seen["after a reset"] >= 30 and seen["across a reset"] >= 1, seen
    assert seen["stale"] >= 20, seen


def test_a_process_that_joins_mid_snapshot_records_before_its_first_message() -> None:
    p, q, r = trio(default_lifetime=10.0)  # r starts now, while 9 runs: color 0, no counts
    start(p, 9)
    start(q, 9)
    assert r.color == 0 and r.peers() == []
    assert r.receive(q.send("r"), message(b"hello"), now=1.0, wall=WALL) == (RecordState(9),)
    assert r.record_state(9, state(2)) == ()  # nothing claimed 9 here yet
    assert r.received_count("q") == 1  # delivered after the recording, of color 9: in no channel
    # The start reaches r late: served from the jump, with r's counts before its first message.
    part = only_part(r.start_snapshot(9, now=1.0))
    assert part.state == state(2)
    assert all(n == 0 for n, _ in outbound(part).values())
    # What r sends now has color 9: p recorded 9 already, so it records nothing and waits for nothing.
    assert deliver(p, r.send("p"), b"from r") == []
    assert p.recorded_ranges == [(0, 9)]


def test_a_process_that_joins_and_is_no_member_drops_its_jump_quietly() -> None:
    _, q, r = trio(default_lifetime=10.0)
    start(q, 9)
    record(r, r.receive(q.send("r"), message(), now=1.0, wall=WALL))
    assert r.recorded_ranges == [(0, 9)] and r.next_deadline == 11.0
    assert r.expire(11.0) == ()  # no start claimed it: no part, no failure, nothing kept
    assert r.recorded_ranges == [] and r.active_snapshots == [] and r.color == 9
