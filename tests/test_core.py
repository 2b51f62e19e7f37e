"""Scripted unit tests of the sans-I/O protocol core: feed events, check the actions returned."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import pytest
from core_actions import only_part, parts

from stablewatch.agents.core import (
    LOCAL_ID_BASE,
    Action,
    AppMessage,
    Entry,
    LocalProtocolError,
    Marker,
    RecordState,
    RemoteProtocolError,
    ReportPart,
    Run,
    SendEntry,
    SnapshotCore,
    SnapshotFailed,
    apply_recording,
)
from stablewatch.detector.assembly import Assembler, Completed, recorded_messages
from stablewatch.v1 import AckPosition, GlobalSnapshot, InboundChannelState, LocalSnapshotPart, LocalState
from stablewatch.v1.ids import ID_SPACES

TOKENS = "tokens"


# -- helpers --------------------------------------------------------------------------------------


def balance(tokens: int) -> LocalState:
    """A local state holding ``tokens`` tokens."""
    return LocalState(counters={TOKENS: tokens})


def token(payload: bytes, tokens: int = 1) -> AppMessage:
    """An application message carrying ``tokens`` tokens."""
    return AppMessage(payload, {TOKENS: tokens})


def record(core: SnapshotCore, actions: Sequence[Action], state: LocalState | None = None) -> list[Action]:
    """Carry out the RecordState in ``actions`` with ``state`` (an empty one by default)."""
    return apply_recording(core, actions, lambda _snapshot_id: state or LocalState())


def markers(actions: Sequence[Action]) -> list[tuple[str, int]]:
    """(destination, snapshot id) of every marker among ``actions``, in order."""
    return [
        (action.dst, action.entry.snapshot_id)
        for action in actions
        if isinstance(action, SendEntry) and isinstance(action.entry, Marker)
    ]


def outbound_counts(part: LocalSnapshotPart) -> dict[str, int]:
    """n per destination reported in ``part``."""
    return {count.dst: count.sent_before_marker for count in part.outbound}


def inbound(part: LocalSnapshotPart, src: str) -> InboundChannelState:
    """The state of channel ``src -> part.process_id`` in ``part``."""
    found = [channel for channel in part.inbound if channel.src == src]
    assert len(found) == 1, f"expected the channel from {src} once in {part}"
    return found[0]


def payloads(channel: InboundChannelState) -> list[bytes]:
    """The payloads recorded on ``channel``, in order."""
    return [message.payload for message in recorded_messages(channel)]


def recording_core(process: str = "p", outbound: Sequence[str] = ("q",), snapshot_id: int = 1) -> SnapshotCore:
    """A core that has started and recorded ``snapshot_id``."""
    core = SnapshotCore(process, outbound)
    record(core, core.start_snapshot(snapshot_id))
    return core


class Network:
    """Cores joined by FIFO channels, with an Assembler as the detector; every step is explicit.

    Balances are debited on send and credited on delivery; the state recorded is the balance.
    """

    def __init__(self, links: dict[str, list[str]], balances: dict[str, int]) -> None:
        self.balances = dict(balances)
        self.cores = {process: SnapshotCore(process, links.get(process, ())) for process in balances}
        self.queues: dict[tuple[str, str], deque[Entry]] = {}
        self.assembler = Assembler()
        self.completed: dict[int, GlobalSnapshot] = {}

    def begin(self, snapshot_id: int) -> None:
        """The detector begins collecting ``snapshot_id`` from every process."""
        self.assembler.begin(snapshot_id, self.balances)

    def start(self, process: str, snapshot_id: int) -> list[Action]:
        """The detector tells ``process`` to start ``snapshot_id``."""
        return self._apply(process, self.cores[process].start_snapshot(snapshot_id))

    def open(self, src: str, dst: str) -> list[Action]:
        """``src`` opens its channel to ``dst``."""
        return self._apply(src, self.cores[src].open_outbound(dst))

    def send(self, src: str, dst: str, payload: bytes, tokens: int = 1) -> None:
        """``src`` sends ``tokens`` to ``dst``."""
        self.balances[src] -= tokens
        message = token(payload, tokens)
        self.cores[src].send(dst)
        self.queues.setdefault((src, dst), deque()).append(message)

    def deliver(self, src: str, dst: str) -> list[Action]:
        """Deliver the oldest entry on ``src -> dst``; returns the receiver's resolved actions."""
        entry = self.queues[(src, dst)].popleft()
        actions = self._apply(dst, self.cores[dst].receive(src, entry))
        if isinstance(entry, AppMessage):
            self.balances[dst] += (entry.counters or {}).get(TOKENS, 0)
        return actions

    def _apply(self, process: str, actions: Sequence[Action]) -> list[Action]:
        core = self.cores[process]
        resolved = apply_recording(core, actions, lambda _k: balance(self.balances[process]))
        for action in resolved:
            if isinstance(action, SendEntry):
                self.queues.setdefault((process, action.dst), deque()).append(action.entry)
            elif isinstance(action, ReportPart):
                outcome = self.assembler.add_part(action.part, sender=process)
                if isinstance(outcome, Completed):
                    self.completed[outcome.snapshot.snapshot_id] = outcome.snapshot
                    for other in self.cores.values():
                        other.finish_snapshot(outcome.snapshot.snapshot_id)
        return resolved


def assert_proof_holds(snapshot: GlobalSnapshot) -> None:
    """Every channel of ``snapshot`` satisfies m + len(recorded) == n."""
    for channel in snapshot.channels:
        assert channel.received_before_recording + len(channel.messages) == channel.sent_before_marker


# -- recording and markers ------------------------------------------------------------------------


