"""The asyncio instrumented channel (``agent.instrument_channel(grpc.aio.insecure_channel(...), peer)``),
on real grpc.aio servers on loopback.

Every kind of call goes through stamped and is counted on both sides. A call's end is taken in where
its caller meets it (its ``await``, the end of its response stream; until then a finished call's
response is in flight to its caller), or, for a call its caller drops, as grpc ends it. What the
asyncio client interceptors cannot do, the channel does: a call made outside a handler waits in its
caller's own task's name, a unary call's metadata accessors show the server's metadata, and a
request stream may be written with ``call.write``. A bad stamp fails the call with ``BadStamp``; a
caller's cancellation stays a cancellation; a break fails the call with ``DeadlockBroken``
(ABORTED), and the call object reports ABORTED too.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from rpc_harness import SERVICE, aio_channel_to, handler_task, new_agent, outstanding, recorded, sample, stamped

from polling import async_poll, run
from stablewatch.agents.rpc import AioInstrumentedChannel, BadStamp, DeadlockBroken, RpcAgent
from stablewatch.agents.rpc.core import STAMP_KEY
from stablewatch.agents.rpc.interceptors import CURRENT_TASK
from stablewatch.v1 import WAIT_MODEL_AND, Wait
from stablewatch.v1.control_pb2 import (
    BREAK_OUTCOME_ALREADY_BROKEN,
    BREAK_OUTCOME_BROKEN,
    BREAK_OUTCOME_GONE,
    BreakWait,
)

SLOW, COUNT, TOTAL, ECHO, META, RELAY = "Slow", "Count", "Total", "Echo", "Meta", "Relay"
#: The method of AioService that serves each kind of call a test holds (with the request ``hold``).
HELD = {"unary_unary": SLOW, "stream_unary": TOTAL, "unary_stream": COUNT}
WAITING = ("unary_unary", "stream_unary")  # the unary-response kinds: their callers wait on the callee
CYCLE = "C:/test.Svc/Slow -> S:/test.Svc/Slow"
GOOD = "0.1.0.S"  # a stamp as S would send it: color 0, incarnation 1, session 0
TIMEOUT = 10.0  # each test's scenario, on a slow shared machine; each takes well under a second


async def recorded_wait(agent: RpcAgent) -> Wait:
    """The one wait of ``agent``'s recorded state, once there is one."""

    def look() -> Wait | None:
        state = recorded(agent)
        if state is None or not state.waits:
            return None
        (wait,) = state.waits
        return wait

    return await async_poll(look, "a recorded wait", TIMEOUT, interval=0.02)


def order(wait: Wait, break_id: int = 1) -> BreakWait:
    return BreakWait(break_id=break_id, snapshot_id=42, instance=wait.instance, task=wait.task, deadlock=CYCLE)


def method(channel: grpc.aio.Channel, kind: str, name: str) -> Any:
    """The multi-callable ``kind`` ("unary_unary", ...) of ``/test.Svc/{name}`` on ``channel``."""
    return getattr(channel, kind)(f"/{SERVICE}/{name}")


