"""Stamps are per hop, whichever way a process is instrumented: a relay C -> S -> T whose handler in S
passes metadata along both ways, as gateways pass headers along.

S's handler forwards its own call's metadata to T (``metadata=context.invocation_metadata()``) and
copies T's trailing metadata into its own response (into its context, or into what it gives its
abort), for an answer, an error and a response stream.
T must be sent S's request stamp only (not C's, forwarded ahead of it: T would count the request as
C's), and C must take in S's response stamp only (not T's, copied ahead of it: C would refuse the
response as a bad stamp and restart its counts with S). Every pair's counts stay right and none
restarts.

The set-ups: sync servers with the sync instrumented channel, or with the sync client interceptor;
asyncio servers with the asyncio instrumented channel, or with the asyncio client interceptors.
Real servers on 127.0.0.1, on ports the system picks.
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from rpc_harness import SERVICE, AioServer, aio_channel_to, new_agent, outstanding, sample

from polling import run
from stablewatch.agents.rpc import BadStamp, RpcAgent
from stablewatch.agents.rpc.core import STAMP_KEY

pytestmark = pytest.mark.timeout(60)

ANSWER, COUNT = "Answer", "Count"  # T's methods: unary-unary, unary-stream
RELAY, RELAY_STREAM = "Relay", "RelayStream"  # S's, relaying to them
TIMEOUT = 10.0  # each call, and each asyncio scenario, on a slow shared machine; each takes well under a second
PASSED = (("x-trace", "abc"),)  # C's own request metadata, which S passes on to T
FROM_T = ("x-from-t", "t")  # T's own trailing metadata, which S copies into its response
REFUSAL = (grpc.StatusCode.FAILED_PRECONDITION, "refused by T")

SYNC = ("sync channel", "sync interceptor")
AIO = {"aio channel": "channel", "aio interceptors": "interceptors"}  # rpc_harness.aio_channel_to's names
SETUPS = (*SYNC, *AIO)
#: What S relays: T's answer; T's error, its trailing metadata copied into S's context or given to
#: S's abort (``abort_with_status`` on a sync server); T's response stream.
RELAYED = ("answer", "error", "error given to abort", "stream")


def stamps(metadata: Any) -> list[str]:
    """The values of our stamp entries among ``metadata``, in order."""
    return [value for key, value in metadata or () if key == STAMP_KEY]


class Status(collections.namedtuple("Status", ("code", "details", "trailing_metadata")), grpc.Status):
    """A status for a sync server's ``abort_with_status`` (grpc.Status only names its fields)."""


class Relay:
    """What one relay saw: T's view of the request's metadata, and C's of the response's trailing
    metadata."""

    def __init__(self, relayed: str) -> None:
        self.relayed = relayed
        self.at_t: list[list[tuple[str, str]]] = []
        # None where grpc.aio's client interceptors hide it (a unary call's answer)
        self.at_c: list[tuple[str, str]] | None = []


# -- sync servers, with the sync instrumented channel or client interceptor ------------------------


class SyncServer:
    """A sync gRPC server on 127.0.0.1 with ``agent``'s interceptor and a worker pool from it."""

    def __init__(self, agent: RpcAgent, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.pool = agent.thread_pool(2)
        self.server = grpc.server(self.pool, interceptors=[agent.server_interceptor(workers=self.pool)])
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=0).wait(TIMEOUT)
        self.pool.shutdown(wait=True, cancel_futures=True)


def sync_channel(agent: RpcAgent, address: str, peer: str, setup: str) -> grpc.Channel:
    """A sync channel from ``agent``'s process to ``peer`` at ``address``, instrumented the ``setup`` way."""
    plain = grpc.insecure_channel(address)
    if setup == "sync interceptor":
        return grpc.intercept_channel(plain, agent.client_interceptor(peer))
    return agent.instrument_channel(plain, peer)


