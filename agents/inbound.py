"""The receiving end of every channel into one agent: the ``Peer`` gRPC service.

Each sender opens one stream per channel. The first frame carries a hello naming the channel;
every frame carries consecutive entries from a sequence number. Entries this agent already has
(a sender resending after a reconnect) are dropped; a frame that skips ahead is refused, because
accepting it would lose what lies between.

Accepting a frame hands its new entries to the agent at once (``accept``): the core counts them
and the messages join the agent's receive queue (:mod:`stablewatch.agents.inbox`), or go straight
to a synchronous handler when nothing waits ahead of them. A frame that carries a marker is
accepted under the agent's recording lock, since the marker may make the process record.

Acknowledgements are cumulative and say what this agent has accepted, not what the handler has
had, so they never wait for a handler (one may itself be blocked on a send). They are held back
while the receive queue is full:

* the first acknowledgement on a stream answers its hello at once (with what is accepted when the
  queue has room, else with the sender's own starting point); every later one either moves
  ``next_seq`` forward, or repeats it exactly once, to say *your window is held here: my receive
  queue is full* (the sender then knows its blocked sends wait on this process consuming);
* a frame the sender marked ``ack_later`` (its window has room to spare) is not answered by
  itself: the next acknowledgement covers it, for whatever reason that one goes (a frame that
  wants one, a hold, a new stream, reading ahead as far as allowed, below), and at the latest
  ``ack_delay`` seconds after it came. Sparse traffic then costs one acknowledgement per
  ``ack_delay`` instead of one per frame, and a busy sender, its window half taken, asks for
  every frame to be acknowledged at once;
* meanwhile the stream keeps reading, unacknowledged, up to ``read_ahead_entries`` entries or
  ``read_ahead_bytes`` bytes, so that markers behind a full window still arrive (a snapshot can
  then record a flow-control deadlock); beyond that it stops reading and gRPC's flow control holds
  the sender back. Memory stays bounded by the queue's bounds plus the read-ahead of each stream.

The per-channel sequence state lives here, not in the gRPC server, so it survives a restart of the
server (for example to reload certificates). A hello with a greater sender incarnation means the
sender restarted: its sequence numbers and counts start again. A hello with a smaller one comes
from an older process still running after its restart (a zombie): it is refused, and nothing is
reset. So a process's incarnations must increase across its restarts (the agent's default, its
start time in nanoseconds, does).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import grpc

from stablewatch.agents.core import Entry, Marker
from stablewatch.agents.frames import FrameError, decode
from stablewatch.agents.inbox import Inbox
from stablewatch.agents.metrics import AgentMetrics
from stablewatch.agents.peer_identity import check_channel_peer
from stablewatch.v1 import AckPosition, ChannelAck, ChannelFrame, channel_pb2_grpc

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


class _Stream:
    """One ``Channel`` call: what it accepted, what it acknowledged, and its two tasks' signals."""

    __slots__ = (
        "ack_timer",
        "acked",
        "due",
        "expected",
        "held",
        "hello_answered",
        "incarnation",
        "progress",
        "src",
        "unacked",
        "wake",
    )

    def __init__(self) -> None:
        self.src = ""
        self.incarnation = 0
        self.expected: _Expected | None = None  # shared by the streams of one sender incarnation
        self.acked = 0  # next_seq of the last acknowledgement (at first: where the sender starts)
        self.due = 0  # accepted up to here, something the sender wants acknowledged at once
        self.hello_answered = False
        self.held = False  # a hold was sent and nothing acknowledged since
        self.unacked: deque[tuple[int, int]] = deque()  # (end sequence number, bytes) per frame read
        self.wake = asyncio.Event()  # for the writer: something accepted, room, or the reader ended
        self.progress = asyncio.Event()  # for the reader: something acknowledged
        self.ack_timer: asyncio.TimerHandle | None = None  # makes what was accepted due, ack_delay after

    def make_due(self) -> None:
        """Everything accepted is to be acknowledged now."""
        if self.ack_timer is not None:
            self.ack_timer.cancel()
            self.ack_timer = None
        if self.expected is not None:
            self.due = self.expected.next_seq
        self.wake.set()

    def next_ack(self, room: bool) -> int | None:
        """The acknowledgement to send now, if any (see the module docstring)."""
        if self.expected is None:
            return None
        accepted = self.expected.next_seq
        if not self.hello_answered:
            self.hello_answered = True
            return self._acknowledge(accepted if room else self.acked)
        if accepted <= self.acked:
            return None
        if room and self.due <= self.acked and not self.held:
            return None  # only markers the sender lets wait are unacknowledged (a hold is lifted at once)
        if room:
            self.held = False
            return self._acknowledge(accepted)
        if self.held:
            return None
        self.held = True
        return self.acked  # the hold: the same next_seq again

    def unacked_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self.unacked)

    def _acknowledge(self, next_seq: int) -> int:
        self.acked = next_seq
        while self.unacked and self.unacked[0][0] <= next_seq:
            self.unacked.popleft()
        if self.ack_timer is not None and self.expected is not None and next_seq >= self.expected.next_seq:
            self.ack_timer.cancel()  # this one covers everything accepted
            self.ack_timer = None
        self.progress.set()
        return next_seq