def test_start_snapshot_records_then_puts_markers_on_every_outbound_channel_in_sorted_order() -> None:
    core = SnapshotCore("p", ["c", "a", "b"])
    actions = core.start_snapshot(7)
    assert actions == (
        RecordState(7),
        SendEntry("a", Marker(7)),
        SendEntry("b", Marker(7)),
        SendEntry("c", Marker(7)),
    )
    assert core.outbound_channels == ["a", "b", "c"]


def test_record_state_reports_state_and_outbound_counts() -> None:
    core = SnapshotCore("p", ["a", "b"])
    core.send("a")
    core.send("a")
    core.send("b")
    core.start_snapshot(1)
    part = only_part(core.record_state(1, balance(5)))
    assert part.snapshot_id == 1
    assert part.process_id == "p"
    assert part.state == balance(5)
    assert [(count.dst, count.sent_before_marker) for count in part.outbound] == [("a", 2), ("b", 1)]
    assert list(part.inbound) == []  # nothing ever arrived: every inbound channel has m = 0, left out
    assert core.active_snapshots == [1]


def test_record_state_reports_every_inbound_channel_as_it_stands_open_until_its_marker() -> None:
    core = SnapshotCore("p", ["a", "b", "c"])
    core.receive_message("a", token(b"a1"))
    core.receive_message("b", token(b"b1"))
    core.receive_message("b", token(b"b2"))
    core.receive_message("c", token(b"c1"))
    actions = core.receive_marker("c", 1)  # c's marker: c -> p is closed, empty; the others record on
    part = only_part(core.record_state(1, balance(0), {"b": [Run([token(b"b2")], 3)]}))
    ends = {c.src: (c.received_before_recording, payloads(c), c.open) for c in part.inbound}
    assert ends == {"a": (1, [], True), "b": (1, [b"b2"], True), "c": (1, [], False)}
    assert markers(actions) == [("a", 1), ("b", 1), ("c", 1)]
    # A message in flight is reported as it arrives, with the same m; markers report nothing.
    late = inbound(only_part(core.receive_message("a", token(b"a2"))), "a")
    assert (late.received_before_recording, payloads(late), late.open) == (1, [b"a2"], True)
    assert core.receive_marker("a", 1) == () and core.receive_marker("b", 1) == ()


def test_first_marker_records_and_its_channel_is_empty() -> None:
    core = SnapshotCore("p", ["b", "a"])
    core.receive_message("a", token(b"early"))
    core.receive_message("a", token(b"early2"))
    core.send("b")
    actions = core.receive_marker("a", 3)
    assert actions == (RecordState(3), SendEntry("a", Marker(3)), SendEntry("b", Marker(3)))
    part = only_part(core.record_state(3, balance(1)))
    assert part.state == balance(1)
    assert outbound_counts(part) == {"a": 0, "b": 1}
    channel = inbound(part, "a")
    assert channel.received_before_recording == 2
    assert payloads(channel) == []
    # Later messages on the closed channel are not part of the snapshot.
    assert core.receive_message("a", token(b"late")) == ()


def test_receive_dispatches_markers_and_messages() -> None:
    core = SnapshotCore("p", ["q"])
    assert core.receive("q", token(b"m")) == ()
    assert core.received_count("q") == 1
    assert core.receive("q", Marker(1)) == (RecordState(1), SendEntry("q", Marker(1)))


@pytest.mark.parametrize(
    "event",
    [
        pytest.param(lambda core: core.send("q"), id="send"),
        pytest.param(lambda core: core.receive_message("q", token(b"m")), id="receive_message"),
        pytest.param(lambda core: core.receive_marker("q", 2), id="receive_marker"),
        pytest.param(lambda core: core.receive("q", Marker(1)), id="receive"),
        pytest.param(lambda core: core.start_snapshot(2), id="start_snapshot"),
        pytest.param(lambda core: core.open_outbound("r"), id="open_outbound"),
        pytest.param(lambda core: core.finish_snapshot(1), id="finish_snapshot"),
    ],
)
def test_every_event_before_record_state_is_a_local_error(event: Callable[[SnapshotCore], object]) -> None:
    core = SnapshotCore("p", ["q"])
    core.start_snapshot(1)
    with pytest.raises(LocalProtocolError, match=r"record_state\(1"):
        event(core)
    # The refused event changed nothing: the recording still completes as if it never happened.
    part = only_part(core.record_state(1, balance(4)))
    assert outbound_counts(part) == {"q": 0}
    assert core.received_count("q") == 0
    assert core.outbound_channels == ["q"]


def test_record_state_with_a_wrong_id_or_nothing_awaited_is_a_local_error() -> None:
    core = SnapshotCore("p", ["q"])
    with pytest.raises(LocalProtocolError, match="awaits no state"):
        core.record_state(1, LocalState())
    core.start_snapshot(1)
    with pytest.raises(LocalProtocolError, match="awaits snapshot 1"):
        core.record_state(2, LocalState())
    assert only_part(core.record_state(1, LocalState())).snapshot_id == 1
    with pytest.raises(LocalProtocolError, match="awaits no state"):
        core.record_state(1, LocalState())


# -- channel states and proof counts --------------------------------------------------------------


