"""From a review (read only) of RPC mode's server side: what its fixes pin.

* An asyncio server's call that is cancelled (its deadline passed, or its caller cancelled it)
  sends no response, though grpc.aio's context says neither done nor cancelled while the handler's
  task unwinds: the response is not counted as sent (it was, and a handler that went on awaiting
  could count it in the pair's next session, where it stayed in flight for good).
* A sync server's queued call whose caller cancels it leaves the pool's picture only when no
  worker will run it: grpc runs the handler of a request-stream call even after its end.
* An asyncio server interceptor that serves a second event loop (a server run again under a new
  ``asyncio.run``, or a second server in another thread) still finds each handler's own task: it
  looked them up in the loop of its first call, and the handlers' calls lost their names.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import grpc
import pytest
from pool_service import PoolService
from rpc_harness import SERVICE, AioServer, aio_channel_to, handler_prefix, new_agent, recorded, sample

from polling import async_poll, poll, run
from stablewatch.agents.rpc import RpcAgent

pytestmark = pytest.mark.timeout(60)


def spy_on_responses(agent: RpcAgent) -> threading.Event:
    """An event set each time ``agent`` is told a handler ended (before the method is first wrapped)."""
    ended = threading.Event()
    respond = agent.respond

    def responding(*args: Any) -> Any:
        try:
            return respond(*args)
        finally:
            ended.set()

    agent.respond = responding  # type: ignore[method-assign]
    return ended


@pytest.mark.parametrize("kind", ["async", "sync", "async generator"])
def test_a_cancelled_asyncio_handlers_response_is_not_counted_as_sent(
    rpc_agents: tuple[RpcAgent, RpcAgent], kind: str
) -> None:
    s_agent, c_agent = rpc_agents
    ended = spy_on_responses(s_agent)
    release = threading.Event()

    async def slow(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await asyncio.sleep(30)
        return b"late"

    def blocking(request: bytes, context: Any) -> bytes:
        release.wait(30)
        return b"late"

    async def stream(request: bytes, context: grpc.aio.ServicerContext) -> Any:
        await asyncio.sleep(30)
        yield b"late"

    handler = {
        "async": grpc.unary_unary_rpc_method_handler(slow),
        "sync": grpc.unary_unary_rpc_method_handler(blocking),
        "async generator": grpc.unary_stream_rpc_method_handler(stream),
    }[kind]

    async def body() -> None:
        async with (
            AioServer(s_agent, {"Slow": handler}) as server,
            aio_channel_to(server.address, c_agent, "channel") as to_s,
        ):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                if kind == "async generator":
                    async for _ in to_s.unary_stream(f"/{SERVICE}/Slow")(b"", timeout=0.3):
                        pass
                else:
                    await to_s.unary_unary(f"/{SERVICE}/Slow")(b"", timeout=0.3)
            assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await async_poll(ended.is_set, "the cancelled handler's end")

    try:
        run(body(), 30)
    finally:
        release.set()
    assert sample(s_agent, "stamped_messages", kind="response") == 0


def test_a_cancelled_queued_request_stream_call_is_taken_out_of_the_pool_and_never_runs() -> None:
    # One worker: Hold runs, then Total (a request stream) and Quick queue. Total's caller cancels
    # it. grpc would still run Total's handler when the worker frees up (a request stream's handler
    # is not skipped for an ended call), holding the worker while the picture showed Quick running:
    # its queued work is taken back instead, so it never runs and Quick is next.
    s_agent, c_agent = new_agent("S"), new_agent("C")
    hold, total = threading.Event(), threading.Event()
    ran: list[str] = []

    def holding(request: bytes, context: grpc.ServicerContext) -> bytes:
        hold.wait(30)
        return b"held"

    def totalling(requests: Any, context: grpc.ServicerContext) -> bytes:
        ran.append("Total")
        total.wait(30)
        return b"%d" % sum(1 for _ in requests)

    def quick(request: bytes, context: grpc.ServicerContext) -> bytes:
        ran.append("Quick")
        return b"quick"

    handlers = {
        "Hold": grpc.unary_unary_rpc_method_handler(holding),
        "Total": grpc.stream_unary_rpc_method_handler(totalling),
        "Quick": grpc.unary_unary_rpc_method_handler(quick),
    }
    service = PoolService(handlers, s_agent, workers=1)
    channel = c_agent.instrument_channel(grpc.insecure_channel(service.address), "S")
    hold_, total_, quick_ = (f"/{SERVICE}/{name}" for name in ("Hold", "Total", "Quick"))

    def picture() -> tuple[list[str], list[str]]:
        with s_agent._lock:
            [pool] = s_agent._pools
            return [name.split("#")[0] for name in pool.running], [name.split("#")[0] for name in pool.queued]

    try:
        held = channel.unary_unary(hold_).future(b"")
        poll(lambda: picture() == ([hold_], []), "Hold running")
        totalled = channel.stream_unary(total_).future(iter([b"1", b"2"]))
        poll(lambda: picture() == ([hold_], [total_]), "Total queued")
        quickly = channel.unary_unary(quick_).future(b"")
        poll(lambda: picture() == ([hold_], [total_, quick_]), "Quick queued")
        totalled.cancel()
        poll(lambda: picture() == ([hold_], [quick_]), "Total out of the queue")
        hold.set()
        assert held.result(timeout=10) == b"held"
        assert quickly.result(timeout=10) == b"quick"
        poll(lambda: picture() == ([], []), "the pool empty")
        assert ran == ["Quick"]  # Total's handler never ran
    finally:
        hold.set()
        total.set()
        channel.close()
        service.stop()
        c_agent.stop()
        s_agent.stop()


def test_an_asyncio_interceptor_serving_a_second_loop_still_names_its_handlers_calls(
    rpc_agents: tuple[RpcAgent, RpcAgent],
) -> None:
    s_agent, c_agent = rpc_agents
    interceptor = s_agent.aio_server_interceptor()  # one interceptor for the server's whole life

    def relay_waits() -> list[str] | None:
        state = recorded(s_agent)
        tasks = [wait.task for wait in state.waits] if state is not None else []
        return tasks or None

    async def serve_once() -> list[str]:
        blocked = asyncio.Event()

        async def block(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            blocked.set()
            await asyncio.sleep(30)
            return b""

        async def relay(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            # S's handler calls B (no agent) and waits on it, in the handler's name.
            async with s_agent.instrument_channel(grpc.aio.insecure_channel(back.address), target=back.address) as to_b:
                return await to_b.unary_unary(f"/{SERVICE}/Block")(b"", timeout=30)

        back = AioServer(None, {"Block": grpc.unary_unary_rpc_method_handler(block)})
        server = grpc.aio.server(interceptors=[interceptor])
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler(SERVICE, {"Relay": grpc.unary_unary_rpc_method_handler(relay)})]
        )
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        try:
            async with back, aio_channel_to(address, c_agent, "channel") as to_s:
                call = asyncio.ensure_future(to_s.unary_unary(f"/{SERVICE}/Relay")(b"", timeout=30))
                await asyncio.wait_for(blocked.wait(), 10)
                waiters = await asyncio.to_thread(poll, relay_waits, "the relay's wait on B")
                call.cancel()
                return waiters
        finally:
            await server.stop(0)

    for loop in ("first", "second"):  # each run() is a new event loop
        [waiter] = run(serve_once(), 30)
        assert waiter.startswith(handler_prefix("Relay", c_agent)), (loop, waiter)
