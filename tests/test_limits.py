"""Bounds against abuse: each breach is refused with a reason and counted, and the detector goes on.

Detectors run in plaintext on 127.0.0.1 with small :class:`Limits` (the bounds hold in every
mode); control streams are driven by hand. Nothing here waits a fixed time: the detector's own
bounds end what must end, and the tests poll for outcomes with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from polling import async_poll, poll
from stablewatch.detector.service.detector import DetectorConfig, exposure_warnings
from stablewatch.detector.service.limits import Limits, TokenBucket, parse_rate
from stablewatch.testing.detector import Running
from stablewatch.v1 import (
    AgentMessage,
    InboundChannelState,
    LocalSnapshotPart,
    LocalState,
    RecordedMessage,
    control_pb2,
    control_pb2_grpc,
    query_pb2,
    query_pb2_grpc,
)
from stablewatch.v1.query_pb2 import SNAPSHOT_OUTCOME_ABORTED

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 10.0
REFUSED = "stablewatch_refused_total"
REJECTED = "stablewatch_rejected_parts_total"


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Running]]:
    """Start a plaintext detector with these limits; stopped after the test."""
    started: list[Running] = []

    def run(**limits: object) -> Running:
        config = DetectorConfig(
            data_dir=tmp_path / f"d{len(started)}",
            listen="127.0.0.1:0",
            metrics_port=None,
            interval=None,
            heartbeat_timeout=60,
            limits=Limits(**limits),  # type: ignore[arg-type]
        )
        started.append(Running(config))
        return started[-1]

    yield run
    for running in started:
        running.stop()


class Stream:
    """One hand-driven control stream, on the caller's event loop."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.call = control_pb2_grpc.ControlStub(self.channel).Attach()

    async def register(self, process_id: str) -> str:
        """Register; the reply's kind (``registered``, ``refused``)."""
        await self.call.write(AgentMessage(register=control_pb2.Register(process_id=process_id, address="x:1")))
        return (await self.read()).WhichOneof("kind")

    async def send(self, message: AgentMessage) -> None:
        """Write, unless the detector has already ended the stream (then :meth:`status` tells how)."""
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.call.write(message)

    async def read(self):  # type: ignore[no-untyped-def]
        return await asyncio.wait_for(self.call.read(), TIMEOUT)

    async def status(self) -> tuple[grpc.StatusCode, str]:
        """Wait for the stream to end: its status code and details."""
        try:
            while await self.read() is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as error:
            return error.code(), error.details() or ""
        return await self.call.code(), await self.call.details()

    async def next_start(self) -> int:
        while (message := await self.read()).WhichOneof("kind") != "start":
            pass
        return message.start.snapshot_id

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


def part(snapshot_id: int, process_id: str, *, messages: int = 0, payload: bytes = b"") -> LocalSnapshotPart:
    """A part with a state and one inbound channel from Z recording `messages` messages of `payload`."""
    channel = InboundChannelState(src="Z", messages=[RecordedMessage(payload=payload)] * messages)
    return LocalSnapshotPart(snapshot_id=snapshot_id, process_id=process_id, state=LocalState(), inbound=[channel])


def run(coroutine) -> None:  # type: ignore[no-untyped-def]
    asyncio.run(asyncio.wait_for(coroutine, 45))


# -- the token bucket -------------------------------------------------------------------------------------


def test_token_bucket_allows_a_burst_then_the_rate() -> None:
    now = [0.0]
    bucket = TokenBucket(3, 6.0, clock=lambda: now[0])  # 3 per 6 s: one every 2 s
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    assert bucket.wait() == pytest.approx(2.0)
    now[0] = 1.0
    assert not bucket.take()
    now[0] = 2.0
    assert bucket.take() and not bucket.take()
    now[0] = 1000.0  # a long pause refills to the burst, no further
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]


@pytest.mark.parametrize(("text", "rate"), [("10/60", (10, 60.0)), ("5", (5, 1.0)), ("1/0.5", (1, 0.5))])
def test_parse_rate(text: str, rate: tuple[int, float]) -> None:
    assert parse_rate(text) == rate


@pytest.mark.parametrize("text", ["", "x/1", "0/1", "1/0", "-1/5", "1/nan"])
def test_parse_rate_refuses_nonsense(text: str) -> None:
    with pytest.raises(ValueError, match=r"N/S|rate"):
        parse_rate(text)