def test_messages_between_recording_and_marker_are_recorded_and_after_it_not() -> None:
    core = SnapshotCore("p", ["q"])
    core.receive_message("q", token(b"before"))
    part = only_part(record(core, core.start_snapshot(1), balance(0)))
    so_far = inbound(part, "q")
    assert (so_far.received_before_recording, payloads(so_far), so_far.open) == (1, [], True)
    first = inbound(only_part(core.receive_message("q", token(b"in1", 2))), "q")
    second = inbound(only_part(core.receive_message("q", AppMessage(b"in2", no_wake=True))), "q")
    assert core.receive_marker("q", 1) == ()
    for channel in (first, second):
        assert (channel.received_before_recording, channel.open) == (1, True)
    assert (payloads(first), payloads(second)) == ([b"in1"], [b"in2"])
    (in1,), (in2,) = recorded_messages(first), recorded_messages(second)
    assert dict(in1.counters) == {TOKENS: 2}
    assert not in1.no_wake
    assert in2.no_wake
    assert dict(in2.counters) == {}
    assert [in1.receive_index, in2.receive_index] == [2, 3]
    assert core.receive_message("q", token(b"after")) == ()
    assert core.received_count("q") == 4


def test_counts_n_and_m_per_channel() -> None:
    core = SnapshotCore("p", ["a", "b"])
    for _ in range(3):
        core.send("a")
    core.receive_message("a", token(b"y"))
    core.receive_message("b", token(b"y"))
    core.receive_message("b", token(b"y"))
    part = only_part(record(core, core.start_snapshot(1)))
    assert outbound_counts(part) == {"a": 3, "b": 0}
    assert {c.src: c.received_before_recording for c in part.inbound} == {"a": 1, "b": 2}
    core.send("a")  # not counted in this snapshot's n
    from_b = inbound(only_part(core.receive_message("b", token(b"z"))), "b")
    assert (from_b.received_before_recording, payloads(from_b)) == (2, [b"z"])
    assert core.receive_marker("a", 1) == () and core.receive_marker("b", 1) == ()
    assert core.sent_count("a") == 4


def test_concurrent_snapshots_record_one_message_in_both() -> None:
    core = SnapshotCore("p", ["a", "b"])
    record(core, core.start_snapshot(1))
    record(core, core.receive_marker("b", 2))
    assert core.active_snapshots == [1, 2]
    for_1_from_a, for_2_from_a = parts(core.receive_message("a", token(b"shared")))
    (for_1_from_b,) = parts(core.receive_message("b", token(b"only-1")))  # b -> p is closed for 2, open for 1
    assert [part.snapshot_id for part in (for_1_from_a, for_2_from_a, for_1_from_b)] == [1, 2, 1]
    assert payloads(inbound(for_1_from_a, "a")) == [b"shared"]
    assert payloads(inbound(for_2_from_a, "a")) == [b"shared"]
    assert payloads(inbound(for_1_from_b, "b")) == [b"only-1"]
    assert inbound(for_1_from_b, "b").received_before_recording == 0


def test_concurrent_snapshots_each_put_their_own_marker_after_earlier_messages() -> None:
    core = SnapshotCore("p", ["q"])
    record(core, core.start_snapshot(1))
    core.send("q")
    part = only_part(record(core, core.start_snapshot(2)))
    assert outbound_counts(part) == {"q": 1}  # sent after marker 1, before marker 2


def test_several_initiators_of_one_snapshot() -> None:
    core = SnapshotCore("p", ["q"])
    record(core, core.start_snapshot(1))
    assert core.start_snapshot(1) == ()  # the detector's start arrives twice
    # The other initiator's marker closes the channel instead of starting over (nothing was
    # recorded on it, so there is nothing to report): a second one is the peer's error.
    assert core.receive_marker("q", 1) == ()
    assert core.active_snapshots == [1]
    with pytest.raises(RemoteProtocolError, match="second marker"):
        core.receive_marker("q", 1)
    other = SnapshotCore("p", ["q"])
    record(other, other.receive_marker("q", 5))
    assert other.start_snapshot(5) == ()  # the start arrives after a marker
    assert other.active_snapshots == [5]


# -- channels that open during a snapshot ---------------------------------------------------------


def test_inbound_channel_opening_after_recording_is_recorded_from_its_first_message() -> None:
    core = recording_core("p", ["q"], snapshot_id=1)
    channel = inbound(only_part(core.receive_messages("new", [token(b"first"), token(b"second")])), "new")
    assert (channel.received_before_recording, channel.open) == (0, True)
    assert payloads(channel) == [b"first", b"second"]
    assert core.receive_marker("new", 1) == ()


def test_open_outbound_during_snapshots_sends_their_markers_first_with_n_zero() -> None:
    core = recording_core("p", ["q"], snapshot_id=2)
    record(core, core.start_snapshot(1))
    actions = core.open_outbound("r")
    assert markers(actions) == [("r", 1), ("r", 2)]
    assert isinstance(actions[0], SendEntry)  # the marker is the first entry on the channel
    new_parts = parts(actions)
    assert [(part.snapshot_id, part.process_id) for part in new_parts] == [(1, "p"), (2, "p")]
    for part in new_parts:
        assert outbound_counts(part) == {"r": 0}
        assert not part.HasField("state")
    assert core.open_outbound("r") == ()  # already open
    assert core.open_outbound("q") == ()
    assert core.outbound_channels == ["q", "r"]


def test_open_outbound_without_running_snapshots_reports_nothing() -> None:
    core = SnapshotCore("p")
    assert core.open_outbound("q") == ()
    core.send("q")
    assert core.sent_count("q") == 1


def test_send_on_a_channel_that_is_not_open_is_a_local_error() -> None:
    core = recording_core("p", ["q"], snapshot_id=1)
    with pytest.raises(LocalProtocolError, match=r"channel p -> r is not open: call open_outbound first"):
        core.send("r")
    assert core.sent_count("r") == 0
    assert core.outbound_channels == ["q"]


def drain(net: Network) -> None:
    """Deliver everything in flight, one channel after another in name order."""
    while any(net.queues.values()):
        for channel in sorted(net.queues):
            if net.queues[channel]:
                net.deliver(*channel)


