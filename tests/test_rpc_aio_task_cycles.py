"""An asyncio handler's task is freed when its call ends, not left to the garbage collector.

The agent's server interceptor puts the handler's call in a context variable of the task's own
context (``NAMED_TASK``), and the call names the task while the handler runs. Left so, the task
referred to itself (task -> its context -> the call -> the task):
every call's task, coroutine, request and response then waited for a garbage collection, and the
collections that freed them cost the server CPU on every call (``bench/rpc_overhead.py --probe``
counted twice the collector's passes of the stamp-only server). Each test turns the collector off,
serves calls, and waits for every handler's task to be freed by reference counting alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from rpc_harness import SERVICE, new_agent

from polling import async_poll, run
from stablewatch.agents.rpc import RpcAgent

TIMEOUT = 10.0  # each scenario, on a slow shared machine; each takes well under a second
CALLS = 3


class TaskTrackingServer:
    """An asyncio server with ``agent``'s interceptor whose handlers keep a weak reference to their
    own task: ``Unary`` answers ``ok``, ``Abort`` aborts (``FAILED_PRECONDITION``), ``Stream``
    answers ``a``, ``b``, ``c``."""

    def __init__(self, agent: RpcAgent) -> None:
        self.tasks: list[weakref.ref[asyncio.Task[object]]] = []
        self.server = grpc.aio.server(interceptors=[agent.aio_server_interceptor()])
        methods = {
            "Unary": grpc.unary_unary_rpc_method_handler(self._unary),
            "Stream": grpc.unary_stream_rpc_method_handler(self._stream),
            "Abort": grpc.unary_unary_rpc_method_handler(self._abort),
        }
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, methods)])
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    def _track(self) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.append(weakref.ref(task))

    async def _unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self._track()
        return b"ok"

    async def _abort(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self._track()
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "refused")
        raise AssertionError("abort returned")

    async def _stream(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        self._track()
        for part in (b"a", b"b", b"c"):
            yield part

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.tasks)


@pytest.fixture
def collector_off() -> Iterator[None]:
    """The garbage collector off for the test: only reference counting frees anything."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


async def _serve_and_count(kind: str, instrumented: bool) -> tuple[int, int]:
    """Serve CALLS calls of ``kind`` and wait for their tasks to go; returns (tasks seen, tasks left)."""
    server_agent, client_agent = new_agent("S"), new_agent("C")
    server = TaskTrackingServer(server_agent)
    await server.server.start()
    channel = grpc.aio.insecure_channel(server.address)
    if instrumented:
        channel = client_agent.instrument_channel(channel, "S")
    try:
        for _ in range(CALLS):
            if kind == "unary":
                assert await channel.unary_unary(f"/{SERVICE}/Unary")(b"x") == b"ok"
            elif kind == "aborted":
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await channel.unary_unary(f"/{SERVICE}/Abort")(b"x")
                assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            else:
                assert [part async for part in channel.unary_stream(f"/{SERVICE}/Stream")(b"x")] == [b"a", b"b", b"c"]
        with contextlib.suppress(TimeoutError):  # reported by the caller, with the count
            await async_poll(lambda: server.alive() == 0, "every handler's task to be freed", timeout=2.0)
        return len(server.tasks), server.alive()
    finally:
        await channel.close()
        await server.server.stop(0)
        server_agent.stop()
        client_agent.stop()


@pytest.mark.parametrize("kind", ["unary", "aborted", "stream"])
@pytest.mark.parametrize("instrumented", [True, False], ids=["caller_with_agent", "caller_without_agent"])
@pytest.mark.usefixtures("collector_off")
def test_a_handlers_task_is_freed_when_its_call_ends(kind: str, instrumented: bool) -> None:
    seen, left = run(_serve_and_count(kind, instrumented), TIMEOUT)
    assert seen == CALLS
    assert left == 0, f"{left} of {seen} handler tasks still alive with the garbage collector off: a reference cycle"
