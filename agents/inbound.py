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
  the sender back. Memory stays bounded by the queue's bounds plus the read-ahead of each channel.

The read-ahead is the channel's, not the stream's: what was accepted and not acknowledged counts
against it whichever stream carried it, and it is checked before a frame is taken, a new stream's
first one included. Only an acknowledgement sent with room in the queue moves the channel's
acknowledged position (a new stream's hello answered while the queue is full does not). A sender
has one stream per channel: a new stream of the same sender incarnation that passes its checks
supersedes the older ones, which end as ``superseded`` (the sender resends from what it saw
acknowledged, and what was accepted before is dropped as a duplicate, so nothing is lost or
delivered twice). A new sender incarnation starts the channel's numbers again with a read-ahead
of its own (its markers behind a full window must still arrive), but inherits what earlier ones left
unacknowledged, until an acknowledgement with room covers it, and all of it together stays within
twice the read-ahead: announcing incarnations buys no more. A frame of more than
``MAX_FRAME_ENTRIES`` entries is refused (``malformed``). So opening streams or restarting cannot
make the agent hold more than twice the read-ahead, plus one frame, per channel.

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

import grpc

from stablewatch.agents.core import Entry, Marker
from stablewatch.agents.frames import MAX_FRAME_ENTRIES, FrameError, decode
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
    "superseded": grpc.StatusCode.ABORTED,
}