def test_open_outbound_on_a_new_channel_during_a_snapshot_lets_the_snapshot_complete() -> None:
    net = Network({"q": ["p"]}, {"p": 5, "q": 5})
    net.send("q", "p", b"in flight")  # keeps the snapshot running until it arrives
    net.begin(1)
    net.start("p", 1)
    net.start("q", 1)
    assert 1 not in net.completed
    assert markers(net.open("p", "q")) == [("q", 1)]
    net.send("p", "q", b"after the marker")
    drain(net)
    snapshot = net.completed[1]
    assert_proof_holds(snapshot)
    assert [(c.src, c.dst, c.sent_before_marker, len(c.messages)) for c in snapshot.channels] == [
        ("p", "q", 0, 0),
        ("q", "p", 1, 1),
    ]


def test_a_snapshot_of_quiet_channels_completes_on_the_states_alone() -> None:
    """No marker needs to arrive: every channel is proven by the counts in the two states."""
    net = Network({"p": ["q"], "q": ["p"]}, {"p": 5, "q": 5})
    net.send("p", "q", b"delivered before")
    net.deliver("p", "q")
    net.begin(1)
    net.start("p", 1)
    assert 1 not in net.completed
    net.start("q", 1)
    snapshot = net.completed[1]
    assert_proof_holds(snapshot)
    assert [(c.src, c.dst, c.sent_before_marker, c.received_before_recording) for c in snapshot.channels] == [
        ("p", "q", 1, 1),
        ("q", "p", 0, 0),
    ]
    assert [m for queue in net.queues.values() for m in queue] == [Marker(1), Marker(1)]  # still on their way
    assert net.deliver("p", "q") == [] and net.deliver("q", "p") == []  # late markers: ignored


# -- errors and forgetting ------------------------------------------------------------------------


def test_second_marker_of_one_snapshot_on_one_channel_is_a_remote_error() -> None:
    core = SnapshotCore("p", ["q"])
    record(core, core.receive_marker("q", 1))
    with pytest.raises(RemoteProtocolError, match=r"second marker of snapshot 1 on channel q -> p"):
        core.receive_marker("q", 1)
    record(core, core.start_snapshot(2))
    core.receive_marker("q", 2)
    with pytest.raises(RemoteProtocolError):
        core.receive("q", Marker(2))


def test_finish_snapshot_forgets_it_and_ignores_late_markers() -> None:
    core = SnapshotCore("p", ["a", "b"])
    record(core, core.start_snapshot(1))
    record(core, core.start_snapshot(2))
    core.finish_snapshot(1)
    assert core.active_snapshots == [2]
    (recorded,) = parts(core.receive_message("a", token(b"m")))  # for 2 only
    assert (recorded.snapshot_id, payloads(inbound(recorded, "a"))) == (2, [b"m"])
    assert core.receive_marker("a", 1) == ()  # late marker: no new recording, no part
    assert core.start_snapshot(1) == ()
    assert core.active_snapshots == [2]
    core.finish_snapshot(2)
    core.finish_snapshot(2)  # idempotent
    core.finish_snapshot(9)  # never seen: its markers are ignored from now on
    assert core.receive_marker("b", 9) == ()
    assert core.active_snapshots == []


def test_recorded_bytes_bound_fails_only_that_snapshot() -> None:
    core = SnapshotCore("p", ["q"], max_recorded_bytes=40)
    record(core, core.start_snapshot(1))
    assert [p.snapshot_id for p in parts(core.receive_message("q", AppMessage(b"x" * 30)))] == [1]
    record(core, core.start_snapshot(2))  # starts after 30 bytes were recorded for snapshot 1
    failed, for_2 = core.receive_message("q", AppMessage(b"y" * 20))
    assert isinstance(failed, SnapshotFailed) and isinstance(for_2, ReportPart)
    assert failed.snapshot_id == 1
    assert "process p" in failed.reason
    assert "bound" in failed.reason
    assert "50 > 40" in failed.reason
    # Snapshot 1 records nothing more and reports nothing; snapshot 2 goes on.
    assert payloads(inbound(for_2.part, "q")) == [b"y" * 20]
    (more,) = parts(core.receive_message("q", AppMessage(b"z")))
    assert (more.snapshot_id, payloads(inbound(more, "q"))) == (2, [b"z"])
    assert core.receive_marker("q", 1) == () and core.receive_marker("q", 2) == ()
    assert core.active_snapshots == [1, 2]  # the detector aborts 1, then finishes it
    core.finish_snapshot(1)
    assert core.active_snapshots == [2]


def test_recorded_bytes_bound_counts_counters_too() -> None:
    core = SnapshotCore("p", ["q"], max_recorded_bytes=40)
    record(core, core.start_snapshot(1))
    assert len(parts(core.receive_message("q", AppMessage(b"", {"a": 1, "b": 2})))) == 1  # 32 bytes
    (failed,) = core.receive_message("q", AppMessage(b"", {"a": 1}))
    assert failed == SnapshotFailed(1, failed.reason)


def test_failed_snapshot_still_puts_markers_on_a_new_channel_but_reports_nothing() -> None:
    core = SnapshotCore("p", ["q"], max_recorded_bytes=1)
    record(core, core.start_snapshot(1))
    assert len(core.receive_message("q", AppMessage(b"xx"))) == 1
    assert core.open_outbound("r") == (SendEntry("r", Marker(1)),)


