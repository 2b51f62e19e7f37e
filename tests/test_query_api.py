"""The detector's query API end to end: a real Detector, real in-process agents, a real gRPC client.

The detector and its agents run on one event loop in a background thread; the tests call the
API synchronously, through :class:`stablewatch.cli.client.DetectorClient` and raw stubs.
Agents A and B each wait on the other (a deadlock) and A has sent B one message, so snapshots
have two processes, one channel, a deadlock cycle and a wait-for graph worth looking at.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from polling import poll
from stablewatch.agents import Agent
from stablewatch.agents.loop_thread import LoopThread
from stablewatch.cli.client import DetectorClient, DetectorError
from stablewatch.detector.service.detector import Detector, DetectorConfig
from stablewatch.v1 import AgentMessage, control_pb2, control_pb2_grpc, query_pb2, query_pb2_grpc
from stablewatch.v1.query_pb2 import SNAPSHOT_OUTCOME_ABORTED, SNAPSHOT_OUTCOME_COMPLETED, WatchEvent

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")
TOKENS = 100


class LoopDetector:
    """A Detector, and agents attached to it, on an event loop in a background thread."""

    def __init__(self, data_dir: Path, **config: Any) -> None:
        self._loop_thread = LoopThread("detector")
        self._loop_thread.start()
        settings = {"listen": "127.0.0.1:0", "metrics_port": 0, "interval": None, **config}
        self.detector = Detector(DetectorConfig(data_dir=data_dir, **settings))
        self.agents: dict[str, Agent] = {}
        self.waits: dict[str, int] = {}  # process id -> the token of its wait
        try:
            self.call(self.detector.start())
        except BaseException:
            self.stop()
            raise
        self.address = self.detector.address

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float = 20) -> T:
        return self._loop_thread.run(coroutine, timeout)

    def attach(self, process_id: str, peers: dict[str, str] | None = None) -> Agent:
        # No long-wait hints: the tests count the snapshots they start themselves.
        agent = Agent(
            process_id, detector=self.address, peers=peers or {}, handler=lambda src, message: None, hint_after=None
        )
        agent.state.set_counter("tokens", TOKENS)
        agent.state.set_active(False)
        self.call(agent.start())
        self.agents[process_id] = agent
        poll(lambda: process_id in self.detector.coordinator.members, f"{process_id} to attach")
        return agent

    def stop(self) -> None:
        try:
            for agent in self.agents.values():
                self.call(agent.stop())
            self.call(self.detector.stop())
        finally:
            self._loop_thread.stop(10)


def attach_deadlocked_pair(running: LoopDetector) -> None:
    """A and B wait on each other; A has sent B one message, so channel A -> B exists (and is empty)."""
    b = running.attach("B")
    a = running.attach("A", peers={"B": b.address})
    running.waits["A"] = a.state.add_wait("B")
    running.waits["B"] = b.state.add_wait("A")
    delivered = threading.Event()
    b.on_message(lambda src, message: delivered.set())
    running.call(a.send("B", b"hello", counters={"tokens": 1}))
    assert delivered.wait(10), "A's message never reached B"


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as failure:
        call()
    return failure.value.code()


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopDetector]:
    running = LoopDetector(tmp_path_factory.mktemp("detector"))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def stub(running: LoopDetector) -> Iterator[query_pb2_grpc.QueryStub]:
    with grpc.insecure_channel(running.address) as channel:
        yield query_pb2_grpc.QueryStub(channel)


@pytest.fixture(scope="module")
def client(running: LoopDetector) -> Iterator[DetectorClient]:
    with DetectorClient(running.address) as client:
        yield client


# The module's tests run in file order: the first ones see the detector before any agent attaches.


def test_before_any_agent(stub: query_pb2_grpc.QueryStub, client: DetectorClient) -> None:
    assert code_of(lambda: stub.GetLatestResults(query_pb2.GetLatestResultsRequest(), timeout=5)) == (
        grpc.StatusCode.NOT_FOUND
    )
    with pytest.raises(DetectorError, match="no agent is attached") as failure:
        client.trigger_snapshot()
    assert failure.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert client.members() == []
    assert not client.list_snapshots().snapshots


def test_health_check_says_serving(running: LoopDetector) -> None:
    with grpc.insecure_channel(running.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "stablewatch.v1.Query", "stablewatch.v1.Control"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service


def test_reflection_lists_the_query_service(running: LoopDetector) -> None:
    with grpc.insecure_channel(running.address) as channel:
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (reply,) = reflection.ServerReflectionInfo(iter([request]), timeout=5)
    names = {service.name for service in reply.list_services_response.service}
    assert {"stablewatch.v1.Query", "stablewatch.v1.Control", "grpc.health.v1.Health"} <= names


def test_members_are_listed(running: LoopDetector, client: DetectorClient) -> None:
    attach_deadlocked_pair(running)
    members = client.members()
    assert [m.process_id for m in members] == ["A", "B"]
    assert [m.address for m in members] == [running.agents["A"].address, running.agents["B"].address]
    for member in members:
        assert member.attached_at.seconds > 0
        assert member.last_heartbeat.ToNanoseconds() >= member.attached_at.ToNanoseconds()


def test_trigger_snapshot_and_read_it_back(stub: query_pb2_grpc.QueryStub, client: DetectorClient) -> None:
    results = client.trigger_snapshot(deadline=10)
    summary = results.snapshot
    assert summary.outcome == SNAPSHOT_OUTCOME_COMPLETED, summary.abort_reason
    assert (summary.processes, summary.channels, summary.messages_in_flight) == (2, 1, 0)
    assert summary.finished_at.ToNanoseconds() >= summary.started_at.ToNanoseconds() > 0
    by_name = {r.name: r for r in results.results}
    assert set(by_name) == {"deadlock", "termination", "conservation(tokens)"}
    assert by_name["deadlock"].holds
    assert by_name["conservation(tokens)"].holds  # the baseline: 2 * 100, one token moved from A to B
    assert by_name["conservation(tokens)"].conservation.observed == 2 * TOKENS

    snapshot_id = summary.snapshot_id
    assert client.latest_results() == results
    assert client.snapshot_results(snapshot_id) == results

    snapshot = client.snapshot(snapshot_id)
    assert snapshot.snapshot_id == snapshot_id
    assert [p.process_id for p in snapshot.processes] == ["A", "B"]
    assert [p.state.counters["tokens"] for p in snapshot.processes] == [TOKENS - 1, TOKENS + 1]
    (channel,) = snapshot.channels
    assert (channel.src, channel.dst, channel.sent_before_marker, channel.received_before_recording) == (
        "A",
        "B",
        1,
        1,
    )

    graph = client.wait_for_graph(snapshot_id)
    assert graph.snapshot_id == snapshot_id
    assert sorted(n.process for n in graph.nodes) == ["A", "B"]
    assert sorted((e.waiter.process, e.target.process, e.discounted) for e in graph.edges) == [
        ("A", "B", False),
        ("B", "A", False),
    ]
    assert [n.process for n in graph.deadlock.cycle] == ["A", "B"]
    assert sorted(n.process for n in graph.deadlock.deadlocked) == ["A", "B"]


def test_unknown_ids_and_bad_requests(stub: query_pb2_grpc.QueryStub, client: DetectorClient) -> None:
    latest = client.latest_results().snapshot.snapshot_id
    for method in (stub.GetSnapshotResults, stub.GetSnapshot, stub.GetWaitForGraph):
        for snapshot_id in (latest + 1000, 2**64 - 1):
            request = query_pb2.GetSnapshotRequest(snapshot_id=snapshot_id)
            assert code_of(lambda m=method, r=request: m(r, timeout=5)) == grpc.StatusCode.NOT_FOUND
        request = query_pb2.GetSnapshotRequest(snapshot_id=0)
        assert code_of(lambda m=method, r=request: m(r, timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
    for request in (
        query_pb2.ListSnapshotsRequest(page_size=1001),
        query_pb2.ListSnapshotsRequest(page_token="not-a-token"),
        query_pb2.ListSnapshotsRequest(page_token="-5"),
    ):
        assert code_of(lambda r=request: stub.ListSnapshots(r, timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
    too_long = query_pb2.TriggerSnapshotRequest(timeout_ms=10 * 60 * 1000 + 1)
    assert code_of(lambda: stub.TriggerSnapshot(too_long, timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT


def test_list_snapshots_pages_newest_first(client: DetectorClient) -> None:
    taken = [client.trigger_snapshot(deadline=10).snapshot.snapshot_id for _ in range(4)]
    assert taken == sorted(taken)
    everything = [s.snapshot_id for s in client.list_snapshots(page_size=1000).snapshots]
    assert everything == sorted(everything, reverse=True)
    assert everything[: len(taken)] == taken[::-1]

    pages, token = [], ""
    while True:
        page = client.list_snapshots(page_size=2, page_token=token)
        assert 1 <= len(page.snapshots) <= 2
        pages.append([s.snapshot_id for s in page.snapshots])
        token = page.next_page_token
        if not token:
            break
    assert [i for page in pages for i in page] == everything
    assert all(len(page) == 2 for page in pages[:-1])
    assert client.list_snapshots().snapshots[0].snapshot_id == everything[0]  # page_size 0: the default page


def read_stream(events: Iterator[WatchEvent]) -> queue.Queue[WatchEvent | Exception]:
    received: queue.Queue[WatchEvent | Exception] = queue.Queue()

    def read() -> None:
        try:
            for event in events:
                received.put(event)
        except Exception as error:  # the test reports it
            received.put(error)

    threading.Thread(target=read, daemon=True).start()
    return received


def next_event(received: queue.Queue[WatchEvent | Exception], timeout: float = 10) -> WatchEvent:
    event = received.get(timeout=timeout)
    if isinstance(event, Exception):
        raise event
    return event


def test_watch_streams_results_and_changes(running: LoopDetector, stub: query_pb2_grpc.QueryStub) -> None:
    full_call = stub.Watch(query_pb2.WatchRequest())
    changes_call = stub.Watch(query_pb2.WatchRequest(changes_only=True))
    try:
        full, changes = read_stream(full_call), read_stream(changes_call)
        # A stream subscribes when its handler first runs; there is no reply to wait for.
        poll(lambda: len(running.detector._watch._watchers) == 2, "both watch streams to subscribe")

        with DetectorClient(running.address) as client:
            # Each stream starts with the present state: the latest results, every value first.
            current = client.latest_results()
            event = next_event(full)
            assert event.results == current
            assert [(c.name, c.first) for c in event.changes] == [(r.name, True) for r in current.results]
            event = next_event(changes)
            assert not event.HasField("results")
            assert [(c.name, c.holds, c.first) for c in event.changes] == [
                (r.name, r.holds, True) for r in current.results
            ]

            same = client.trigger_snapshot(deadline=10)  # no predicate changes value
            event = next_event(full)
            assert event.snapshot_id == same.snapshot.snapshot_id
            assert event.results == same
            assert not event.changes

            a = running.agents["A"].state
            a.remove_wait(running.waits["A"])  # A waits on nothing: no more deadlock
            try:
                released = client.trigger_snapshot(deadline=10)
            finally:
                running.waits["A"] = a.add_wait("B")
        event = next_event(full)
        assert event.snapshot_id == released.snapshot.snapshot_id
        assert [(c.name, c.holds, c.previous_holds, c.first) for c in event.changes] == [
            ("deadlock", False, True, False)
        ]
        event = next_event(changes)  # the unchanged snapshot before was not sent
        assert event.snapshot_id == released.snapshot.snapshot_id
        assert not event.HasField("results")
        assert [(c.name, c.holds) for c in event.changes] == [("deadlock", False)]
    finally:
        full_call.cancel()
        changes_call.cancel()
    poll(lambda: not running.detector._watch._watchers, "the cancelled streams to unsubscribe")


def test_restart_keeps_history_and_ids_grow(tmp_path: Path) -> None:
    first = LoopDetector(tmp_path)
    try:
        first.attach("A")
        with DetectorClient(first.address) as client:
            old = [client.trigger_snapshot(deadline=10).snapshot.snapshot_id for _ in range(3)]
            old_latest = client.latest_results()
    finally:
        first.stop()

    second = LoopDetector(tmp_path)
    try:
        with DetectorClient(second.address) as client:
            assert client.latest_results() == old_latest
            assert [s.snapshot_id for s in client.list_snapshots().snapshots] == old[::-1]
            assert client.snapshot(old[0]).snapshot_id == old[0]
            second.attach("A")
            new = client.trigger_snapshot(deadline=10)
            assert new.snapshot.outcome == SNAPSHOT_OUTCOME_COMPLETED
            assert new.snapshot.snapshot_id > max(old)
            assert [s.snapshot_id for s in client.list_snapshots().snapshots] == [new.snapshot.snapshot_id, *old[::-1]]
    finally:
        second.stop()


def test_a_second_detector_cannot_take_the_same_port(running: LoopDetector, tmp_path: Path) -> None:
    with pytest.raises((OSError, RuntimeError)):
        LoopDetector(tmp_path, listen=running.address, metrics_port=None).stop()


def test_stop_with_a_slow_watcher_whose_queue_is_full(tmp_path: Path) -> None:
    running = LoopDetector(tmp_path, metrics_port=None)

    async def fill_a_slow_watchers_queue() -> AsyncIterator[WatchEvent]:
        watcher = running.detector.watch()
        waiting = asyncio.ensure_future(anext(watcher))
        await asyncio.sleep(0)
        running.detector._watch.publish(query_pb2.SnapshotResults(), [])
        await waiting  # it took one event and reads no more, like a stream stuck on flow control
        for _ in range(1000):  # the queue's bound: it is full, not yet cut off
            running.detector._watch.publish(query_pb2.SnapshotResults(), [])
        return watcher  # kept alive: a collected generator would unsubscribe

    try:
        watcher = running.call(fill_a_slow_watchers_queue())
        assert [queue.full() for queue in running.detector._watch._watchers] == [True]
        running.call(running.detector.stop())
        del watcher
    finally:
        running.detector._watch._watchers.clear()
        running.stop()


class SilentAgent:
    """Attaches on the control stream and then never answers: its snapshots can only time out."""

    def __init__(self, address: str, process_id: str = "S") -> None:
        self._closed = threading.Event()
        self._channel = grpc.insecure_channel(address)

        def requests() -> Iterator[AgentMessage]:
            yield AgentMessage(register=control_pb2.Register(process_id=process_id, address="127.0.0.1:1"))
            self._closed.wait()

        self._call = control_pb2_grpc.ControlStub(self._channel).Attach(requests())
        self.received = read_stream(self._call)

    def close(self) -> None:
        self._closed.set()
        self._call.cancel()
        self._channel.close()


def test_a_cancelled_trigger_still_finishes_its_snapshot(tmp_path: Path) -> None:
    running = LoopDetector(tmp_path, metrics_port=None, heartbeat_timeout=60)
    silent = SilentAgent(running.address)
    try:
        poll(lambda: "S" in running.detector.coordinator.members, "the silent agent to attach")
        with grpc.insecure_channel(running.address) as channel:
            stub = query_pb2_grpc.QueryStub(channel)
            request = query_pb2.TriggerSnapshotRequest(timeout_ms=500)
            assert code_of(lambda: stub.TriggerSnapshot(request, timeout=0.2)) == grpc.StatusCode.DEADLINE_EXCEEDED
            newest = lambda: stub.ListSnapshots(query_pb2.ListSnapshotsRequest(), timeout=5).snapshots[0]  # noqa: E731
            assert newest().outcome != SNAPSHOT_OUTCOME_COMPLETED
            poll(lambda: newest().outcome == SNAPSHOT_OUTCOME_ABORTED, "the snapshot to abort at its deadline", 3)
            assert "deadline" in newest().abort_reason
        assert running.detector.coordinator.running == []
    finally:
        silent.close()
        running.stop()