def relay_sync(setup: str, relay: Relay, c_agent: RpcAgent, s_agent: RpcAgent, t_agent: RpcAgent) -> None:
    """C calls S, whose handler calls T, every process on sync gRPC."""

    def answer(request: bytes, context: grpc.ServicerContext) -> bytes:
        relay.at_t.append(list(context.invocation_metadata()))
        context.set_trailing_metadata((FROM_T,))
        if relay.relayed.startswith("error"):
            context.abort(*REFUSAL)
        return b"done:" + request

    def count(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        relay.at_t.append(list(context.invocation_metadata()))
        context.set_trailing_metadata((FROM_T,))
        yield b"0"
        yield b"1"

    t_server = SyncServer(
        t_agent,
        {ANSWER: grpc.unary_unary_rpc_method_handler(answer), COUNT: grpc.unary_stream_rpc_method_handler(count)},
    )
    try:
        with sync_channel(s_agent, t_server.address, "T", setup) as to_t:

            def relayed(request: bytes, context: grpc.ServicerContext) -> bytes:
                forward = to_t.unary_unary(f"/{SERVICE}/{ANSWER}")
                try:
                    if relay.relayed.startswith("error"):  # a stub's plain call (the instrumented channel's fast path)
                        return forward(request, timeout=TIMEOUT, metadata=context.invocation_metadata())
                    response, ended = forward.with_call(
                        request, timeout=TIMEOUT, metadata=context.invocation_metadata()
                    )
                except grpc.RpcError as error:
                    code, details, trailing = error.code(), error.details(), error.trailing_metadata()  # type: ignore[attr-defined]
                    if relay.relayed == "error given to abort":  # its trailing metadata replace the context's
                        context.abort_with_status(Status(code, details, trailing))
                    context.set_trailing_metadata(trailing)
                    context.abort(code, details)
                context.set_trailing_metadata(ended.trailing_metadata())
                return response

            def relayed_stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
                responses = to_t.unary_stream(f"/{SERVICE}/{COUNT}")(
                    request, timeout=TIMEOUT, metadata=context.invocation_metadata()
                )
                yield from responses
                context.set_trailing_metadata(responses.trailing_metadata())

            s_server = SyncServer(
                s_agent,
                {
                    RELAY: grpc.unary_unary_rpc_method_handler(relayed),
                    RELAY_STREAM: grpc.unary_stream_rpc_method_handler(relayed_stream),
                },
            )
            try:
                with sync_channel(c_agent, s_server.address, "S", setup) as to_s:
                    if relay.relayed == "answer":
                        response, ended = to_s.unary_unary(f"/{SERVICE}/{RELAY}").with_call(
                            b"x", timeout=TIMEOUT, metadata=PASSED
                        )
                        assert response == b"done:x"
                        relay.at_c = list(ended.trailing_metadata())
                    elif relay.relayed.startswith("error"):
                        with pytest.raises(grpc.RpcError) as failed:
                            to_s.unary_unary(f"/{SERVICE}/{RELAY}")(b"x", timeout=TIMEOUT, metadata=PASSED)
                        assert not isinstance(failed.value, BadStamp)
                        assert (failed.value.code(), failed.value.details()) == REFUSAL  # type: ignore[attr-defined]
                        relay.at_c = list(failed.value.trailing_metadata())  # type: ignore[attr-defined]
                    else:
                        counted = to_s.unary_stream(f"/{SERVICE}/{RELAY_STREAM}")(b"", timeout=TIMEOUT, metadata=PASSED)
                        assert list(counted) == [b"0", b"1"]
                        relay.at_c = list(counted.trailing_metadata())
                    assert outstanding(c_agent) == 0 and outstanding(s_agent) == 0
            finally:
                s_server.stop()
    finally:
        t_server.stop()


# -- asyncio servers, with the asyncio instrumented channel or client interceptors -----------------


async def relay_aio(setup: str, relay: Relay, c_agent: RpcAgent, s_agent: RpcAgent, t_agent: RpcAgent) -> None:
    """C calls S, whose handler calls T, every process on grpc.aio, the clients set up the ``setup`` way."""
    clients = AIO[setup]

    async def answer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        relay.at_t.append(list(context.invocation_metadata() or ()))
        context.set_trailing_metadata((FROM_T,))
        if relay.relayed.startswith("error"):
            await context.abort(*REFUSAL)
        return b"done:" + request

    async def count(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        relay.at_t.append(list(context.invocation_metadata() or ()))
        context.set_trailing_metadata((FROM_T,))
        yield b"0"
        yield b"1"

    t_handlers = {
        ANSWER: grpc.unary_unary_rpc_method_handler(answer),
        COUNT: grpc.unary_stream_rpc_method_handler(count),
    }
    async with (
        AioServer(t_agent, t_handlers) as t_server,
        aio_channel_to(t_server.address, s_agent, clients, "T") as to_t,
    ):

        async def relayed(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            call = to_t.unary_unary(f"/{SERVICE}/{ANSWER}")(
                request, timeout=TIMEOUT, metadata=context.invocation_metadata()
            )
            try:
                response = await call
            except grpc.aio.AioRpcError as error:
                if relay.relayed == "error given to abort":  # S's stamp goes into what abort() is given
                    await context.abort(error.code(), error.details(), error.trailing_metadata())
                context.set_trailing_metadata(tuple(error.trailing_metadata()))
                await context.abort(error.code(), error.details())
            # None through the interceptors: grpc.aio hides a unary response's metadata from them.
            context.set_trailing_metadata(tuple(await call.trailing_metadata() or ()))
            return response

        async def relayed_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            call = to_t.unary_stream(f"/{SERVICE}/{COUNT}")(
                request, timeout=TIMEOUT, metadata=context.invocation_metadata()
            )
            async for response in call:
                yield response
            context.set_trailing_metadata(tuple(await call.trailing_metadata()))

        s_handlers = {
            RELAY: grpc.unary_unary_rpc_method_handler(relayed),
            RELAY_STREAM: grpc.unary_stream_rpc_method_handler(relayed_stream),
        }
        async with (
            AioServer(s_agent, s_handlers) as s_server,
            aio_channel_to(s_server.address, c_agent, clients) as to_s,
        ):
            if relay.relayed == "answer":
                call = to_s.unary_unary(f"/{SERVICE}/{RELAY}")(b"x", timeout=TIMEOUT, metadata=PASSED)
                assert await call == b"done:x"
                if clients == "interceptors":
                    assert await call.trailing_metadata() is None  # hidden, as in S: nothing to look at
                    relay.at_c = None
                else:
                    relay.at_c = list(await call.trailing_metadata())
            elif relay.relayed.startswith("error"):
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await to_s.unary_unary(f"/{SERVICE}/{RELAY}")(b"x", timeout=TIMEOUT, metadata=PASSED)
                assert not isinstance(failed.value, BadStamp)
                assert (failed.value.code(), failed.value.details()) == REFUSAL
                relay.at_c = list(failed.value.trailing_metadata())
            else:
                counted = to_s.unary_stream(f"/{SERVICE}/{RELAY_STREAM}")(b"", timeout=TIMEOUT, metadata=PASSED)
                assert [response async for response in counted] == [b"0", b"1"]
                relay.at_c = list(await counted.trailing_metadata())
            assert outstanding(c_agent) == 0 and outstanding(s_agent) == 0


# -- the scenario ----------------------------------------------------------------------------------


@pytest.mark.parametrize("relayed", RELAYED)
@pytest.mark.parametrize("setup", SETUPS)
def test_a_relay_passing_metadata_along_both_ways_keeps_each_hops_stamps(
    rpc_agents: tuple[RpcAgent, RpcAgent], setup: str, relayed: str
) -> None:
    """T is sent S's request stamp only, C takes in S's response stamp only: each pair's counts are
    right, none restarted, no stamp was refused; the metadata that is not ours goes along."""
    s_agent, c_agent = rpc_agents
    t_agent = new_agent("T")
    relay = Relay(relayed)
    try:
        if setup in SYNC:
            relay_sync(setup, relay, c_agent, s_agent, t_agent)
        else:
            run(relay_aio(setup, relay, c_agent, s_agent, t_agent), TIMEOUT)
    finally:
        t_agent.stop()

    # What T was sent: C's own metadata, and one stamp, S's ("{seq}:{color}.{incarnation}.{session}.S").
    (at_t,) = relay.at_t
    assert PASSED[0] in at_t
    assert [stamp.rpartition(".")[2] for stamp in stamps(at_t)] == ["S"], at_t
    # What C was sent back: T's own trailing metadata, copied, and one stamp, S's.
    if relay.at_c is not None:
        assert FROM_T in relay.at_c
        assert [stamp.rpartition(".")[2] for stamp in stamps(relay.at_c)] == ["S"], relay.at_c

    assert t_agent._core.received_count("S") == 1 and t_agent._core.received_count("C") == 0
    assert s_agent._core.received_count("C") == 1 and s_agent._core.received_count("T") == 1
    assert c_agent._core.received_count("S") == 1 and c_agent._core.received_count("T") == 0
    assert c_agent._core.session("S") == s_agent._core.session("T") == 0  # no count restarted
    for agent in (c_agent, s_agent, t_agent):
        assert sample(agent, "bad_stamps", side="client") == sample(agent, "bad_stamps", side="server") == 0
        assert sample(agent, "peer_resets") == 0