class _Expected:
    """One channel's state for its sender's current incarnation, shared by its streams: what was
    accepted, what was acknowledged, and what is read ahead of the acknowledgements."""

    __slots__ = ("acked", "carried_bytes", "carried_entries", "next_seq", "sender_incarnation", "unacked")

    def __init__(self, sender_incarnation: int, next_seq: int, carried: tuple[int, int] = (0, 0)) -> None:
        self.sender_incarnation = sender_incarnation
        self.next_seq = next_seq  # accepted up to here
        # The highest acknowledgement sent with room in the queue: the read-ahead counts from here.
        self.acked = next_seq
        self.unacked: deque[tuple[int, int]] = deque()  # (end sequence number, bytes) per frame accepted
        # What an earlier incarnation read ahead and nothing acknowledged: it still counts.
        self.carried_entries, self.carried_bytes = carried

    def read_ahead(self) -> tuple[int, int]:
        """Entries and bytes this incarnation accepted and nothing acknowledged."""
        return self.next_seq - self.acked, sum(size for _, size in self.unacked)

    def held(self) -> tuple[int, int]:
        """Entries and bytes accepted and not acknowledged, earlier incarnations' included."""
        entries, nbytes = self.read_ahead()
        return entries + self.carried_entries, nbytes + self.carried_bytes

    def acknowledged(self, next_seq: int) -> None:
        """An acknowledgement up to ``next_seq`` went out with room in the queue."""
        self.acked = max(self.acked, next_seq)
        while self.unacked and self.unacked[0][0] <= self.acked:
            self.unacked.popleft()
        self.room()

    def room(self) -> None:
        """The queue has room: what an earlier incarnation read ahead is within its bounds now."""
        self.carried_entries = self.carried_bytes = 0


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
        "reader",
        "src",
        "superseded",
        "wake",
    )

    def __init__(self) -> None:
        self.src = ""
        self.incarnation = 0
        self.expected: _Expected | None = None  # shared by the streams of one sender incarnation
        self.acked = 0  # next_seq of the last acknowledgement on this stream (at first: where the sender starts)
        self.due = 0  # accepted up to here, something the sender wants acknowledged at once
        self.hello_answered = False
        self.held = False  # a hold was sent and nothing acknowledged since
        self.reader: asyncio.Future[None] | None = None  # the task reading the frames
        self.superseded = False  # a newer stream of the same sender took the channel over
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
            # Without room: the sender's own starting point, which acknowledges nothing new.
            return self._acknowledge(accepted) if room else self.acked
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

    def supersede(self) -> None:
        """A newer stream of the same sender took the channel over: stop reading, end this one."""
        self.superseded = True
        if self.reader is not None:
            self.reader.cancel()  # it waits for a frame or for progress: nothing is half taken
        self.wake.set()

    def _acknowledge(self, next_seq: int) -> int:
        """Send ``next_seq`` (the queue has room): it moves the channel's read-ahead on too."""
        self.acked = next_seq
        if self.expected is not None:
            self.expected.acknowledged(next_seq)
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
        reader = stream.reader = asyncio.ensure_future(self._read(request_iterator, context, stream))
        try:
            while not stream.superseded:
                next_seq = stream.next_ack(self._inbox.has_room())
                if next_seq is not None:
                    yield ChannelAck(next_seq=next_seq, receiver_incarnation=self._incarnation)
                    continue
                if reader.done():
                    break
                stream.wake.clear()
                await stream.wake.wait()
            # A reader that failed on its own keeps its reason, superseded or not.
            error = reader.exception() if reader.done() and not reader.cancelled() else None
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
        if stream.superseded and error is None:
            error = FrameError("superseded", "a newer stream of the same sender took this channel over")
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
                self._check_size(entries)
                if stream.expected is None:
                    self._open(frame, stream)
                # Checked before taking too: a new stream's first frame gets no allowance of its own.
                await self._within_read_ahead(stream)
                if frame.markers:
                    async with self._lock:  # recording may happen: wait for a moment it is allowed
                        self._take(frame, entries, stream)
                else:
                    self._take(frame, entries, stream)
                if not frame.ack_later:
                    stream.make_due()
                elif stream.ack_timer is None:
                    loop = asyncio.get_running_loop()
                    stream.ack_timer = loop.call_later(self._ack_delay, stream.make_due)
                stream.wake.set()
                await self._within_read_ahead(stream)
        finally:
            stream.wake.set()

    @staticmethod
    def _check_size(entries: list[Entry]) -> None:
        """Refuse a frame of more entries than the wire contract allows (:data:`MAX_FRAME_ENTRIES`):
        the read-ahead is checked between frames, so one frame of many tiny entries would escape it.
        Bytes need no check of their own: gRPC's receive limit bounds a frame's."""
        if len(entries) > MAX_FRAME_ENTRIES:
            raise FrameError("malformed", f"a frame of {len(entries)} entries is more than {MAX_FRAME_ENTRIES}")

    async def _within_read_ahead(self, stream: _Stream) -> None:
        """Wait while the channel holds as much unacknowledged as it may read ahead.

        The sender's current incarnation may read ahead in full, so that its markers behind a full
        window still arrive after a restart; what earlier ones left unacknowledged counts only
        against twice that, so announcing incarnations buys no more.
        """
        while True:
            expected = self._expect(stream)
            entries, nbytes = expected.read_ahead()
            if (
                entries < self._read_ahead_entries
                and nbytes < self._read_ahead_bytes
                and entries + expected.carried_entries < 2 * self._read_ahead_entries
                and nbytes + expected.carried_bytes < 2 * self._read_ahead_bytes
            ):
                return
            # Read ahead as far as allowed: what was left to wait is acknowledged now.
            stream.make_due()
            stream.progress.clear()
            await stream.progress.wait()

    def _take(self, frame: ChannelFrame, entries: list[Entry], stream: _Stream) -> None:
        """Hand over the entries of ``frame`` not accepted before (synchronously: no other frame of
        this channel can slip in between the check and the update)."""
        expected = self._expect(stream)
        skip = expected.next_seq - frame.first_seq
        if skip < 0:
            raise FrameError("sequence_gap", f"expected entry {expected.next_seq}, got {frame.first_seq}")
        if skip >= len(entries):
            return
        # Only the new entries' share of the frame: a resent frame is not charged twice.
        nbytes = frame.ByteSize() * (len(entries) - skip) // len(entries)
        expected.unacked.append((frame.first_seq + len(entries), nbytes))
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
        same = known is not None and hello.sender_incarnation == known.sender_incarnation
        if same and frame.first_seq > known.next_seq:  # refused here, before it supersedes a stream
            raise FrameError("sequence_gap", f"expected entry {known.next_seq}, got {frame.first_seq}")
        if known is None or hello.sender_incarnation > known.sender_incarnation:
            carried = (0, 0)
            if known is not None:
                self._on_sender_restart(hello.src)
                carried = known.held()  # still queued: a new incarnation buys no more than one allowance
            known = self._expected[hello.src] = _Expected(hello.sender_incarnation, frame.first_seq, carried)
        for other in list(self._streams):
            if other is not stream and other.src == hello.src and other.incarnation == hello.sender_incarnation:
                # One stream per channel (an earlier incarnation's is refused on its next frame). It
                # leaves the picture at once: a writer stuck in a write must not speak for the channel.
                other.supersede()
                self._streams.discard(other)
        stream.src, stream.incarnation = hello.src, hello.sender_incarnation
        stream.expected = known
        # What the sender knows to be acknowledged: an honest sender starts no further than the
        # channel's acknowledged position, and the stream acknowledges nothing before passing it.
        stream.acked = min(frame.first_seq, known.acked)

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
        """The receive queue has room again: every stream may acknowledge what it holds, and a
        stream waiting only on what an earlier incarnation read ahead may read on (it has nothing
        new to acknowledge that would wake it)."""
        for expected in self._expected.values():
            expected.room()
        for stream in self._streams:
            stream.wake.set()
            stream.progress.set()
