"""The sync client side (the client interceptor, and the instrumented channel) takes in a call's end
before its caller sees it, whichever way the call is made (blocking ``__call__``/``with_call``, or
``future``); a call its caller abandons still ends its wait; a call that fails is taken in too, and
restarts the pair's counts only when the server's stamp does not say what arrived. The server here
has no agent: its trailing metadata is scripted."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import grpc
import pytest
from rpc_harness import SERVICE, Service, outstanding

from polling import poll
from stablewatch.agents.rpc import AioInstrumentedChannel, InstrumentedChannel
from stablewatch.agents.rpc.agent import BadStamp, RpcAgent
from stablewatch.agents.rpc.interceptors import ClientInterceptor

GOOD = "0.1.0.server"  # color 0, incarnation 1, session 0, from the channel's peer


def instrumented(kind: str, agent: RpcAgent, address: str) -> grpc.Channel:
    """A channel to ``address`` leading to the process "server", instrumented the ``kind`` way."""
    if kind == "interceptor":
        return grpc.intercept_channel(grpc.insecure_channel(address), agent.client_interceptor("server"))
    return agent.instrument_channel(grpc.insecure_channel(address), "server")


@pytest.fixture(params=["interceptor", "channel"])
def client_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=[GOOD, "not-a-stamp", None], ids=["stamped", "bad-stamp", "unstamped"])
def echo(
    request: pytest.FixtureRequest, client_kind: str
) -> Iterator[tuple[grpc.UnaryUnaryMultiCallable, RpcAgent, threading.Event]]:
    stamp: str | None = request.param
    release = threading.Event()

    def handler(payload: bytes, context: grpc.ServicerContext) -> bytes:
        release.wait(10)
        if stamp is not None:
            context.set_trailing_metadata((("stablewatch-stamp", stamp),))
        return payload

    service = Service({"Echo": handler}, None)
    agent = RpcAgent("client")
    channel = instrumented(client_kind, agent, service.address)
    try:
        yield channel.unary_unary(f"/{SERVICE}/Echo"), agent, release
    finally:
        release.set()
        channel.close()
        service.server.stop(None)


@pytest.mark.parametrize("how", ["call", "with_call", "future"])
def test_the_end_of_a_call_is_taken_in_before_its_caller_sees_it(echo, how: str) -> None:
    method, agent, release = echo
    release.set()
    bad = agent.metrics.registry.get_sample_value("stablewatch_agent_rpc_bad_stamps_total", {"side": "client"})
    try:
        if how == "call":
            assert method(b"x") == b"x"
        elif how == "with_call":
            response, call = method.with_call(b"x")
            assert response == b"x" and call.code() == grpc.StatusCode.OK
        else:
            assert method.future(b"x").result() == b"x"
    except BadStamp as error:
        assert error.code() == grpc.StatusCode.INTERNAL
        assert (
            agent.metrics.registry.get_sample_value("stablewatch_agent_rpc_bad_stamps_total", {"side": "client"})
            == bad + 1
        )
    else:
        assert (
            agent.metrics.registry.get_sample_value("stablewatch_agent_rpc_bad_stamps_total", {"side": "client"}) == bad
        )
    assert outstanding(agent) == 0  # no wait left once the caller has its answer


def test_a_call_its_caller_abandons_still_ends_its_wait(echo) -> None:
    method, agent, release = echo
    future = method.future(b"x")
    assert outstanding(agent) == 1
    release.set()
    poll(lambda: outstanding(agent) == 0, "the abandoned call's end taken in")
    assert future.done()


@pytest.mark.parametrize("stamped", [True, False], ids=["stamped", "unstamped"])
@pytest.mark.parametrize("how", ["call", "with_call", "future"])
def test_a_failed_call_is_taken_in_and_restarts_the_counts_only_without_the_servers_stamp(
    client_kind: str, how: str, stamped: bool
) -> None:
    def refuse(payload: bytes, context: grpc.ServicerContext) -> bytes:
        if stamped:
            context.set_trailing_metadata((("stablewatch-stamp", GOOD),))
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "refused by the service")

    service = Service({"Refuse": refuse}, None)
    agent = RpcAgent("client")
    channel = instrumented(client_kind, agent, service.address)
    try:
        method = channel.unary_unary(f"/{SERVICE}/Refuse")
        with pytest.raises(grpc.RpcError) as raised:
            if how == "call":
                method(b"x", timeout=10)
            elif how == "with_call":
                method.with_call(b"x", timeout=10)
            else:
                method.future(b"x", timeout=10).result()
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert raised.value.details() == "refused by the service"
        assert outstanding(agent) == 0
        # The server's stamp says the request arrived and the refusal is its response: the counts
        # stay comparable. Without it, nobody knows what arrived: the pair's counts restart.
        assert agent._core.session("server") == (0 if stamped else 1)
    finally:
        channel.close()
        service.stop()


def test_an_instrumented_channels_unary_calls_skip_the_interceptor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocking calls and futures alike: the channel makes them itself (a future so that its caller
    waits on it only while it blocks in result())."""
    service = Service({"Echo": lambda payload, context: payload}, None)
    agent = RpcAgent("client")
    took: list[str] = []
    invoke = ClientInterceptor._invoke

    def noted(self: ClientInterceptor, *args: object) -> object:
        took.append("interceptor")
        return invoke(self, *args)

    monkeypatch.setattr(ClientInterceptor, "_invoke", noted)
    with agent.instrument_channel(grpc.insecure_channel(service.address), "server") as channel:
        method = channel.unary_unary(f"/{SERVICE}/Echo")
        assert method(b"a", timeout=10) == b"a"
        assert method.with_call(b"b", timeout=10)[0] == b"b"
        assert method.future(b"c", timeout=10).result() == b"c"
        assert took == []  # gRPC's interceptor machinery never ran
    assert stamped_requests(agent) == 3
    assert outstanding(agent) == 0
    with pytest.raises(ValueError):  # `with` closed the channel it wraps
        method(b"d", timeout=10)
    service.stop()


