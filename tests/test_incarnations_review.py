"""Incarnations and channel errors: a zombie is no restart, a frame is never taken twice.

Each test pins a case found by a review (reproductions first written read-only):

* a hello from an OLDER incarnation of a sender (a zombie still running after its restart) was
  taken as a restart: the receiver started the channel again, the current sender's messages were
  delivered twice, and the zombie's were counted as the current sender's (a made-up deadlock);
* an acknowledgement from an OLDER receiver incarnation was taken as the receiver's restart: the
  sender's count reset, and the zombie's acknowledgements dropped what the current receiver never got;
* a restarted sender's marker of a snapshot its old incarnation had closed the channel for was a
  "second marker" error, and the messages before it in its frame, handed over already, came again
  with every resend of the frame;
* a state provider that raised left the core awaiting a state forever: the agent was wedged.

Raw ``Peer.Channel`` streams stand in for senders (as in test_agent_truth_review.py), so a restart
or a zombie is one hello.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc
import pytest
from prometheus_client import CollectorRegistry

from polling import async_poll
from stablewatch.agents import Agent, ChannelSettings
from stablewatch.agents.core import (
    AppMessage,
    Marker,
    RecordState,
    RemoteProtocolError,
    ReportPart,
    SnapshotCore,
    SnapshotFailed,
)
from stablewatch.agents.frames import encode
from stablewatch.agents.metrics import AgentMetrics
from stablewatch.agents.outbound import OutboundChannel
from stablewatch.detector.assembly import Assembler, Completed, PartRejected
from stablewatch.detector.evaluation import evaluate, verdict
from stablewatch.v1 import (
    AckPosition,
    ChannelAck,
    ChannelFrame,
    ChannelHello,
    LocalSnapshotPart,
    LocalState,
    Wait,
    WaitNode,
    channel_pb2_grpc,
)

pytestmark = pytest.mark.timeout(60)
TIMEOUT = 10.0

Scenario = Callable[[Agent, channel_pb2_grpc.PeerStub, list[bytes]], Awaitable[None]]


def hello(incarnation: int) -> ChannelHello:
    return ChannelHello(src="A", dst="B", sender_incarnation=incarnation)


async def send(call: grpc.aio.StreamStreamCall, frame: ChannelFrame) -> ChannelAck:
    """Write ``frame`` and read the acknowledgement it gets."""
    await call.write(frame)
    ack = await asyncio.wait_for(call.read(), TIMEOUT)
    assert ack is not grpc.aio.EOF, "the stream ended instead of acknowledging"
    return ack


async def refusal(call: grpc.aio.StreamStreamCall, frame: ChannelFrame) -> grpc.aio.AioRpcError:
    """Write ``frame`` and return the error the stream ends with."""
    await call.write(frame)
    try:
        answer = await asyncio.wait_for(call.read(), TIMEOUT)
    except grpc.aio.AioRpcError as error:
        return error
    pytest.fail(f"the frame was taken (answered {answer!r}), not refused")


def with_b(scenario: Scenario, settings: ChannelSettings | None = None) -> None:
    """Run ``scenario`` against agent B, whose synchronous handler collects the payloads it gets."""

    async def main() -> None:
        got: list[bytes] = []
        agent = Agent("B", handler=lambda src, m: got.append(m.payload), channel_settings=settings, hint_after=None)
        await agent.start()
        channel = grpc.aio.insecure_channel(agent.address)
        try:
            await scenario(agent, channel_pb2_grpc.PeerStub(channel), got)
        finally:
            await channel.close()
            await agent.stop()

    asyncio.run(asyncio.wait_for(main(), 3 * TIMEOUT))


# -- a zombie sender -----------------------------------------------------------------------------


def test_a_zombie_senders_hello_is_refused_and_resets_nothing() -> None:
    """A2 sends m0..m2 (acknowledgement left for later); a zombie stream of A1 says hello. It is
    refused, naming its stale incarnation; A2's stream goes on, and every message is delivered once."""

    async def scenario(agent: Agent, stub: channel_pb2_grpc.PeerStub, got: list[bytes]) -> None:
        current = stub.Channel(timeout=TIMEOUT)
        assert (await send(current, encode(0, (), hello(2)))).next_seq == 0
        frame = encode(0, [b"m0", b"m1", b"m2"])
        frame.ack_later = True
        await current.write(frame)
        await async_poll(lambda: len(got) == 3, "m0..m2 delivered")
        zombie = stub.Channel(timeout=TIMEOUT)
        error = await refusal(zombie, encode(0, (), hello(1)))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "stale sender incarnation 1" in (error.details() or "")
        assert (await send(current, encode(3, [b"m3"]))).next_seq == 4  # A2's stream was not superseded
        assert got == [b"m0", b"m1", b"m2", b"m3"]
        assert agent._core.received_count("A") == 4
        current.cancel()

    with_b(scenario, ChannelSettings(ack_delay=5.0))