@pytest.mark.parametrize(
    "misuse",
    [
        pytest.param(lambda: SnapshotCore(""), id="empty-process-id"),
        pytest.param(lambda: SnapshotCore("p", ["p"]), id="outbound-to-itself"),
        pytest.param(lambda: SnapshotCore("p", [""]), id="empty-outbound"),
        pytest.param(lambda: SnapshotCore("p", max_recorded_bytes=0), id="zero-bound"),
        pytest.param(lambda: SnapshotCore("p").send("p"), id="send-to-itself"),
        pytest.param(lambda: SnapshotCore("p").send(""), id="send-to-empty"),
        pytest.param(lambda: SnapshotCore("p").open_outbound("p"), id="open-to-itself"),
        pytest.param(lambda: SnapshotCore("p").open_outbound(""), id="open-to-empty"),
    ],
)
def test_self_channels_and_empty_ids_are_local_errors(misuse: Callable[[], object]) -> None:
    with pytest.raises(LocalProtocolError):
        misuse()


@pytest.mark.parametrize(
    "receive",
    [
        pytest.param(lambda core: core.receive_message("p", token(b"m")), id="message-from-itself"),
        pytest.param(lambda core: core.receive_message("", token(b"m")), id="message-from-empty"),
        pytest.param(lambda core: core.receive_marker("p", 1), id="marker-from-itself"),
        pytest.param(lambda core: core.receive_marker("", 1), id="marker-from-empty"),
    ],
)
def test_receiving_from_itself_or_an_empty_id_is_a_local_error(
    receive: Callable[[SnapshotCore], object],
) -> None:
    with pytest.raises(LocalProtocolError):
        receive(SnapshotCore("p", ["q"]))


def test_apply_recording_splices_the_recorded_part_in_place() -> None:
    core = SnapshotCore("p", ["a", "b"])
    captured: list[int] = []

    def capture(snapshot_id: int) -> LocalState:
        captured.append(snapshot_id)
        return balance(9)

    resolved = apply_recording(core, core.start_snapshot(4), capture)
    assert captured == [4]
    assert [type(action) for action in resolved] == [ReportPart, SendEntry, SendEntry]
    assert only_part(resolved).state == balance(9)
    assert markers(resolved) == [("a", 4), ("b", 4)]
    assert apply_recording(core, (), capture) == []
    assert apply_recording(core, [SendEntry("a", Marker(4))], capture) == [SendEntry("a", Marker(4))]
    assert captured == [4]


# -- hand-checked classic examples ----------------------------------------------------------------


def test_two_process_example_p1_records_message_in_flight() -> None:
    """P2 sends M to P1; P1 records and sends its marker; M reaches P1 after P1 recorded."""
    net = Network({"P1": ["P2"], "P2": ["P1"]}, {"P1": 10, "P2": 10})
    net.begin(1)
    net.send("P2", "P1", b"M", tokens=3)
    p1_actions = net.start("P1", 1)
    assert markers(p1_actions) == [("P2", 1)]
    p1_part = only_part(p1_actions)
    assert p1_part.state == balance(10)
    assert outbound_counts(p1_part) == {"P2": 0}

    # M arrives after P1 recorded: in flight, reported as it comes.
    p1_channel = inbound(only_part(net.deliver("P2", "P1")), "P2")
    assert (payloads(p1_channel), p1_channel.received_before_recording, p1_channel.open) == ([b"M"], 0, True)
    assert 1 not in net.completed  # P2 has not recorded: its n of P2 -> P1 is unknown
    p2_actions = net.deliver("P1", "P2")  # the marker: P2 records, P1 -> P2 is empty
    assert markers(p2_actions) == [("P1", 1)]
    p2_part = only_part(p2_actions)
    assert p2_part.state == balance(7)
    assert outbound_counts(p2_part) == {"P1": 1}
    assert list(p2_part.inbound) == []  # P1 -> P2 carried nothing before its marker: m = 0, left out
    assert p1_channel.received_before_recording + len(payloads(p1_channel)) == 1  # m + len == n
    assert net.deliver("P2", "P1") == []  # P2's marker finds snapshot 1 complete already

    snapshot = net.completed[1]
    assert_proof_holds(snapshot)
    assert [channel.src + "->" + channel.dst for channel in snapshot.channels] == ["P1->P2", "P2->P1"]
    in_flight = snapshot.channels[1]
    assert (in_flight.sent_before_marker, in_flight.received_before_recording) == (1, 0)
    assert [message.payload for message in in_flight.messages] == [b"M"]
    total = sum(process.state.counters[TOKENS] for process in snapshot.processes)
    total += sum(m.counters[TOKENS] for channel in snapshot.channels for m in channel.messages)
    assert total == 20


def test_token_received_before_the_marker_is_in_the_balance_not_the_channel() -> None:
    net = Network({"P1": ["P2"], "P2": ["P1"]}, {"P1": 5, "P2": 0})
    net.begin(1)
    net.send("P1", "P2", b"token")
    net.start("P1", 1)
    assert net.deliver("P1", "P2") == []  # P2 has not recorded: the token goes into its balance
    p2_part = only_part(net.deliver("P1", "P2"))
    assert p2_part.state == balance(1)
    channel = inbound(p2_part, "P1")
    assert (channel.received_before_recording, payloads(channel)) == (1, [])
    net.deliver("P2", "P1")
    snapshot = net.completed[1]
    assert_proof_holds(snapshot)
    assert all(len(channel.messages) == 0 for channel in snapshot.channels)
    assert {p.process_id: p.state.counters[TOKENS] for p in snapshot.processes} == {"P1": 4, "P2": 1}


