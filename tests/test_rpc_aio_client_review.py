"""From a review (read only) of the asyncio instrumented channel's client side
(``agents/rpc/aio_channel.py``), on real grpc.aio servers on loopback.

* A stream-unary call waits on the callee only while its caller writes it (a write can block on the
  server) or awaits it. A write's wait ends when the write returns: its caller is free again, and
  may do other things, cancel or drop the call. It used to wait from the first write until the
  call was awaited, which made a deadlock up through a caller busy elsewhere.
* A written call's end, and a response stream's, is taken in when grpc ends the call, whether or
  not the caller meets it: an ended call holds no wait, and a finished stream its caller holds
  unread to its end leaves no response in flight that would abort every snapshot of the pair.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from rpc_harness import SERVICE, AioServer, agent, call, deadlock, handler_prefix, new_agent, outstanding, recorded
from rpc_harness import snapshot as take_snapshot

from polling import async_poll, poll, run
from stablewatch.agents.rpc import DeadlockBroken, RpcAgent
from stablewatch.detector.service.query import outcome_name
from stablewatch.testing.detector import Running
from stablewatch.v1 import LocalState, Wait
from stablewatch.v1.control_pb2 import BREAK_OUTCOME_BROKEN, BreakWait

TIMEOUT = 20.0  # each scenario, on a slow shared machine; each takes a second or two
#: Without BDP probing, a stream's flow-control window stays 64 KiB: a write of a larger message to
#: a handler that reads nothing blocks until it reads.
NO_WINDOW_GROWTH = (("grpc.http2.bdp_probe", 0),)
BIG = b"x" * 1_000_000


def aio_server(s_agent: RpcAgent, handlers: dict[str, grpc.RpcMethodHandler]) -> tuple[grpc.aio.Server, str]:
    """An asyncio server on 127.0.0.1 (OS-picked port) with ``s_agent``'s interceptor and a window
    that does not grow (see NO_WINDOW_GROWTH); made in the test's loop, started by the caller."""
    server = grpc.aio.server(interceptors=[s_agent.aio_server_interceptor()], options=NO_WINDOW_GROWTH)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    return server, f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"


async def _await(stream: Any) -> Any:
    """``await stream``, for a task of its own."""
    return await stream


def waits_now(c_agent: RpcAgent) -> list[str]:
    """The tasks of the waits ``c_agent`` records now."""
    state: LocalState | None = recorded(c_agent)
    assert state is not None
    return [wait.task for wait in state.waits]


async def the_wait(c_agent: RpcAgent) -> Wait:
    """The one wait ``c_agent`` records, once it records one."""

    def look() -> Wait | None:
        state = recorded(c_agent)
        return state.waits[0] if state is not None and len(state.waits) == 1 else None

    return await async_poll(look, "a recorded wait", TIMEOUT, interval=0.02)


async def a_wait(c_agent: RpcAgent) -> str:
    """The task of the one wait ``c_agent`` records, once it records one."""
    return (await the_wait(c_agent)).task


# -- a write's wait ends with the write -------------------------------------------------------------