def test_a_zombie_senders_message_is_not_counted_and_no_deadlock_is_made_up() -> None:
    """A2 waits on B and has sent B w (which wakes B), not yet read by B; B waits on A. A zombie of
    A1 says hello with a message z: refused, z is neither delivered nor counted. B records with m = 0
    for A -> B, w arrives and is recorded in flight, and the cut proves no deadlock A <-> B."""

    async def scenario(agent: Agent, stub: channel_pb2_grpc.PeerStub, got: list[bytes]) -> None:
        parts: list[LocalSnapshotPart] = []
        agent.on_part(parts.append)
        agent.state.add_wait("A")
        current = stub.Channel(timeout=TIMEOUT)
        assert (await send(current, encode(0, (), hello(2)))).next_seq == 0
        zombie = stub.Channel(timeout=TIMEOUT)
        await refusal(zombie, encode(0, [b"z"], hello(1)))
        assert got == [] and agent._core.received_count("A") == 0
        snapshot_id = await agent.start_snapshot(9)
        assert (await send(current, encode(0, [b"w"]))).next_seq == 1  # w, in flight at the cut
        assert got == [b"w"]
        current.cancel()
        a = SnapshotCore("A", ["B"])
        a.send("B", 1)
        assert isinstance(a.start_snapshot(snapshot_id, now=0.0)[0], RecordState)
        a_wait = Wait(task="", targets=[WaitNode(process="B")], instance=1, began_at_us=1)
        seen = {"B": AckPosition(sender_incarnation=2, receiver_incarnation=agent.incarnation, next_seq=0)}
        a_actions = a.record_state(snapshot_id, LocalState(active=True, waits=[a_wait]), acks_seen=seen)
        assembler = Assembler()
        assembler.begin(snapshot_id, ["A", "B"])
        b_parts = [p for p in parts if p.snapshot_id == snapshot_id]
        a_parts = [x.part for x in a_actions if isinstance(x, ReportPart)]
        outcomes = [assembler.add_part(part) for part in [*a_parts, *b_parts]]
        done = [o for o in outcomes if isinstance(o, Completed)]
        assert done, f"the cut with w in flight is provable: {outcomes}"
        (channel,) = [c for c in done[0].snapshot.channels if c.src == "A"]
        assert channel.received_before_recording == 0
        result = verdict(evaluate(done[0].snapshot).results[0])
        assert result != "true", "a deadlock A <-> B reported while w, which wakes B, was in flight"

    with_b(scenario)


# -- a zombie receiver ---------------------------------------------------------------------------