def test_token_received_after_recording_and_before_the_marker_is_in_the_channel() -> None:
    net = Network({"P1": ["P2"], "P2": ["P1"]}, {"P1": 5, "P2": 0})
    net.begin(1)
    net.send("P1", "P2", b"token", tokens=2)
    net.start("P2", 1)  # P2 records with balance 0 while the token is on its way
    net.start("P1", 1)  # P1 records after sending: n = 1 on P1 -> P2
    channel = inbound(only_part(net.deliver("P1", "P2")), "P1")  # reported as it arrives
    assert (channel.received_before_recording, payloads(channel)) == (0, [b"token"])
    assert 1 in net.completed  # the last message in flight: every channel is proven
    assert net.deliver("P1", "P2") == []  # its marker, late
    net.deliver("P2", "P1")
    snapshot = net.completed[1]
    assert_proof_holds(snapshot)
    balances = {p.process_id: p.state.counters[TOKENS] for p in snapshot.processes}
    assert balances == {"P1": 3, "P2": 0}
    assert (
        sum(balances.values()) + sum(m.counters[TOKENS] for channel in snapshot.channels for m in channel.messages) == 5
    )


# -- deadlines ------------------------------------------------------------------------------------


def test_a_started_recording_is_dropped_at_its_deadline_and_reported() -> None:
    core = SnapshotCore("p", ["q"])
    record(core, core.start_snapshot(1, now=100.0, lifetime=5.0))
    core.receive_message("q", token(b"in flight"))
    assert core.next_deadline == 105.0
    assert core.expire(104.9) == ()
    assert core.active_snapshots == [1]
    (failed,) = core.expire(105.0)
    assert failed.snapshot_id == 1
    assert "process p" in failed.reason and "deadline" in failed.reason
    assert core.active_snapshots == [] and core.next_deadline is None
    # Gone for good: its late marker and a repeated start begin nothing.
    assert core.receive_marker("q", 1, now=106.0) == ()
    assert core.start_snapshot(1, now=106.0, lifetime=5.0) == ()
    assert core.remembered_snapshots == 1


def test_a_recording_begun_by_a_marker_lives_the_default_lifetime_until_its_start_arrives() -> None:
    core = SnapshotCore("p", ["q"], default_lifetime=30.0)
    record(core, core.receive_marker("q", 1, now=10.0))
    record(core, core.receive_marker("q", 2, now=10.0))
    assert core.next_deadline == 40.0
    assert core.start_snapshot(1, now=11.0, lifetime=2.0) == ()  # the start takes over: 13.0
    assert core.start_snapshot(1, now=12.0, lifetime=50.0) == ()  # a repeated start changes nothing
    assert core.start_snapshot(2, now=11.0) == ()  # no lifetime: the marker's default stands
    (failed,) = core.expire(13.0)
    assert failed.snapshot_id == 1
    assert core.active_snapshots == [2]
    assert [f.snapshot_id for f in core.expire(40.0)] == [2]


def test_events_without_a_time_are_dated_by_the_latest_time_passed() -> None:
    core = SnapshotCore("p", ["q"], default_lifetime=10.0)
    assert core.expire(50.0) == ()
    record(core, core.receive_marker("q", 1))  # no now: 50.0
    record(core, core.start_snapshot(2, lifetime=1.0))
    assert core.next_deadline == 51.0
    record(core, core.start_snapshot(3, now=40.0, lifetime=1.0))  # time never runs backwards
    assert sorted(f.snapshot_id for f in core.expire(51.0)) == [2, 3]
    assert [f.snapshot_id for f in core.expire(60.0)] == [1]


def test_a_recording_that_failed_already_expires_quietly() -> None:
    core = SnapshotCore("p", ["q"], max_recorded_bytes=1)
    record(core, core.start_snapshot(1, now=0.0, lifetime=1.0))
    assert len(core.receive_message("q", AppMessage(b"xx"))) == 1  # failed: reported once
    assert core.expire(1.0) == ()
    assert core.active_snapshots == []


def test_a_negative_lifetime_is_a_local_error() -> None:
    with pytest.raises(LocalProtocolError, match="lifetime"):
        SnapshotCore("p").start_snapshot(1, now=0.0, lifetime=-1.0)
    with pytest.raises(LocalProtocolError, match="default_lifetime"):
        SnapshotCore("p", default_lifetime=0)


# -- the bound on concurrent recordings ----------------------------------------------------------


def test_beyond_max_recordings_a_new_snapshot_is_refused_with_a_reason() -> None:
    core = SnapshotCore("p", ["q"], max_recordings=2)
    record(core, core.start_snapshot(1, now=0.0))
    record(core, core.receive_marker("q", 2, now=0.0))
    (refused,) = core.start_snapshot(3, now=0.0)
    assert isinstance(refused, SnapshotFailed) and refused.snapshot_id == 3
    assert "refused" in refused.reason and "max_recordings" in refused.reason
    (refused_marker,) = core.receive_marker("q", 4, now=0.0)
    assert refused_marker.snapshot_id == 4
    assert core.active_snapshots == [1, 2]
    # A refused snapshot stays refused: its other markers and starts begin nothing later.
    core.finish_snapshot(1)
    assert core.receive_marker("q", 3, now=0.0) == ()
    assert core.start_snapshot(4, now=0.0) == ()
    assert isinstance(core.start_snapshot(5, now=0.0)[0], RecordState)


def test_max_recordings_must_be_positive() -> None:
    with pytest.raises(LocalProtocolError, match="max_recordings"):
        SnapshotCore("p", max_recordings=0)


# -- snapshot ids: epochs and the local id space -------------------------------------------------


