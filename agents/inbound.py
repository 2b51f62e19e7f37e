"""The receiving end of every channel into one agent: the ``Peer`` gRPC service.

Each sender opens one stream per channel. The first frame carries a hello naming the channel;
every frame carries consecutive entries from a sequence number. Entries this agent already has
(a sender resending after a reconnect) are dropped; a frame that skips ahead is refused, because
accepting it would lose what lies between. Each frame is acknowledged, cumulatively, once its
entries have been delivered.

The per-channel sequence state lives here, not in the gRPC server, so it survives a restart of the
server (for example to reload certificates). A hello with a new sender incarnation means the
sender restarted: its sequence numbers and counts start again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from stablewatch.agents.core import Entry
from stablewatch.agents.frames import FrameError, decode
from stablewatch.agents.metrics import AgentMetrics
from stablewatch.agents.tls import check_channel_peer
from stablewatch.v1 import ChannelAck, ChannelFrame, channel_pb2_grpc

__all__ = ["InboundChannels"]

_STATUS = {
    "no_hello": grpc.StatusCode.INVALID_ARGUMENT,
    "unknown_channel": grpc.StatusCode.FAILED_PRECONDITION,
    "sequence_gap": grpc.StatusCode.OUT_OF_RANGE,
    "malformed": grpc.StatusCode.INVALID_ARGUMENT,
    "spoofed": grpc.StatusCode.PERMISSION_DENIED,
}


@dataclass(slots=True)
class _Expected:
    sender_incarnation: int
    next_seq: int


class InboundChannels(channel_pb2_grpc.PeerServicer):
    """Accepts channel streams for ``process_id`` and hands their new entries to ``deliver``.

    ``deliver(src, entries, only_messages)`` is told when a run holds no marker, for its fast path.
    """

    def __init__(
        self,
        process_id: str,
        incarnation: int,
        *,
        lock: asyncio.Lock,
        deliver: Callable[[str, list[Entry], bool], Awaitable[None]],
        on_sender_restart: Callable[[str], None],
        metrics: AgentMetrics,
    ) -> None:
        self._process_id = process_id
        self._incarnation = incarnation
        # The agent's delivery lock: deduplication, delivery and recording never interleave.
        self._lock = lock
        self._deliver = deliver
        self._on_sender_restart = on_sender_restart
        self._metrics = metrics
        self._expected: dict[str, _Expected] = {}

    async def Channel(
        self, request_iterator: AsyncIterator[ChannelFrame], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ChannelAck]:
        """One channel's stream: frames in, cumulative acknowledgements out."""
        channel: list[tuple[str, int]] = []  # (src, sender incarnation) once the hello is read
        try:
            async for frame in request_iterator:
                if frame.HasField("hello"):  # with mutual TLS, the certificate says who may send
                    check_channel_peer(context, frame.hello)
                entries = decode(frame)
                # Shielded: a stream cancelled mid-frame (a break, a server restart) must not leave
                # a frame half delivered, or the sender's resend would deliver its start twice.
                accepting = asyncio.ensure_future(self._accept(frame, entries, channel))
                next_seq = await asyncio.shield(accepting)
                yield ChannelAck(next_seq=next_seq, receiver_incarnation=self._incarnation)
        except FrameError as error:
            self._metrics.frame_rejected(error.reason)
            where = f"{channel[0][0] if channel else '?'} -> {self._process_id}"
            await context.abort(_STATUS[error.reason], f"channel {where}: {error}")

    async def _accept(self, frame: ChannelFrame, entries: list[Entry], channel: list[tuple[str, int]]) -> int:
        """Deliver the entries of ``frame`` not delivered before; returns the next expected sequence number."""
        async with self._lock:
            if not channel:
                channel.append(self._hello(frame))
            src, sender_incarnation = channel[0]
            expected = self._expect(src, sender_incarnation)
            skip = expected.next_seq - frame.first_seq
            if skip < 0:
                raise FrameError("sequence_gap", f"expected entry {expected.next_seq}, got {frame.first_seq}")
            if skip < len(entries):
                await self._deliver(src, entries[skip:] if skip else entries, not frame.markers)
                expected.next_seq = frame.first_seq + len(entries)
            return expected.next_seq

    def _hello(self, frame: ChannelFrame) -> tuple[str, int]:
        """Check the first frame's hello and set up (or reset) the channel it names."""
        if not frame.HasField("hello"):
            raise FrameError("no_hello", "the first frame of a stream must carry a hello")
        hello = frame.hello
        if hello.dst != self._process_id:
            raise FrameError("unknown_channel", f"channel {hello.src} -> {hello.dst} does not end here")
        if not hello.src or hello.src == self._process_id:
            raise FrameError("unknown_channel", f"a channel cannot come from {hello.src!r}")
        known = self._expected.get(hello.src)
        if known is None or known.sender_incarnation != hello.sender_incarnation:
            if known is not None:
                self._on_sender_restart(hello.src)
            self._expected[hello.src] = _Expected(hello.sender_incarnation, frame.first_seq)
        return hello.src, hello.sender_incarnation

    def _expect(self, src: str, sender_incarnation: int) -> _Expected:
        expected = self._expected[src]
        if expected.sender_incarnation != sender_incarnation:
            # A stream of an earlier incarnation of the sender: what it carries is stale.
            raise FrameError("unknown_channel", "superseded by a stream of a newer sender incarnation")
        return expected
