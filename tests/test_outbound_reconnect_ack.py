"""A sender takes an acknowledgement that covers more than its new stream has resent yet.

After a reconnect the sender resends its window from the last acknowledgement it saw, and the
receiver answers the new stream's hello with everything it accepted on the old one. That answer
may cover entries the new stream has not written again: they were written before, so the answer
is honest, and the sender drops them from its window instead of the stream.
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from stablewatch.agents import ChannelSettings
from stablewatch.agents.metrics import AgentMetrics
from stablewatch.agents.outbound import OutboundChannel
from stablewatch.v1 import ChannelAck

pytestmark = pytest.mark.timeout(30)


def sender() -> OutboundChannel:
    return OutboundChannel(
        "A",
        "B",
        "127.0.0.1:1",
        incarnation=7,
        settings=ChannelSettings(max_frame_entries=4),
        metrics=AgentMetrics(CollectorRegistry()),
        on_receiver_restart=lambda lost: None,
    )


def write_all(out: OutboundChannel) -> int:
    """Write frames until the window is written; the sequence number after the last."""
    first_seq = 0
    while out._next_to_write < len(out._entries):
        frame = out._next_frame()
        first_seq = frame.first_seq + len(frame.payloads)
    return first_seq


def test_a_hello_answer_past_what_the_new_stream_resent_moves_the_window_on() -> None:
    out = sender()
    for i in range(40):
        out.push(b"m%d" % i, 16)
    out._acknowledge(ChannelAck(next_seq=0, receiver_incarnation=1))  # the first stream's hello
    assert write_all(out) == 40
    out._next_to_write = out._head  # the stream broke: the next one resends from the last ack seen
    out._next_frame()  # the new stream has resent m0..m3 when the hello's answer comes
    out._acknowledge(ChannelAck(next_seq=40, receiver_incarnation=1))  # B had accepted all 40
    assert out.unacknowledged == 0
    assert out._next_to_write == out._head  # nothing acknowledged is written again


def test_an_acknowledgement_past_anything_ever_written_is_still_refused() -> None:
    out = sender()
    for i in range(8):
        out.push(b"m%d" % i, 16)
    out._acknowledge(ChannelAck(next_seq=0, receiver_incarnation=1))
    out._next_frame()  # m0..m3 written
    with pytest.raises(ConnectionError, match="acknowledgement of 6 outside the window"):
        out._acknowledge(ChannelAck(next_seq=6, receiver_incarnation=1))