def test_after_thousands_of_finished_ids_small_ids_are_ignored_until_a_new_epoch() -> None:
    """A detector on a fresh store starts again at small ids: the new epoch makes them heard."""
    core = SnapshotCore("p", ["q"])
    for k in range(1000, 1000 + 5000):  # the detector of space 0: its ids are multiples of 128
        core.finish_snapshot(k * ID_SPACES)
    assert core.remembered_snapshots == 4096
    assert core.start_snapshot(ID_SPACES, now=0.0) == ()  # taken for a late start of a forgotten one
    record(core, core.start_snapshot(6000 * ID_SPACES, now=0.0))  # a running one of the old epoch
    core.new_epoch()
    assert core.active_snapshots == []
    assert core.remembered_snapshots == 0
    assert isinstance(core.start_snapshot(ID_SPACES, now=0.0)[0], RecordState)


def test_local_ids_are_a_space_of_their_own() -> None:
    """Thousands of finished local snapshots never make the detector's ids look finished."""
    core = SnapshotCore("p", ["q"])
    for offset in range(5000):
        core.finish_snapshot(LOCAL_ID_BASE + offset)
    record(core, core.start_snapshot(LOCAL_ID_BASE + 9000, now=0.0))
    assert isinstance(core.start_snapshot(7 * ID_SPACES, now=0.0)[0], RecordState)
    assert only_part(core.record_state(7 * ID_SPACES, LocalState())).snapshot_id == 7 * ID_SPACES
    core.new_epoch()  # detector snapshots go; the local one stays, and so does its memory
    assert core.active_snapshots == [LOCAL_ID_BASE + 9000]
    assert core.receive_marker("q", LOCAL_ID_BASE + 4999, now=0.0) == ()


def test_a_new_epoch_forgets_only_its_own_id_space() -> None:
    """Detector 1 restarts on a fresh store: detector 0's snapshots, running or finished, stay."""
    core = SnapshotCore("p", ["q"])
    core.receive_message("q", token(b"before"))
    for snapshot_id in (2 * ID_SPACES, 2 * ID_SPACES + 1, LOCAL_ID_BASE + 5):  # spaces 0, 1 and local
        record(core, core.start_snapshot(snapshot_id, now=0.0), balance(1))
    core.finish_snapshot(ID_SPACES)  # space 0
    core.finish_snapshot(ID_SPACES + 1)  # space 1
    core.new_epoch(1)
    assert core.active_snapshots == [2 * ID_SPACES, LOCAL_ID_BASE + 5]
    assert core.remembered_snapshots == 1
    assert core.start_snapshot(ID_SPACES, now=0.0) == ()  # still finished
    assert core.receive_marker("q", ID_SPACES, now=0.0) == ()
    # Detector 1's old ids are heard again, as new snapshots of its new epoch.
    assert isinstance(core.start_snapshot(ID_SPACES + 1, now=0.0)[0], RecordState)
    part = only_part(core.record_state(ID_SPACES + 1, balance(1)))
    assert inbound(part, "q").received_before_recording == 1
    # Detector 0's running snapshot goes on: a message in flight, then its marker.
    late = parts(core.receive_message("q", token(b"late")))
    assert {p.snapshot_id: payloads(inbound(p, "q")) for p in late} == {
        2 * ID_SPACES: [b"late"],
        ID_SPACES + 1: [b"late"],
        LOCAL_ID_BASE + 5: [b"late"],
    }
    assert core.receive_marker("q", 2 * ID_SPACES, now=0.0) == ()  # its channel closes
    after = parts(core.receive_message("q", token(b"after")))
    assert sorted(p.snapshot_id for p in after) == [ID_SPACES + 1, LOCAL_ID_BASE + 5]


def test_the_forgotten_ids_memory_is_kept_per_id_space() -> None:
    """Thousands of detector 0's ids forgotten never make detector 1's smaller ids look finished."""
    core = SnapshotCore("p", ["q"])
    for k in range(1000, 1000 + 5000):
        core.finish_snapshot(k * ID_SPACES)  # space 0, far ahead of detector 1's clock
    assert core.start_snapshot(5 * ID_SPACES, now=0.0) == ()  # below space 0's forgotten ones
    # Detector 1's ids are far smaller, yet none of them was ever finished.
    for k in (5, 6):
        assert isinstance(core.start_snapshot(k * ID_SPACES + 1, now=0.0)[0], RecordState)
        assert only_part(core.record_state(k * ID_SPACES + 1, LocalState())).snapshot_id == k * ID_SPACES + 1
        core.finish_snapshot(k * ID_SPACES + 1)
    # Detector 1's own finished ids, forgotten in turn, are below only in space 1.
    for k in range(10, 10 + 5000):
        core.finish_snapshot(k * ID_SPACES + 1)
    assert core.start_snapshot(7 * ID_SPACES + 1, now=0.0) == ()
    record(core, core.start_snapshot(7 * ID_SPACES + 2, now=0.0))  # space 2 never forgot anything
    assert core.active_snapshots == [7 * ID_SPACES + 2]
    core.new_epoch(1)  # detector 1's new store: its small ids are heard again; space 0's stay finished
    assert core.start_snapshot(5 * ID_SPACES, now=0.0) == ()
    assert isinstance(core.start_snapshot(7 * ID_SPACES + 1, now=0.0)[0], RecordState)


# -- messages that arrived but were not received yet ---------------------------------------------