def test_an_older_receiver_incarnation_drops_the_stream_and_resets_nothing() -> None:
    """A talks to B2 (incarnation 2) and reaches a zombie B1: B1's acknowledgement ends the stream
    without a restart, and drops nothing from the window; B2's and then a newer B3's still count."""

    async def main() -> None:
        restarts: list[int] = []
        channel = OutboundChannel(
            "A", "B", "127.0.0.1:1", incarnation=1, settings=ChannelSettings(),
            metrics=AgentMetrics(CollectorRegistry()), on_receiver_restart=restarts.append,
        )  # fmt: skip
        channel._acknowledge(ChannelAck(next_seq=0, receiver_incarnation=2))  # B2 answers the hello
        channel.push(b"m0", 10)
        channel.push(b"m1", 10)
        channel._next_frame()
        channel._next_to_write = channel._head  # the stream broke: reconnect, to the zombie B1
        with pytest.raises(ConnectionError, match="stale receiver incarnation 1"):
            channel._acknowledge(ChannelAck(next_seq=0, receiver_incarnation=1))
        assert restarts == [] and channel.unacknowledged == 2
        assert channel.ack_seen is not None and channel.ack_seen.receiver_incarnation == 2
        channel._next_frame()  # the next stream reaches B2 again
        channel._acknowledge(ChannelAck(next_seq=2, receiver_incarnation=2))
        assert restarts == [] and channel.unacknowledged == 0
        channel.push(b"m2", 10)
        channel._next_frame()
        channel._acknowledge(ChannelAck(next_seq=2, receiver_incarnation=3))  # B restarted: B3
        assert restarts == [1]

    asyncio.run(main())


# -- a second marker after a sender restart ------------------------------------------------------


def test_a_restarted_senders_marker_of_a_channel_closed_before_is_ignored_once() -> None:
    """Core: the old sender's marker closed A -> B for k; after the reset, the new sender's marker k
    is its first, not an error. A further one is."""
    b = SnapshotCore("B", ["A"])
    k = 7
    assert isinstance(b.start_snapshot(k, now=0.0)[0], RecordState)
    b.record_state(k, LocalState(active=True))
    assert b.receive_marker("A", k) == ()
    assert b.reset_inbound("A") == ()  # the channel was closed for k: k is not failed
    assert b.receive_marker("A", k) == ()
    with pytest.raises(RemoteProtocolError, match="second marker"):
        b.receive_marker("A", k)


async def attempt(stub: channel_pb2_grpc.PeerStub, incarnation: int, first_seq: int, frame: ChannelFrame) -> str:
    """One stream of A from ``first_seq``: hello, then ``frame``; how it ended."""
    call = stub.Channel(timeout=TIMEOUT)
    try:
        await send(call, encode(first_seq, (), hello(incarnation)))
        await call.write(frame)
        end = frame.first_seq + len(frame.payloads)
        while (ack := await asyncio.wait_for(call.read(), TIMEOUT)) is not grpc.aio.EOF:
            if ack.next_seq == end:
                return "acknowledged"
        return "ended"
    except grpc.aio.AioRpcError as error:
        return f"{error.code().name}: {error.details()}"
    finally:
        call.cancel()


def test_a_restarted_senders_marker_of_a_closed_channel_delivers_nothing_twice() -> None:
    """B records local snapshot L; A1's marker L closes A -> B. A2 sends m0, its marker L (it
    recorded L on B's marker resent to it), m1: taken once, acknowledged."""

    async def scenario(agent: Agent, stub: channel_pb2_grpc.PeerStub, got: list[bytes]) -> None:
        local = await agent.start_snapshot()
        old = stub.Channel(timeout=TIMEOUT)
        assert (await send(old, encode(0, [Marker(local)], hello(1)))).next_seq == 1
        old.cancel()
        outcome = await attempt(stub, 2, 0, encode(0, [b"m0", Marker(local), b"m1"]))
        assert outcome == "acknowledged"
        assert got == [b"m0", b"m1"]

    with_b(scenario)


def test_a_frame_refused_at_a_marker_is_not_taken_again_from_its_start() -> None:
    """A (one incarnation) sends marker L twice, a protocol error, the second after m0 in one
    frame. The error ends the stream; each resend of the frame starts at the marker, not at m0."""

    async def scenario(agent: Agent, stub: channel_pb2_grpc.PeerStub, got: list[bytes]) -> None:
        local = await agent.start_snapshot()
        first = stub.Channel(timeout=TIMEOUT)
        assert (await send(first, encode(0, [Marker(local)], hello(1)))).next_seq == 1
        first.cancel()
        frame = encode(1, [b"m0", Marker(local), b"m1"])
        outcomes = [await attempt(stub, 1, 1, frame) for _ in range(3)]
        assert all("second marker" in outcome for outcome in outcomes), outcomes
        assert got == [b"m0"], f"B's handler got {got}; A's streams: {outcomes}"
        assert agent._core.received_count("A") == 1

    with_b(scenario)