def test_a_call_that_fails_before_grpc_answers_is_taken_in_and_restarts_the_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service = Service({"Echo": lambda payload, context: payload}, None)
    agent = RpcAgent("client")
    channel = agent.instrument_channel(grpc.insecure_channel(service.address), "server")
    try:
        method = channel.unary_unary(f"/{SERVICE}/Echo")

        def broken(*args: object, **kwargs: object) -> object:
            raise ValueError("the request could not be serialized")

        monkeypatch.setattr(method._plain, "with_call", broken)  # how the channel makes a blocking call
        with pytest.raises(ValueError, match="serialized"):
            method(b"x")
        assert outstanding(agent) == 0  # the caller waits on nothing any more
        assert agent._core.session("server") == 1  # nobody knows whether it went: counts restart
    finally:
        channel.close()
        service.stop()


def test_an_asyncio_channel_is_instrumented_as_one_and_the_sync_channel_refuses_it() -> None:
    async def attempt() -> None:
        agent = RpcAgent("client")
        async with agent.instrument_channel(grpc.aio.insecure_channel("127.0.0.1:9"), "server") as channel:
            assert isinstance(channel, AioInstrumentedChannel)
        plain = grpc.aio.insecure_channel("127.0.0.1:9")
        try:
            with pytest.raises(TypeError, match="AioInstrumentedChannel"):
                InstrumentedChannel(plain, agent, "server", True)
        finally:
            await plain.close()

    asyncio.run(attempt())


def stamped_requests(agent: RpcAgent) -> float | None:
    return agent.metrics.registry.get_sample_value("stablewatch_agent_rpc_stamped_messages_total", {"kind": "request"})


def test_a_future_waits_on_its_callee_only_while_its_caller_blocks_on_it() -> None:
    """A future made and not yet asked for holds nobody up: its caller is free (fanning out, or
    never asking). It waits, in the name of the thread that blocks in result(), only meanwhile."""
    held, release = threading.Event(), threading.Event()

    def slow(payload: bytes, context: object) -> bytes:
        held.set()
        release.wait(10)
        return payload

    service = Service({"Slow": slow}, None)
    agent = RpcAgent("client")
    try:
        with agent.instrument_channel(grpc.insecure_channel(service.address), "server") as channel:
            future = channel.unary_unary(f"/{SERVICE}/Slow").future(b"x", timeout=10)
            poll(held.is_set, "the call held by its server")
            assert agent.open_waits() == [] and outstanding(agent) == 1
            with pytest.raises(grpc.FutureTimeoutError):
                future.result(timeout=0.05)  # blocked a moment, then free again
            assert agent.open_waits() == []
            answers: list[bytes] = []
            waiter = threading.Thread(target=lambda: answers.append(future.result()), name="waiter")
            waiter.start()
            poll(lambda: [wait.task for wait in agent.open_waits()] == ["waiter"], "the waiter's wait")
            release.set()
            waiter.join(10)
            assert answers == [b"x"]
            assert agent.open_waits() == [] and outstanding(agent) == 0
    finally:
        release.set()
        agent.stop()
        service.stop()
