"""A raw gRPC client feeds hand-made frames to a live agent: every bad frame is refused with a reason.

The client speaks ``Peer.Channel`` directly (stablewatch.v1 stubs, frames from
``stablewatch.agents.frames.encode`` or built by hand), pretending to be process A sending to the
agent B. For each refusal the test checks the gRPC status code, the reason in the status details,
the ``stablewatch_agent_rejected_frames_total{reason=...}`` counter, and that the refused frame
delivered nothing while what the channel accepted before it stays delivered, once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import pytest

from stablewatch.agents import Agent, AppMessage
from stablewatch.agents.frames import encode
from stablewatch.v1 import ChannelAck, ChannelFrame, ChannelHello, channel_pb2_grpc

TIMEOUT = 10.0
REJECTED = "stablewatch_agent_rejected_frames_total"
REASONS = ("no_hello", "unknown_channel", "sequence_gap", "malformed")


def hello(src: str = "A", dst: str = "B", incarnation: int = 1) -> ChannelHello:
    return ChannelHello(src=src, dst=dst, sender_incarnation=incarnation)


def messages(*payloads: bytes) -> list[AppMessage]:
    return [AppMessage(payload) for payload in payloads]


def numbered(start: int, stop: int) -> list[AppMessage]:
    return messages(*(b"m%d" % i for i in range(start, stop)))


class Receiver:
    """Agent B, what its handler got, and raw streams into it."""

    def __init__(self, agent: Agent, stub: channel_pb2_grpc.PeerStub) -> None:
        self.agent = agent
        self.stub = stub
        self.got: list[tuple[str, bytes]] = []

    def stream(self) -> RawStream:
        return RawStream(self.stub.Channel(timeout=TIMEOUT))

    def payloads(self) -> list[bytes]:
        return [payload for _, payload in self.got]

    def rejected(self) -> dict[str, float]:
        registry = self.agent.metrics.registry
        return {reason: registry.get_sample_value(REJECTED, {"reason": reason}) or 0 for reason in REASONS}


class RawStream:
    """One ``Peer.Channel`` call: write a frame, read its acknowledgement or the error."""

    def __init__(self, call: Any) -> None:
        self.call = call

    async def send(self, frame: ChannelFrame) -> ChannelAck:
        await self.call.write(frame)
        ack = await self.call.read()
        assert ack is not grpc.aio.EOF, "the stream ended instead of acknowledging"
        return ack

    async def refused(self, frame: ChannelFrame) -> grpc.aio.AioRpcError:
        """Write ``frame`` and return the error that ends the stream."""
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await self.call.write(frame)
            ack = await self.call.read()
            raise AssertionError(f"the frame was accepted: {ack}")
        return info.value

    def close(self) -> None:
        self.call.cancel()


def run(scenario: Callable[[Receiver], Awaitable[None]]) -> None:
    """Start agent B, run ``scenario`` against it with a raw client, and clean up."""

    async def main() -> None:
        receiver: Receiver | None = None

        def handler(src: str, message: AppMessage) -> None:
            assert receiver is not None
            receiver.got.append((src, message.payload))

        agent = Agent("B", handler=handler)
        await agent.start()
        channel = grpc.aio.insecure_channel(agent.address)
        try:
            receiver = Receiver(agent, channel_pb2_grpc.PeerStub(channel))
            await scenario(receiver)
        finally:
            await channel.close()
            await agent.stop()

    asyncio.run(asyncio.wait_for(main(), 3 * TIMEOUT))


def assert_refusal(
    error: grpc.aio.AioRpcError, code: grpc.StatusCode, reason: str, receiver: Receiver, *more: str
) -> None:
    assert error.code() == code, (error.code(), error.details())
    details = error.details() or ""
    assert f"{reason}: " in details, details
    for text in more:
        assert text in details, details
    assert receiver.rejected() == {r: (1 if r == reason else 0) for r in REASONS}


# -- the hello ----------------------------------------------------------------------------------


def test_first_frame_without_hello_is_invalid_argument() -> None:
    async def scenario(receiver: Receiver) -> None:
        error = await receiver.stream().refused(encode(0, numbered(0, 3)))
        assert_refusal(error, grpc.StatusCode.INVALID_ARGUMENT, "no_hello", receiver)
        assert receiver.got == []

    run(scenario)


@pytest.mark.parametrize(
    "bad_hello",
    [hello(dst="Z"), hello(src="B"), hello(src="")],
    ids=["another-destination", "from-itself", "no-source"],
)
def test_hello_for_a_channel_that_does_not_end_here_is_failed_precondition(bad_hello: ChannelHello) -> None:
    async def scenario(receiver: Receiver) -> None:
        error = await receiver.stream().refused(encode(0, numbered(0, 3), bad_hello))
        assert_refusal(error, grpc.StatusCode.FAILED_PRECONDITION, "unknown_channel", receiver)
        assert receiver.got == []
        # The agent still takes a proper channel.
        ack = await receiver.stream().send(encode(0, numbered(0, 1), hello()))
        assert ack.next_seq == 1
        assert receiver.payloads() == [b"m0"]

    run(scenario)


def test_stream_of_an_earlier_sender_incarnation_is_refused() -> None:
    """A new sender incarnation restarts the channel; the old incarnation's stream is then stale."""

    async def scenario(receiver: Receiver) -> None:
        old = receiver.stream()
        assert (await old.send(encode(0, numbered(0, 2), hello(incarnation=1)))).next_seq == 2
        new = receiver.stream()
        restarted = encode(0, messages(b"n0"), hello(incarnation=2))  # its numbers start again
        assert (await new.send(restarted)).next_seq == 1
        error = await old.refused(encode(2, numbered(2, 3)))
        assert_refusal(error, grpc.StatusCode.FAILED_PRECONDITION, "unknown_channel", receiver, "superseded")
        assert receiver.payloads() == [b"m0", b"m1", b"n0"]
        new.close()

    run(scenario)