# -- a state provider that raises ------------------------------------------------------------------


def test_a_failing_state_capture_fails_its_snapshot_and_wedges_nothing(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []

    def provider() -> LocalState:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the application's state was briefly unavailable")
        return LocalState(active=True)

    async def main() -> tuple[list[str], list[int]]:
        agent = Agent("B", peers={"A": "127.0.0.1:1"}, state_provider=provider, hint_after=None)
        parts: list[LocalSnapshotPart] = []
        agent.on_part(parts.append)
        failures: list[str] = []
        record_state = agent._core.record_state

        def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
            actions = record_state(*args, **kwargs)
            failures.extend(a.reason for a in actions if isinstance(a, SnapshotFailed))
            return actions

        agent._core.record_state = spy  # type: ignore[method-assign]
        await agent.start()
        try:
            assert await agent.start_snapshot(5) == 5
            assert await agent.start_snapshot(6) == 6
            await agent.send("A", b"x")
        finally:
            await agent.stop()
        return failures, [p.snapshot_id for p in parts]

    with caplog.at_level(logging.ERROR, logger="stablewatch.agents.agent"):
        failures, reported = asyncio.run(main())
    assert len(failures) == 1 and "RuntimeError: the application's state was briefly unavailable" in failures[0]
    # Snapshot 6 reports (its state, then the channel to A opened during it); 5 reports nothing.
    assert set(reported) == {6}, "no part for the snapshot whose state could not be captured"
    assert any("snapshot 5" in record.getMessage() for record in caplog.records)


def test_a_channel_is_not_proven_with_counts_of_two_sender_incarnations() -> None:
    # From the same review: S1 records snapshot k (n(S->R) = 3, all received by R) and restarts
    # before the detector notices; R sees S2's hello (its counts start again), receives two of
    # S2's messages and records k (m = 2, the channel open), then records S2's third: 2 + 1 = n.
    # The counts are of two incarnations of S, and the "proven" cut counted S2's tokens as S1's
    # (conservation said violated: 13 of 10). The ends' acknowledgement positions name the
    # incarnations each recorded with: they differ, and the channel is inconsistent.
    k, token = 128 * 1000, AppMessage(b"t", {"tokens": 1})
    s1, r = SnapshotCore("S", ["R"]), SnapshotCore("R")
    s1.send("R", 3)
    r.receive_messages("S", [token] * 3)
    assembler = Assembler()
    assembler.begin(k, ["R", "S"])

    def record(core: SnapshotCore, tokens: int, **positions: dict[str, AckPosition]) -> list[LocalSnapshotPart]:
        assert isinstance(core.start_snapshot(k, now=0.0)[0], RecordState)
        state = LocalState(active=True, counters={"tokens": tokens})
        return [a.part for a in core.record_state(k, state, **positions) if isinstance(a, ReportPart)]

    seen = AckPosition(sender_incarnation=1, receiver_incarnation=7, next_seq=3)  # S1's, from R
    outcomes = [assembler.add_part(p) for p in record(s1, 7, acks_seen={"R": seen})]
    r.reset_inbound("S")
    r.receive_messages("S", [token] * 2)
    acked = AckPosition(sender_incarnation=2, receiver_incarnation=7, next_seq=2)  # R's, to S2
    [r_part] = record(r, 5, acked={"S": acked})
    with pytest.raises(PartRejected) as rejected:
        assembler.add_part(r_part)
    assert str(rejected.value) == (
        "inconsistent_counts: snapshot 128000 channel S->R is inconsistent: S recorded as incarnation 1 "
        "talking to R incarnation 7, R as incarnation 7 hearing from S incarnation 2"
    )
    assert rejected.value.aborted is not None  # the snapshot is given up, with that reason
    assert not [o for o in outcomes if isinstance(o, Completed)]