def test_undelivered_messages_at_recording_are_in_flight_and_not_counted_in_m() -> None:
    core = SnapshotCore("p", ["q"])
    core.receive_messages("q", [token(b"m1"), token(b"m2"), token(b"m3")])  # arrivals 1..3
    # The application has taken m1; m2 and m3 wait in the driver's queue.
    actions = core.start_snapshot(1, now=0.0)
    (part,) = parts(core.record_state(1, balance(0), {"q": [Run([token(b"m2"), token(b"m3")], 2)]}))
    so_far = inbound(part, "q")
    assert (so_far.received_before_recording, payloads(so_far), so_far.open) == (1, [b"m2", b"m3"], True)
    assert [m.receive_index for m in recorded_messages(so_far)] == [2, 3]
    channel = inbound(only_part(core.receive_message("q", token(b"m4"))), "q")
    assert channel.received_before_recording == 1
    assert (payloads(channel), channel.open) == ([b"m4"], True)
    assert [m.receive_index for m in recorded_messages(channel)] == [4]
    assert core.receive_marker("q", 1) == ()
    assert markers(actions) == [("q", 1)]


def test_a_marker_taken_in_ahead_of_queued_messages_records_them_as_its_channel() -> None:
    """The first marker of k arrives behind two undelivered messages of its channel."""
    core = SnapshotCore("p", ["q", "r"])
    core.receive_messages("q", [token(b"a"), token(b"b")])
    core.receive_messages("r", [token(b"c")])
    actions = core.receive_marker("q", 1, now=0.0)
    assert markers(actions) == [("q", 1), ("r", 1)]
    undelivered = {"q": [Run([token(b"a"), token(b"b")], 1)], "r": [Run([token(b"c")], 3)]}
    part = only_part(core.record_state(1, balance(0), undelivered))
    from_q = inbound(part, "q")
    assert (from_q.received_before_recording, payloads(from_q), from_q.open) == (0, [b"a", b"b"], False)
    from_r = inbound(part, "r")
    assert (from_r.received_before_recording, payloads(from_r), from_r.open) == (0, [b"c"], True)
    assert core.receive_marker("r", 1) == ()


def test_more_undelivered_than_arrived_is_a_local_error() -> None:
    core = SnapshotCore("p", ["q"])
    core.receive_message("q", token(b"a"))
    core.start_snapshot(1, now=0.0)
    with pytest.raises(LocalProtocolError, match="2 messages undelivered on q -> p, but only 1 arrived"):
        core.record_state(1, LocalState(), {"q": [Run([token(b"a"), token(b"b")], 1)]})
    assert only_part(core.record_state(1, LocalState(), {"q": [Run([token(b"a")], 1)]})).snapshot_id == 1


def test_undelivered_bytes_count_against_the_bound() -> None:
    core = SnapshotCore("p", ["q"], max_recorded_bytes=3)
    core.receive_message("q", AppMessage(b"abcd"))
    core.start_snapshot(1, now=0.0)
    (failed,) = core.record_state(1, LocalState(), {"q": [Run([AppMessage(b"abcd")], 1)]})
    assert isinstance(failed, SnapshotFailed) and "bound" in failed.reason
    assert core.receive_marker("q", 1) == ()


def test_acknowledgement_positions_at_recording_travel_in_the_parts() -> None:
    """The driver's acknowledgement positions at the recording moment reach the state part as
    given, per outbound and per inbound channel (one known only by its acknowledgement too)."""
    seen_by_p = AckPosition(sender_incarnation=10, receiver_incarnation=20, next_seq=3)
    acked_by_p = AckPosition(sender_incarnation=30, receiver_incarnation=10, next_seq=7)
    core = SnapshotCore("p", ["q", "r"])
    assert isinstance(core.start_snapshot(1)[0], RecordState)
    first = only_part(core.record_state(1, balance(0), acked={"q": acked_by_p}, acks_seen={"q": seen_by_p}))
    assert {count.dst: count.ack_seen for count in first.outbound} == {"q": seen_by_p, "r": AckPosition()}
    assert first.outbound[0].HasField("ack_seen") and not first.outbound[1].HasField("ack_seen")
    channel = inbound(first, "q")
    assert (channel.acked, channel.received_before_recording, channel.open) == (acked_by_p, 0, True)
    assert [c.src for c in first.inbound] == ["q"]  # s had nothing and no acknowledgement: left out
    assert core.receive_marker("q", 1) == () and core.receive_marker("s", 1) == ()


def test_acknowledgement_positions_reach_the_global_snapshot() -> None:
    seen = AckPosition(sender_incarnation=1, receiver_incarnation=2, next_seq=4)
    acked = AckPosition(sender_incarnation=1, receiver_incarnation=2, next_seq=6)
    p, q = SnapshotCore("p", ["q"]), SnapshotCore("q", ["p"])
    assembler = Assembler()
    assembler.begin(1, ["p", "q"])
    for core in (p, q):
        assert isinstance(core.start_snapshot(1)[0], RecordState)  # the markers cross: no message
    actions = [
        *p.record_state(1, balance(0), acks_seen={"q": seen}),
        *q.record_state(1, balance(0), acked={"p": acked}),
        *q.receive_marker("p", 1),
        *p.receive_marker("q", 1),
    ]
    done = [assembler.add_part(part) for part in parts(actions)]
    snapshot = next(result for result in done if isinstance(result, Completed)).snapshot
    by_channel = {(c.src, c.dst): c for c in snapshot.channels}
    assert by_channel["p", "q"].sender_ack_seen == seen
    assert by_channel["p", "q"].receiver_acked == acked
    assert not by_channel["q", "p"].HasField("sender_ack_seen")
    assert not by_channel["q", "p"].HasField("receiver_acked")


@pytest.mark.parametrize(
    ("process_id", "problem"),
    [("", "process id is empty"), ("p" * 257, "longer than 256 bytes"), ("a\nb", "control character")],
)
def test_a_process_id_the_detector_would_refuse_is_refused_at_once(process_id: str, problem: str) -> None:
    """An agent learns of a bad id when it is built, not from a detector that keeps refusing it."""
    with pytest.raises(LocalProtocolError, match=problem):
        SnapshotCore(process_id)