def _pieces(entries: list[Entry], start: int) -> Iterator[tuple[int, int]]:
    """``entries[start:]`` cut into runs of messages and single markers, as (start, end) pairs."""
    run = start
    for position in range(start, len(entries)):
        if type(entries[position]) is Marker:
            if run < position:
                yield run, position
            yield position, position + 1
            run = position + 1
    if run < len(entries):
        yield run, len(entries)


class InboundChannels(channel_pb2_grpc.PeerServicer):
    """Accepts channel streams for ``process_id`` and hands their new entries to ``accept``.

    ``accept(src, entries, only_messages)`` runs synchronously, in arrival order per channel; it
    is told when a run holds no marker, for its fast path. ``incarnation`` is this process's, sent
    with every acknowledgement: it must be greater than every earlier incarnation's of the process
    (a sender takes an acknowledgement of a smaller one for a zombie's).
    """

    def __init__(
        self,
        process_id: str,
        incarnation: int,
        *,
        lock: asyncio.Lock,
        inbox: Inbox,
        accept: Callable[[str, list[Entry], bool], None],
        on_sender_restart: Callable[[str], None],
        metrics: AgentMetrics,
        read_ahead_entries: int,
        read_ahead_bytes: int,
        ack_delay: float,
    ) -> None:
        self._process_id = process_id
        self._incarnation = incarnation
        # The agent's recording lock: a frame with a marker is accepted only where recording may happen.
        self._lock = lock
        self._inbox = inbox
        self._accept = accept
        self._on_sender_restart = on_sender_restart
        self._metrics = metrics
        self._read_ahead_entries = read_ahead_entries
        self._read_ahead_bytes = read_ahead_bytes
        self._ack_delay = ack_delay
        self._expected: dict[str, _Expected] = {}
        self._streams: set[_Stream] = set()
        inbox.on_room(self._room)

    async def Channel(
        self, request_iterator: AsyncIterator[ChannelFrame], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ChannelAck]:
        """One channel's stream: frames in (read by a task of its own), cumulative acknowledgements out."""
        stream = _Stream()
        self._streams.add(stream)
        reader = asyncio.ensure_future(self._read(request_iterator, context, stream))
        try:
            while True:
                next_seq = stream.next_ack(self._inbox.has_room())
                if next_seq is not None:
                    yield ChannelAck(next_seq=next_seq, receiver_incarnation=self._incarnation)
                    continue
                if reader.done():
                    break
                stream.wake.clear()
                await stream.wake.wait()
            error = reader.exception()
        finally:
            self._streams.discard(stream)
            if stream.ack_timer is not None:
                stream.ack_timer.cancel()
            if not reader.done():
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
            elif not reader.cancelled():
                reader.exception()  # taken: a stream closed under it (server stopping) ends quietly
        if isinstance(error, FrameError):
            self._metrics.frame_rejected(error.reason)
            where = f"{stream.src or '?'} -> {self._process_id}"
            await context.abort(_STATUS[error.reason], f"channel {where}: {error}")
        elif error is not None:
            raise error

    async def _read(
        self, request_iterator: AsyncIterator[ChannelFrame], context: grpc.aio.ServicerContext, stream: _Stream
    ) -> None:
        """Accept frames until the stream ends, reading ahead of the acknowledgements only so far."""
        try:
            async for frame in request_iterator:
                if frame.HasField("hello"):  # with mutual TLS, the certificate says who may send
                    check_channel_peer(context, frame.hello)
                entries = decode(frame)
                if stream.expected is None:
                    self._open(frame, stream)
                if frame.markers:
                    async with self._lock:  # recording may happen: wait for a moment it is allowed
                        self._take(frame, entries, stream)
                else:
                    self._take(frame, entries, stream)
                stream.unacked.append((frame.first_seq + len(entries), frame.ByteSize()))
                if not frame.ack_later:
                    stream.make_due()
                elif stream.ack_timer is None:
                    loop = asyncio.get_running_loop()
                    stream.ack_timer = loop.call_later(self._ack_delay, stream.make_due)
                stream.wake.set()
                while (
                    stream.expected.next_seq - stream.acked >= self._read_ahead_entries
                    or stream.unacked_bytes() >= self._read_ahead_bytes
                ):
                    # Read ahead as far as allowed: what was left to wait is acknowledged now.
                    stream.make_due()
                    stream.progress.clear()
                    await stream.progress.wait()
        finally:
            stream.wake.set()

    def _take(self, frame: ChannelFrame, entries: list[Entry], stream: _Stream) -> None:
        """Hand over the entries of ``frame`` not accepted before (synchronously: no other frame of
        this channel can slip in between the check and the update)."""
        expected = self._expect(stream)
        skip = expected.next_seq - frame.first_seq
        if skip < 0:
            raise FrameError("sequence_gap", f"expected entry {expected.next_seq}, got {frame.first_seq}")
        if skip >= len(entries):
            return
        if not frame.markers:
            self._accept(stream.src, entries[skip:] if skip else entries, True)
            expected.next_seq = frame.first_seq + len(entries)
            return
        # A marker may raise (a peer's protocol error) after the messages before it were handed
        # over: take the frame piece by piece, each marker alone, and move next_seq past every
        # piece taken, so that the frame resent after the error skips what was accepted.
        for start, end in _pieces(entries, skip):
            self._accept(stream.src, entries[start:end], type(entries[start]) is not Marker)
            expected.next_seq = frame.first_seq + end

    def _open(self, frame: ChannelFrame, stream: _Stream) -> None:
        """Check the first frame's hello and set up (or reset) the channel it names."""
        if not frame.HasField("hello"):
            raise FrameError("no_hello", "the first frame of a stream must carry a hello")
        hello = frame.hello
        if hello.dst != self._process_id:
            raise FrameError("unknown_channel", f"channel {hello.src} -> {hello.dst} does not end here")
        if not hello.src or hello.src == self._process_id:
            raise FrameError("unknown_channel", f"a channel cannot come from {hello.src!r}")
        known = self._expected.get(hello.src)
        if known is not None and hello.sender_incarnation < known.sender_incarnation:
            # An older incarnation still running (a zombie after its restart): taking it for a
            # restart would start the channel again under the current sender, whose messages
            # would then be delivered twice and counted with the zombie's. Refused, nothing reset.
            raise FrameError(
                "unknown_channel",
                f"stale sender incarnation {hello.sender_incarnation} of {hello.src}: "
                f"incarnation {known.sender_incarnation} has superseded it",
            )
        if known is None or hello.sender_incarnation > known.sender_incarnation:
            if known is not None:
                self._on_sender_restart(hello.src)
            known = self._expected[hello.src] = _Expected(hello.sender_incarnation, frame.first_seq)
        stream.src, stream.incarnation = hello.src, hello.sender_incarnation
        stream.expected = known
        stream.acked = frame.first_seq  # what the sender knows to be acknowledged

    def _expect(self, stream: _Stream) -> _Expected:
        expected = self._expected[stream.src]
        if expected.sender_incarnation != stream.incarnation:
            # A stream of an earlier incarnation of the sender: what it carries is stale.
            raise FrameError("unknown_channel", "superseded by a stream of a newer sender incarnation")
        return expected

    def acked(self) -> dict[str, AckPosition]:
        """Per inbound channel, where acknowledgements to its sender's current incarnation stand:
        the highest one sent, or bound to be sent.

        While the receive queue has room, every entry accepted is acknowledged with nothing more
        from the application (at once, within ``ack_delay``, or in the answer to the sender's next
        hello), so that position is reported: it counts as in transit. That holds for a sender
        whose stream is down too: its next stream's hello is answered with it. A recording can
        fall between the queue's freeing and the acknowledgement's writing (a marker waiting for
        the handler records the moment the handler returns, or the stream broke and the sender is
        backing off), and the acknowledgement last written would then hide the one owed: a sender
        blocked on the full window would look held by a receiver that has consumed, a deadlock that
        is none. While the queue is full, the last one sent on an open stream stands (a hold); a
        sender without one learns nothing more until there is room (its next hello is answered
        with its own starting point), so nothing is owed to it. Recorded with the process's state
        (see :attr:`OutboundChannel.ack_seen <stablewatch.agents.outbound.OutboundChannel.ack_seen>`).
        """
        highest: dict[str, int] = {}
        if self._inbox.has_room():
            for src, expected in self._expected.items():
                highest[src] = expected.next_seq  # owed: sent without anything more from the handler
        else:
            for stream in self._streams:
                expected = stream.expected
                if expected is None or self._expected.get(stream.src) is not expected or not stream.hello_answered:
                    continue  # no hello (answered) yet, or a stream of an earlier sender incarnation
                highest[stream.src] = max(highest.get(stream.src, 0), stream.acked)
        return {
            src: AckPosition(
                sender_incarnation=self._expected[src].sender_incarnation,
                receiver_incarnation=self._incarnation,
                next_seq=next_seq,
            )
            for src, next_seq in highest.items()
        }

    def _room(self) -> None:
        """The receive queue has room again: every stream may acknowledge what it holds."""
        for stream in self._streams:
            stream.wake.set()
