"""The sending end of one channel ``src -> dst``: a window of entries over a gRPC stream.

Entries (messages and markers, in the order the core produced them) wait in a buffer until the
receiver acknowledges them. A writer sends them in frames over one ``Peer.Channel`` stream; a
reader takes cumulative acknowledgements and drops what they cover. When the stream breaks, the
sender reconnects with backoff and sends again everything not yet acknowledged; the receiver
drops what it already has by sequence number. So the channel is FIFO and exactly-once.

The buffer is bounded: :meth:`OutboundChannel.has_space` tells the agent when to hold back the
application (markers are always accepted, so recording never blocks). The receiver acknowledges
what it has queued, not what its handler has had; an acknowledgement that repeats the last one
(after the first on a stream) means the receiver's queue is full and it holds this window
(:attr:`OutboundChannel.held`): a send blocked on the full window then waits for the receiver to
consume, which the agent reports as a flow-control wait.

A marker of a detector snapshot is held back instead of written: it goes in front of the next
entry, or is dropped at the snapshot's deadline (the core's *Markers may wait* says why that is
enough), so a snapshot costs a channel no write of its own. A frame written while at most half the
window is taken asks the receiver to acknowledge it later (``ack_later``): within the receiver's
``ack_delay``, or with the next acknowledgement that goes anyway. Sparse traffic then costs about
one write per message, not two; once half the window is taken every frame is acknowledged at
once, so what waits for an acknowledgement never holds back a send.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import random
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from stablewatch.agents.core import Marker
from stablewatch.agents.frames import ENTRY_OVERHEAD, MAX_FRAME_ENTRIES, Outgoing, encode
from stablewatch.agents.metrics import AgentMetrics
from stablewatch.v1 import AckPosition, ChannelAck, ChannelFrame, ChannelHello, channel_pb2_grpc

__all__ = ["ChannelSettings", "OutboundChannel"]

# Acknowledged entries are dropped from the window's front once there are this many (and more than
# the entries still in it).
_COMPACT_AFTER = 256


class ChannelSettings:
    """Limits and timings shared by every channel of an agent."""

    def __init__(
        self,
        *,
        window_entries: int = 4096,
        window_bytes: int = 16 * 1024 * 1024,
        max_frame_entries: int = 512,
        max_frame_bytes: int = 1024 * 1024,
        backoff_initial: float = 0.05,
        backoff_max: float = 2.0,
        ack_delay: float = 0.25,
        inbox_entries: int = 4096,
        inbox_bytes: int = 16 * 1024 * 1024,
        read_ahead_entries: int | None = None,
        read_ahead_bytes: int | None = None,
    ) -> None:
        # Receiving: acknowledgements stop while inbox_entries messages or inbox_bytes wait for the
        # handler; each channel reads at most read_ahead_* beyond its acknowledgements (by default
        # twice a window, so that markers behind a peer's full window still arrive).
        read_ahead_entries = 2 * window_entries if read_ahead_entries is None else read_ahead_entries
        read_ahead_bytes = 2 * window_bytes if read_ahead_bytes is None else read_ahead_bytes
        limits = (window_entries, window_bytes, max_frame_entries, max_frame_bytes, inbox_entries, inbox_bytes)
        if min(*limits, read_ahead_entries, read_ahead_bytes) <= 0:
            raise ValueError("channel windows, frame limits, receive queue and read-ahead bounds must be positive")
        if ack_delay < 0:
            raise ValueError(f"ack_delay must not be negative, not {ack_delay}")
        if max_frame_entries > MAX_FRAME_ENTRIES:
            raise ValueError(
                f"max_frame_entries is at most {MAX_FRAME_ENTRIES} (receivers refuse more), not {max_frame_entries}"
            )
        # Receiving: a frame the sender lets wait is acknowledged at the latest this long after it came.
        self.ack_delay = ack_delay
        self.window_entries = window_entries
        self.window_bytes = window_bytes
        self.max_frame_entries = max_frame_entries
        self.max_frame_bytes = max_frame_bytes
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.inbox_entries = inbox_entries
        self.inbox_bytes = inbox_bytes
        self.read_ahead_entries = read_ahead_entries
        self.read_ahead_bytes = read_ahead_bytes


class OutboundChannel:
    """One directed channel to a peer agent; runs its own connection task.

    ``incarnation`` is the sending process's, sent in every hello: it must be greater than every
    earlier incarnation's of the process, for the receiver takes a greater one for a restart and
    refuses a smaller one as a zombie's. A receiver's greater incarnation is likewise its restart.
    """

    def __init__(
        self,
        src: str,
        dst: str,
        target: str | Callable[[], str],
        *,
        incarnation: int,
        settings: ChannelSettings,
        metrics: AgentMetrics,
        on_receiver_restart: Callable[[int], None],
        credentials: grpc.ChannelCredentials | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.src, self.dst = src, dst
        # A callable target is asked again at every connection attempt: a peer that is not known
        # yet, or that restarted elsewhere, is found when it (re)appears.
        self._resolve = target if callable(target) else lambda: target
        self.target = ""
        self._settings = settings
        self._max_entries = settings.window_entries
        self._max_bytes = settings.window_bytes
        self._metrics = metrics
        # Called with the number of application messages the restarted receiver will get.
        self._on_receiver_restart = on_receiver_restart
        self._credentials = credentials
        # gRPC's own reconnect backoff (1 s growing to 120 s) would override ours: align it.
        self._options = [
            ("grpc.initial_reconnect_backoff_ms", max(1, round(settings.backoff_initial * 1000))),
            ("grpc.min_reconnect_backoff_ms", max(1, round(settings.backoff_initial * 1000))),
            ("grpc.max_reconnect_backoff_ms", max(1, round(settings.backoff_max * 1000))),
            *channel_options,
        ]
        self._hello = ChannelHello(src=src, dst=dst, sender_incarnation=incarnation)
        # The window: _entries[_head:] are unacknowledged; the first has sequence number _acked.
        # _sizes runs beside _entries (window bytes of each entry), so sums are C-level slices.
        self._entries: list[Outgoing] = []
        self._sizes: list[int] = []
        self._head = 0
        self._acked = 0
        self._next_to_write = 0  # index into _entries
        self._written_high = 0  # highest index ever written: below it a write is a retransmission
        self._window_bytes = 0
        self._receiver_incarnation: int | None = None
        self._acks_on_stream = 0
        #: Whether the receiver holds this window (its receive queue is full), as it last said.
        self.held = False
        # Markers held back for the next entry, each with the loop time it may be dropped at.
        self._held_markers: deque[tuple[Marker, float]] = deque()
        self._data = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        self._grpc_channel: grpc.aio.Channel | None = None
        self.last_error = ""

    # -- what the agent uses -------------------------------------------------------------------

    def start(self) -> None:
        """Start the connection task on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"channel {self.src}->{self.dst}")

    async def close(self) -> None:
        """Stop sending; entries not acknowledged are dropped."""
        self._closed = True
        self._data.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._grpc_channel is not None:
            await self._grpc_channel.close()

    @property
    def unacknowledged(self) -> int:
        """Entries in the window (written or not) that the receiver has not acknowledged."""
        return len(self._entries) - self._head

    @property
    def ack_seen(self) -> AckPosition | None:
        """The highest acknowledgement received so far, or None before the first.

        Recorded with the process's state: the detector compares it with the receiver's
        :meth:`InboundChannels.acked <stablewatch.agents.inbound.InboundChannels.acked>` to tell an
        acknowledgement in transit, which will give a blocked send window space.
        """
        if self._receiver_incarnation is None:
            return None
        return AckPosition(
            sender_incarnation=self._hello.sender_incarnation,
            receiver_incarnation=self._receiver_incarnation,
            next_seq=self._acked,
        )

    def has_space(self) -> bool:
        """Whether the application may add a message without passing the window."""
        return len(self._entries) - self._head < self._max_entries and self._window_bytes < self._max_bytes

    async def wait_for_space(self) -> None:
        """Wait until :meth:`has_space` (backpressure for the application's sends)."""
        while not self.has_space():
            self._space.clear()
            await self._space.wait()
            if self._closed:
                raise ConnectionError(f"channel {self.src} -> {self.dst} is closed")

    def free_entries(self, sizes: Sequence[int]) -> int:
        """How many of the next entries (of window bytes ``sizes``) fit the window now: the entries
        left in it, and as many bytes as are left (at least one entry while :meth:`has_space`)."""
        left = self._max_entries - (len(self._entries) - self._head)
        fitting = bisect.bisect_right(list(itertools.accumulate(sizes[:left])), self._max_bytes - self._window_bytes)
        return max(1, fitting) if self.has_space() else 0

    def push_many(self, entries: Sequence[Outgoing], sizes: Sequence[int]) -> None:
        """Append ``entries`` (window bytes ``sizes``), in order, after everything in the channel."""
        if self._held_markers:
            self._release_markers()
        self._entries.extend(entries)
        self._sizes.extend(sizes)
        self._window_bytes += sum(sizes)
        if not self._data.is_set():
            self._data.set()

    def push(self, entry: Outgoing, size: int) -> None:
        """Append an entry of ``size`` window bytes (see ``entry_size``) after everything in the channel."""
        if self._held_markers:
            self._release_markers()
        self._entries.append(entry)
        self._sizes.append(size)
        self._window_bytes += size
        if not self._data.is_set():
            self._data.set()

    def put_marker(self, marker: Marker, hold_until: float | None = None) -> None:
        """Put ``marker`` on the channel; given ``hold_until`` (loop time), hold it back to go in
        front of the next entry, or to be dropped at ``hold_until`` if none comes by then."""
        if hold_until is None:
            self.push(marker, ENTRY_OVERHEAD)
            return
        held = self._held_markers
        now = asyncio.get_running_loop().time()
        while held and held[0][1] <= now:  # the oldest first: an idle channel's list stays short
            held.popleft()
        held.append((marker, hold_until))

    @property
    def held_markers(self) -> list[int]:
        """Snapshot ids of the markers held back for the next entry, in the order they came."""
        return [marker.snapshot_id for marker, _ in self._held_markers]

    def _release_markers(self) -> None:
        """Put the held markers still due in the window, ahead of what comes next."""
        now = asyncio.get_running_loop().time()
        due = [marker for marker, until in self._held_markers if until > now]
        self._held_markers.clear()
        self._entries.extend(due)
        self._sizes.extend([ENTRY_OVERHEAD] * len(due))
        self._window_bytes += ENTRY_OVERHEAD * len(due)

    # -- the connection ------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = self._settings.backoff_initial
        while not self._closed:
            acked_before = self._acked
            try:
                await self._stream()
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as error:
                self.last_error = f"{error.code().name}: {error.details()}"
            except (ConnectionError, grpc.RpcError) as error:
                self.last_error = str(error)
            if self._closed:
                return
            if self._acked > acked_before:  # the stream made progress: start backing off afresh
                backoff = self._settings.backoff_initial
            self._next_to_write = self._head  # resend everything not acknowledged
            self._metrics.reconnected(self.dst)
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, self._settings.backoff_max)

    async def _channel(self) -> grpc.aio.Channel:
        try:
            target = self._resolve()
        except LookupError as error:
            raise ConnectionError(f"no address for peer {self.dst}: {error}") from None
        if self._grpc_channel is not None and target != self.target:
            await self._grpc_channel.close()
            self._grpc_channel = None
        if self._grpc_channel is None:
            self.target = target
            if self._credentials is None:
                self._grpc_channel = grpc.aio.insecure_channel(target, options=self._options)
            else:
                self._grpc_channel = grpc.aio.secure_channel(target, self._credentials, options=self._options)
        return self._grpc_channel

    async def _stream(self) -> None:
        call = channel_pb2_grpc.PeerStub(await self._channel()).Channel()
        self._acks_on_stream = 0
        # ``held`` stays until this stream's first acknowledgement (the hello's answer) says
        # otherwise: a reconnect that fails changes nothing at the receiver, whose full queue
        # still holds the window; cleared here, a deadlock through it went unreported meanwhile.
        reader = asyncio.get_running_loop().create_task(self._read_acks(call))
        try:
            # The hello goes out at once, so the receiver's incarnation is known before any data.
            await call.write(encode(self._acked + self._next_to_write - self._head, (), self._hello))
            while True:
                if self._next_to_write == len(self._entries):
                    self._data.clear()
                    waiter = asyncio.ensure_future(self._data.wait())
                    await asyncio.wait((waiter, reader), return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    if reader.done() or self._closed:
                        break
                    continue
                await call.write(self._next_frame())
        finally:
            if not reader.done():
                call.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            call.cancel()

    def _next_frame(self) -> ChannelFrame:
        start = self._next_to_write
        end = min(len(self._entries), start + self._settings.max_frame_entries)
        # Cut the frame at max_frame_bytes; a single larger entry still goes, alone.
        fitting = bisect.bisect_right(
            list(itertools.accumulate(self._sizes[start:end])), self._settings.max_frame_bytes
        )
        end = start + max(1, fitting)
        batch = self._entries[start:end]
        first_seq = self._acked + start - self._head
        frame = encode(first_seq, batch)
        self._next_to_write = end
        if self._room_to_spare():
            frame.ack_later = True
        if start < self._written_high:
            self._metrics.retransmitted(self.dst, min(end, self._written_high) - start)
        if end > self._written_high:  # count what goes out for the first time
            fresh_from = max(start, self._written_high)
            markers = sum(1 for marker in frame.markers if marker.position >= fresh_from - start)
            entries = end - fresh_from
            nbytes = sum(self._sizes[fresh_from:end]) - ENTRY_OVERHEAD * entries
            self._metrics.sent(self.dst, entries - markers, nbytes)
            if markers:
                self._metrics.markers_sent(markers)
            self._written_high = end
        return frame

    def _room_to_spare(self) -> bool:
        """Whether at most half the window is taken (entries and bytes): a frame may wait for its ack."""
        return (len(self._entries) - self._head) * 2 <= self._max_entries and self._window_bytes * 2 <= self._max_bytes

    async def _read_acks(self, call: grpc.aio.StreamStreamCall) -> None:
        async for ack in call:
            self._acknowledge(ack)

    def _acknowledge(self, ack: ChannelAck) -> None:
        known = self._receiver_incarnation
        if known is None or ack.receiver_incarnation > known:
            if known is not None:
                # A new receiver gets exactly what is still in the window, from the next entry on,
                # and no held marker: it never recorded those snapshots.
                self._held_markers.clear()
                in_window = self._entries[self._head :]
                self._on_receiver_restart(sum(1 for entry in in_window if type(entry) is not Marker))
            self._receiver_incarnation = ack.receiver_incarnation
        elif ack.receiver_incarnation < known:
            # An older receiver still running (a zombie, at an address the resolver still gave):
            # not a restart. Its acknowledgements must not drop entries the current receiver never
            # got: the stream is dropped, and the window resent on the next one.
            raise ConnectionError(
                f"channel {self.src} -> {self.dst}: acknowledgement from stale receiver incarnation "
                f"{ack.receiver_incarnation} (incarnation {known} has superseded it)"
            )
        covered = ack.next_seq - self._acked
        # Bounded by what was ever written, not by what this stream has resent yet: after a
        # reconnect the receiver answers the hello with all it accepted on the stream before.
        written = max(self._next_to_write, self._written_high)
        if covered < 0 or covered > written - self._head:
            raise ConnectionError(
                f"channel {self.src} -> {self.dst}: acknowledgement of {ack.next_seq} outside the window "
                f"[{self._acked}, {self._acked + written - self._head}]"
            )
        self._acks_on_stream += 1
        # The first acknowledgement answers the hello; a later one that covers nothing is a hold.
        self.held = not covered and self._acks_on_stream > 1
        if covered:
            end = self._head + covered
            self._window_bytes -= sum(self._sizes[self._head : end])
            self._head = end
            self._next_to_write = max(self._next_to_write, end)  # no resending what is acknowledged
            self._acked = ack.next_seq
            self._compact()
        self._metrics.window(self.dst, len(self._entries) - self._head, self._window_bytes)
        if self.has_space():
            self._space.set()

    def _compact(self) -> None:
        """Drop acknowledged entries from the front once they outnumber the rest (amortised O(1) per
        entry), and soon: markers are tuples, and a slow channel that kept thousands of acknowledged
        ones would have every full garbage collection of the process walk them."""
        if self._head >= _COMPACT_AFTER and self._head * 2 > len(self._entries):
            del self._entries[: self._head]
            del self._sizes[: self._head]
            self._next_to_write -= self._head
            self._written_high -= self._head
            self._head = 0