def test_limits_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="max_agents"):
        Limits(max_agents=0)
    with pytest.raises(ValueError, match="rate"):
        Limits(trigger_rate=(0, 1.0))


# -- parts ------------------------------------------------------------------------------------------------


def test_oversized_part_is_rejected_and_aborts_its_snapshot(start: Callable[..., Running]) -> None:
    """A part over max_part_bytes: rejected as too_large, its snapshot aborted at once with the reason.

    A message far beyond the limit never reaches the detector's code: gRPC ends that stream with
    RESOURCE_EXHAUSTED and the member is detached; the detector goes on taking agents.
    """
    running = start(max_part_bytes=2048)

    async def scenario() -> None:
        p = Stream(running.detector.address)
        assert await p.register("P") == "registered"
        future = asyncio.run_coroutine_threadsafe(running.detector.take_snapshot(TIMEOUT), running.loop)
        snapshot_id = await p.next_start()
        await p.call.write(AgentMessage(part=part(snapshot_id, "P", messages=1, payload=b"x" * 4096)))
        results = await asyncio.wrap_future(future)
        assert results.snapshot.outcome == SNAPSHOT_OUTCOME_ABORTED
        assert results.snapshot.abort_kind == "part_too_large"
        assert "above the limit of 2048" in results.snapshot.abort_reason
        assert running.metric(REJECTED, reason="too_large") == 1
        assert running.metric("stablewatch_snapshot_aborts_total", kind="part_too_large") == 1

        await p.send(AgentMessage(part=part(snapshot_id + 1, "P", messages=1, payload=b"x" * 200_000)))
        code, details = await p.status()
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        await p.close()
        await async_poll(lambda: not running.detector.coordinator.members, "P to be detached")
        again = Stream(running.detector.address)
        assert await again.register("P") == "registered"
        await again.close()

    run(scenario())


def test_part_with_too_many_recorded_messages_is_rejected(start: Callable[..., Running]) -> None:
    running = start(max_part_messages=3)

    async def scenario() -> None:
        p = Stream(running.detector.address)
        assert await p.register("P") == "registered"
        future = asyncio.run_coroutine_threadsafe(running.detector.take_snapshot(TIMEOUT), running.loop)
        snapshot_id = await p.next_start()
        await p.call.write(AgentMessage(part=part(snapshot_id, "P", messages=4, payload=b"m")))
        results = await asyncio.wrap_future(future)
        assert results.snapshot.outcome == SNAPSHOT_OUTCOME_ABORTED
        assert "records 4 messages, above the limit of 3" in results.snapshot.abort_reason
        assert running.metric(REJECTED, reason="too_many_messages") == 1
        await p.close()

    run(scenario())


# -- control streams --------------------------------------------------------------------------------------


def test_agents_over_the_limit_are_refused(start: Callable[..., Running]) -> None:
    running = start(max_agents=1)

    async def scenario() -> None:
        first, second = Stream(running.detector.address), Stream(running.detector.address)
        assert await first.register("P") == "registered"
        await second.send(AgentMessage(register=control_pb2.Register(process_id="Q", address="x:1")))
        code, details = await second.status()
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "'Q' is refused" in details
        assert running.metric(REFUSED, reason="too_many_agents") == 1
        assert set(running.detector.coordinator.members) == {"P"}
        await first.close()
        await second.close()

    run(scenario())


