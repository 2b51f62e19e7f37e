"""The interceptors' less travelled paths, on real gRPC servers on 127.0.0.1 (ports the system picks).

* An asyncio server runs a sync handler as grpc.aio runs one without stablewatch: with a sync
  servicer context (``abort`` ends the call, ``send_initial_metadata`` sends, ``add_callback``
  registers), a request stream as a sync iterator, a response stream taken from its generator. The
  call is answered once, with the server's stamp, and the handler runs in the call's name.
* An asyncio handler's ``abort_with_status`` carries the response's stamp, as its ``abort`` does:
  the refusal is a response like any other, and the caller's counts need no restart.
* The sync client interceptor's calls report a refused response as the refusal, in ``code()`` and
  ``details()`` too, not as the status the server sent.
* The asyncio client interceptors take in the end of a response stream its caller never reads, when
  grpc ends the call (else the call would stay out for good, and the caller's counts with the
  server lag the server's); a refused end still reaches a reader.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent import futures
from typing import Any, NamedTuple

import grpc
import pytest
from rpc_harness import SERVICE, AioServer, Service, aio_channel_to, handler_prefix, outstanding, sample

from polling import async_poll, run
from stablewatch.agents.rpc import BadStamp, RpcAgent
from stablewatch.agents.rpc.calls import IncomingCall
from stablewatch.agents.rpc.core import STAMP_KEY
from stablewatch.agents.rpc.interceptors import CURRENT_TASK, _as_handler, _runs_here, current_task_name

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 10.0  # each call, and each asyncio scenario, on a slow shared machine; each takes well under a second
REFUSAL = (grpc.StatusCode.NOT_FOUND, "nothing here")


def stamps(metadata: Any) -> list[str]:
    """The processes whose stamps are among ``metadata``, in order."""
    return [value.rpartition(".")[2] for key, value in metadata or () if key == STAMP_KEY]


class Status(NamedTuple):
    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, str], ...]


def answered_once_each(s_agent: RpcAgent, c_agent: RpcAgent, calls: int) -> None:
    """Every call taken in and answered once, with S's stamp; no count restarted, nothing left out."""
    assert s_agent._core.received_count("C") == s_agent._core.sent_count("C") == calls
    assert c_agent._core.sent_count("S") == c_agent._core.received_count("S") == calls
    assert c_agent._core.session("S") == 0 and sample(c_agent, "peer_resets") == 0
    assert outstanding(c_agent) == 0


# -- sync handlers on an asyncio server ------------------------------------------------------------


def name() -> bytes:
    """The name the running handler's own calls wait in ("none" without a handler's name)."""
    return current_task_name().encode() if CURRENT_TASK.get() else b"none"