# -- sequence numbers ---------------------------------------------------------------------------


def test_sequence_gap_is_out_of_range_and_keeps_what_came_before() -> None:
    async def scenario(receiver: Receiver) -> None:
        stream = receiver.stream()
        ack = await stream.send(encode(0, numbered(0, 3), hello()))
        assert (ack.next_seq, ack.receiver_incarnation) == (3, receiver.agent.incarnation)
        error = await stream.refused(encode(5, numbered(5, 7)))
        assert_refusal(error, grpc.StatusCode.OUT_OF_RANGE, "sequence_gap", receiver, "expected entry 3, got 5")
        assert receiver.payloads() == [b"m0", b"m1", b"m2"]
        assert all(src == "A" for src, _ in receiver.got)

        # A new stream that continues at the right number is accepted.
        again = receiver.stream()
        assert (await again.send(encode(3, numbered(3, 5), hello()))).next_seq == 5
        assert receiver.payloads() == [b"m%d" % i for i in range(5)]
        again.close()

    run(scenario)


def test_duplicates_are_acknowledged_but_delivered_once() -> None:
    """Resent frames (wholly or partly acknowledged already) are not delivered again.

    A frame that brings nothing new gets no acknowledgement of its own (one repeating the last
    would say the receiver holds the window): the acknowledgement of what follows covers it.
    """

    async def scenario(receiver: Receiver) -> None:
        stream = receiver.stream()
        assert (await stream.send(encode(0, numbered(0, 3), hello()))).next_seq == 3
        await stream.call.write(encode(0, numbered(0, 3)))  # the same frame again
        assert (await stream.send(encode(1, numbered(1, 5)))).next_seq == 5  # overlaps: m3, m4 are new
        assert receiver.payloads() == [b"m%d" % i for i in range(5)]
        stream.close()

        # After a reconnect the sender resends from what it last saw acknowledged.
        again = receiver.stream()
        assert (await again.send(encode(2, numbered(2, 5), hello()))).next_seq == 5
        assert (await again.send(encode(4, numbered(4, 6)))).next_seq == 6
        assert receiver.payloads() == [b"m%d" % i for i in range(6)]
        assert receiver.rejected() == dict.fromkeys(REASONS, 0)
        again.close()

    run(scenario)


# -- malformed frames ---------------------------------------------------------------------------


def _frame(first_seq: int, payloads: Sequence[bytes], **fields: Any) -> ChannelFrame:
    frame = ChannelFrame(first_seq=first_seq, payloads=list(payloads))
    for marker in fields.get("markers", ()):
        frame.markers.add(**marker)
    for extras in fields.get("extras", ()):
        frame.extras.add(**extras)
    return frame


MALFORMED = {
    "marker-beyond-payloads": (
        lambda seq: _frame(seq, [b"a", b"b"], markers=[{"position": 2, "snapshot_id": 7}]),
        "marker at position 2 but the frame has 2 entries",
    ),
    "extras-beyond-payloads": (
        lambda seq: _frame(seq, [b"a"], extras=[{"position": 5, "no_wake": True}]),
        "extras at position 5 but the frame has 1 entries",
    ),
    "marker-and-extras-on-one-position": (
        lambda seq: _frame(
            seq, [b"", b"b"], markers=[{"position": 0, "snapshot_id": 7}], extras=[{"position": 0, "no_wake": True}]
        ),
        "two annotations claim position 0",
    ),
    "two-markers-on-one-position": (
        lambda seq: _frame(seq, [b""], markers=[{"position": 0, "snapshot_id": 7}, {"position": 0, "snapshot_id": 8}]),
        "two annotations claim position 0",
    ),
    "marker-with-a-payload": (
        lambda seq: _frame(seq, [b"a", b"x"], markers=[{"position": 1, "snapshot_id": 7}]),
        "marker at position 1 carries a payload",
    ),
}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_malformed_frame_is_invalid_argument_and_delivers_nothing(kind: str) -> None:
    build, detail = MALFORMED[kind]

    async def scenario(receiver: Receiver) -> None:
        stream = receiver.stream()
        assert (await stream.send(encode(0, numbered(0, 2), hello()))).next_seq == 2
        error = await stream.refused(build(2))
        assert_refusal(error, grpc.StatusCode.INVALID_ARGUMENT, "malformed", receiver, detail)
        assert receiver.payloads() == [b"m0", b"m1"]

        # The channel goes on from where it was.
        again = receiver.stream()
        assert (await again.send(encode(2, numbered(2, 3), hello()))).next_seq == 3
        assert receiver.payloads() == [b"m0", b"m1", b"m2"]
        again.close()

    run(scenario)


def test_malformed_first_frame_is_refused_before_its_hello_opens_the_channel() -> None:
    async def scenario(receiver: Receiver) -> None:
        frame = _frame(0, [b"a"], markers=[{"position": 3, "snapshot_id": 1}])
        frame.hello.CopyFrom(hello())
        error = await receiver.stream().refused(frame)
        assert_refusal(error, grpc.StatusCode.INVALID_ARGUMENT, "malformed", receiver)
        assert receiver.got == []
        # The refused hello opened nothing: a channel may still start at any number.
        assert (await receiver.stream().send(encode(10, numbered(10, 11), hello()))).next_seq == 11
        assert receiver.payloads() == [b"m10"]

    run(scenario)
