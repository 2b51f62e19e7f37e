"""Gaps of RPC mode closed by issue 27, on real gRPC servers on loopback.

* The asyncio server interceptor wraps a method's handler once, not per call, and each call still
  reaches its handler as its own (through a variable of the call's task).
* A call gRPC ends before its handler starts (cancelled by its caller, or its deadline passed,
  while it waited for the only worker of a pool from ``agent.thread_pool``) leaves the agent's
  picture of the pool then, and later calls run and are pictured as usual. A method whose handler
  has a pool of its own (grpc's ``experimental_thread_pool``) keeps it and never queues in the
  server's pool.
* A call from a caller without an agent is named by the caller's address from the moment its
  handler starts (``{method}#grpc://{host}:{seq}``); while it waits for a worker it is
  ``{method}#?:{seq}``, since the sync server does not tell its interceptors the address.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
import pytest
from rpc_harness import SERVICE, aio_channel_to, call, handler_prefix, pictured_calls, recorded

from polling import poll, run
from stablewatch.agents.rpc import RpcAgent
from stablewatch.agents.rpc import interceptors as rpc_interceptors
from stablewatch.agents.rpc import pool as rpc_pool
from stablewatch.agents.rpc.interceptors import CURRENT_TASK
from stablewatch.v1 import WAIT_MODEL_OR, Wait

LOOPBACK = "grpc://127.0.0.1"


def queued(agent: RpcAgent) -> list[Wait] | None:
    """The queued requests (OR waits on the running handlers) of ``agent``'s recorded state now."""
    state = recorded(agent, lifetime=0.05)
    return None if state is None else [wait for wait in state.waits if wait.model == WAIT_MODEL_OR]


def poll_queued(agent: RpcAgent, count: int, what: str) -> list[Wait]:
    """The queued requests of ``agent``'s recorded state, once there are ``count``."""

    def look() -> tuple[list[Wait]] | None:  # a tuple: truthy even when no request is queued
        found = queued(agent)
        return (found,) if found is not None and len(found) == count else None

    return poll(look, what, interval=0.02)[0]


class PoolServer:
    """A sync gRPC server on 127.0.0.1 with one worker from its agent (``agent.thread_pool(1)``).

    ``Hold`` keeps the worker until ``release`` is set; ``Echo`` answers with its task's name.
    """

    def __init__(self, agent: RpcAgent, handlers: dict[str, grpc.RpcMethodHandler] | None = None) -> None:
        self.held, self.release = threading.Event(), threading.Event()
        self.pool = agent.thread_pool(1)
        self.server = grpc.server(self.pool, interceptors=[agent.server_interceptor(workers=self.pool)])
        methods = {
            "Hold": grpc.unary_unary_rpc_method_handler(self._hold),
            "Echo": grpc.unary_unary_rpc_method_handler(self._echo),
            **(handlers or {}),
        }
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, methods)])
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def _hold(self, request: bytes, context: Any) -> bytes:
        self.held.set()
        assert self.release.wait(30), "never released"
        return (CURRENT_TASK.get() or "").encode()

    def _echo(self, request: bytes, context: Any) -> bytes:
        return (CURRENT_TASK.get() or "").encode()

    def stop(self) -> None:
        self.release.set()
        self.server.stop(grace=0).wait(10)
        self.pool.shutdown(wait=True, cancel_futures=True)


def aio_server(agent: RpcAgent, handlers: dict[str, Callable[..., Any]], interceptors: list[Any] | None = None) -> Any:
    server = grpc.aio.server(interceptors=[*(interceptors or []), agent.aio_server_interceptor()])
    methods = {name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in handlers.items()}
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, methods)])
    return server


# -- gap 1: the asyncio server wraps once per method ------------------------------------------------


@pytest.mark.parametrize("setup", ["interceptors", "channel"])
def test_an_asyncio_server_wraps_each_method_once_and_serves_each_call_as_its_own(
    rpc_agents: tuple[RpcAgent, RpcAgent], monkeypatch: pytest.MonkeyPatch, setup: str
) -> None:
    s_agent, c_agent = rpc_agents
    wraps: list[str] = []
    wrap = rpc_interceptors._wrap

    def counted(handler: Any, *args: Any) -> Any:
        wraps.append(handler.unary_unary.__name__)
        return wrap(handler, *args)

    monkeypatch.setattr(rpc_interceptors, "_wrap", counted)
    calls = 4

    async def body() -> None:
        inside = 0
        all_inside = asyncio.Event()

        async def echo(request: bytes, context: Any) -> bytes:
            nonlocal inside
            inside += 1
            if inside == calls:
                all_inside.set()
            await all_inside.wait()  # every call is in its handler at once: each must see its own
            return (CURRENT_TASK.get() or "").encode()

        async def other(request: bytes, context: Any) -> bytes:
            return (CURRENT_TASK.get() or "").encode()

        server = aio_server(s_agent, {"Echo": echo, "Other": other})
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = aio_channel_to(f"127.0.0.1:{port}", c_agent, setup)
        try:
            names = await asyncio.gather(
                *(channel.unary_unary(f"/{SERVICE}/Echo")(b"", timeout=20) for _ in range(calls))
            )
            assert wraps == ["echo"]  # one method, many calls: wrapped once
            assert len(set(names)) == calls
            assert all(name.startswith(handler_prefix("Echo", c_agent).encode()) for name in names)
            other_name = await channel.unary_unary(f"/{SERVICE}/Other")(b"", timeout=20)
            assert other_name.startswith(handler_prefix("Other", c_agent).encode())
            assert await channel.unary_unary(f"/{SERVICE}/Echo")(b"", timeout=20) not in names
            assert wraps == ["echo", "other"]  # two methods: twice
        finally:
            await channel.close()
            await server.stop(0)

    run(body(), 60)
    # Every call taken in and answered once, stamped.
    assert s_agent._core.received_count("C") == s_agent._core.sent_count("C") == calls + 2
    assert c_agent._core.received_count("S") == calls + 2


