"""Channel faults with real gRPC on 127.0.0.1: broken streams, server and process restarts, backpressure.

Token-bank services (stablewatch.testing.token_node) run as OS processes; a TCP proxy (TcpProxy)
between a sender and its receiver breaks the gRPC connections on demand. Every payload carries a
per-channel sequence number and the receiving node records an error for every gap, duplicate or
reordering, so "exactly once, in order" is checked message by message. A few tests use in-process
asyncio agents where the test must control the receiver's handler.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from cuts import assert_consistent
from detector_stub import SnapshotAborted, StubDetector

from polling import async_poll, poll, run
from stablewatch.agents import Agent, AppMessage, ChannelSettings, MessageTooLarge
from stablewatch.testing.tcp_proxy import TcpProxy
from stablewatch.testing.token_nodes import Node, connect_all, wait_quiet
from stablewatch.v1 import GlobalSnapshot

TOKENS = 100
RECONNECTS = "stablewatch_agent_reconnects_total"
RETRANSMITTED = "stablewatch_agent_retransmitted_entries_total"
SENT = "stablewatch_agent_messages_sent_total"
RECEIVED = "stablewatch_agent_messages_received_total"


# -- helpers ------------------------------------------------------------------------------------


def break_repeatedly(proxy: TcpProxy, times: int, progress: Callable[[], int]) -> None:
    """Break every connection through ``proxy`` ``times`` times, each once ``progress()`` has grown.

    Before each break the receiver must have made progress since the previous one (so every
    break cuts a transfer that is flowing again, often in the middle of a frame), and every
    connection must be past its HTTP/2 handshake: a connection broken earlier counts for gRPC as a
    failed attempt, which it answers with a second or more of backoff.
    """
    for round_ in range(times):
        mark = progress()
        poll(
            lambda mark=mark: progress() > mark and proxy.all_established,
            f"progress through the proxy before break {round_ + 1}",
            interval=0.005,
        )
        assert proxy.break_all() >= 1


def registered_incarnation(detector: StubDetector, process_id: str) -> int | None:
    member = detector.coordinator.members.get(process_id)
    return None if member is None else member.incarnation


def total_received(node: Node) -> int:
    return sum(node.stats()["received"].values())


def assert_clean(stats: list[dict[str, Any]], total: int | None = None) -> None:
    assert all(not s["errors"] for s in stats), [s["errors"] for s in stats]
    if total is not None:
        assert sum(s["tokens"] for s in stats) == total


def delivered_to_b(a: Node, b: Node, c: Node) -> dict[str, int]:
    """Once A and C have sent their transfers and everything arrived: nothing was lost or repeated,
    the tokens add up, and B received exactly what each sent it; what each sent to B."""
    for node in (a, c):
        node.wait_seen("transferred")
    stats = wait_quiet([a, b, c])
    assert_clean(stats, 3 * TOKENS)
    sent_to_b = {"A": stats[0]["sent"]["B"], "C": stats[2]["sent"]["B"]}
    assert stats[1]["received"] == sent_to_b
    return sent_to_b


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture
def start_nodes() -> Iterator[Callable[..., list[Node]]]:
    started: list[Node] = []

    def start(*ids: str, args: tuple[str, ...] = ()) -> list[Node]:
        nodes = []
        for pid in ids:
            nodes.append(Node(pid, *(("--tokens", str(TOKENS)) if "--tokens" not in args else ()), *args))
            started.append(nodes[-1])
        return nodes

    yield start
    for node in started:
        node.stop()


@pytest.fixture
def proxies() -> Iterator[Callable[..., TcpProxy]]:
    started: list[TcpProxy] = []

    def start(target: str, **options: Any) -> TcpProxy:
        started.append(TcpProxy(target, **options))
        return started[-1]

    yield start
    for proxy in started:
        proxy.stop()


# -- streams broken mid-transfer ----------------------------------------------------------------


def test_stream_breaks_mid_transfer_lose_and_duplicate_nothing(start_nodes, proxies) -> None:
    """A and C send to B through a proxy that breaks every connection 20 times mid-transfer.

    The proxy caps each connection at 50 kB/s and frames hold at most 64 messages, so the transfer
    lasts long enough for 20 breaks, each after B received more. Afterwards every message arrived
    exactly once and in order, tokens are conserved, and the senders' metrics show that they
    reconnected and retransmitted.
    """
    a, b, c = start_nodes("A", "B", "C", args=("--max-frame-entries", "64"))
    proxy = proxies(b.address, rate=50_000)
    connect_all([a, b, c], {"A": a.address, "B": proxy.address, "C": c.address})
    for seed, node in ((1, a), (2, c)):
        node.command("transfer", count=6000, seed=seed)

    break_repeatedly(proxy, 20, lambda: total_received(b))
    received_after_breaks = total_received(b)
    sent_to_b = delivered_to_b(a, b, c)
    assert received_after_breaks < sum(sent_to_b.values()), "the transfer ended before the last break"
    assert proxy.breaks >= 20
    samples = {"reconnects": (RECONNECTS, {"peer": "B"}), "retransmitted": (RETRANSMITTED, {"peer": "B"})}
    metrics = [node.metrics(samples) for node in (a, c)]
    assert sum(m["reconnects"] or 0 for m in metrics) >= 20, metrics
    assert sum(m["retransmitted"] or 0 for m in metrics) > 0, metrics
    # The receiving agent counted each message once too.
    assert b.metrics({src: (RECEIVED, {"peer": src}) for src in ("A", "C")}) == sent_to_b


def test_snapshots_stay_consistent_while_streams_break(detector: StubDetector, start_nodes, proxies) -> None:
    """Snapshots run back to back while every channel of A, B and C breaks 20 times.

    Every node sits behind its own proxy (50 kB/s per connection) and all three send to each
    other. A new snapshot begins between any two breaks, so each one sees streams break under it.
    Each snapshot either completes, passes the per-channel proof and conserves the tokens, or is
    aborted (SnapshotAborted); none is ever rejected as inconsistent, and snapshots complete after
    the breaks stop.
    """
    args = ("--detector", detector.address, "--window", "50", "--max-frame-entries", "64")
    nodes = start_nodes("A", "B", "C", args=args)
    by_id = {node.process_id: node for node in nodes}
    fronts = {pid: proxies(node.address, rate=50_000) for pid, node in by_id.items()}
    connect_all(nodes, {pid: proxy.address for pid, proxy in fronts.items()})
    detector.wait_members(set(by_id))
    for seed, node in enumerate(nodes):
        node.command("transfer", count=4000, seed=seed)

    started: list[float] = []
    snapshots: list[GlobalSnapshot] = []
    aborted: list[str] = []
    done = threading.Event()

    def take_snapshots() -> None:
        while not done.is_set() and len(started) < 100:
            started.append(time.monotonic())
            try:
                snapshots.append(detector.snapshot(timeout=5))
            except SnapshotAborted as error:
                aborted.append(str(error))

    worker = threading.Thread(target=take_snapshots, name="snapshots")
    worker.start()
    try:
        for round_ in range(20):
            begun = len(started)
            for proxy in fronts.values():
                mark = proxy.upstream_bytes
                poll(
                    lambda proxy=proxy, mark=mark, begun=begun: (
                        len(started) > begun and proxy.upstream_bytes > mark and proxy.all_established
                    ),
                    f"a new snapshot and traffic through every proxy before break {round_ + 1}",
                    interval=0.005,
                )
            for proxy in fronts.values():
                proxy.break_all()
    finally:
        done.set()
        worker.join(30)
    assert not worker.is_alive()
    during = snapshots[:]
    for node in nodes:
        node.wait_seen("transferred")
    after = [detector.snapshot(timeout=10) for _ in range(3)]
    stats = wait_quiet(nodes)

    assert len(started) >= 20 and len(during) >= 5, (len(started), len(during), aborted)
    assert any(c.messages for snapshot in during for c in snapshot.channels), "no snapshot caught a message"
    assert not detector.rejections, detector.rejections
    for snapshot in during + after:
        assert [p.process_id for p in snapshot.processes] == ["A", "B", "C"]
        assert_consistent(snapshot, 3 * TOKENS)
    assert_clean(stats, 3 * TOKENS)
    quiet = detector.snapshot()
    assert_consistent(quiet, 3 * TOKENS)
    assert not any(c.messages for c in quiet.channels)


# -- the receiving agent's server restarted -----------------------------------------------------


@pytest.mark.parametrize(
    "delay",
    [
        0.0,
        0.001,
    ],
    ids=["fast-receiver", "slow-receiver"],
)
def test_receiver_server_restart_mid_transfer(start_nodes, proxies, delay: float) -> None:
    """B's gRPC server is restarted three times while A and C send to it; its channel state survives.

    A and C reach B through a proxy capped at 50 kB/s per connection, so the transfer is still
    going at every restart. Nothing is lost, duplicated or reordered; tokens are conserved. With a
    receiver whose handler awaits (``slow``), a restart lands while a frame is half delivered.
    """
    a, b, c = start_nodes("A", "B", "C", args=("--max-frame-entries", "64"))
    proxy = proxies(b.address, rate=50_000)
    connect_all([a, b, c], {"A": a.address, "B": proxy.address, "C": c.address})
    if delay:
        b.command("slow", seconds=delay)
        b.expect("slow")
    for seed, node in ((3, a), (4, c)):
        node.command("transfer", count=4000, seed=seed)

    for _ in range(3):
        mark = total_received(b)
        poll(lambda mark=mark: total_received(b) >= mark + 100, "deliveries to B", interval=0.01)
        b.command("restart_server")
        assert b.expect("restarted")["address"] == b.address
    received_after_restarts = total_received(b)
    if delay:
        b.command("slow", seconds=0)
        b.expect("slow")
    sent_to_b = delivered_to_b(a, b, c)
    assert received_after_restarts < sum(sent_to_b.values()), "the transfer ended before the last restart"
    samples = {"reconnects": (RECONNECTS, {"peer": "B"})}
    assert sum(node.metrics(samples)["reconnects"] or 0 for node in (a, c)) >= 3


# -- the receiving process killed and restarted -------------------------------------------------


def test_receiver_process_killed_and_restarted(detector: StubDetector, start_nodes, proxies) -> None:
    """B is killed (SIGKILL) mid-transfer and a new B process starts on the same address.

    What the design promises (agents/inbound.py, agents/outbound.py, core.reset_outbound): the new
    process is a new receiver incarnation. Each sender learns it from the first acknowledgement,
    resets its counts for the channel (``core.reset_outbound``, to the messages still in its window)
    and delivers to the new process every message the old one had not acknowledged. Messages the
    old process received and acknowledged are gone with it, and so are the tokens it held; messages
    it received but had not yet acknowledged reach the new process again.

    Asserted here:
    * no message is lost across the restart: the new B's first sequence number from each sender is
      at most what the old B had received when traffic to it was frozen (the proxy is paused, so no
      acknowledgement from the old B passes after that), and from there on it receives every
      message exactly once and in order, up to the last one sent;
    * snapshots after the restart complete, pass the per-channel proof, and all conserve the same
      total, which equals the live processes' tokens once the system is quiet (the total before
      the kill is not expected, since the dead process took its tokens with it);
    * the detector rejected no part as inconsistent; the only parts it refused are late parts of
      snapshots begun before the restart (the new B can get a retransmitted old marker).

    An agent acknowledges what it queued for its handler; with ``--inbox 1`` it acknowledges only
    when its queue is empty, so every message acknowledged has been received, as counted above.
    """
    args = ("--detector", detector.address, "--window", "200", "--inbox", "1")
    a, b, c = start_nodes("A", "B", "C", args=args)
    proxy = proxies(b.address)
    connect_all([a, b, c], {"A": a.address, "B": proxy.address, "C": c.address})
    detector.wait_members({"A", "B", "C"})
    old_incarnation = registered_incarnation(detector, "B")
    b.command("slow", seconds=0.0005)  # so that the kill finds plenty of messages in flight
    b.expect("slow")
    for seed, node in ((5, a), (6, c)):
        node.command("transfer", count=3000, seed=seed)
    before = detector.snapshot(timeout=20)
    assert_consistent(before, 3 * TOKENS)
    poll(lambda: all(n >= 200 for n in b.stats()["received"].values()) and len(b.stats()["received"]) == 2, "B busy")

    proxy.pause()  # from here on nothing reaches B and no acknowledgement leaves it
    received_by_old = b.stats()["received"]
    b.kill()
    proxy.break_all()
    restart_args = ("--tokens", "0", "--listen", b.address, "--resume", "--detector", detector.address, "--inbox", "1")
    (new_b,) = start_nodes("B", args=restart_args)
    assert new_b.address == b.address
    proxy.resume()
    poll(lambda: registered_incarnation(detector, "B") not in (None, old_incarnation), "the new B registered")
    poll(lambda: set(new_b.stats()["first"]) == {"A", "C"}, "both senders reached the new B", timeout=20)
    # A sender resets its channel when the new B's first acknowledgement reaches it; a snapshot
    # begun before that would be failed by the reset ("its receiver restarted"), and rightly.
    restarts = {"restarts": ("stablewatch_agent_receiver_restarts_total", {"peer": "B"})}
    poll(lambda: all(node.metrics(restarts)["restarts"] == 1 for node in (a, c)), "A and C saw the new B")
    last_old_snapshot = before.snapshot_id

    for seed, node in ((7, a), (8, c)):
        node.command("transfer", count=1500, seed=seed)
    after = [detector.snapshot(timeout=10) for _ in range(4)]
    for node in (a, c):
        node.wait_seen("transferred", 2)
    stats = wait_quiet([a, new_b, c])
    after.append(detector.snapshot(timeout=10))

    first = new_b.stats()["first"]
    for src in ("A", "C"):
        assert first[src] <= received_by_old[src], (first, received_by_old)
    assert_clean(stats)
    sent = {"A": stats[0]["sent"]["B"], "C": stats[2]["sent"]["B"]}
    assert stats[1]["received"] == sent
    total = sum(s["tokens"] for s in stats)
    for snapshot in after:
        assert [p.process_id for p in snapshot.processes] == ["A", "B", "C"]
        assert assert_consistent(snapshot, None) == total, f"snapshot {snapshot.snapshot_id}"
    assert not any(ch.messages for ch in after[-1].channels)
    assert all(
        r.reason in ("late", "unknown_snapshot") and f"snapshot {last_old_snapshot}" in r.detail
        for r in detector.rejections
    ), detector.rejections
    reconnects = a.metrics({"b": (RECONNECTS, {"peer": "B"})})["b"]
    assert reconnects and reconnects >= 1


# -- backpressure -------------------------------------------------------------------------------


def test_slow_receiver_holds_the_sender_to_its_window(start_nodes) -> None:
    """With a 50-entry window and a slow B, A never has more than 50 messages unacknowledged.

    Neither by A's own account (stats ``unacknowledged``) nor end to end (sent by A minus received
    by B: B's receive queue is bounded at one message, so it acknowledges only what its handler
    has had); the transfer is held back while B is slow and finishes, complete, once B speeds up.
    """
    a, b = start_nodes("A", "B", args=("--window", "50", "--inbox", "1"))
    connect_all([a, b])
    b.command("slow", seconds=0.002)
    b.expect("slow")
    count = 1000
    a.command("transfer", count=count, seed=9)

    observed = []
    for _ in range(50):
        sent = a.stats()
        received = b.stats()["received"].get("A", 0)
        observed.append(sent["unacknowledged"].get("B", 0))
        assert sent["unacknowledged"].get("B", 0) <= 50
        # A numbers a message before its send waits for space: one more than the window at most.
        assert sent["sent"].get("B", 0) - received <= 51
        time.sleep(0.005)
    assert max(observed) == 50, observed  # the window really filled up
    assert a.stats()["sent"]["B"] < count  # and held the transfer back

    b.command("slow", seconds=0)
    b.expect("slow")
    a.wait_seen("transferred")
    stats = wait_quiet([a, b])
    assert_clean(stats, 2 * TOKENS)
    assert stats[1]["received"] == {"A": count}


def test_full_window_blocks_send_until_receiver_handler_returns() -> None:
    """In process: B's handler blocks on an event; B's receive queue (bounded at one message)
    stays full, so A's 10-entry window fills up.

    ``try_send`` then returns False (and sends nothing) and ``send`` waits until the event is set;
    afterwards every message arrives once, in order.
    """

    async def scenario() -> None:
        release = asyncio.Event()
        got: list[bytes] = []

        async def handler(src: str, message: AppMessage) -> None:
            got.append(message.payload)
            await release.wait()

        b = Agent("B", handler=handler, channel_settings=ChannelSettings(inbox_entries=1))
        await b.start()
        a = Agent("A", peers={"B": b.address}, channel_settings=ChannelSettings(window_entries=10))
        await a.start()
        try:
            accepted = 0
            while accepted < 100 and a.try_send("B", b"%d" % accepted):
                accepted += 1
            assert accepted == 10
            await async_poll(lambda: got, "the first delivery")
            assert not a.try_send("B", b"refused")
            blocked = asyncio.ensure_future(a.send("B", b"10"))
            done, _ = await asyncio.wait({blocked}, timeout=0.5)
            assert not done, "send returned while the window was full"
            assert a._outbound["B"].unacknowledged == 10
            release.set()
            await asyncio.wait_for(blocked, 10)
            await async_poll(lambda: len(got) == 11, "every delivery")
            assert got == [b"%d" % i for i in range(11)]
        finally:
            release.set()
            await a.stop()
            await b.stop()

    run(scenario())


def test_oversized_message_is_refused_at_send_and_nothing_is_sent() -> None:
    """A message over ``max_message_bytes`` raises MessageTooLarge from send and try_send.

    Nothing goes out: no tokens leave the sender, the receiver gets only the next, valid message,
    and only that one is counted as sent.
    """

    async def scenario() -> None:
        got: list[bytes] = []
        b = Agent("B", handler=lambda src, message: got.append(message.payload))
        await b.start()
        a = Agent("A", peers={"B": b.address}, max_message_bytes=1024)
        a.state.set_counter("tokens", 10)
        await a.start()
        try:
            with pytest.raises(MessageTooLarge):
                await a.send("B", b"x" * 1025, counters={"tokens": 5})
            with pytest.raises(MessageTooLarge):
                a.try_send("B", b"y" * 4096, counters={"tokens": 5})
            assert a.state.counter("tokens") == 10
            await a.send("B", b"z" * 1024, counters={"tokens": 1})  # exactly at the limit: fine
            await async_poll(lambda: got, "the valid message")
            await async_poll(lambda: a._outbound["B"].unacknowledged == 0, "the acknowledgement")
            assert got == [b"z" * 1024]
            assert a.state.counter("tokens") == 9 and b.state.counter("tokens") == 1
            assert a.metrics.registry.get_sample_value(SENT, {"peer": "B"}) == 1
            assert b.metrics.registry.get_sample_value(RECEIVED, {"peer": "A"}) == 1
        finally:
            await a.stop()
            await b.stop()

    run(scenario())


# -- regressions of bugs these tests found ------------------------------------------------------------------


def test_stream_break_during_async_handler_delivers_nothing_twice(proxies) -> None:
    """In process: B's async handler blocks on the third message of a five-message frame; the
    connection breaks and the sender reconnects; then the handler is released.

    A frame's delivery completes even though its stream broke, so nothing is delivered twice when
    the sender resends, and the tokens are counted once.
    """

    async def scenario() -> None:
        release = asyncio.Event()
        got: list[bytes] = []

        async def handler(src: str, message: AppMessage) -> None:
            got.append(message.payload)
            if message.payload == b"2" and not release.is_set():
                await release.wait()

        b = Agent("B", handler=handler)
        await b.start()
        proxy = proxies(b.address)
        a = Agent(
            "A",
            peers={"B": proxy.address},
            channel_settings=ChannelSettings(backoff_initial=0.01, backoff_max=0.2),
        )
        a.state.set_counter("tokens", 5)
        await a.start()
        try:
            for i in range(5):  # one frame: nothing yields to the loop between these sends
                assert a.try_send("B", b"%d" % i, counters={"tokens": 1})
            await async_poll(lambda: len(got) == 3, "the handler blocking on message 2")
            accepted = proxy.accepted
            await asyncio.to_thread(proxy.break_all)
            await async_poll(lambda: proxy.accepted > accepted, "the sender reconnecting")
            release.set()
            await async_poll(lambda: a._outbound["B"].unacknowledged == 0, "every acknowledgement")
            await async_poll(lambda: len(got) >= 5, "every delivery")
            assert got == [b"0", b"1", b"2", b"3", b"4"]
            assert a.state.counter("tokens") + b.state.counter("tokens") == 5
        finally:
            release.set()
            await a.stop()
            await b.stop()

    run(scenario())


def test_sender_retries_an_unreachable_peer_within_backoff_max(proxies) -> None:
    """A peer refuses connections for 2.5 s, then accepts them again.

    With ``backoff_max=0.2`` the sender must try to connect at least every few tenths of a second
    (0.2 s, with jitter up to 1.5x, plus connection time, on a loaded machine: under 1 s, where
    gRPC's own backoff would reach gaps of 1.6 s and more) and deliver soon after the peer is back.
    """

    async def scenario() -> None:
        got: list[bytes] = []
        b = Agent("B", handler=lambda src, message: got.append(message.payload))
        await b.start()
        proxy = proxies(b.address)
        proxy.refuse(True)
        a = Agent(
            "A",
            peers={"B": proxy.address},
            channel_settings=ChannelSettings(backoff_initial=0.01, backoff_max=0.2),
        )
        await a.start()
        try:
            await a.send("B", b"hello")
            await async_poll(lambda: proxy.accept_times, "a first connection attempt")
            await asyncio.sleep(2.5)  # the outage whose connection attempts are measured
            proxy.refuse(False)
            back = time.monotonic()
            await async_poll(lambda: got, "the delivery", timeout=15)
            delay = time.monotonic() - back
            attempts = list(proxy.accept_times)
            gaps = [later - earlier for earlier, later in itertools.pairwise(attempts)]
            assert a._outbound["B"].last_error
            assert max(gaps) < 1.0, f"connection attempts at gaps {[round(g, 2) for g in gaps]} s"
            assert delay < 1.0, f"delivered {delay:.2f} s after the peer was reachable again"
        finally:
            await a.stop()
            await b.stop()

    run(scenario())