def sync_handlers(callbacks: list[str]) -> dict[str, grpc.RpcMethodHandler]:
    """One sync handler of each kind, and two that refuse their call."""

    def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
        context.send_initial_metadata((("x-early", "yes"),))
        context.add_callback(lambda: callbacks.append("unary done"))
        return name()

    def count(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield name()
        yield from (str(i).encode() for i in range(int(request)))

    def total(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        return b"+".join([name(), *requests])

    def echo(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        yield name()
        for request in requests:
            yield request.upper()

    def refuse(request: bytes, context: grpc.ServicerContext) -> bytes:
        context.abort(*REFUSAL)
        raise AssertionError("abort() returned")

    def refuse_streaming(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield b"first"
        context.abort(*REFUSAL)
        raise AssertionError("abort() returned")

    return {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Count": grpc.unary_stream_rpc_method_handler(count),
        "Total": grpc.stream_unary_rpc_method_handler(total),
        "Echo": grpc.stream_stream_rpc_method_handler(echo),
        "Refuse": grpc.unary_unary_rpc_method_handler(refuse),
        "RefuseStreaming": grpc.unary_stream_rpc_method_handler(refuse_streaming),
    }


def served_sync(
    s_agent: RpcAgent, c_agent: RpcAgent, setup: str, scenario: Callable[[grpc.aio.Channel], Awaitable[None]]
) -> list[str]:
    """Run ``scenario`` against an asyncio server of ``sync_handlers``, its client set up the ``setup``
    way; returns the callbacks the handlers' contexts ran."""
    callbacks: list[str] = []

    async def body() -> None:
        async with (
            AioServer(s_agent, sync_handlers(callbacks)) as server,
            aio_channel_to(server.address, c_agent, setup) as channel,
        ):
            await scenario(channel)

    run(body(), 3 * TIMEOUT)
    return callbacks


SETUP = pytest.mark.parametrize("setup", ["interceptors", "channel"])


@SETUP
def test_a_sync_unary_handler_on_an_asyncio_server_has_a_sync_context(
    rpc_agents: tuple[RpcAgent, RpcAgent], setup: str
) -> None:
    s_agent, c_agent = rpc_agents

    async def scenario(channel: grpc.aio.Channel) -> None:
        unary = channel.unary_unary(f"/{SERVICE}/Unary")(b"", timeout=TIMEOUT)
        assert (await unary).startswith(handler_prefix("Unary", c_agent).encode())  # it ran in the call's name
        if setup == "channel":  # (grpc.aio's client interceptors hide a unary call's metadata)
            assert ("x-early", "yes") in tuple(await unary.initial_metadata())

    assert served_sync(s_agent, c_agent, setup, scenario) == ["unary done"]
    answered_once_each(s_agent, c_agent, 1)


@SETUP
def test_a_sync_handlers_abort_on_an_asyncio_server_refuses_its_call_with_the_servers_stamp(
    rpc_agents: tuple[RpcAgent, RpcAgent], setup: str
) -> None:
    s_agent, c_agent = rpc_agents

    async def scenario(channel: grpc.aio.Channel) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await channel.unary_unary(f"/{SERVICE}/Refuse")(b"", timeout=TIMEOUT)
        assert (refused.value.code(), refused.value.details()) == REFUSAL
        assert stamps(refused.value.trailing_metadata()) == ["S"]
        streaming = channel.unary_stream(f"/{SERVICE}/RefuseStreaming")(b"", timeout=TIMEOUT)
        responses: list[bytes] = []
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for response in streaming:
                responses.append(response)
        assert responses == [b"first"]
        assert (refused.value.code(), refused.value.details()) == REFUSAL
        assert stamps(refused.value.trailing_metadata()) == ["S"]

    served_sync(s_agent, c_agent, setup, scenario)
    answered_once_each(s_agent, c_agent, 2)


@SETUP
def test_a_sync_response_stream_on_an_asyncio_server_is_sent(rpc_agents: tuple[RpcAgent, RpcAgent], setup: str) -> None:
    s_agent, c_agent = rpc_agents

    async def scenario(channel: grpc.aio.Channel) -> None:
        count = channel.unary_stream(f"/{SERVICE}/Count")(b"3", timeout=TIMEOUT)
        responses = [response async for response in count]
        assert responses[1:] == [b"0", b"1", b"2"]
        assert responses[0].startswith(handler_prefix("Count", c_agent).encode())

    served_sync(s_agent, c_agent, setup, scenario)
    answered_once_each(s_agent, c_agent, 1)


@SETUP
def test_a_sync_handler_on_an_asyncio_server_reads_its_request_stream_as_an_iterator(
    rpc_agents: tuple[RpcAgent, RpcAgent], setup: str
) -> None:
    s_agent, c_agent = rpc_agents

    async def scenario(channel: grpc.aio.Channel) -> None:
        total = await channel.stream_unary(f"/{SERVICE}/Total")(iter([b"a", b"b"]), timeout=TIMEOUT)
        assert total.startswith(handler_prefix("Total", c_agent).encode()) and total.endswith(b"+a+b")
        echo = channel.stream_stream(f"/{SERVICE}/Echo")(iter([b"x", b"y"]), timeout=TIMEOUT)
        responses = [response async for response in echo]
        assert responses[1:] == [b"X", b"Y"] and responses[0].startswith(handler_prefix("Echo", c_agent).encode())

    served_sync(s_agent, c_agent, setup, scenario)
    answered_once_each(s_agent, c_agent, 2)


def test_a_sync_response_stream_on_an_asyncio_server_is_taken_in_threads_in_the_calls_name(
    rpc_agents: tuple[RpcAgent, RpcAgent],
) -> None:
    """A sync response stream on an asyncio server is produced step by step in threads: every step
    runs in the call's name, so a call the handler makes between two responses waits in it."""
    s_agent, c_agent = rpc_agents
    seen: list[tuple[str, bool]] = []

    def names(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        for _ in range(3):
            seen.append((current_task_name(), threading.current_thread() is threading.main_thread()))
            yield b"."

    async def body() -> None:
        handlers = {"Names": grpc.unary_stream_rpc_method_handler(names)}
        async with AioServer(s_agent, handlers) as server, aio_channel_to(server.address, c_agent, "channel") as to_s:
            assert [r async for r in to_s.unary_stream(f"/{SERVICE}/Names")(b"", timeout=TIMEOUT)] == [b"."] * 3

    run(body(), TIMEOUT)
    assert len({task for task, _ in seen}) == 1 and seen[0][0].startswith(handler_prefix("Names", c_agent))
    assert not any(on_main for _, on_main in seen)  # never on the event loop's thread
    answered_once_each(s_agent, c_agent, 1)


def test_without_stablewatch_the_sync_handlers_behave_the_same() -> None:
    """The reference: grpc.aio's own treatment of the same sync handlers, with no agent anywhere."""
    callbacks: list[str] = []

    async def body() -> None:
        async with (
            AioServer(None, sync_handlers(callbacks)) as server,
            grpc.aio.insecure_channel(server.address) as channel,
        ):
            method = f"/{SERVICE}/"
            assert await channel.unary_unary(method + "Unary")(b"", timeout=TIMEOUT) == b"none"
            count = channel.unary_stream(method + "Count")(b"2", timeout=TIMEOUT)
            assert [response async for response in count] == [b"none", b"0", b"1"]
            total = channel.stream_unary(method + "Total")(iter([b"a"]), timeout=TIMEOUT)
            assert await total == b"none+a"
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await channel.unary_unary(method + "Refuse")(b"", timeout=TIMEOUT)
            assert (refused.value.code(), refused.value.details()) == REFUSAL
        assert callbacks == ["unary done"]

    run(body(), TIMEOUT)


# -- abort_with_status on an asyncio server --------------------------------------------------------


@pytest.mark.parametrize("trailing", [(), (("x-why", "policy"),)], ids=["bare", "with-trailing-metadata"])
def test_an_asyncio_handlers_abort_with_status_carries_the_servers_stamp(
    rpc_agents: tuple[RpcAgent, RpcAgent], trailing: tuple[tuple[str, str], ...]
) -> None:
    s_agent, c_agent = rpc_agents

    async def refuse(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await context.abort_with_status(Status(*REFUSAL, trailing))
        raise AssertionError("abort_with_status() returned")

    async def body() -> None:
        handlers = {"Refuse": grpc.unary_unary_rpc_method_handler(refuse)}
        async with AioServer(s_agent, handlers) as server, aio_channel_to(server.address, c_agent, "channel") as to_s:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await to_s.unary_unary(f"/{SERVICE}/Refuse")(b"", timeout=TIMEOUT)
            assert (refused.value.code(), refused.value.details()) == REFUSAL
            received = tuple(refused.value.trailing_metadata())
            assert stamps(received) == ["S"] and all(entry in received for entry in trailing)

    run(body(), TIMEOUT)
    answered_once_each(s_agent, c_agent, 1)


# -- the sync client interceptor: a refused response is what code() and details() report -------------


@pytest.fixture
def bad_stamps() -> Iterator[str]:
    """The address of a sync server without an agent whose responses carry a malformed stamp: every
    response is refused (``Answer``, unary; ``Count``, a response stream)."""

    def answer(request: bytes, context: grpc.ServicerContext) -> bytes:
        context.set_trailing_metadata(((STAMP_KEY, "not-a-stamp"),))
        return b"answer"

    def count(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        context.set_trailing_metadata(((STAMP_KEY, "not-a-stamp"),))
        yield b"0"
        yield b"1"

    pool = futures.ThreadPoolExecutor(2)
    server = grpc.server(pool)
    handlers = {
        "Answer": grpc.unary_unary_rpc_method_handler(answer),
        "Count": grpc.unary_stream_rpc_method_handler(count),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=0).wait(TIMEOUT)
        pool.shutdown(wait=True)


@pytest.mark.parametrize("asked_first", ["result", "code"])
def test_a_sync_interceptor_future_reports_its_refused_response_in_code_and_details(
    bad_stamps: str, asked_first: str
) -> None:
    c_agent = RpcAgent("C")
    channel = grpc.intercept_channel(grpc.insecure_channel(bad_stamps), c_agent.client_interceptor("S"))
    try:
        future = channel.unary_unary(f"/{SERVICE}/Answer").future(b"", timeout=TIMEOUT)
        if asked_first == "code":  # before the caller met the end: it is taken in now
            assert future.code() is grpc.StatusCode.INTERNAL
        with pytest.raises(BadStamp) as refused:
            future.result()
        assert future.code() is grpc.StatusCode.INTERNAL
        assert future.details() == refused.value.details() and "bad stamp" in future.details()
        assert future.exception() is refused.value

        stream = channel.unary_stream(f"/{SERVICE}/Count")(b"", timeout=TIMEOUT)
        with pytest.raises(BadStamp) as refused:
            assert list(stream) == [b"0", b"1"]
        assert stream.code() is grpc.StatusCode.INTERNAL
        assert stream.details() == refused.value.details()
    finally:
        channel.close()
    assert outstanding(c_agent) == 0


class Finished:
    """A unary call grpc has finished already when the continuation returns it: OK, with a bad stamp."""

    def done(self) -> bool:
        return True

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((STAMP_KEY, "not-a-stamp"),)

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.OK

    def details(self) -> str:
        return ""

    def result(self, timeout: float | None = None) -> bytes:
        return b"answer"


class Details(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


def test_a_call_refused_as_it_is_handed_over_reports_the_refusal_in_code_and_details() -> None:
    """A call that has ended when the continuation returns (grpc's blocking calls, or a future done at
    once) is taken in there; refused, what the caller gets is the refusal throughout."""
    c_agent = RpcAgent("C")
    interceptor = c_agent.client_interceptor("S")
    details = Details(f"/{SERVICE}/Answer", None, None, None, None, None)
    outcome = interceptor.intercept_unary_unary(lambda details, request: Finished(), details, b"")
    with pytest.raises(BadStamp) as refused:
        outcome.result()
    assert outcome.exception() is refused.value
    assert outcome.code() is grpc.StatusCode.INTERNAL and outcome.details() == refused.value.details()
    assert outstanding(c_agent) == 0


# -- the asyncio client interceptors: a response stream nobody reads ------------------------------


@pytest.mark.parametrize("ending", ["cancelled", "past its deadline"])
def test_the_asyncio_interceptors_take_in_the_end_of_a_response_stream_its_caller_never_reads(
    rpc_agents: tuple[RpcAgent, RpcAgent], ending: str
) -> None:
    """S answered (its response counted and stamped), and C's caller never reads the stream: the call
    ends when its caller cancels it or its deadline passes, and its end is taken in then, so that C
    no longer has it out, and C's counts with S agree with S's (else C would wait for that response
    in every snapshot to come).

    Cancelled, the call ends without S's stamp: C cannot know whether S's response arrived, and the
    pair's counts restart. Past its deadline, grpc ends it with the trailing metadata that arrived,
    S's stamp among them: S's response is taken in."""
    s_agent, c_agent = rpc_agents

    async def count(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        yield b"0"
        yield b"1"

    async def body() -> None:
        handlers = {"Count": grpc.unary_stream_rpc_method_handler(count)}
        async with (
            AioServer(s_agent, handlers) as server,
            aio_channel_to(server.address, c_agent, "interceptors") as to_s,
        ):
            timeout = 0.5 if ending == "past its deadline" else TIMEOUT
            unread = to_s.unary_stream(f"/{SERVICE}/Count")(b"", timeout=timeout)
            await async_poll(lambda: s_agent._core.sent_count("C") == 1, "S answered", TIMEOUT)
            if ending == "cancelled":
                assert unread.cancel()
            await async_poll(lambda: outstanding(c_agent) == 0, "the unread stream's end taken in", TIMEOUT)

    run(body(), 2 * TIMEOUT)
    if ending == "cancelled":
        assert c_agent._core.session("S") == 1 and sample(c_agent, "peer_resets") == 1
    else:
        answered_once_each(s_agent, c_agent, 1)


def test_a_streams_refused_end_reaches_its_reader_whichever_takes_it_in_first(bad_stamps: str) -> None:
    """The end of a response stream is taken in by whichever comes first, the reader or grpc's end
    of the call; a refused response is raised to the reader either way, once taken in."""
    c_agent = RpcAgent("C")

    async def body() -> None:
        async with aio_channel_to(bad_stamps, c_agent, "interceptors") as channel:
            for _ in range(3):
                stream = channel.unary_stream(f"/{SERVICE}/Count")(b"", timeout=TIMEOUT)
                responses: list[bytes] = []
                with pytest.raises(BadStamp):
                    async for response in stream:
                        responses.append(response)
                assert responses == [b"0", b"1"]

    run(body(), TIMEOUT)
    assert sample(c_agent, "bad_stamps", side="client") == 3 and outstanding(c_agent) == 0


@pytest.mark.parametrize("cancelled", [False, True])
def test_a_sync_handlers_thread_hands_its_call_back_only_to_a_task_still_running(cancelled: bool) -> None:
    """A sync handler on an asyncio server runs in a thread that owns its call meanwhile
    (``_as_handler``); then the call is its task's again, unless that task ended meanwhile (a
    cancelled call, whose handler's task ends while the thread still runs): an ended task handed
    back would be kept alive, with its context, in a cycle only the garbage collector frees."""
    call = IncomingCall(f"/{SERVICE}/Hold#C:1", "C", True)
    handlers_task = object()
    call.own_task = handlers_task

    def handler() -> None:
        assert call.own_task is threading.current_thread()
        if cancelled:
            call.own_task = None  # as the handler's task does as it ends (_unary_aio)

    _as_handler(call, handler)
    assert call.own_task is (None if cancelled else handlers_task)


def test_a_non_blocking_sync_response_stream_is_refused_with_a_clear_error(caplog: pytest.LogCaptureFixture) -> None:
    """grpc's ``experimental_non_blocking`` response streams send their responses from other threads
    after the handler returns, where RPC mode cannot stamp them: the server interceptor says so for
    each call, rather than failing inside the handler with an argument missing. grpc ignores the
    flag on a unary response, and so does the agent."""
    agent = RpcAgent("S", expire_interval=0.05, hint_after=None).start()
    sent: list[bytes] = []

    def answer(request: bytes, context: Any, send_response_callback: Callable[[Any], None]) -> None:
        sent.append(request)
        send_response_callback(request)
        send_response_callback(None)

    def echo(request: bytes, context: Any) -> bytes:
        return request

    answer.experimental_non_blocking = True  # type: ignore[attr-defined]
    echo.experimental_non_blocking = True  # type: ignore[attr-defined]
    methods = {"Stream": grpc.unary_stream_rpc_method_handler(answer), "Echo": echo}
    service = Service(methods, agent, workers=2)
    try:
        with grpc.insecure_channel(service.address) as channel:
            with pytest.raises(grpc.RpcError) as failed:
                list(channel.unary_stream(f"/{SERVICE}/Stream")(b"x", timeout=10))
            assert channel.unary_unary(f"/{SERVICE}/Echo")(b"y", timeout=10) == b"y"
        assert failed.value.code() == grpc.StatusCode.UNKNOWN
        assert sent == []
        assert f"the handler of /{SERVICE}/Stream is experimental_non_blocking" in caplog.text
    finally:
        service.stop()
        agent.stop()


def test_an_asyncio_call_of_a_loop_a_sync_handler_runs_on_an_asyncio_server_waits_in_its_name(
    rpc_agents: tuple[RpcAgent, RpcAgent],
) -> None:
    """A sync handler on an asyncio server runs in a thread of its own (the agent's), and may run an
    event loop there (``asyncio.run``): an asyncio call the loop's main task awaits waits in the
    handler's name, as on a sync server."""
    s_agent, t_agent = rpc_agents  # T is the second agent here
    release, held = threading.Event(), threading.Event()

    def slow(request: bytes, context: Any) -> bytes:
        held.set()
        release.wait(TIMEOUT)
        return b"done:" + request

    t_service = Service({"Slow": slow}, t_agent)

    def relay(request: bytes, context: Any) -> bytes:
        async def main() -> bytes:
            async with aio_channel_to(t_service.address, s_agent, "channel", "C") as to_t:
                return await to_t.unary_unary(f"/{SERVICE}/Slow")(request, timeout=TIMEOUT)

        return asyncio.run(main())

    async def body() -> None:
        handlers = {"Relay": grpc.unary_unary_rpc_method_handler(relay)}
        async with AioServer(s_agent, handlers) as server, grpc.aio.insecure_channel(server.address) as to_s:
            answer = asyncio.ensure_future(to_s.unary_unary(f"/{SERVICE}/Relay")(b"hold", timeout=TIMEOUT))
            await async_poll(held.is_set, "T holding the relayed call", TIMEOUT)
            waits = await async_poll(s_agent.open_waits, "S's wait", TIMEOUT)
            assert [wait.task for wait in waits] == [f"/{SERVICE}/Relay#grpc://127.0.0.1:1"]
            release.set()
            assert await answer == b"done:hold"

    try:
        run(body(), 2 * TIMEOUT)
    finally:
        release.set()
        t_service.stop()


def test_a_loop_read_as_running_with_no_stop_pending_was_so_at_one_moment() -> None:
    """Whether a sync handler's loop runs with no stop pending is read from asyncio's attributes,
    one at a time, from another thread: a run that ends between the reads (it clears the stop, then
    the thread) must not read as a run with its stop cleared."""
    thread = threading.get_ident()

    class EndingWhileRead:
        _thread_id: int | None = thread

        @property
        def _stopping(self) -> bool:
            self._thread_id = None  # the run ends as the stop is read: stop cleared, then the thread
            return False

    class Running:
        _thread_id, _stopping = thread, False

    assert not _runs_here(EndingWhileRead(), thread)
    assert _runs_here(Running(), thread)