@pytest.mark.parametrize("setup", ["interceptors", "channel"])
def test_an_asyncio_handler_run_in_another_task_than_its_interceptor_is_served_unobserved(
    rpc_agents: tuple[RpcAgent, RpcAgent], caplog: pytest.LogCaptureFixture, setup: str
) -> None:
    """An interceptor ahead of the agent's that awaits the rest of the chain in a task of its own hides
    the call's variable from the handler: the call is served all the same, and a warning says why
    it takes no part in snapshots."""
    s_agent, c_agent = rpc_agents

    class InATaskOfItsOwn(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
            return await asyncio.create_task(continuation(details))

    async def body() -> list[bytes]:
        async def echo(request: bytes, context: Any) -> bytes:
            return (CURRENT_TASK.get() or "none").encode()

        server = aio_server(s_agent, {"Echo": echo}, [InATaskOfItsOwn()])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = aio_channel_to(f"127.0.0.1:{port}", c_agent, setup)
        try:
            return [await channel.unary_unary(f"/{SERVICE}/Echo")(b"", timeout=20) for _ in range(2)]
        finally:
            await channel.close()
            await server.stop(0)

    with caplog.at_level(logging.WARNING, logger=rpc_interceptors.__name__):
        assert run(body(), 60) == [b"none", b"none"]
    assert caplog.text.count("outside the task its server interceptor saw the call in") == 1
    # Taken in on arrival, never answered with a stamp: counts on both sides agree.
    assert s_agent._core.received_count("C") == 2 and s_agent._core.sent_count("C") == 0
    assert c_agent._core.sent_count("S") == 2 and c_agent._core.received_count("S") == 0


# -- gap 2: a call gRPC ends before its handler starts leaves the pool's picture ---------------------


@pytest.mark.parametrize("ending", ["cancelled by its caller", "its deadline passed"])
def test_a_queued_call_ended_by_grpc_leaves_the_picture_and_a_later_call_runs(
    rpc_agents: tuple[RpcAgent, RpcAgent], ending: str
) -> None:
    s_agent, c_agent = rpc_agents
    server = PoolServer(s_agent)
    channel = c_agent.instrument_channel(grpc.insecure_channel(server.address), "S")
    try:
        hold = channel.unary_unary(f"/{SERVICE}/Hold").future(b"", timeout=30)
        poll(server.held.is_set, "Hold holding the only worker")
        timeout = 30 if ending == "cancelled by its caller" else 3
        waiting = channel.unary_unary(f"/{SERVICE}/Echo").future(b"", timeout=timeout)
        (wait,) = poll_queued(s_agent, 1, "Echo queued behind Hold")
        assert wait.task.startswith(handler_prefix("Echo", c_agent)) and wait.instance
        if ending == "cancelled by its caller":
            assert waiting.cancel()
        else:
            with pytest.raises(grpc.RpcError) as failed:
                waiting.result(10)
            assert failed.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        # Out of the picture once gRPC ended it, while Hold still holds the worker.
        poll_queued(s_agent, 0, "the ended call out of the queue")
        running, waiting_names = pictured_calls(s_agent)
        assert [name.split("#")[0] for name in running] == [f"/{SERVICE}/Hold"] and waiting_names == []
        assert not s_agent.open_waits()
        assert not server.release.is_set()
        server.release.set()
        assert hold.result(10).startswith(handler_prefix("Hold", c_agent).encode())
        # The worker skips the ended call's item; a later call runs, and the picture is empty after.
        assert call(channel, "Echo", timeout=10).startswith(handler_prefix("Echo", c_agent).encode())
        poll(lambda: pictured_calls(s_agent) == ([], []), "an empty picture of the pool")
    finally:
        channel.close()
        server.stop()


def test_without_grpcs_call_state_a_cancelled_call_leaves_once_a_worker_reaches_it(
    rpc_agents: tuple[RpcAgent, RpcAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another grpc (its work items laid out otherwise): the work item is wrapped, and the cancelled
    call leaves the picture once a worker has run it, not sooner; it does not linger after."""
    monkeypatch.setattr(rpc_pool, "_GRPC_CALL_STATE", None)
    s_agent, c_agent = rpc_agents
    server = PoolServer(s_agent)
    channel = c_agent.instrument_channel(grpc.insecure_channel(server.address), "S")
    try:
        hold = channel.unary_unary(f"/{SERVICE}/Hold").future(b"", timeout=30)
        poll(server.held.is_set, "Hold holding the only worker")
        waiting = channel.unary_unary(f"/{SERVICE}/Echo").future(b"", timeout=30)
        poll_queued(s_agent, 1, "Echo queued behind Hold")
        assert waiting.cancel()
        server.release.set()
        hold.result(10)
        assert call(channel, "Echo", timeout=10).startswith(handler_prefix("Echo", c_agent).encode())
        poll(lambda: pictured_calls(s_agent) == ([], []), "an empty picture of the pool")
        assert queued(s_agent) == []
    finally:
        channel.close()
        server.stop()


def test_a_method_with_a_pool_of_its_own_runs_there_and_never_queues_in_the_servers(
    rpc_agents: tuple[RpcAgent, RpcAgent],
) -> None:
    s_agent, c_agent = rpc_agents
    own = futures.ThreadPoolExecutor(1, thread_name_prefix="own-pool")
    seen: dict[str, Any] = {}

    def on_its_own(request: bytes, context: Any) -> bytes:
        seen["picture"] = pictured_calls(s_agent)
        seen["queued"] = queued(s_agent)
        return threading.current_thread().name.encode()

    on_its_own.experimental_thread_pool = own  # type: ignore[attr-defined]
    server = PoolServer(s_agent, {"Own": grpc.unary_unary_rpc_method_handler(on_its_own)})
    channel = c_agent.instrument_channel(grpc.insecure_channel(server.address), "S")
    try:
        hold = channel.unary_unary(f"/{SERVICE}/Hold").future(b"", timeout=30)
        poll(server.held.is_set, "Hold holding the only worker")
        behind = channel.unary_unary(f"/{SERVICE}/Echo").future(b"", timeout=30)
        poll_queued(s_agent, 1, "Echo queued behind Hold")
        # Own runs at once on its own pool, though the server's only worker is held.
        assert call(channel, "Own", timeout=10).startswith(b"own-pool")
        running, waiting = seen["picture"]
        assert [name.split("#")[0] for name in running] == [f"/{SERVICE}/Hold"]
        assert [name.split("#")[0] for name in waiting] == [f"/{SERVICE}/Echo"]
        (wait,) = seen["queued"]  # Echo's wait: on Hold alone, and Own is no waiter
        assert [target.task.split("#")[0] for target in wait.targets] == [f"/{SERVICE}/Hold"]
        server.release.set()
        hold.result(10)
        behind.result(10)
        poll(lambda: pictured_calls(s_agent) == ([], []), "an empty picture of the pool")
    finally:
        channel.close()
        server.stop()
        own.shutdown(wait=True)


# -- gap 5: a caller without an agent is named by its address ---------------------------------------


def test_a_sync_call_without_an_agent_is_named_by_address_once_its_handler_starts(
    rpc_agents: tuple[RpcAgent, RpcAgent],
) -> None:
    s_agent, _ = rpc_agents
    server = PoolServer(s_agent)
    channel = grpc.insecure_channel(server.address)  # the caller has no agent
    try:
        hold = channel.unary_unary(f"/{SERVICE}/Hold").future(b"", timeout=30)
        poll(server.held.is_set, "Hold holding the only worker")
        behind = channel.unary_unary(f"/{SERVICE}/Echo").future(b"", timeout=30)
        (wait,) = poll_queued(s_agent, 1, "Echo queued behind Hold")
        # Waiting for a worker, the call is named without an address (none is known yet); the
        # running handler it waits on is named by its caller's.
        assert wait.task.startswith(f"/{SERVICE}/Echo#?:")
        ((target,),) = [wait.targets]
        assert target.process == "S" and target.task.startswith(f"/{SERVICE}/Hold#{LOOPBACK}:")
        server.release.set()
        assert hold.result(10).decode() == target.task
        echo_name = behind.result(10).decode()
        assert echo_name == wait.task.replace("#?:", f"#{LOOPBACK}:")  # the same call, by its address
        poll(lambda: pictured_calls(s_agent) == ([], []), "an empty picture of the pool")
    finally:
        channel.close()
        server.stop()
    assert s_agent._core.sent_count(LOOPBACK) == 2  # the responses, counted to the peer outside the cut


def test_an_asyncio_call_without_an_agent_is_named_by_address(rpc_agents: tuple[RpcAgent, RpcAgent]) -> None:
    s_agent, _ = rpc_agents

    async def body() -> bytes:
        async def echo(request: bytes, context: Any) -> bytes:
            return (CURRENT_TASK.get() or "").encode()

        server = aio_server(s_agent, {"Echo": echo})
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")  # the caller has no agent
        try:
            return await channel.unary_unary(f"/{SERVICE}/Echo")(b"", timeout=20)
        finally:
            await channel.close()
            await server.stop(0)

    name = run(body(), 60).decode()
    method, _, seq = name.rpartition(":")
    assert method == f"/{SERVICE}/Echo#{LOOPBACK}" and seq.isdigit()
    assert s_agent._core.sent_count(LOOPBACK) == 1