class AioService:
    """An asyncio gRPC server on 127.0.0.1 (with ``agent``'s interceptor, if any) serving
    ``handlers``, by default one method of each kind:

    * ``Slow`` (unary-unary) answers ``done:{request}``; ``Total`` (stream-unary) joins its requests
      with ``+``. A request ``hold`` makes either set ``held`` and wait for ``release``.
    * ``Count`` (unary-stream) answers ``0``, ``1``, ... up to its request's number; ``hold`` answers
      ``0`` and then holds as above.
    * ``Echo`` (stream-stream) answers each request in capitals.

    Made inside the event loop of its test (its events belong to that loop).
    """

    def __init__(
        self,
        agent: RpcAgent | None,
        handlers: dict[str, grpc.RpcMethodHandler] | None = None,
        options: tuple[tuple[str, Any], ...] = (),
    ) -> None:
        self.held, self.release = asyncio.Event(), asyncio.Event()
        interceptors = [agent.aio_server_interceptor()] if agent is not None else []
        self.server = grpc.aio.server(interceptors=interceptors, options=options)
        methods = handlers or {
            SLOW: grpc.unary_unary_rpc_method_handler(self._slow),
            COUNT: grpc.unary_stream_rpc_method_handler(self._count),
            TOTAL: grpc.stream_unary_rpc_method_handler(self._total),
            ECHO: grpc.stream_stream_rpc_method_handler(self._echo),
        }
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, methods)])
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    async def __aenter__(self) -> AioService:
        await self.server.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.release.set()
        await self.server.stop(0)

    async def _hold(self) -> None:
        self.held.set()
        await self.release.wait()

    async def _slow(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if request == b"hold":
            await self._hold()
        return b"done:" + request

    async def _count(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        if request == b"hold":
            yield b"0"
            await self._hold()
            return
        for i in range(int(request)):
            yield str(i).encode()

    async def _total(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        parts = [request async for request in requests]
        if b"hold" in parts:
            await self._hold()
        return b"+".join(parts)

    async def _echo(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for request in requests:
            yield request.upper()


def instrumented(
    agent: RpcAgent, address: str, peer: str = "S", options: tuple[tuple[str, Any], ...] = ()
) -> AioInstrumentedChannel:
    channel = agent.instrument_channel(grpc.aio.insecure_channel(address, options=options), peer)
    assert isinstance(channel, AioInstrumentedChannel)
    return channel


def held_call(channel: grpc.aio.Channel, kind: str) -> Any:
    """A call of ``kind`` (a key of HELD) that its AioService holds until ``release``."""
    request = iter([b"hold"]) if kind == "stream_unary" else b"hold"
    return method(channel, kind, HELD[kind])(request, timeout=TIMEOUT)


# -- every kind of call --------------------------------------------------------------------------


def test_every_kind_of_call_goes_through_stamped_and_is_counted(rpc_agents: tuple[RpcAgent, RpcAgent]) -> None:
    s_agent, c_agent = rpc_agents

    async def body() -> None:
        async with AioService(s_agent) as service, instrumented(c_agent, service.address) as channel:
            unary = method(channel, "unary_unary", SLOW)(b"u", timeout=TIMEOUT)
            assert isinstance(unary, grpc.aio.UnaryUnaryCall)
            assert await unary == b"done:u"

            count = method(channel, "unary_stream", COUNT)(b"3", timeout=TIMEOUT)
            assert isinstance(count, grpc.aio.UnaryStreamCall)
            assert [response async for response in count] == [b"0", b"1", b"2"]

            assert await method(channel, "stream_unary", TOTAL)(iter([b"a", b"b"]), timeout=TIMEOUT) == b"a+b"
            written = method(channel, "stream_unary", TOTAL)(timeout=TIMEOUT)
            assert isinstance(written, grpc.aio.StreamUnaryCall)
            await written.write(b"c")
            await written.write(b"d")
            await written.done_writing()
            assert await written == b"c+d"

            echo = method(channel, "stream_stream", ECHO)(timeout=TIMEOUT)
            assert isinstance(echo, grpc.aio.StreamStreamCall)
            for request in (b"x", b"y"):
                await echo.write(request)
                assert await echo.read() == request.upper()
            await echo.done_writing()
            assert await echo.read() is grpc.aio.EOF

            async def requests() -> AsyncIterator[bytes]:
                for request in (b"p", b"q"):
                    yield request

            iterated = method(channel, "stream_stream", ECHO)(requests(), timeout=TIMEOUT)
            assert [response async for response in iterated] == [b"P", b"Q"]

            # Every end taken in before its caller saw it.
            assert outstanding(c_agent) == 0 and c_agent.open_waits() == []

    run(body(), TIMEOUT)
    calls = 6
    assert stamped(c_agent, "request") == calls and stamped(s_agent, "response") == calls
    assert s_agent._core.received_count("C") == s_agent._core.sent_count("C") == calls
    assert c_agent._core.sent_count("S") == c_agent._core.received_count("S") == calls
    assert c_agent._core.session("S") == 0  # no end left unknown: the counts never restarted
    assert sample(c_agent, "uninstrumented_calls", direction="outbound") == 0


@pytest.mark.parametrize("kind", ["unary_unary", "stream_unary"])
def test_a_unary_calls_metadata_is_the_servers_with_our_stamp(rpc_agents: tuple[RpcAgent, RpcAgent], kind: str) -> None:
    s_agent, c_agent = rpc_agents

    async def meta(request: Any, context: grpc.aio.ServicerContext) -> bytes:
        await context.send_initial_metadata((("greeting", "hello"),))
        context.set_trailing_metadata((("parting", "bye"),))
        return b"answer"

    handler = (grpc.unary_unary_rpc_method_handler if kind == "unary_unary" else grpc.stream_unary_rpc_method_handler)(
        meta
    )

    async def body() -> None:
        async with (
            AioService(s_agent, {META: handler}) as service,
            instrumented(c_agent, service.address) as channel,
        ):
            request = b"q" if kind == "unary_unary" else iter([b"q"])
            call = method(channel, kind, META)(request, timeout=TIMEOUT)
            assert await call == b"answer"
            assert ("greeting", "hello") in list(await call.initial_metadata())
            trailing = list(await call.trailing_metadata())
            assert [key for key, _ in trailing] == ["parting", STAMP_KEY]
            assert trailing[0] == ("parting", "bye")
            assert trailing[1][1].startswith("0.") and trailing[1][1].endswith(".0.S")  # S's stamp, session 0
            assert await call.code() == grpc.StatusCode.OK
            assert await call.details() == ""
            assert (call.done(), call.cancelled()) == (True, False)

    run(body(), TIMEOUT)
    assert c_agent._core.received_count("S") == 1


@pytest.mark.parametrize("kind", ["stream_unary", "stream_stream"])
def test_a_request_stream_may_be_given_by_its_keyword_as_grpc_names_it(
    rpc_agents: tuple[RpcAgent, RpcAgent], kind: str
) -> None:
    """grpc.aio names a request stream ``request_iterator``; a stub's caller may pass it so."""
    s_agent, c_agent = rpc_agents

    async def body() -> None:
        async with AioService(s_agent) as service, instrumented(c_agent, service.address) as channel:
            if kind == "stream_unary":
                call = method(channel, kind, TOTAL)(request_iterator=iter([b"a", b"b"]), timeout=TIMEOUT)
                assert await call == b"a+b"
            else:
                call = method(channel, kind, ECHO)(request_iterator=iter([b"a", b"b"]), timeout=TIMEOUT)
                assert [response async for response in call] == [b"A", b"B"]
            assert outstanding(c_agent) == 0

    run(body(), TIMEOUT)
    assert c_agent._core.received_count("S") == 1


# -- waits ----------------------------------------------------------------------------------------


@pytest.fixture
def t_agent() -> Iterator[RpcAgent]:
    """A third process's agent, T, whom S's handlers call."""
    agent = new_agent("T")
    yield agent
    agent.stop()


@pytest.mark.parametrize("client", ["channel", "interceptors"])
@pytest.mark.parametrize("kind", WAITING)
def test_a_call_outside_a_handler_waits_in_its_callers_task_name(
    rpc_agents: tuple[RpcAgent, RpcAgent], kind: str, client: str
) -> None:
    """Through the client interceptors too, though grpc.aio runs them in a task of its own: the
    caller is the task that awaits that task."""
    s_agent, c_agent = rpc_agents

    async def body() -> None:
        async with AioService(s_agent) as service, aio_channel_to(service.address, c_agent, client) as channel:

            async def caller() -> bytes:
                return await held_call(channel, kind)

            reply = asyncio.create_task(caller(), name="caller")
            await async_poll(service.held.is_set, "the call held by its server", TIMEOUT)
            (opened,) = c_agent.open_waits()
            assert opened.task == "caller" and opened.instance > 0
            wait = await recorded_wait(c_agent)
            assert (wait.task, wait.instance, wait.model) == ("caller", opened.instance, WAIT_MODEL_AND)
            assert [(t.process, t.task) for t in wait.targets] == [("S", handler_task(HELD[kind], c_agent, 1))]
            service.release.set()
            assert await reply == (b"done:hold" if kind == "unary_unary" else b"hold")
            assert c_agent.open_waits() == [] and outstanding(c_agent) == 0
            assert not (await async_poll(lambda: recorded(c_agent), "C's state", TIMEOUT, interval=0.02)).waits

    run(body(), TIMEOUT)


def test_a_call_with_a_response_stream_is_out_but_makes_no_wait(rpc_agents: tuple[RpcAgent, RpcAgent]) -> None:
    s_agent, c_agent = rpc_agents

    async def body() -> None:
        async with AioService(s_agent) as service, instrumented(c_agent, service.address) as channel:
            count = method(channel, "unary_stream", COUNT)(b"hold", timeout=TIMEOUT)
            assert await count.read() == b"0"
            await async_poll(service.held.is_set, "Count held by its server", TIMEOUT)
            assert outstanding(c_agent) == 1 and c_agent.open_waits() == []
            service.release.set()
            assert await count.read() is grpc.aio.EOF
            assert outstanding(c_agent) == 0

    run(body(), TIMEOUT)
    assert c_agent._core.received_count("S") == 1


@pytest.mark.parametrize(
    ("made", "client"),
    [
        ("by-the-handler", "channel"),
        ("by-the-handler", "interceptors"),
        ("in-a-task-it-starts", "channel"),
        ("in-a-task-it-starts", "interceptors"),
        ("in-a-callback-it-schedules", "channel"),
        ("in-a-callback-it-schedules", "interceptors"),
    ],
)
def test_a_call_from_a_handler_waits_in_the_handlers_name(
    rpc_agents: tuple[RpcAgent, RpcAgent], t_agent: RpcAgent, made: str, client: str
) -> None:
    """S's handler Relay calls T through an asyncio channel (instrumented, or with the client
    interceptors): the call waits in the name of Relay's task for C's call, not in the name of the
    server's asyncio task. A call made in a task the handler starts (and may never wait for: here
    it answers at once) waits in that task's own name, though the task inherits the handler's
    context; one made in a callback the handler schedules (in no task) waits in the thread's name.
    Through the client interceptors, which grpc.aio runs in a task of its own, the waiter is the
    task that awaits that task: none yet when the callback's call starts (ensure_future's task
    awaits it after), so it waits in the name of grpc's task, and never in the handler's."""
    s_agent, c_agent = rpc_agents
    started: list[asyncio.Task[bytes]] = []

    loop_thread = threading.current_thread().name  # the loop of run() runs in this thread

    async def body() -> None:
        async with AioService(t_agent) as t_service, aio_channel_to(t_service.address, s_agent, client, "T") as to_t:

            async def relay(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
                if made == "by-the-handler":
                    return await method(to_t, "unary_unary", SLOW)(request, timeout=TIMEOUT)

                async def background() -> bytes:
                    return await method(to_t, "unary_unary", SLOW)(request, timeout=TIMEOUT)

                def made_in_a_callback() -> None:  # made here, awaited in a task: it waits in its maker's name
                    started.append(asyncio.ensure_future(method(to_t, "unary_unary", SLOW)(request, timeout=TIMEOUT)))

                if made == "in-a-task-it-starts":
                    started.append(asyncio.create_task(background(), name="background"))
                else:
                    asyncio.get_running_loop().call_soon(made_in_a_callback)
                return b"started"

            relaying = {RELAY: grpc.unary_unary_rpc_method_handler(relay)}
            async with AioService(s_agent, relaying) as s_service, instrumented(c_agent, s_service.address) as to_s:
                reply = asyncio.ensure_future(method(to_s, "unary_unary", RELAY)(b"hold", timeout=TIMEOUT))
                await async_poll(t_service.held.is_set, "T's Slow held", TIMEOUT)
                (opened,) = s_agent.open_waits()
                if made == "by-the-handler":
                    assert opened.task == handler_task(RELAY, c_agent, 1)
                else:
                    assert await reply == b"started"  # the handler is done: nothing waits in its name
                    if made == "in-a-task-it-starts":
                        assert opened.task == "background"
                    elif client == "channel":
                        assert opened.task == loop_thread
                    else:
                        assert opened.task.startswith("Task-")  # grpc's task around the interceptors
                t_service.release.set()
                if made == "by-the-handler":
                    assert await reply == b"done:hold"
                else:
                    assert await started[0] == b"done:hold"
                assert s_agent.open_waits() == [] and outstanding(s_agent) == 0

    run(body(), TIMEOUT)
    assert t_agent._core.received_count("S") == s_agent._core.received_count("T") == 1


@pytest.mark.parametrize(
    "awaited", ["handed-to-a-task", "in-a-gather", "in-a-gather-failing-fast", "in-wait-for", "in-ensure-future"]
)
def test_a_handlers_call_awaited_by_another_task_waits_in_the_name_of_whoever_is_blocked(
    rpc_agents: tuple[RpcAgent, RpcAgent], t_agent: RpcAgent, awaited: str
) -> None:
    """A call S's handler makes through the instrumented channel but another task awaits: the
    handler is the waiter only while it is blocked on that task until it ends (the task of a
    gather with return_exceptions=True, wait_for or ensure_future around the call); a call handed
    to a task it does not wait for (here it answers at once), or gathered failing fast (another
    call failing would let the handler go on while this one runs), waits in that task's name, not
    the handler's, which could make a deadlock up."""
    s_agent, c_agent = rpc_agents
    handed: list[asyncio.Task[bytes]] = []
    handler = handler_task(RELAY, c_agent, 1)

    async def body() -> None:
        async with AioService(t_agent) as t_service, instrumented(s_agent, t_service.address, "T") as to_t:

            async def consume(call: Any) -> bytes:
                return await call

            async def relay(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
                call = method(to_t, "unary_unary", SLOW)(request, timeout=TIMEOUT)
                if awaited == "handed-to-a-task":
                    handed.append(asyncio.create_task(consume(call), name="consumer"))
                    return b"started"
                if awaited.startswith("in-a-gather"):
                    (response,) = await asyncio.gather(call, return_exceptions=awaited == "in-a-gather")
                    return response
                if awaited == "in-wait-for":
                    return await asyncio.wait_for(call, TIMEOUT)
                return await asyncio.ensure_future(call)

            relaying = {RELAY: grpc.unary_unary_rpc_method_handler(relay)}
            async with AioService(s_agent, relaying) as s_service, instrumented(c_agent, s_service.address) as to_s:
                reply = asyncio.ensure_future(method(to_s, "unary_unary", RELAY)(b"hold", timeout=TIMEOUT))
                await async_poll(t_service.held.is_set, "T's Slow held", TIMEOUT)
                if awaited == "handed-to-a-task":
                    assert await reply == b"started"  # the handler answered: it waits on nothing
                (opened,) = s_agent.open_waits()
                if awaited == "handed-to-a-task":
                    assert opened.task == "consumer"
                elif awaited == "in-a-gather-failing-fast":
                    assert opened.task.startswith("Task-")  # gather's task around the call
                else:
                    assert opened.task == handler
                t_service.release.set()
                assert await (handed[0] if handed else reply) == b"done:hold"
                assert s_agent.open_waits() == [] and outstanding(s_agent) == 0

    run(body(), TIMEOUT)


@pytest.mark.parametrize("made", ["by-the-handler", "in-a-task-it-schedules"])
def test_a_sync_handler_on_an_asyncio_server_waits_in_its_name_and_its_tasks_in_theirs(
    rpc_agents: tuple[RpcAgent, RpcAgent], t_agent: RpcAgent, made: str
) -> None:
    """The agent runs a sync handler of an asyncio server in a thread its task awaits: the handler's
    own calls there wait in its name. A task it schedules on the loop from that thread, and does not
    wait for (here it answers at once), inherits its context but waits in its own name."""
    s_agent, c_agent = rpc_agents
    scheduled: list[Any] = []

    async def body() -> None:
        loop = asyncio.get_running_loop()
        plain = None
        async with AioService(t_agent) as t_service, instrumented(s_agent, t_service.address, "T") as aio_to_t:
            plain = grpc.insecure_channel(t_service.address)
            to_t = s_agent.instrument_channel(plain, "T")

            async def background(request: bytes) -> bytes:
                asyncio.current_task().set_name("background")  # type: ignore[union-attr]
                return await method(aio_to_t, "unary_unary", SLOW)(request, timeout=TIMEOUT)

            def relay(request: bytes, context: Any) -> bytes:  # a sync handler
                if made == "by-the-handler":
                    return to_t.unary_unary(f"/{SERVICE}/{SLOW}")(request, timeout=TIMEOUT)
                scheduled.append(asyncio.run_coroutine_threadsafe(background(request), loop))
                return b"started"

            relaying = {RELAY: grpc.unary_unary_rpc_method_handler(relay)}
            try:
                async with AioService(s_agent, relaying) as s_service, instrumented(c_agent, s_service.address) as to_s:
                    reply = asyncio.ensure_future(method(to_s, "unary_unary", RELAY)(b"hold", timeout=TIMEOUT))
                    await async_poll(t_service.held.is_set, "T's Slow held", TIMEOUT)
                    if made == "in-a-task-it-schedules":
                        assert await reply == b"started"
                    (opened,) = s_agent.open_waits()
                    relay_task = handler_task(RELAY, c_agent, 1)
                    assert opened.task == (relay_task if made == "by-the-handler" else "background")
                    t_service.release.set()
                    if scheduled:
                        assert await asyncio.wrap_future(scheduled[0]) == b"done:hold"
                    else:
                        assert await reply == b"done:hold"
                    assert s_agent.open_waits() == [] and outstanding(s_agent) == 0
            finally:
                plain.close()

    run(body(), TIMEOUT)


@pytest.mark.parametrize("client", ["channel", "interceptor"])
def test_a_call_from_a_thread_an_asyncio_handler_runs_waits_in_the_threads_name(
    rpc_agents: tuple[RpcAgent, RpcAgent], t_agent: RpcAgent, client: str
) -> None:
    """``asyncio.to_thread`` copies the handler's context, its name with it, into the thread; but the
    handler need not wait for the thread (here it answers at once), so a sync call made there waits
    in the thread's own name, through the instrumented channel and the client interceptor alike."""
    s_agent, c_agent = rpc_agents
    threads: list[str] = []
    started: list[asyncio.Task[bytes]] = []

    async def body() -> None:
        async with AioService(t_agent) as t_service:
            plain = grpc.insecure_channel(t_service.address)
            if client == "channel":
                to_t = s_agent.instrument_channel(plain, "T")
            else:
                to_t = grpc.intercept_channel(plain, s_agent.client_interceptor("T"))

            def call_t(request: bytes) -> bytes:
                threads.append(threading.current_thread().name)
                return to_t.unary_unary(f"/{SERVICE}/{SLOW}")(request, timeout=TIMEOUT)

            async def relay(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
                started.append(asyncio.ensure_future(asyncio.to_thread(call_t, request)))
                return b"started"

            relaying = {RELAY: grpc.unary_unary_rpc_method_handler(relay)}
            try:
                async with AioService(s_agent, relaying) as s_service, instrumented(c_agent, s_service.address) as to_s:
                    assert await method(to_s, "unary_unary", RELAY)(b"hold", timeout=TIMEOUT) == b"started"
                    await async_poll(t_service.held.is_set, "T's Slow held", TIMEOUT)
                    (opened,) = s_agent.open_waits()
                    assert opened.task == threads[0] != handler_task(RELAY, c_agent, 1)
                    t_service.release.set()
                    assert await started[0] == b"done:hold"
                    assert s_agent.open_waits() == [] and outstanding(s_agent) == 0
            finally:
                plain.close()

    run(body(), TIMEOUT)


# -- ends nobody met --------------------------------------------------------------------------------


async def round_trip(channel: grpc.aio.Channel) -> None:
    """One more call answered: the loop has run everything grpc had for it until then."""
    assert await method(channel, "unary_unary", SLOW)(b"trip", timeout=TIMEOUT) == b"done:trip"


def test_a_call_kept_unawaited_stays_out_until_its_caller_meets_its_end(rpc_agents: tuple[RpcAgent, RpcAgent]) -> None:
    """Until its caller awaits it, a finished call's response is in flight to the caller, as the
    protocol counts it, and taken in at the ``await``. Nobody waits on it meanwhile: the task that
    made it went on (here it ended), and nothing blocks on the call until something awaits it."""
    s_agent, c_agent = rpc_agents

    async def body() -> None:
        async with AioService(s_agent) as service, instrumented(c_agent, service.address) as channel:
            calls: list[Any] = []

            async def caller() -> None:
                calls.append(held_call(channel, "unary_unary"))

            await asyncio.create_task(caller(), name="caller")
            (call,) = calls
            await async_poll(service.held.is_set, "the call held by its server", TIMEOUT)
            service.release.set()
            await async_poll(call.done, "the call ended", TIMEOUT)
            await round_trip(channel)
            assert c_agent.open_waits() == []
            assert c_agent._core.received_count("S") == 1  # the round trip's only
            assert await call == b"done:hold"
            assert outstanding(c_agent) == 0 and c_agent._core.received_count("S") == 2
            assert await call == b"done:hold"  # awaited again: the same response, taken in once
            assert c_agent._core.received_count("S") == 2

    run(body(), TIMEOUT)


@pytest.mark.parametrize("dropped", ["before-its-end", "after-its-end"])
@pytest.mark.parametrize("kind", list(HELD))
def test_a_call_its_caller_drops_has_its_end_taken_in_when_grpc_ends_it(
    rpc_agents: tuple[RpcAgent, RpcAgent], kind: str, dropped: str
) -> None:
    s_agent, c_agent = rpc_agents

    async def body() -> None:
        async with AioService(s_agent) as service, instrumented(c_agent, service.address) as channel:
            call = held_call(channel, kind)  # never awaited
            if kind == "unary_stream":
                # Read what was sent: grpc ends no call while a message of it waits to be read.
                assert await call.read() == b"0"
            await async_poll(service.held.is_set, "the call held by its server", TIMEOUT)
            assert outstanding(c_agent) == 1
            assert c_agent.open_waits() == []  # never awaited: nobody waits on it
            if dropped == "after-its-end":
                service.release.set()
                await async_poll(call.done, "the call ended", TIMEOUT)
                await round_trip(channel)
                if kind == "unary_stream":  # a response stream's end is taken in when grpc ends it
                    await async_poll(lambda: outstanding(c_agent) == 0, "the held stream's end taken in", TIMEOUT)
                else:
                    assert outstanding(c_agent) == 1  # in flight to its caller, who may still meet it
            del call
            service.release.set()
            await async_poll(lambda: outstanding(c_agent) == 0, "the dropped call's end taken in", TIMEOUT)
            assert c_agent.open_waits() == []

    run(body(), TIMEOUT)
    trips = 1 if dropped == "after-its-end" else 0
    assert c_agent._core.received_count("S") == 1 + trips  # its stamp, taken in
    assert c_agent._core.session("S") == 0  # an end like any other: the counts did not restart


# -- refused responses and failed calls -------------------------------------------------------------


def scripted(stamp: str | None, refuse: bool = False) -> dict[str, grpc.RpcMethodHandler]:
    """Handlers of a server without an agent whose trailing metadata carries ``stamp`` (if not None):
    ``Slow`` answers ``done``, ``Count`` answers ``0``, ``1``; with ``refuse`` both abort with
    FAILED_PRECONDITION instead."""
    trailing = ((STAMP_KEY, stamp),) if stamp is not None else ()

    async def slow(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if refuse:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "refused by the service", trailing)
        context.set_trailing_metadata(trailing)
        return b"done"

    async def count(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        yield b"0"
        yield b"1"
        if refuse:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "refused by the service", trailing)
        context.set_trailing_metadata(trailing)

    return {
        SLOW: grpc.unary_unary_rpc_method_handler(slow),
        COUNT: grpc.unary_stream_rpc_method_handler(count),
    }


async def read_all(call: Any, into: list[bytes]) -> None:
    """Read the response stream of ``call`` into ``into`` with ``read()`` to its end."""
    while (response := await call.read()) is not grpc.aio.EOF:
        into.append(response)


@pytest.mark.parametrize("stamp", ["not-a-stamp", "0.1.0.X"], ids=["garbage", "another-process"])
def test_a_bad_stamp_fails_a_unary_call_with_bad_stamp(rpc_agents: tuple[RpcAgent, RpcAgent], stamp: str) -> None:
    _, c_agent = rpc_agents

    async def body() -> None:
        async with AioService(None, scripted(stamp)) as service, instrumented(c_agent, service.address) as channel:
            call = method(channel, "unary_unary", SLOW)(b"", timeout=TIMEOUT)
            with pytest.raises(BadStamp) as refused:
                await call
            assert refused.value.code() == grpc.StatusCode.INTERNAL
            assert "/test.Svc/Slow from S has a bad stamp" in refused.value.details()
            # The call object reports what its caller met (the refusal), not the server's OK.
            assert await call.code() == grpc.StatusCode.INTERNAL
            assert await call.details() == refused.value.details()
            assert outstanding(c_agent) == 0 and c_agent.open_waits() == []
            with pytest.raises(BadStamp):  # awaited again: still refused, counted once
                await call

            # Dropped: its end is taken in when grpc ends it, refused with nobody to tell.
            method(channel, "unary_unary", SLOW)(b"", timeout=TIMEOUT)
            await async_poll(lambda: outstanding(c_agent) == 0, "the dropped call's end taken in", TIMEOUT)

    run(body(), TIMEOUT)
    assert sample(c_agent, "bad_stamps", side="client") == 2
    assert c_agent._core.session("S") == 2  # each bad stamp restarted the pair's counts
    assert c_agent._core.received_count("S") == 0


@pytest.mark.parametrize("stamp", ["not-a-stamp", "0.1.0.X"], ids=["garbage", "another-process"])
@pytest.mark.parametrize("how", ["read", "async-for"])
def test_a_bad_stamp_fails_a_response_stream_at_its_end(
    rpc_agents: tuple[RpcAgent, RpcAgent], stamp: str, how: str
) -> None:
    _, c_agent = rpc_agents

    async def body() -> None:
        async with AioService(None, scripted(stamp)) as service, instrumented(c_agent, service.address) as channel:
            call = method(channel, "unary_stream", COUNT)(b"", timeout=TIMEOUT)
            responses: list[bytes] = []
            with pytest.raises(BadStamp) as refused:
                if how == "read":
                    await read_all(call, responses)
                else:
                    async for response in call:
                        responses.append(response)
            assert responses == [b"0", b"1"]  # the messages came through; the end is refused
            assert refused.value.code() == grpc.StatusCode.INTERNAL
            assert (await call.code(), await call.details()) == (grpc.StatusCode.INTERNAL, refused.value.details())
            assert outstanding(c_agent) == 0

    run(body(), TIMEOUT)
    assert sample(c_agent, "bad_stamps", side="client") == 1
    assert c_agent._core.session("S") == 1


@pytest.mark.parametrize("stamp", [GOOD, None], ids=["stamped", "unstamped"])
@pytest.mark.parametrize("kind", ["unary_unary", "unary_stream"])
def test_a_server_error_is_raised_and_restarts_the_counts_only_without_the_servers_stamp(
    rpc_agents: tuple[RpcAgent, RpcAgent], stamp: str | None, kind: str
) -> None:
    _, c_agent = rpc_agents

    async def body() -> None:
        async with (
            AioService(None, scripted(stamp, refuse=True)) as service,
            instrumented(c_agent, service.address) as channel,
        ):
            name = SLOW if kind == "unary_unary" else COUNT
            call = method(channel, kind, name)(b"", timeout=TIMEOUT)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                if kind == "unary_unary":
                    await call
                else:
                    await read_all(call, [])
            assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert failed.value.details() == "refused by the service"
            assert not isinstance(failed.value, BadStamp)
            assert await call.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert outstanding(c_agent) == 0

    run(body(), TIMEOUT)
    # The server's stamp says the request arrived and the refusal is its response: the counts stay
    # comparable. Without it, nobody knows what arrived: the pair's counts restart.
    assert c_agent._core.session("S") == (0 if stamp else 1)
    assert c_agent._core.received_count("S") == (1 if stamp else 0)
    assert sample(c_agent, "bad_stamps", side="client") == 0


# -- cancellations and breaks -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(HELD))
def test_a_cancelled_caller_gets_its_cancellation_and_the_wait_ends(
    rpc_agents: tuple[RpcAgent, RpcAgent], kind: str
) -> None:
    s_agent, c_agent = rpc_agents

    async def body() -> None:
        async with AioService(s_agent) as service, instrumented(c_agent, service.address) as channel:
            calls: list[Any] = []

            async def caller() -> Any:
                calls.append(held_call(channel, kind))
                if kind == "unary_stream":
                    return [response async for response in calls[0]]
                return await calls[0]

            task = asyncio.create_task(caller(), name="caller")
            await async_poll(service.held.is_set, "the call held by its server", TIMEOUT)
            assert [wait.task for wait in c_agent.open_waits()] == ([] if kind == "unary_stream" else ["caller"])
            task.cancel()
            with pytest.raises(asyncio.CancelledError):  # not DeadlockBroken: nothing was broken
                await task
            (call,) = calls
            await async_poll(lambda: outstanding(c_agent) == 0, "the cancelled call's end taken in", TIMEOUT)
            assert c_agent.open_waits() == []
            assert call.cancelled() and await call.code() == grpc.StatusCode.CANCELLED
            # Nobody knows whether the response was on its way: the pair's counts restart.
            assert c_agent._core.session("S") == 1
            assert sample(c_agent, "breaks", kind="call") == 0

    run(body(), TIMEOUT)


def test_a_reader_cancelled_as_its_request_is_sent_cancels_the_call(rpc_agents: tuple[RpcAgent, RpcAgent]) -> None:
    """grpc.aio cancels a response-stream call when its reader is cancelled, but not when the reader
    is cancelled after the request was sent and before it woke up to that: the call would go on
    unread, and its end never be taken in while its caller keeps it. The instrumented call cancels it
    then too. (The moment is made with grpc's private task that sends the request: a callback added
    to it before the reader awaits it runs first, and cancels the reader there.)"""
    s_agent, c_agent = rpc_agents

    async def body() -> None:
        async with AioService(s_agent) as service, instrumented(c_agent, service.address) as channel:
            call = held_call(channel, "unary_stream")
            reader = asyncio.ensure_future(call.read())
            call._grpc_call._preparation.add_done_callback(lambda _: reader.cancel())
            with pytest.raises(asyncio.CancelledError):
                await reader
            assert call.cancelled()
            await async_poll(lambda: outstanding(c_agent) == 0, "the cancelled call's end taken in", TIMEOUT)
            assert c_agent._core.session("S") == 1  # nobody knows what was on its way: counts restart

    run(body(), TIMEOUT)


@pytest.mark.parametrize("awaited", ["awaited", "in-a-gather"])
@pytest.mark.parametrize("kind", WAITING)
def test_a_broken_call_raises_deadlock_broken_and_reports_aborted(
    rpc_agents: tuple[RpcAgent, RpcAgent], kind: str, awaited: str
) -> None:
    s_agent, c_agent = rpc_agents

    async def body() -> None:
        async with AioService(s_agent) as service, instrumented(c_agent, service.address) as channel:
            calls: list[Any] = []

            async def caller() -> Any:
                calls.append(held_call(channel, kind))
                if awaited == "awaited":
                    return await calls[0]
                return await asyncio.gather(calls[0])  # awaited by gather's own task, for the caller

            task = asyncio.create_task(caller(), name="caller")
            wait = await recorded_wait(c_agent)
            assert wait.task == "caller" and wait.instance > 0  # breakable, in its caller's name
            # As the control stream would: from the agent's own thread, not the caller's loop.
            report = await asyncio.to_thread(c_agent.breaks.handle, order(wait))
            assert report.outcome == BREAK_OUTCOME_BROKEN
            (call,) = calls
            with pytest.raises(DeadlockBroken) as raised:
                await task
            assert raised.value.code() == grpc.StatusCode.ABORTED and CYCLE in raised.value.details()
            assert raised.value.instance == wait.instance
            assert await call.code() == grpc.StatusCode.ABORTED
            assert CYCLE in await call.details()
            with pytest.raises(DeadlockBroken):  # where grpc raises a failed call's end, as its await does
                await call.wait_for_connection()
            assert (call.done(), call.cancelled()) == (True, False)  # broken, not cancelled by its caller
            assert outstanding(c_agent) == 0 and c_agent.open_waits() == []
            assert sample(c_agent, "peer_resets") == 1
            again = await asyncio.to_thread(c_agent.breaks.handle, order(wait, 2))
            assert again.outcome == BREAK_OUTCOME_ALREADY_BROKEN
            service.release.set()
            assert await method(channel, "unary_unary", SLOW)(b"after", timeout=TIMEOUT) == b"done:after"

    run(body(), TIMEOUT)
    assert sample(c_agent, "breaks", kind="call") == 1


def test_a_break_that_comes_after_the_call_ended_is_not_reported_as_done(
    rpc_agents: tuple[RpcAgent, RpcAgent],
) -> None:
    """A break for a call whose end came first (a deadline, on a stale proof) cancels nothing: it
    must not be reported broken, with its caller told ABORTED, while the caller gets the call's
    own end. Here the response came and waits for its caller, who gets it."""
    s_agent, c_agent = rpc_agents

    async def body() -> None:
        async with AioService(s_agent) as service, instrumented(c_agent, service.address) as channel:
            call = held_call(channel, "unary_unary")
            c_agent.awaited(call._call)  # as an await does when it begins (the caller's await resumes later)
            await async_poll(service.held.is_set, "the call held by its server", TIMEOUT)
            (opened,) = c_agent.open_waits()
            service.release.set()
            await async_poll(call.done, "the call ended", TIMEOUT)
            stale = BreakWait(break_id=1, snapshot_id=42, instance=opened.instance, task=opened.task, deadlock=CYCLE)
            report = await asyncio.to_thread(c_agent.breaks.handle, stale)
            assert report.outcome == BREAK_OUTCOME_GONE
            assert await call == b"done:hold"  # what the report says: nothing was broken
            assert (await call.code(), call.cancelled()) == (grpc.StatusCode.OK, False)
            assert outstanding(c_agent) == 0

    run(body(), TIMEOUT)
    assert sample(c_agent, "breaks", kind="call") == 0
    assert c_agent._core.session("S") == 0


def test_concurrent_callers_wait_each_in_its_own_name(rpc_agents: tuple[RpcAgent, RpcAgent]) -> None:
    """Two callers, each with a call out at once, wait each in its own name: its task's, or the
    handler's call name in CURRENT_TASK when that is set (as the server interceptor sets it)."""
    s_agent, c_agent = rpc_agents

    async def body() -> None:
        async with AioService(s_agent) as service, instrumented(c_agent, service.address) as channel:

            async def caller(named: str | None) -> bytes:
                if named is not None:
                    CURRENT_TASK.set(named)
                return await held_call(channel, "unary_unary")

            replies = [
                asyncio.create_task(caller(None), name="first"),
                asyncio.create_task(caller("/outer/Handler#X:7"), name="second"),
            ]
            await async_poll(lambda: len(c_agent.open_waits()) == 2, "both calls out", TIMEOUT)
            assert sorted(wait.task for wait in c_agent.open_waits()) == ["/outer/Handler#X:7", "first"]
            service.release.set()
            assert await asyncio.gather(*replies) == [b"done:hold"] * 2
            assert c_agent.open_waits() == []

    run(body(), TIMEOUT)


#: Without BDP probing, a stream's flow-control window stays 64 KiB: a write of a larger message
#: to a handler that reads nothing never completes.
NO_WINDOW_GROWTH = (("grpc.http2.bdp_probe", 0),)


@pytest.mark.parametrize("when", ["while-writing", "before-a-write"])
def test_a_broken_stream_unary_call_fails_its_writer_with_deadlock_broken(
    rpc_agents: tuple[RpcAgent, RpcAgent], when: str
) -> None:
    """A stream-unary call waits while its caller writes the request stream, and while it awaits
    the call: a break while its caller writes (or while another task awaits the call, before the
    caller writes again) fails the write with DeadlockBroken, and the caller's task is not left
    cancelled by a cancellation nobody asked for."""
    s_agent, c_agent = rpc_agents
    held, release = asyncio.Event(), asyncio.Event()

    async def unread(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        held.set()
        await release.wait()  # reads nothing until then
        return b"+".join([request async for request in requests])

    async def body() -> None:
        handlers = {TOTAL: grpc.stream_unary_rpc_method_handler(unread)}
        async with (
            AioService(s_agent, handlers, NO_WINDOW_GROWTH) as service,
            instrumented(c_agent, service.address, options=NO_WINDOW_GROWTH) as channel,
        ):
            call = method(channel, "stream_unary", TOTAL)(timeout=TIMEOUT)
            await call.write(b"a")
            await async_poll(held.is_set, "the handler holding", TIMEOUT)
            writing, broken, written = asyncio.Event(), asyncio.Event(), []

            async def writer() -> None:
                if when == "before-a-write":
                    await broken.wait()
                writing.set()
                await call.write(b"x" * 1_000_000)  # before the break: stopped by flow control
                written.append(True)

            task = asyncio.create_task(writer(), name="caller")
            awaiting = None
            if when == "while-writing":
                await async_poll(writing.is_set, "the writer in its write", TIMEOUT)
            else:  # between writes the writer waits on nobody: an await of the call holds the wait
                awaiting = asyncio.create_task(asyncio.wait_for(call, TIMEOUT), name="awaiter")
            wait = await recorded_wait(c_agent)
            assert (await asyncio.to_thread(c_agent.breaks.handle, order(wait))).outcome == BREAK_OUTCOME_BROKEN
            await async_poll(call.done, "the broken call ended", TIMEOUT)
            broken.set()
            with pytest.raises(DeadlockBroken):
                await task
            assert not task.cancelled() and written == []
            with pytest.raises(DeadlockBroken):
                await call
            if awaiting is not None:
                with pytest.raises(DeadlockBroken):
                    await awaiting
            assert outstanding(c_agent) == 0
            # grpc reports a call cancelled during a write as INTERNAL; the break is what happened.
            assert (await call.code(), call.cancelled()) == (grpc.StatusCode.ABORTED, False)
            release.set()

    run(body(), TIMEOUT)