@pytest.mark.parametrize("awaited", [False, True], ids=["unawaited", "awaited-by-another-task"])
def test_a_written_stream_unary_call_not_awaited_makes_no_deadlock_up(running: Running, awaited: bool) -> None:
    """T calls B.Outer, which (B's one worker) calls A.Mid; Mid writes a stream-unary call to
    B.Total (queued behind Outer), then does other work. Mid is not blocked on its call: no deadlock.
    With `awaited`, a task of Mid's own begins awaiting the call while the write is under way (from
    a review of the first version, which kept the wait in Mid's name once the write returned)."""
    a_agent, b_agent, t_agent = agent(running, "A"), agent(running, "B"), agent(running, "T")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="A-loop", daemon=True)
    thread.start()
    written, proceed = threading.Event(), threading.Event()
    state: dict[str, Any] = {}

    def outer(request: bytes, context: Any) -> bytes:
        return call(state["B->A"], "Mid", timeout=30)

    def total(requests: Any, context: Any) -> bytes:
        return b"+".join(requests)

    b_pool = b_agent.thread_pool(1)
    b_server = grpc.server(b_pool, interceptors=[b_agent.server_interceptor(workers=b_pool)])
    b_server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
        "Outer": grpc.unary_unary_rpc_method_handler(outer),
        "Total": grpc.stream_unary_rpc_method_handler(total),
    })])  # fmt: skip
    b_port = b_server.add_insecure_port("127.0.0.1:0")
    b_server.start()

    async def collect(c: Any) -> Any:
        state["awaiting"] = True
        return await c

    async def mid(request: bytes, context: Any) -> bytes:
        total_call = state["A->B"].stream_unary(f"/{SERVICE}/Total")(timeout=30)
        if awaited:
            state["collector"] = asyncio.create_task(collect(total_call))  # another task awaits the call
        await total_call.write(b"x")  # the collector begins its await while this write is under way
        state["awaited_during_write"] = state.get("awaiting", False)
        await total_call.done_writing()
        written.set()
        await asyncio.to_thread(proceed.wait, 30)  # other work, not the call
        # Left to the test to cancel once Mid answered: a call's cancelled end restarts the counts
        # between A and B, and a response of A's sent before that restart is refused by B.
        state["Total"] = total_call
        return b"ok"

    async def start_a() -> int:
        server = grpc.aio.server(interceptors=[a_agent.aio_server_interceptor()])
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
            "Mid": grpc.unary_unary_rpc_method_handler(mid)})])  # fmt: skip
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        state["a_server"] = server
        state["A->B"] = a_agent.instrument_channel(grpc.aio.insecure_channel(f"127.0.0.1:{b_port}"), "B")
        return port

    a_port = asyncio.run_coroutine_threadsafe(start_a(), loop).result(10)
    state["B->A"] = b_agent.instrument_channel(grpc.insecure_channel(f"127.0.0.1:{a_port}"), "A")
    t_channel = t_agent.instrument_channel(grpc.insecure_channel(f"127.0.0.1:{b_port}"), "B")
    driver = futures.ThreadPoolExecutor(1, thread_name_prefix="driver")
    try:
        reply = driver.submit(call, t_channel, "Outer", b"", timeout=30)
        assert written.wait(10)
        assert state["awaited_during_write"] == awaited
        poll(lambda: b_agent._pools[0].queued, "Total queued at B")
        results = take_snapshot(running)
        assert outcome_name(results.snapshot.outcome) == "completed", results.snapshot.abort_reason
        found = deadlock(results)
        proceed.set()  # Mid goes on as soon as the test lets it, and everything ends
        assert reply.result(20) == b"ok"
        assert not found.holds, f"made-up deadlock: {found.summary}"
    finally:
        proceed.set()
        if "Total" in state:
            loop.call_soon_threadsafe(state["Total"].cancel)
        t_channel.close()
        state["B->A"].close()

        async def stop_a() -> None:
            await state["A->B"].close()
            await state["a_server"].stop(0)

        asyncio.run_coroutine_threadsafe(stop_a(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        b_server.stop(0).wait(10)
        b_pool.shutdown(wait=True)
        driver.shutdown(wait=True)
        for each in (a_agent, b_agent, t_agent):
            each.stop()


def test_a_write_waits_while_it_blocks_and_an_await_begun_meanwhile_keeps_the_wait(
    rpc_agents: tuple[RpcAgent, RpcAgent],
) -> None:
    """A handler of C hands its stream-unary call to a task of its own ("writer") that writes it
    while the handler does something else: the wait is the writer's while its write is blocked (by
    flow control), nobody's once it returned, and the handler's own when it then awaits the call
    (not the writer's, whose wait ended). An await begun while a write is blocked keeps the wait
    after the write returns."""
    s_agent, c_agent = rpc_agents
    d_agent = new_agent("D")
    held, release, finish, go = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Event()
    tasks: dict[str, asyncio.Task[Any]] = {}

    async def total(requests: AsyncIterator[bytes], context: Any) -> bytes:
        held.set()
        await release.wait()  # reads nothing until then: the writer's big write blocks
        parts = [request async for request in requests]
        await finish.wait()
        return b"%d" % len(parts)

    async def write_all(stream: Any, chunks: int) -> None:
        for _ in range(chunks):
            await stream.write(BIG)
        await stream.done_writing()

    async def body() -> None:
        s_server, s_address = aio_server(s_agent, {"Total": grpc.stream_unary_rpc_method_handler(total)})
        await s_server.start()
        to_s = c_agent.instrument_channel(grpc.aio.insecure_channel(s_address, options=NO_WINDOW_GROWTH), "S")

        async def mid(request: bytes, context: Any) -> bytes:
            stream = to_s.stream_unary(f"/{SERVICE}/Total")(timeout=TIMEOUT)
            tasks["writer"] = asyncio.create_task(write_all(stream, 1), name="writer")
            await go.wait()  # other work: not blocked on the writer
            return await stream

        async with AioServer(c_agent, {"Mid": grpc.unary_unary_rpc_method_handler(mid)}) as c_server:
            to_c = d_agent.instrument_channel(grpc.aio.insecure_channel(c_server.address), "C")
            try:
                reply = asyncio.create_task(_await(to_c.unary_unary(f"/{SERVICE}/Mid")(b"", timeout=TIMEOUT)))
                await async_poll(held.is_set, "Total held", TIMEOUT)
                assert await a_wait(c_agent) == "writer"  # blocked in its write
                release.set()
                await async_poll(lambda: "writer" in tasks and tasks["writer"].done(), "the writer done", TIMEOUT)
                await tasks["writer"]
                assert waits_now(c_agent) == []  # the write returned: nobody is blocked on the call
                go.set()  # the handler awaits the call now: the wait is its own
                assert (await a_wait(c_agent)).startswith(handler_prefix("Mid", d_agent))
                finish.set()
                assert await reply == b"1"

                # An await begun while a write blocks: the wait stays once the write returned. (Made
                # outside a handler, the call waits in its maker's name, whoever writes it.)
                held.clear(), release.clear(), finish.clear()
                maker = asyncio.current_task().get_name()  # type: ignore[union-attr]
                stream = to_s.stream_unary(f"/{SERVICE}/Total")(timeout=TIMEOUT)
                writer = asyncio.create_task(write_all(stream, 1), name="writer")
                await async_poll(held.is_set, "Total held", TIMEOUT)
                assert await a_wait(c_agent) == maker
                awaiting = asyncio.create_task(_await(stream), name="awaiting")
                await async_poll(lambda: stream._awaited, "the await begun", TIMEOUT)
                release.set()
                await writer
                assert waits_now(c_agent) == [maker]  # the await holds it
                finish.set()
                assert await awaiting == b"1"
                assert waits_now(c_agent) == [] and outstanding(c_agent) == 0
            finally:
                await to_c.close()
                await to_s.close()
                await s_server.stop(0)

    try:
        run(body(), TIMEOUT)
    finally:
        d_agent.stop()


def test_a_write_after_a_break_fails_with_deadlock_broken(rpc_agents: tuple[RpcAgent, RpcAgent]) -> None:
    """Between its caller's writes a stream-unary call waits only if something awaits it: that
    await's wait, broken, fails the await and the caller's next write with DeadlockBroken."""
    s_agent, c_agent = rpc_agents
    held, release = asyncio.Event(), asyncio.Event()

    async def total(requests: AsyncIterator[bytes], context: Any) -> bytes:
        held.set()
        await release.wait()
        return b""

    async def body() -> None:
        server, address = aio_server(s_agent, {"Total": grpc.stream_unary_rpc_method_handler(total)})
        await server.start()
        channel = c_agent.instrument_channel(grpc.aio.insecure_channel(address), "S")
        try:
            stream = channel.stream_unary(f"/{SERVICE}/Total")(timeout=TIMEOUT)
            await stream.write(b"a")
            await async_poll(held.is_set, "Total held", TIMEOUT)
            assert waits_now(c_agent) == []  # written, not awaited: nobody waits
            awaiting = asyncio.create_task(_await(stream), name="awaiter")
            wait = await the_wait(c_agent)
            order = BreakWait(break_id=1, snapshot_id=42, instance=wait.instance, task=wait.task, deadlock="C -> S")
            assert (await asyncio.to_thread(c_agent.breaks.handle, order)).outcome == BREAK_OUTCOME_BROKEN
            await async_poll(stream.done, "the broken call ended", TIMEOUT)
            with pytest.raises(DeadlockBroken):
                await stream.write(b"b")
            with pytest.raises(DeadlockBroken):
                await awaiting
            assert outstanding(c_agent) == 0 and waits_now(c_agent) == []
        finally:
            release.set()
            await channel.close()
            await server.stop(0)

    run(body(), TIMEOUT)


# -- an ended call's end is taken in when grpc ends it ---------------------------------------------


@pytest.mark.parametrize("end", ["cancel", "deadline", "close", "cancelled-write"])
def test_a_written_call_that_ends_while_held_keeps_no_wait_and_is_taken_in(
    rpc_agents: tuple[RpcAgent, RpcAgent], end: str
) -> None:
    """A stream-unary call its caller wrote and holds unawaited ends (cancelled by its caller, by its
    deadline, by the channel's close, or with a write its caller cancelled): no wait is left for
    it, and its end is taken in (nothing stays in flight to the caller)."""
    s_agent, c_agent = rpc_agents

    async def total(requests: AsyncIterator[bytes], context: Any) -> bytes:
        await asyncio.sleep(30)  # reads nothing: a big write blocks (ended by the call's end)
        return b""

    async def body() -> None:
        server, address = aio_server(s_agent, {"Total": grpc.stream_unary_rpc_method_handler(total)})
        await server.start()
        channel = c_agent.instrument_channel(grpc.aio.insecure_channel(address, options=NO_WINDOW_GROWTH), "S")
        try:
            stream = channel.stream_unary(f"/{SERVICE}/Total")(timeout=1.0 if end == "deadline" else TIMEOUT)
            await stream.write(b"x")
            if end == "cancelled-write":
                writer = asyncio.create_task(stream.write(BIG), name="writer")
                # Made outside a handler: it waits in its maker's name, whoever writes it.
                assert await a_wait(c_agent) == asyncio.current_task().get_name()  # type: ignore[union-attr]
                writer.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await writer
            elif end == "cancel":
                stream.cancel()
            elif end == "close":
                await channel.close()
            await async_poll(stream.done, "the call ended", TIMEOUT)
            await async_poll(lambda: outstanding(c_agent) == 0, "the ended call's end taken in", 5)
            assert waits_now(c_agent) == [], "a wait for a call that has ended"
            assert c_agent.open_waits() == []
        finally:
            await channel.close()
            await server.stop(0)

    run(body(), TIMEOUT)


@pytest.mark.parametrize("kind", ["unary_stream", "stream_stream"])
def test_a_finished_response_stream_held_unread_to_its_end_does_not_stop_snapshots(running: Running, kind: str) -> None:
    """The caller reads what it wanted of a response stream and keeps the object, never reading
    the stream's end: the end is taken in when grpc ends the call, and snapshots of the pair
    complete (they aborted, a channel never reported, while its response was taken as in flight)."""
    s_agent, c_agent = agent(running, "S"), agent(running, "C")

    async def count(request: bytes, context: Any) -> AsyncIterator[bytes]:
        yield b"0"

    async def echo(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for request in requests:
            yield request.upper()

    async def body() -> None:
        handlers = {
            "Count": grpc.unary_stream_rpc_method_handler(count),
            "Echo": grpc.stream_stream_rpc_method_handler(echo),
        }
        async with AioServer(s_agent, handlers) as server:
            channel = c_agent.instrument_channel(grpc.aio.insecure_channel(server.address), "S")
            try:
                if kind == "unary_stream":
                    stream = channel.unary_stream(f"/{SERVICE}/Count")(b"", timeout=TIMEOUT)
                    assert await stream.read() == b"0"
                else:
                    stream = channel.stream_stream(f"/{SERVICE}/Echo")(timeout=TIMEOUT)
                    await stream.write(b"a")
                    await stream.done_writing()
                    assert await stream.read() == b"A"
                await async_poll(stream.done, "the call ended at grpc", TIMEOUT)
                await async_poll(lambda: outstanding(c_agent) == 0, "the held call's end taken in", 5)
                for _ in range(2):
                    results = await asyncio.wrap_future(
                        asyncio.run_coroutine_threadsafe(running.detector.take_snapshot(deadline=2), running.loop)
                    )
                    assert outcome_name(results.snapshot.outcome) == "completed", results.snapshot.abort_reason
                assert await stream.read() is grpc.aio.EOF  # the caller still meets the end, once
                assert c_agent._core.received_count("S") == 1
            finally:
                await channel.close()

    try:
        run(body(), 60)
    finally:
        c_agent.stop()
        s_agent.stop()