def test_control_streams_over_the_limit_are_refused(start: Callable[..., Running]) -> None:
    """One stream open and silent holds the only slot; a second is refused until the first ends."""
    running = start(max_control_streams=1)

    async def scenario() -> None:
        silent = Stream(running.detector.address)
        await silent.call.wait_for_connection()
        await async_poll(lambda: running.detector.coordinator.open_streams == 1, "the first stream")
        second = Stream(running.detector.address)  # refused before it says anything
        assert (await second.status())[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert running.metric(REFUSED, reason="too_many_streams") == 1
        await silent.close()
        await second.close()
        await async_poll(lambda: running.detector.coordinator.open_streams == 0, "the slot to free")
        third = Stream(running.detector.address)
        assert await third.register("Q") == "registered"
        await third.close()

    run(scenario())


def test_a_stream_that_never_registers_is_ended(start: Callable[..., Running]) -> None:
    running = start(register_timeout=0.2)

    async def scenario() -> None:
        silent = Stream(running.detector.address)
        code, details = await silent.status()
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "no Register within 0.2 s" in details
        assert running.metric(REFUSED, reason="no_register") == 1
        await async_poll(lambda: running.detector.coordinator.open_streams == 0, "the stream to close")
        await silent.close()
        wrong = Stream(running.detector.address)
        await wrong.send(AgentMessage(heartbeat=control_pb2.Heartbeat(sequence=1)))
        assert (await wrong.status())[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert running.metric(REFUSED, reason="no_register") == 2
        await wrong.close()

    run(scenario())


# -- the query API ----------------------------------------------------------------------------------------


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as failure:
        call()
    return failure.value.code()


def test_page_size_and_expected_members_are_bounded(start: Callable[..., Running]) -> None:
    running = start(max_page_size=5, max_agents=2)
    with grpc.insecure_channel(running.detector.address) as channel:
        stub = query_pb2_grpc.QueryStub(channel)
        assert not stub.ListSnapshots(query_pb2.ListSnapshotsRequest(page_size=5), timeout=TIMEOUT).snapshots
        too_big = query_pb2.ListSnapshotsRequest(page_size=6)
        assert code_of(lambda: stub.ListSnapshots(too_big, timeout=TIMEOUT)) == grpc.StatusCode.INVALID_ARGUMENT
        crowd = query_pb2.TriggerSnapshotRequest(expected_members=["A", "B", "C"])
        assert code_of(lambda: stub.TriggerSnapshot(crowd, timeout=TIMEOUT)) == grpc.StatusCode.INVALID_ARGUMENT
    assert running.metric(REFUSED, reason="bad_request") == 2


def test_watch_streams_over_the_limit_are_refused(start: Callable[..., Running]) -> None:
    """127.0.0.1 may hold one stream here (the total, from two addresses: test_query_limits.py)."""
    running = start(max_watchers=2, max_watchers_per_identity=1)
    with grpc.insecure_channel(running.detector.address) as channel:
        stub = query_pb2_grpc.QueryStub(channel)
        first = stub.Watch(query_pb2.WatchRequest(), timeout=30)
        try:
            poll(lambda: running.detector._watch.watchers == 1, "the first watcher")
            second = stub.Watch(query_pb2.WatchRequest(), timeout=TIMEOUT)
            assert code_of(lambda: next(second)) == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert running.metric(REFUSED, reason="too_many_watchers_for_identity") == 1
        finally:
            first.cancel()


def test_running_triggers_are_bounded(start: Callable[..., Running]) -> None:
    """A member that never reports keeps one triggered snapshot running; a second trigger is refused."""
    running = start(max_running_triggers=1)

    async def scenario() -> None:
        silent = Stream(running.detector.address)
        assert await silent.register("S") == "registered"
        async with grpc.aio.insecure_channel(running.detector.address) as channel:
            stub = query_pb2_grpc.QueryStub(channel)
            first = asyncio.ensure_future(stub.TriggerSnapshot(query_pb2.TriggerSnapshotRequest(timeout_ms=30_000)))
            await async_poll(lambda: running.detector.coordinator.running, "the first snapshot to run")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.TriggerSnapshot(query_pb2.TriggerSnapshotRequest(), timeout=TIMEOUT)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert running.metric(REFUSED, reason="too_many_triggers") == 1
            await silent.close()  # S leaves: the first snapshot aborts, and its slot frees
            assert (await first).snapshot.outcome == SNAPSHOT_OUTCOME_ABORTED

    run(scenario())


# -- warnings at start ------------------------------------------------------------------------------------


def test_exposure_is_warned_about(tmp_path: Path) -> None:
    config = DetectorConfig(data_dir=tmp_path, listen="0.0.0.0:50051", metrics_address="0.0.0.0")
    warnings = exposure_warnings(config)
    assert any("PLAINTEXT" in warning for warning in warnings)
    assert any("/metrics is served in plaintext" in warning for warning in warnings)
    tls = dataclasses.replace(config, tls_cert=tmp_path / "c.pem", tls_key=tmp_path / "k.pem")
    assert [warning for warning in exposure_warnings(tls) if "no --tls-client-ca" in warning]
    assert exposure_warnings(dataclasses.replace(tls, tls_client_ca=tmp_path / "ca.pem")) == []
    for host in ("127.0.0.1", "[::1]", "localhost"):
        loopback = DetectorConfig(data_dir=tmp_path, listen=f"{host}:50051", metrics_address=host.strip("[]"))
        assert exposure_warnings(loopback) == [], host
