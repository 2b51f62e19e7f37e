"""RPC mode with streaming calls end to end: a real detector, sync and asyncio gRPC services on loopback.

One server S serves a unary method and one of each streaming kind; one client C keeps a call of
each kind in flight. Snapshots complete with them in flight; only the unary-response calls
(unary-unary, stream-unary) make their caller wait on the callee (a response stream's messages are
not counted, so a wait on it could be a false deadlock); stamps travel on the streams' trailing
metadata; the calls' results are what they are without stablewatch.

The detector here takes only the snapshots the tests ask for: C's unary-response calls wait past
the agents' hint threshold (20 ms), and a snapshot their hints started would interleave with the
tests' own and move S's color past the one the test follows.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from rpc_harness import SERVICE, agent, aio_channel_to, deadlock, snapshot, stamped, stored

from conftest import limited_detector
from polling import async_poll, poll, run
from stablewatch.agents.rpc.core import STAMP_KEY
from stablewatch.detector.service.query import outcome_name
from stablewatch.testing.detector import Running
from stablewatch.v1 import GlobalSnapshot
from stablewatch.v1.query_pb2 import SnapshotResults

UNARY, COUNT, TOTAL, ECHO = "Slow", "Count", "Total", "Echo"  # unary-unary, unary-stream, stream-unary, stream-stream
METHODS = (UNARY, COUNT, TOTAL, ECHO)
WAITING = {f"/{SERVICE}/{UNARY}", f"/{SERVICE}/{TOTAL}"}  # the calls whose callers wait on the callee


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    """conftest's detector without hint snapshots: the only snapshots are the tests' own."""
    service = limited_detector(tmp_path / "data", hints=False)
    yield service
    service.stop()


def completed(results: SnapshotResults) -> None:
    assert outcome_name(results.snapshot.outcome) == "completed", results.snapshot.abort_reason
    assert not deadlock(results).holds, deadlock(results).summary


def call_waits(cut: GlobalSnapshot, process: str) -> dict[str, str]:
    """The process's waits on calls: the method of the callee's task -> the waiting task."""
    (state,) = [p.state for p in cut.processes if p.process_id == process]
    waits = {}
    for wait in state.waits:
        (target,) = wait.targets
        assert target.process == "S"
        waits[target.task.split("#")[0]] = wait.task
    return waits


def has_stamp(metadata: Any) -> bool:
    return any(key == STAMP_KEY for key, _ in metadata or ())


@pytest.mark.parametrize("client", ["interceptor", "instrumented channel"])
def test_sync_streaming_calls_in_flight(running: Running, client: str) -> None:
    s_agent, c_agent = agent(running, "S"), agent(running, "C", gate=True)
    c_gate: threading.Event = c_agent.gate  # type: ignore[attr-defined]
    c_gate.set()
    started = {name: threading.Event() for name in METHODS}
    release = {name: threading.Event() for name in METHODS}

    def slow(request: bytes, context: Any) -> bytes:
        started[UNARY].set()
        release[UNARY].wait(20)
        return b"done:" + request

    def count(request: bytes, context: Any) -> Iterator[bytes]:
        for i in range(int(request)):
            yield str(i).encode()
            started[COUNT].set()
            release[COUNT].wait(20)

    def total(requests: Iterator[bytes], context: Any) -> bytes:
        parts = list(requests)
        started[TOTAL].set()
        release[TOTAL].wait(20)
        return b"+".join(parts)

    def echo(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
        for request in requests:
            yield request.upper()
            started[ECHO].set()
        release[ECHO].wait(20)

    handlers = {
        UNARY: grpc.unary_unary_rpc_method_handler(slow),
        COUNT: grpc.unary_stream_rpc_method_handler(count),
        TOTAL: grpc.stream_unary_rpc_method_handler(total),
        ECHO: grpc.stream_stream_rpc_method_handler(echo),
    }
    pool = futures.ThreadPoolExecutor(8)
    server = grpc.server(pool, interceptors=[s_agent.server_interceptor(workers=8)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    plain = grpc.insecure_channel(f"127.0.0.1:{port}")
    if client == "interceptor":
        channel = grpc.intercept_channel(plain, c_agent.client_interceptor("S"))
    else:
        channel = c_agent.instrument_channel(plain, "S")
    callers = {name: futures.ThreadPoolExecutor(1, thread_name_prefix=name) for name in METHODS}
    streams: dict[str, Any] = {}

    def stream(name: str, kind: str, request: Any) -> list[bytes]:
        streams[name] = getattr(channel, kind)(f"/{SERVICE}/{name}")(request, timeout=30)
        return list(streams[name])

    try:
        replies = {
            UNARY: callers[UNARY].submit(channel.unary_unary(f"/{SERVICE}/{UNARY}"), b"u", timeout=30),
            COUNT: callers[COUNT].submit(stream, COUNT, "unary_stream", b"3"),
            TOTAL: callers[TOTAL].submit(channel.stream_unary(f"/{SERVICE}/{TOTAL}"), iter([b"a", b"b"]), timeout=30),
            ECHO: callers[ECHO].submit(stream, ECHO, "stream_stream", iter([b"x", b"y"])),
        }
        for name in METHODS:
            poll(started[name].is_set, f"{name} running")

        # 1. A snapshot with the four calls in flight: only the unary-response calls wait.
        results = snapshot(running)
        completed(results)
        first = results.snapshot.snapshot_id
        waits = call_waits(stored(running, results), "C")
        assert set(waits) == WAITING
        assert waits[f"/{SERVICE}/{UNARY}"] == f"{UNARY}_0" and waits[f"/{SERVICE}/{TOTAL}"] == f"{TOTAL}_0"

        # 2. S records, C not yet: the end of the Count stream carries S's color, and C records
        # before the stream's iterator stops. Only the Count stream ends meanwhile, and C's starts
        # wait for its gate, so that stream's end is the one way S's color can reach C.
        c_gate.clear()
        pending = asyncio.run_coroutine_threadsafe(running.detector.take_snapshot(deadline=10), running.loop)
        poll(lambda: s_agent.color > first, "S recorded")
        assert c_agent.color == first
        release[COUNT].set()
        assert replies[COUNT].result(20) == [b"0", b"1", b"2"]
        assert c_agent.color == s_agent.color  # recorded on the stream's end
        assert has_stamp(streams[COUNT].trailing_metadata())
        for name in (UNARY, TOTAL, ECHO):
            release[name].set()
        c_gate.set()
        results = pending.result(20)
        completed(results)
        assert results.snapshot.snapshot_id == c_agent.color  # the color C took in was that snapshot's

        # 3. The results are unchanged; every call's end carried S's stamp.
        assert replies[UNARY].result(20) == b"done:u"
        assert replies[TOTAL].result(20) == b"a+b"
        assert replies[ECHO].result(20) == [b"X", b"Y"]
        assert has_stamp(streams[ECHO].trailing_metadata())
        assert stamped(c_agent, "request") == 4 and stamped(s_agent, "response") == 4
        results = snapshot(running)
        completed(results)
        assert not [w for p in stored(running, results).processes for w in p.state.waits]
    finally:
        c_gate.set()
        for event in release.values():
            event.set()
        for caller in callers.values():
            caller.shutdown(wait=True)
        channel.close()
        server.stop(grace=0).wait(10)
        pool.shutdown(wait=True)
        c_agent.stop()
        s_agent.stop()


@pytest.mark.parametrize("setup", ["interceptors", "channel"])
def test_asyncio_streaming_calls_in_flight(running: Running, setup: str) -> None:
    s_agent, c_agent = agent(running, "S"), agent(running, "C")

    async def take_snapshot() -> SnapshotResults:
        return await asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(running.detector.take_snapshot(deadline=10), running.loop)
        )

    async def body() -> None:
        started = {name: asyncio.Event() for name in METHODS}
        release = {name: asyncio.Event() for name in METHODS}

        async def slow(request: bytes, context: Any) -> bytes:
            started[UNARY].set()
            await release[UNARY].wait()
            return b"done:" + request

        async def count(request: bytes, context: Any) -> AsyncIterator[bytes]:
            for i in range(int(request)):
                yield str(i).encode()
                started[COUNT].set()
                await release[COUNT].wait()

        async def total(requests: AsyncIterator[bytes], context: Any) -> bytes:
            parts = [request async for request in requests]
            started[TOTAL].set()
            await release[TOTAL].wait()
            return b"+".join(parts)

        async def echo(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
            async for request in requests:
                yield request.upper()
                started[ECHO].set()
            await release[ECHO].wait()

        handlers = {
            UNARY: grpc.unary_unary_rpc_method_handler(slow),
            COUNT: grpc.unary_stream_rpc_method_handler(count),
            TOTAL: grpc.stream_unary_rpc_method_handler(total),
            ECHO: grpc.stream_stream_rpc_method_handler(echo),
        }
        server = grpc.aio.server(interceptors=[s_agent.aio_server_interceptor()])
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = aio_channel_to(f"127.0.0.1:{port}", c_agent, setup)
        streams: dict[str, Any] = {}

        async def unary(name: str, kind: str, request: Any) -> bytes:
            return await getattr(channel, kind)(f"/{SERVICE}/{name}")(request, timeout=30)

        async def stream(name: str, kind: str, request: Any) -> list[bytes]:
            streams[name] = getattr(channel, kind)(f"/{SERVICE}/{name}")(request, timeout=30)
            return [response async for response in streams[name]]

        try:
            replies = {
                UNARY: asyncio.create_task(unary(UNARY, "unary_unary", b"u"), name="unary-caller"),
                COUNT: asyncio.create_task(stream(COUNT, "unary_stream", b"3")),
                TOTAL: asyncio.create_task(unary(TOTAL, "stream_unary", iter([b"a", b"b"])), name="total-caller"),
                ECHO: asyncio.create_task(stream(ECHO, "stream_stream", iter([b"x", b"y"]))),
            }
            for name in METHODS:
                await async_poll(started[name].is_set, f"{name} running")

            results = await take_snapshot()
            completed(results)
            waits = call_waits(stored(running, results), "C")
            assert set(waits) == WAITING
            # Each waits in its caller's task, through the interceptors too (the task awaiting grpc.aio's)
            assert waits == {f"/{SERVICE}/{UNARY}": "unary-caller", f"/{SERVICE}/{TOTAL}": "total-caller"}

            for event in release.values():
                event.set()
            assert await replies[UNARY] == b"done:u"
            assert await replies[COUNT] == [b"0", b"1", b"2"]
            assert await replies[TOTAL] == b"a+b"
            assert await replies[ECHO] == [b"X", b"Y"]
            assert stamped(c_agent, "request") == 4 and stamped(s_agent, "response") == 4
            results = await take_snapshot()
            completed(results)
            assert not [w for p in stored(running, results).processes for w in p.state.waits]
        finally:
            for event in release.values():
                event.set()
            await channel.close()
            await server.stop(0)

    try:
        run(body(), 60)
    finally:
        c_agent.stop()
        s_agent.stop()
