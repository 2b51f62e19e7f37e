"""The interceptors and the instrumented channel know the agent only as :class:`CallEvents`: RpcAgent
implements it with the same signatures, and a stand-in that has nothing but its methods serves
and makes calls through them."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from rpc_harness import SERVICE

from polling import run
from stablewatch.agents.breaking import Doorbell
from stablewatch.agents.rpc.agent import RpcAgent
from stablewatch.agents.rpc.aio_channel import AioInstrumentedChannel
from stablewatch.agents.rpc.calls import CallEvents
from stablewatch.agents.rpc.channel import InstrumentedChannel
from stablewatch.agents.rpc.interceptors import ClientInterceptor, ServerInterceptor

EVENTS = ("call_out", "awaited", "not_awaited", "call_returned", "arrive", "handler_started", "respond")


def test_call_events_names_the_agent_calls_and_rpc_agent_has_them_with_the_same_signatures() -> None:
    named = tuple(name for name in vars(CallEvents) if not name.startswith("_"))
    assert named == EVENTS
    # And one attribute: the doorbell the asyncio channel rings when it begins a call's wait itself.
    assert set(CallEvents.__annotations__) == {"doorbell"}
    assert isinstance(RpcAgent("P").doorbell, Doorbell)
    for name in EVENTS:
        assert inspect.signature(getattr(RpcAgent, name)) == inspect.signature(getattr(CallEvents, name)), name


class OnlyCallEvents:
    """Nothing but the calls of CallEvents (no other attribute to reach for), passed on to a real agent and logged."""

    __slots__ = ("_agent", "doorbell", "log")

    def __init__(self, agent: RpcAgent) -> None:
        self._agent = agent
        self.doorbell = agent.doorbell
        self.log: list[str] = []

    def call_out(self, *args: Any) -> Any:
        self.log.append("call_out")
        return self._agent.call_out(*args)

    def awaited(self, *args: Any) -> Any:
        self.log.append("awaited")
        return self._agent.awaited(*args)

    def not_awaited(self, *args: Any) -> Any:
        self.log.append("not_awaited")
        return self._agent.not_awaited(*args)

    def call_returned(self, *args: Any) -> Any:
        self.log.append("call_returned")
        return self._agent.call_returned(*args)

    def arrive(self, *args: Any) -> Any:
        self.log.append("arrive")
        return self._agent.arrive(*args)

    def handler_started(self, *args: Any) -> Any:
        self.log.append("handler_started")
        return self._agent.handler_started(*args)

    def respond(self, *args: Any) -> Any:
        self.log.append("respond")
        return self._agent.respond(*args)


@pytest.fixture
def server() -> Iterator[tuple[str, OnlyCallEvents]]:
    events = OnlyCallEvents(RpcAgent("server"))
    pool = futures.ThreadPoolExecutor(2)
    grpc_server = grpc.server(pool, interceptors=[ServerInterceptor(events, None)])
    echo = grpc.unary_unary_rpc_method_handler(lambda payload, context: payload)
    grpc_server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {"Echo": echo})])
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    try:
        yield f"127.0.0.1:{port}", events
    finally:
        grpc_server.stop(grace=0).wait(10)
        pool.shutdown(wait=True)


@pytest.mark.parametrize("kind", ["channel", "interceptor"])
def test_a_call_goes_through_the_call_events_alone(server: tuple[str, OnlyCallEvents], kind: str) -> None:
    address, served = server
    client_agent = RpcAgent("client")
    client = OnlyCallEvents(client_agent)
    plain = grpc.insecure_channel(address)
    if kind == "channel":
        channel: grpc.Channel = InstrumentedChannel(plain, client, "server", True)
    else:
        channel = grpc.intercept_channel(plain, ClientInterceptor(client, "server", True))
    try:
        assert channel.unary_unary(f"/{SERVICE}/Echo")(b"ping", timeout=10) == b"ping"
    finally:
        channel.close()
    assert client.log == ["call_out", "call_returned"]
    assert served.log == ["arrive", "handler_started", "respond"]
    # The call's two messages went out stamped, as the protocol's, not passed through unstamped.
    assert stamped(client_agent, "request") == 1
    assert stamped(served._agent, "response") == 1


def test_an_asyncio_call_goes_through_the_call_events_alone(server: tuple[str, OnlyCallEvents]) -> None:
    """The asyncio channel begins a unary call's wait itself at its await (with the doorbell of
    CallEvents), and reports the rest through the calls."""
    address, served = server
    client_agent = RpcAgent("client")
    client = OnlyCallEvents(client_agent)
    waits: list[bool] = []

    async def body() -> bytes:
        channel = AioInstrumentedChannel(grpc.aio.insecure_channel(address), client, "server", True)
        try:
            call = channel.unary_unary(f"/{SERVICE}/Echo")(b"ping", timeout=10)
            waits.append(call._call.waits)  # made: nobody waits on it yet
            response = await call
            waits.append(call._call.waits)  # awaited: its caller waited on it until its end
            return response
        finally:
            await channel.close()

    assert run(body(), 10) == b"ping"
    assert waits == [False, True]
    assert client.log == ["call_out", "call_returned"]
    assert served.log == ["arrive", "handler_started", "respond"]
    assert stamped(client_agent, "request") == 1 and client_agent.open_waits() == []


def stamped(agent: RpcAgent, kind: str) -> float | None:
    return agent.metrics.registry.get_sample_value("stablewatch_agent_rpc_stamped_messages_total", {"kind": kind})
