"""The sync client side of RPC mode at its edges: the instrumented channel (and the client
interceptor its futures and streams go through) ends every call's wait exactly once, whatever
interrupts the call, and its call objects behave as grpc's own; the agent's worker pool keeps its
picture true when a server stops, and a break that loses a race to a worker or to the call's end
is reported gone, never broken.

The servers here have no agent unless a test needs one: what their calls answer is scripted.
Interruptions (Ctrl-C in a waiting thread) are simulated by grpc's call object raising from its
wait; a wait that would hang fails at once instead (see ``interrupted``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc._channel
import pytest
from pool_service import PoolService
from rpc_harness import SERVICE, Service, aio_channel_to, new_agent, outstanding, pictured_calls, recorded, sample

from polling import DEFAULT_TIMEOUT, poll
from stablewatch.agents.rpc import pool as rpc_pool
from stablewatch.agents.rpc.agent import RpcAgent
from stablewatch.agents.rpc.interceptors import CURRENT_TASK
from stablewatch.v1.control_pb2 import BREAK_OUTCOME_GONE, BreakWait

#: grpc's call object behind a sync future or stream (a private class of grpc, stable in 1.85).
_RENDEZVOUS = grpc._channel._MultiThreadedRendezvous


@dataclass
class Scripted:
    """A sync gRPC server without an agent on 127.0.0.1, whose methods do as scripted.

    ``Hold`` (unary) and ``Total`` (stream-unary) answer once ``release`` is set; ``Forever`` (unary-
    stream) sends one message and keeps its stream open until the call ends; ``Echo`` answers at
    once. ``held`` is set when Hold or Total runs, ``ended`` when a call of Hold or Forever is over
    (grpc's callback: cancelled, or answered).
    """

    release: threading.Event = field(default_factory=threading.Event)
    held: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)
    address: str = ""
    server: Any = None

    def hold(self, payload: bytes, context: grpc.ServicerContext) -> bytes:
        context.add_callback(self.ended.set)
        self.held.set()
        assert self.release.wait(30), "never released"
        return payload

    def total(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        self.held.set()
        assert self.release.wait(30), "never released"
        return b"".join(requests)

    def forever(self, payload: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        context.add_callback(self.ended.set)
        yield b"first"
        self.ended.wait(30)  # open until the call ends (its callback sets ended)


@pytest.fixture
def scripted() -> Iterator[Scripted]:
    made = Scripted()
    made.server = grpc.server(futures.ThreadPoolExecutor(8))
    methods = {
        "Hold": grpc.unary_unary_rpc_method_handler(made.hold),
        "Total": grpc.stream_unary_rpc_method_handler(made.total),
        "Forever": grpc.unary_stream_rpc_method_handler(made.forever),
        "Echo": grpc.unary_unary_rpc_method_handler(lambda payload, context: payload),
    }
    made.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, methods)])
    made.address = f"127.0.0.1:{made.server.add_insecure_port('127.0.0.1:0')}"
    made.server.start()
    yield made
    made.release.set()
    made.ended.set()
    made.server.stop(grace=0).wait(10)


@pytest.fixture
def client() -> Iterator[RpcAgent]:
    """The caller's agent (no detector); its channels lead to the process "server"."""
    agent = new_agent("client")
    yield agent
    agent.stop()


def channel_to(scripted: Scripted, agent: RpcAgent, kind: str = "channel", breakable: bool = False) -> grpc.Channel:
    """A channel to the scripted server, instrumented the ``kind`` way (the channel, or the interceptor)."""
    if kind == "interceptor":
        return grpc.intercept_channel(grpc.insecure_channel(scripted.address), agent.client_interceptor("server"))
    return agent.instrument_channel(grpc.insecure_channel(scripted.address), "server", breakable=breakable)


# -- every way out of a blocking call ends its wait ---------------------------------------------------


@pytest.mark.parametrize("breakable", [False, True], ids=["default", "breakable"])
@pytest.mark.parametrize("how", ["call", "with_call"])
def test_a_blocking_call_whose_metadata_grpc_refuses_ends_its_wait(
    scripted: Scripted, client: RpcAgent, breakable: bool, how: str
) -> None:
    """Metadata the call cannot carry (an optional entry left None) fails the call before anything
    is sent. Its request was counted already: the wait must end, and the pair's counts restart,
    or the channel to the server could never again be proven complete."""
    with channel_to(scripted, client, breakable=breakable) as channel:
        method = channel.unary_unary(f"/{SERVICE}/Echo")
        with pytest.raises(TypeError):
            getattr(method, "__call__" if how == "call" else how)(b"x", timeout=10, metadata=[("k", "v"), None])
        assert outstanding(client) == 0
        assert client._core.session("server") == 1
        assert method(b"y", timeout=10, metadata=[("k", "v")]) == b"y"
    assert outstanding(client) == 0


class Interrupted(BaseException):
    """Stands for KeyboardInterrupt raised in a thread while it waits for a call."""


@pytest.fixture
def interrupted(monkeypatch: pytest.MonkeyPatch) -> None:
    """grpc's waits for a call's end raise :class:`Interrupted` while the call is out, as Ctrl-C
    makes them raise KeyboardInterrupt; reading the end of a call that is not over (which blocks
    until it is) fails at once, naming the hang it would be."""
    result, trailing_metadata, code = _RENDEZVOUS.result, _RENDEZVOUS.trailing_metadata, _RENDEZVOUS.code

    def interrupting(self: Any, timeout: float | None = None) -> Any:
        if not self.done():
            raise Interrupted()
        return result(self, timeout)

    def ended_only(read: Any) -> Any:
        def reading(self: Any) -> Any:
            assert self.done(), "waited for the end of a call that is not over: the interrupted caller hangs"
            return read(self)

        return reading

    monkeypatch.setattr(_RENDEZVOUS, "result", interrupting)
    monkeypatch.setattr(_RENDEZVOUS, "trailing_metadata", ended_only(trailing_metadata))
    monkeypatch.setattr(_RENDEZVOUS, "code", ended_only(code))


@pytest.mark.usefixtures("interrupted")
@pytest.mark.parametrize(
    "how",
    [
        "breakable call",
        "breakable stream-unary call",
        "future",
    ],
)
def test_a_caller_interrupted_while_it_waits_gets_the_interruption_at_once(
    scripted: Scripted, client: RpcAgent, how: str
) -> None:
    """The interruption reaches the caller at once, not when the call ends (which may be never); a
    blocking call is cancelled then, a future goes on; either way its wait ends with the call."""
    with channel_to(scripted, client, breakable=True) as channel:
        future = None
        with pytest.raises(Interrupted):
            if how == "breakable call":
                channel.unary_unary(f"/{SERVICE}/Hold")(b"x", timeout=30)
            elif how == "future":
                future = channel.unary_unary(f"/{SERVICE}/Hold").future(b"x", timeout=30)
                future.result()
            else:
                channel.stream_unary(f"/{SERVICE}/Total")(iter([b"a", b"b"]), timeout=30)
        if future is None:  # a blocking call: nobody waits for it any more, and it was cancelled
            poll(lambda: outstanding(client) == 0, "the interrupted call's end taken in")
            assert client._core.session("server") == 1  # nobody knows whether its request arrived
        else:  # a future: the call goes on, and its caller may still wait for it
            assert outstanding(client) == 1
            assert client.open_waits() == []  # the interrupted thread blocks on it no longer
            scripted.release.set()
            poll(future.done, "the call's end")  # (a wait for it would be interrupted again here)
            assert future.result() == b"x"
            assert outstanding(client) == 0


@pytest.mark.parametrize("kind", ["channel", "interceptor"])
def test_a_response_stream_its_caller_drops_half_read_is_cancelled_as_grpc_cancels_it(
    scripted: Scripted, client: RpcAgent, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """grpc cancels a call whose object its caller drops (when the object is collected): a stream
    read halfway (``for ... : break``) ends then, and so does its server's handler. The agent must
    not keep the call's object alive, or the stream would stay open, and the handler run on, for
    as long as the server keeps it (here 30 s; a subscription, for good)."""
    made: list[weakref.ref[Any]] = []
    init = _RENDEZVOUS.__init__

    def noted(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(_RENDEZVOUS, "__init__", noted)
    with channel_to(scripted, client, kind) as channel:
        for message in channel.unary_stream(f"/{SERVICE}/Forever")(b"", timeout=30):
            assert message == b"first"
            break
        gc.collect()
        assert [ref() for ref in made] == [None], "the dropped call is kept alive"
        assert scripted.ended.wait(10), "the server's handler never saw the call end"
        poll(lambda: outstanding(client) == 0, "the dropped stream's end taken in")


# -- the future, as grpc's own --------------------------------------------------------------------------


def test_a_future_behaves_as_grpcs_own_and_its_callbacks_see_its_end_taken_in(
    scripted: Scripted, client: RpcAgent
) -> None:
    with channel_to(scripted, client) as channel:
        hold = channel.unary_unary(f"/{SERVICE}/Hold")
        # Cancelled by its caller: a cancellation, not a break; the pair's counts restart.
        dropped = hold.future(b"dropped", timeout=30)
        assert dropped.cancel() and not dropped.cancel()
        assert dropped.cancelled() and dropped.done()
        with pytest.raises(grpc.FutureCancelledError):
            dropped.result(10)
        assert dropped.code() is grpc.StatusCode.CANCELLED
        poll(lambda: outstanding(client) == 0, "the cancelled call's end taken in")
        assert client._core.session("server") == 1

        future = hold.future(b"x", timeout=30)
        with pytest.raises(grpc.FutureTimeoutError):  # the server holds it: its wait goes on
            future.result(timeout=0.01)
        assert future.running() and not future.done() and outstanding(client) == 1
        seen: list[tuple[Any, int, grpc.StatusCode]] = []
        future.add_done_callback(lambda done: seen.append((done, outstanding(client), done.code())))
        scripted.release.set()
        assert future.result(10) == b"x"
        poll(lambda: seen, "the done callback")  # grpc runs it on its own thread
        assert seen == [(future, 0, grpc.StatusCode.OK)]  # the proxy, its end taken in already
        late: list[Any] = []
        future.add_done_callback(late.append)  # on a done future: at once, with the proxy
        assert late == [future]
        assert future.exception() is None and not future.cancel()


# -- breaks that lose a race are gone, and change nothing ---------------------------------------------


def test_a_break_of_an_outgoing_call_that_ends_before_its_cancel_is_gone(
    scripted: Scripted, client: RpcAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The break claims the call, and the call ends before the cancel reaches it: nothing was
    broken. The caller gets its answer, and the wait may be broken by nobody again (it is gone)."""
    cancel = _RENDEZVOUS.cancel
    cancels: list[bool] = []

    def too_late(self: Any) -> bool:
        scripted.release.set()
        poll(self.done, "the call's end")
        cancels.append(cancel(self))
        return cancels[-1]

    monkeypatch.setattr(_RENDEZVOUS, "cancel", too_late)
    caller = futures.ThreadPoolExecutor(1)
    with channel_to(scripted, client, breakable=True) as channel:
        try:
            reply = caller.submit(channel.unary_unary(f"/{SERVICE}/Hold"), b"x", timeout=30)

            def breakable() -> int:
                state = recorded(client)
                return next((wait.instance for wait in state.waits if wait.instance), 0) if state else 0

            instance = poll(breakable, "the call's breakable wait")
            order = BreakWait(break_id=1, instance=instance, deadlock="C -> S -> C")
            assert client.breaks.handle(order).outcome == BREAK_OUTCOME_GONE
            assert cancels == [False]
            assert reply.result(10) == b"x"  # its own answer, not DeadlockBroken
            assert client.breaks.handle(order).outcome == BREAK_OUTCOME_GONE  # never "already broken"
            assert sample(client, "breaks", kind="call") == 0
            assert client._core.session("server") == 0  # its end taken in as it came
        finally:
            scripted.release.set()
            caller.shutdown(wait=True)


def pictured(agent: RpcAgent) -> tuple[list[str], list[str]]:
    """The agent's picture of its one pool as a recording reads it: the running calls' and the
    queued calls' methods."""
    running, queued = pictured_calls(agent)
    return [name.split("#")[0] for name in running], [name.split("#")[0] for name in queued]


@dataclass
class OneWorker:
    """A server S with one worker from its agent's pool: ``Hold`` (which sets ``held`` as it runs)
    keeps it until ``release``, and ``Echo`` (which sets ``echoed`` as it runs) queues behind it."""

    service: PoolService
    channel: grpc.Channel
    release: threading.Event
    echoed: threading.Event
    held: threading.Event
    hold: Any = None
    echo: Any = None

    def queue_echo_behind_hold(self, s_agent: RpcAgent, timeout: float = DEFAULT_TIMEOUT) -> int:
        """Hold the worker and queue a call of Echo; returns the queued wait's instance.

        Waits for Hold's handler itself to run, not only for the picture: the agent pictures a call
        as running from its arrival, while the worker may not have started it yet, and a server
        stopped then ends Hold too (neither handler ever runs: both leave the picture).
        """
        self.hold = self.channel.unary_unary(f"/{SERVICE}/Hold").future(b"", timeout=30)
        poll(self.held.is_set, "Hold's handler running", timeout)
        assert pictured(s_agent) == ([f"/{SERVICE}/Hold"], [])
        self.echo = self.channel.unary_unary(f"/{SERVICE}/Echo").future(b"", timeout=30)
        (pool,) = s_agent._pools

        def queued() -> int:
            with s_agent._lock:
                calls = list(pool.queued.values())
            return calls[0].instance if calls and calls[0].work is not None else 0

        return poll(queued, "Echo queued in the pool")


@pytest.fixture
def one_worker(rpc_agents: tuple[RpcAgent, RpcAgent]) -> Iterator[OneWorker]:
    s_agent, c_agent = rpc_agents
    release, echoed, held = threading.Event(), threading.Event(), threading.Event()

    def hold(payload: bytes, context: Any) -> bytes:
        held.set()
        assert release.wait(30), "never released"
        return b"held"

    def echo(payload: bytes, context: Any) -> bytes:
        echoed.set()
        return b"echo"

    service = PoolService({"Hold": hold, "Echo": echo}, s_agent, 1)
    channel = c_agent.instrument_channel(grpc.insecure_channel(service.address), "S")
    try:
        yield OneWorker(service, channel, release, echoed, held)
    finally:
        release.set()
        channel.close()
        service.stop()


def test_a_break_of_a_queued_call_that_a_worker_takes_first_is_gone_and_the_call_runs(
    rpc_agents: tuple[RpcAgent, RpcAgent], one_worker: OneWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    s_agent, _ = rpc_agents
    instance = one_worker.queue_echo_behind_hold(s_agent)
    take = rpc_pool.QueuedWork.take
    taken: list[bool] = []

    def too_late(work: rpc_pool.QueuedWork) -> bool:  # the worker frees up and runs Echo first
        one_worker.release.set()
        assert one_worker.echoed.wait(10), "Echo never ran"
        taken.append(take(work))
        return taken[-1]

    monkeypatch.setattr(rpc_pool.QueuedWork, "take", too_late)
    order = BreakWait(break_id=1, instance=instance, deadlock="S -> S")
    assert s_agent.breaks.handle(order).outcome == BREAK_OUTCOME_GONE
    assert taken == [False]
    assert one_worker.echo.result(10) == b"echo"  # it ran, and answered: not refused
    assert one_worker.hold.result(10) == b"held"
    assert s_agent.breaks.handle(order).outcome == BREAK_OUTCOME_GONE  # never "already broken"
    assert sample(s_agent, "breaks", kind="queued") == 0
    poll(lambda: pictured(s_agent) == ([], []), "an empty picture of the pool")


def test_a_server_stopped_with_a_call_queued_takes_it_out_of_the_pools_picture(
    rpc_agents: tuple[RpcAgent, RpcAgent], one_worker: OneWorker
) -> None:
    """Stopping the server ends its calls: the queued one leaves the picture at once (no wait for
    a worker is left behind), the running one when its handler returns."""
    s_agent, _ = rpc_agents
    one_worker.queue_echo_behind_hold(s_agent)
    stopped = one_worker.service.server.stop(grace=0)
    poll(lambda: pictured(s_agent) == ([f"/{SERVICE}/Hold"], []), "the queued call out of the picture")
    assert s_agent.open_waits() == []
    with pytest.raises(grpc.RpcError):
        one_worker.echo.result(10)
    assert not one_worker.echoed.is_set()
    one_worker.release.set()
    assert stopped.wait(10)
    poll(lambda: pictured(s_agent) == ([], []), "an empty picture of the pool")


class _Relaying:
    """S relays to T's ``Slow`` (which holds until ``release``) from a sync handler, ``Relay``, in
    the way a test gives; S's caller has no agent, so the handler's name is known."""

    handler_name = f"/{SERVICE}/Relay#grpc://127.0.0.1:1"

    def __init__(self, relay: Callable[[RpcAgent, str, bytes], bytes]) -> None:
        self.s_agent, self.t_agent = new_agent("S"), new_agent("T")
        self.release, self.held = threading.Event(), threading.Event()

        def slow(request: bytes, context: Any) -> bytes:
            self.held.set()
            self.release.wait(10)
            return b"done:" + request

        self.t_service = Service({"Slow": slow}, self.t_agent)
        self.s_service = Service(
            {"Relay": lambda request, context: relay(self.s_agent, self.t_service.address, request)}, self.s_agent
        )
        self.to_s = grpc.insecure_channel(self.s_service.address)

    def waiter_while_held(self) -> str:
        """The name S's one open wait is in, while T holds the relayed call; then T answers."""
        answer = self.to_s.unary_unary(f"/{SERVICE}/Relay").future(b"hold", timeout=10)
        assert self.held.wait(10)
        (opened,) = self.s_agent.open_waits()
        self.release.set()
        assert answer.result(10) == b"done:hold"
        return opened.task

    def close(self) -> None:
        self.release.set()
        self.to_s.close()
        self.s_service.stop()
        self.t_service.stop()
        self.s_agent.stop()
        self.t_agent.stop()


@pytest.fixture
def relaying() -> Iterator[Callable[[Callable[[RpcAgent, str, bytes], bytes]], _Relaying]]:
    made: list[_Relaying] = []

    def make(relay: Callable[[RpcAgent, str, bytes], bytes]) -> _Relaying:
        made.append(_Relaying(relay))
        return made[-1]

    yield make
    for each in made:
        each.close()


@pytest.mark.parametrize("setup", ["channel", "interceptor"])
def test_a_thread_given_a_sync_handlers_context_waits_in_its_own_name(relaying: Any, setup: str) -> None:
    """Code may copy a handler's context into another thread (``copy_context().run``); the handler may
    or may not wait for that thread, so the thread's calls wait in the thread's own name, not the
    handler's (a deadlock through the handler's wait on the thread is missed, never made up)."""
    background = futures.ThreadPoolExecutor(1, thread_name_prefix="background")

    def relay(s_agent: RpcAgent, address: str, request: bytes) -> bytes:
        def call_t() -> bytes:
            plain = grpc.insecure_channel(address)
            if setup == "channel":
                to_t = s_agent.instrument_channel(plain, "T")
            else:
                to_t = grpc.intercept_channel(plain, s_agent.client_interceptor("T"))
            with to_t:
                return to_t.unary_unary(f"/{SERVICE}/Slow")(request, timeout=10)

        return background.submit(contextvars.copy_context().run, call_t).result(10)

    try:
        assert relaying(relay).waiter_while_held() == "background_0"
    finally:
        background.shutdown(wait=True)


def test_a_blocking_call_in_a_loop_a_sync_handler_runs_waits_in_the_handlers_name(relaying: Any) -> None:
    """A sync handler that runs an event loop (``asyncio.run``) is blocked by a blocking call any task
    of that loop makes: the call waits in the handler's name."""

    def relay(s_agent: RpcAgent, address: str, request: bytes) -> bytes:
        async def call_t() -> bytes:
            with s_agent.instrument_channel(grpc.insecure_channel(address), "T") as to_t:
                return to_t.unary_unary(f"/{SERVICE}/Slow")(request, timeout=10)

        async def main() -> bytes:
            return await asyncio.create_task(call_t(), name="in-the-handlers-loop")

        return asyncio.run(main())

    assert relaying(relay).waiter_while_held() == _Relaying.handler_name


@pytest.mark.parametrize("setup", ["channel", "interceptors"])
def test_an_asyncio_call_the_main_task_of_a_sync_handlers_loop_awaits(relaying: Any, setup: str) -> None:
    """``asyncio.run(...)`` in a sync handler blocks the handler until its main task ends: an asyncio
    call that task awaits through the instrumented channel waits in the handler's name. Through the
    client interceptors it waits in the task's name (missed, never made up)."""

    def relay(s_agent: RpcAgent, address: str, request: bytes) -> bytes:
        async def main() -> bytes:
            async with aio_channel_to(address, s_agent, setup, "T") as to_t:
                return await to_t.unary_unary(f"/{SERVICE}/Slow")(request, timeout=10)

        return asyncio.run(main())

    waiter = relaying(relay).waiter_while_held()
    if setup == "channel":
        assert waiter == _Relaying.handler_name
    else:
        assert waiter.startswith("Task-")


def _run_until(loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]) -> None:
    """Run ``loop`` until ``task`` ends, or until the loop is stopped."""
    with contextlib.suppress(RuntimeError):
        loop.run_until_complete(task)


@pytest.mark.parametrize("then", ["the handler goes on", "another thread runs the loop until the task"])
@pytest.mark.parametrize("handed_off", [False, True])
def test_a_sync_handler_whose_loop_stopped_early_no_longer_waits_on_its_main_tasks_call(
    relaying: Any, then: str, handed_off: bool
) -> None:
    """A loop the handler runs until its main task ends may stop first (``loop.stop()``): the handler
    goes on, and the main task's call, still outstanding, waits in the task's name from then on,
    also while another thread runs the loop until that task. A call the main task hands to another
    task, which it does not wait for, waits in that task's name throughout."""
    moved_on, done = threading.Event(), threading.Event()
    loops: list[asyncio.AbstractEventLoop] = []

    def relay(s_agent: RpcAgent, address: str, request: bytes) -> bytes:
        async def await_it(call: Any) -> bytes:
            return await call

        async def main() -> bytes:
            async with aio_channel_to(address, s_agent, "channel", "T") as to_t:
                call = to_t.unary_unary(f"/{SERVICE}/Slow")(request, timeout=10)
                if not handed_off:
                    return await call
                awaiting = asyncio.create_task(await_it(call), name="awaits-the-call")
                try:
                    await asyncio.Event().wait()  # not for that task: until cancelled
                finally:
                    awaiting.cancel()
                    with contextlib.suppress(asyncio.CancelledError, grpc.RpcError):
                        await awaiting
                return b"never"

        loop = asyncio.new_event_loop()
        loops.append(loop)
        main_task = loop.create_task(main(), name="the-handlers-main-task")
        helper = None
        try:
            return loop.run_until_complete(main_task)
        except RuntimeError:  # the loop stopped before the task ended: the handler goes on
            if then != "the handler goes on":
                helper = threading.Thread(target=_run_until, args=(loop, main_task), name="helper")
                helper.start()
            moved_on.set()
            assert done.wait(10)
            return b"went on"
        finally:
            if helper is not None:
                loop.call_soon_threadsafe(loop.stop)
                helper.join(10)
            main_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.RpcError):
                loop.run_until_complete(main_task)
            loop.close()

    relayed = relaying(relay)
    answer = relayed.to_s.unary_unary(f"/{SERVICE}/Relay").future(b"hold", timeout=10)
    try:
        assert relayed.held.wait(10)
        waiter = "awaits-the-call" if handed_off else _Relaying.handler_name
        poll(lambda: [wait.task for wait in relayed.s_agent.open_waits()] == [waiter], "the call's wait")
        loops[0].call_soon_threadsafe(loops[0].stop)
        assert moved_on.wait(10)
        if then != "the handler goes on":
            poll(loops[0].is_running, "the helper thread running the loop")
        waiter = "awaits-the-call" if handed_off else "the-handlers-main-task"
        assert [wait.task for wait in relayed.s_agent.open_waits()] == [waiter]
        state = recorded(relayed.s_agent)  # what a snapshot records, too
        assert state is not None
        assert [wait.task for wait in state.waits] == [waiter]
    finally:
        done.set()
        relayed.release.set()
    assert answer.result(10) == b"went on"


def test_a_sync_handlers_loop_stopping_no_longer_waits_on_its_main_tasks_call(relaying: Any) -> None:
    """``stop()`` ends a loop once the callbacks of its turn have run: from the moment it is asked,
    the handler will go on without its main task's call, so the call waits in the task's name,
    though the loop still runs (a long step after the stop)."""
    in_step, step_done = threading.Event(), threading.Event()
    loops: list[asyncio.AbstractEventLoop] = []

    def relay(s_agent: RpcAgent, address: str, request: bytes) -> bytes:
        async def main() -> bytes:
            async with aio_channel_to(address, s_agent, "channel", "T") as to_t:
                return await to_t.unary_unary(f"/{SERVICE}/Slow")(request, timeout=10)

        loop = asyncio.new_event_loop()
        loops.append(loop)
        main_task = loop.create_task(main(), name="the-handlers-main-task")
        try:
            return loop.run_until_complete(main_task)
        except RuntimeError:  # stopped before the task ended
            return b"went on"
        finally:
            main_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.RpcError):
                loop.run_until_complete(main_task)
            loop.close()

    def stop_then_step() -> None:  # a callback of the handler's loop
        loops[0].stop()
        in_step.set()
        step_done.wait(10)

    relayed = relaying(relay)
    answer = relayed.to_s.unary_unary(f"/{SERVICE}/Relay").future(b"hold", timeout=10)
    try:
        assert relayed.held.wait(10)
        poll(lambda: [wait.task for wait in relayed.s_agent.open_waits()] == [_Relaying.handler_name], "A's wait")
        loops[0].call_soon_threadsafe(stop_then_step)
        assert in_step.wait(10)
        assert [wait.task for wait in relayed.s_agent.open_waits()] == ["the-handlers-main-task"]
        state = recorded(relayed.s_agent)
        assert state is not None
        assert [wait.task for wait in state.waits] == ["the-handlers-main-task"]
    finally:
        step_done.set()
        relayed.release.set()
    assert answer.result(10) == b"went on"


@pytest.mark.parametrize("setup", ["channel", "interceptors"])
def test_an_asyncio_call_in_another_task_of_a_sync_handlers_loop_waits_in_its_tasks_name(
    relaying: Any, setup: str
) -> None:
    """An asyncio call in another task of a loop a sync handler runs waits in that task's name: the
    handler may not be waiting for the task (missed, never made up)."""

    def relay(s_agent: RpcAgent, address: str, request: bytes) -> bytes:
        async def call_t() -> bytes:
            async with aio_channel_to(address, s_agent, setup, "T") as to_t:
                return await to_t.unary_unary(f"/{SERVICE}/Slow")(request, timeout=10)

        async def main() -> bytes:
            return await asyncio.create_task(call_t(), name="in-the-handlers-loop")

        return asyncio.run(main())

    assert relaying(relay).waiter_while_held() == "in-the-handlers-loop"


def test_a_call_a_sync_response_stream_handler_makes_waits_in_its_name() -> None:
    """A sync handler with a response stream (a generator, which grpc's sync server runs in one
    worker) makes its calls in its own name, between its responses too."""
    s_agent, t_agent = new_agent("S"), new_agent("T")
    release, held = threading.Event(), threading.Event()

    def slow(request: bytes, context: Any) -> bytes:
        held.set()
        release.wait(10)
        return request

    t_service = Service({"Slow": slow}, t_agent)
    to_t = s_agent.instrument_channel(grpc.insecure_channel(t_service.address), "T")

    def relay(request: bytes, context: Any) -> Iterator[bytes]:
        yield b"first"
        yield to_t.unary_unary(f"/{SERVICE}/Slow")(request, timeout=10)

    s_service = Service({"Relay": grpc.unary_stream_rpc_method_handler(relay)}, s_agent, workers=2)
    try:
        with grpc.insecure_channel(s_service.address) as to_s:
            responses = to_s.unary_stream(f"/{SERVICE}/Relay")(b"hold", timeout=10)
            assert next(responses) == b"first"
            assert held.wait(10)
            (opened,) = s_agent.open_waits()
            assert opened.task == f"/{SERVICE}/Relay#grpc://127.0.0.1:1"
            release.set()
            assert list(responses) == [b"hold"]
    finally:
        release.set()
        s_service.stop()
        to_t.close()
        t_service.stop()
        s_agent.stop()
        t_agent.stop()


def test_a_call_of_a_loop_task_another_handler_of_the_same_thread_runs_is_not_the_first_handlers() -> None:
    """Handler A (call 1) runs a shared loop until its main task, whose call waits in A's name; the
    loop stops early and A returns. The pool's one worker then serves call 2, whose handler runs the
    loop until that same task: the same thread blocks on it, but not as A, which has ended. The call
    waits in the task's name (B's wait on it is missed, never put on A)."""
    s_agent, t_agent = new_agent("S"), new_agent("T")
    release, held = threading.Event(), threading.Event()

    def slow(request: bytes, context: Any) -> bytes:
        held.set()
        release.wait(10)
        return b"done"

    t_service = Service({"Slow": slow}, t_agent)
    loop = asyncio.new_event_loop()
    shared: list[asyncio.Task[bytes]] = []
    handlers: list[str | None] = []

    async def main() -> bytes:
        async with aio_channel_to(t_service.address, s_agent, "channel", "T") as to_t:
            return await to_t.unary_unary(f"/{SERVICE}/Slow")(b"x", timeout=10)

    def relay(request: bytes, context: Any) -> bytes:
        handlers.append(CURRENT_TASK.get())
        if not shared:
            shared.append(loop.create_task(main(), name="the-shared-task"))
        try:
            return loop.run_until_complete(shared[0])
        except RuntimeError:  # stopped early
            return b"went on"

    s_service = Service({"Relay": relay}, s_agent, workers=1)
    to_s = grpc.insecure_channel(s_service.address)
    try:
        first = to_s.unary_unary(f"/{SERVICE}/Relay").future(b"first", timeout=10)
        assert held.wait(10)
        poll(lambda: [wait.task for wait in s_agent.open_waits()] == [handlers[0]], "the call in A's name")
        loop.call_soon_threadsafe(loop.stop)
        assert first.result(10) == b"went on"
        second = to_s.unary_unary(f"/{SERVICE}/Relay").future(b"second", timeout=10)
        poll(lambda: len(handlers) == 2 and loop.is_running(), "B running the loop until the task")
        assert [wait.task for wait in s_agent.open_waits()] == ["the-shared-task"]
        state = recorded(s_agent)
        assert state is not None
        assert [wait.task for wait in state.waits] == ["the-shared-task"]
        release.set()
        assert second.result(10) == b"done"
    finally:
        release.set()
        to_s.close()
        s_service.stop()
        t_service.stop()
        loop.close()
        s_agent.stop()
        t_agent.stop()
