"""Benchmark: the Python work of one RPC-mode unary call, client and server side, in one process.

``rpc_overhead.py`` measures whole calls between two processes, where gRPC's own work (about
400 µs of CPU a call here) and the machine's noise hide differences of a few microseconds. This
benchmark takes gRPC's transport away: a loopback channel hands each call straight to a server
side, which finds its handler through gRPC's own server interceptor pipeline
(``grpc._interceptor.service_pipeline``) in a fresh ``contextvars.Context`` per call, as the sync
server does, and runs it with a servicer context that keeps the metadata. So what is timed is the
Python the instrumentation adds to a call, on both sides. It is timed in CPU time of the calling
thread (``time.thread_time``), so that other processes on a shared machine do not count. Cases:

* ``loopback``: the loopback alone (a plain method and a server without interceptors): the cost of
  the harness, to subtract;
* ``stamp_only``: one stamp-sized entry carried each way, as ``rpc_overhead.py``'s stamp-only case
  carries it, and nothing else: the floor of any instrumentation that tells the other side
  something on every call;
* ``instrumented``: two agents (no detector), the server's interceptor (``workers=4``) and the
  client's instrumented channel, with no snapshot running: what the agents add to every call;
* ``instrumented_recording``: the same while a snapshot records on both sides (started and never
  finished), so that every call is also checked against a running recording;
* ``client_interceptor``: the server's interceptor and the client interceptor through
  ``grpc.intercept_channel``;
* ``pooled_stamp_only`` and ``pooled_instrumented``: ``stamp_only`` and ``instrumented`` with the
  server's handler submitted to a worker pool as grpc's sync server submits it (``context.run``
  and the call's grpc ``_RPCState`` among its arguments, under the state's condition), run as a
  worker runs it, and the state's end-of-call callbacks run as grpc's polling thread runs them: a
  plain ``ThreadPoolExecutor`` for the floor, the agent's ``WorkerExecutor`` with
  ``server_interceptor(workers=pool)`` (the README's set-up) for the agent. The pools start no
  thread (the loopback runs each work item itself), so the CPU the pool costs, where grpc spends
  it, is timed too: the other cases leave it out (``workers=4`` is only the pool's size);
* ``pooled_plain_agent``: the agents of ``pooled_instrumented`` through the plain pool, with
  ``server_interceptor()`` (no ``workers``): the agent without its picture of the pool, as
  ``rpc_overhead.py``'s ``plain-pool`` case sets it up. Set beside ``pooled_instrumented``, it
  gives what the picture (which queued call waits for which running handlers, and what lets a
  break refuse a queued call) costs a call; set beside ``pooled_stamp_only``, what the agent costs
  when its handler runs in a worker pool, as every sync server's does; ``pooled_least_agent``, the
  least agent (below) through the plain pool, is the floor of that;
* ``aio_loopback``, ``aio_stamp_only``, ``aio_instrumented``, ``aio_client_interceptors``: the same
  for the asyncio API, awaited in one event loop. The client is the agent's instrumented asyncio
  channel (the README's set-up), or its asyncio client interceptor called as ``grpc.aio`` calls it,
  or the stamp-only method; each call is served at once, in a fresh ``contextvars.Context``: the
  server's interceptors (the agent's ``aio_server_interceptor``, or the stamp-only one) and the
  handler, as one task of ``grpc.aio`` runs them. What ``grpc.aio`` adds around a client
  interceptor (a task per intercepted call) is gRPC's, not timed here: ``rpc_overhead.py`` has it.

Each case runs in interleaved rounds of ``--seconds`` (1) each, ``--rounds`` (5). The table and the
last line (JSON) give the median µs per call and the spread (lowest and highest round), each case
less its loopback (``*_added_us``), and for the agents' cases the requests their client stamped
(``*_stamped_requests``: one per call made). ``hot_path_agent_us`` is the issue's measure: the
agents' own Python per call, both sides, above the stamp-only floor (``instrumented`` less
``stamp_only`` within each round; median and spread over rounds), target at most 4 µs;
``hot_path_agent_recording_us`` the same with a recording running, ``aio_hot_path_agent_us`` the
asyncio one (``aio_instrumented`` less ``aio_stamp_only``), ``hot_path_agent_pooled_us`` the
same with the pools (``pooled_instrumented`` less ``pooled_stamp_only``),
``hot_path_agent_plain_pool_us`` the agent through the plain pool (``pooled_plain_agent`` less
``pooled_stamp_only``) and ``hot_path_pool_picture_us`` its picture of the pool
(``pooled_instrumented`` less ``pooled_plain_agent``), ``hot_path_least_agent_pooled_us`` and
``hot_path_agent_pooled_over_least_us`` the least agent through the plain pool above its floor,
and the agent with its pool above it. ``targets`` holds the target met or not.

A microbenchmark's loop keeps the CPU's caches warm; a real server's call does not find its
Python there, after gRPC's C core, the kernel and the other processes have run. ``--cold MB``
evicts them before each call (a copy of MB megabytes, not timed; more than the last-level cache
for a call as cold as can be) and times each call alone: the same keys, as each case costs cold
(``cold_mb`` says which; no ``targets``, which are set for the warm measure).

    python bench/rpc_hot_path.py [--seconds 1] [--rounds 5] [--cold MB] [--profile CASE]

``--profile CASE`` runs one case under cProfile for ``--seconds`` and prints where its time goes
(cProfile's own cost per function call inflates the total several times: read the shares).
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import cProfile
import pstats
import statistics
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import grpc
from grpc import _interceptor
from grpc._server import _RPCState
from least_agent import LeastAgent
from report import interleaved, json_line, medians_and_spreads, spread, spread_row
from rich.console import Console
from rich.table import Table
from rpc_overhead import AioStampOnlyMethod, AioStampOnlyServerInterceptor, StampOnlyMethod, StampOnlyServerInterceptor

from stablewatch.agents.rpc.agent import RpcAgent
from stablewatch.agents.rpc.aio_channel import AioInstrumentedChannel
from stablewatch.agents.rpc.pool import WorkerExecutor

METHOD = "/bench.Echo/Call"
PAYLOAD = b"x" * 64
_OK = grpc.StatusCode.OK
#: The target of ``hot_path_agent_us`` (and of ``aio_hot_path_agent_us``), in µs per call.
TARGET_US = 4.0
#: Each agent case's floor, to compute the agents' own cost above it.
AGENT_KEYS = {
    "hot_path_agent_us": ("instrumented", "stamp_only"),
    "hot_path_agent_recording_us": ("instrumented_recording", "stamp_only"),
    "aio_hot_path_agent_us": ("aio_instrumented", "aio_stamp_only"),
    "hot_path_agent_pooled_us": ("pooled_instrumented", "pooled_stamp_only"),
    "hot_path_agent_plain_pool_us": ("pooled_plain_agent", "pooled_stamp_only"),
    "hot_path_pool_picture_us": ("pooled_instrumented", "pooled_plain_agent"),
    "hot_path_least_agent_pooled_us": ("pooled_least_agent", "pooled_stamp_only"),
    "hot_path_agent_pooled_over_least_us": ("pooled_instrumented", "pooled_least_agent"),
    "hot_path_least_agent_us": ("least_agent", "stamp_only"),
    "hot_path_bare_bookkeeping_us": ("bare_bookkeeping", "stamp_only"),
    "hot_path_agent_over_least_us": ("instrumented", "least_agent"),
    "aio_hot_path_least_agent_us": ("aio_least_agent", "aio_stamp_only"),
    "aio_hot_path_bare_bookkeeping_us": ("aio_bare_bookkeeping", "aio_stamp_only"),
    "aio_hot_path_agent_over_least_us": ("aio_instrumented", "aio_least_agent"),
}


class _Details(NamedTuple):
    method: str
    invocation_metadata: Sequence[tuple[str, str]]


class HandlerCallDetails(_Details, grpc.HandlerCallDetails):
    """What the server's interceptors see of an arriving call."""


class ServerContext:
    """The part of a sync ``grpc.ServicerContext`` that the agent uses, keeping the trailing metadata."""

    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = metadata
        self._trailing: Sequence[tuple[str, str]] = ()

    def invocation_metadata(self) -> Sequence[tuple[str, str]]:
        return self._metadata

    def trailing_metadata(self) -> Sequence[tuple[str, str]]:
        return self._trailing

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._trailing = metadata

    def is_active(self) -> bool:
        return True

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RuntimeError(f"aborted: {code.name}: {details}")


class AioServerContext(ServerContext):
    """The part of a ``grpc.aio.ServicerContext`` that the agent uses."""

    def done(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:  # type: ignore[override]
        raise RuntimeError(f"aborted: {code.name}: {details}")


class Ended:
    """The finished call a blocking ``with_call`` returns."""

    def __init__(self, trailing: Sequence[tuple[str, str]]) -> None:
        self._trailing = trailing

    def trailing_metadata(self) -> Sequence[tuple[str, str]]:
        return self._trailing

    def code(self) -> grpc.StatusCode:
        return _OK


class InlinePool(ThreadPoolExecutor):
    """A thread pool that starts no thread: the loopback runs each submitted work item itself, in
    the calling thread, so that its CPU time counts (``_adjust_thread_count`` is the pool's own
    hook for starting workers; the queue is the pool's ``_work_queue``)."""

    def _adjust_thread_count(self) -> None:
        return None

    def run_next(self) -> None:
        """Run the work item submitted last, as a worker would."""
        self._work_queue.get_nowait().run()


class InlineWorkerPool(WorkerExecutor, InlinePool):
    """The agent's :class:`~stablewatch.agents.rpc.pool.WorkerExecutor` (``agent.thread_pool(4)``),
    starting no thread either."""


def _in_pool(rpc_event: Any, state: Any, behavior: Callable[..., Any], request: Any, context: Any) -> Any:
    """What grpc's sync server submits to its pool for a unary call (``_unary_response_in_pool``),
    its arguments laid out alike: the call's state third."""
    return behavior(request, context)


class LoopbackServer:
    """One echo method behind a server's interceptors, found the way grpc's sync server finds it.

    With a ``pool`` (an :class:`InlinePool`), the handler is submitted to it as grpc's sync server
    submits it (``context.run`` and the call's grpc ``_RPCState`` among the arguments, under the
    state's condition), run as a worker runs it, and the state's callbacks are run when the call
    is over, as grpc's polling thread runs them: what a server pays for its pool on every call.
    """

    def __init__(self, interceptors: Sequence[grpc.ServerInterceptor], pool: InlinePool | None = None) -> None:
        self._handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
        self._pipeline = _interceptor.service_pipeline(interceptors)
        self._pool = pool

    def _query(self, details: HandlerCallDetails) -> grpc.RpcMethodHandler:
        return self._handler

    def call(self, request: Any, metadata: Sequence[tuple[str, str]]) -> tuple[Any, Ended]:
        details = HandlerCallDetails(METHOD, metadata)
        context = contextvars.Context()  # one per call, for its interceptors and its handler
        if self._pipeline is None:
            handler = context.run(self._query, details)
        else:
            handler = context.run(self._pipeline.execute, self._query, details)
        servicer_context = ServerContext(metadata)
        pool = self._pool
        if pool is None:
            response = context.run(handler.unary_unary, request, servicer_context)
            return response, Ended(servicer_context.trailing_metadata())
        state = _RPCState()
        with state.condition:
            future = pool.submit(context.run, _in_pool, None, state, handler.unary_unary, request, servicer_context)
        pool.run_next()
        response = future.result()
        with state.condition:  # the call is over: grpc's polling thread runs its callbacks
            callbacks, state.callbacks = state.callbacks, None
        for callback in callbacks or ():
            callback()
        return response, Ended(servicer_context.trailing_metadata())


class LoopbackMethod(grpc.UnaryUnaryMultiCallable):
    def __init__(self, server: LoopbackServer) -> None:
        self._server = server

    def __call__(
        self,
        request: Any,
        timeout: Any = None,
        metadata: Any = None,
        credentials: Any = None,
        wait_for_ready: Any = None,
        compression: Any = None,
    ) -> Any:
        return self._server.call(request, metadata or ())[0]

    def with_call(
        self,
        request: Any,
        timeout: Any = None,
        metadata: Any = None,
        credentials: Any = None,
        wait_for_ready: Any = None,
        compression: Any = None,
    ) -> Any:
        return self._server.call(request, metadata or ())

    def future(self, request: Any, timeout: Any = None, metadata: Any = None, **options: Any) -> Any:
        raise NotImplementedError("the loopback makes blocking calls only")


class LoopbackChannel(grpc.Channel):
    """A channel whose unary methods call a :class:`LoopbackServer` in the caller's thread."""

    def __init__(self, server: LoopbackServer) -> None:
        self._server = server

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> LoopbackMethod:
        return LoopbackMethod(self._server)

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def subscribe(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def unsubscribe(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        return None


# -- the asyncio loopback ------------------------------------------------------------------------------


async def _echo(request: Any, context: Any) -> Any:
    return request


class AioLoopbackServer:
    """One asyncio echo method behind a server's asyncio interceptors, served at once.

    Each call runs its interceptors and its handler in a fresh ``contextvars.Context``, as
    ``grpc.aio`` runs them in one task of the call. None of them suspends here, so the coroutine is
    driven to its end by one ``send``, outside the event loop's scheduling.
    """

    def __init__(self, interceptors: Sequence[grpc.aio.ServerInterceptor]) -> None:
        handler = grpc.unary_unary_rpc_method_handler(_echo)

        async def query(details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
            return handler

        find: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]] = query
        for interceptor in reversed(interceptors):  # the first interceptor sees the call first
            find = _bind(interceptor, find)
        self._find = find

    async def _serve(self, request: Any, metadata: Sequence[tuple[str, str]]) -> tuple[Any, AioServerContext]:
        handler = await self._find(HandlerCallDetails(METHOD, metadata))
        context = AioServerContext(metadata)
        return await handler.unary_unary(request, context), context

    def call(self, request: Any, metadata: Sequence[tuple[str, str]]) -> tuple[Any, AioServerContext]:
        serving = self._serve(request, metadata)
        try:
            contextvars.Context().run(serving.send, None)
        except StopIteration as done:
            return done.value
        serving.close()
        raise RuntimeError("the loopback server's coroutine suspended: it must run to its end at once")


def _bind(
    interceptor: grpc.aio.ServerInterceptor,
    continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
) -> Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]:
    async def find(details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        return await interceptor.intercept_service(continuation, details)

    return find


class AioLoopbackCall:
    """A finished asyncio unary call, as ``grpc.aio`` hands it out: awaiting it gives the response."""

    def __init__(self, response: Any, context: AioServerContext) -> None:
        self._response, self._context = response, context

    def __await__(self) -> Generator[None, None, Any]:
        yield from ()
        return self._response

    async def trailing_metadata(self) -> Sequence[tuple[str, str]]:
        return self._context.trailing_metadata()

    async def code(self) -> grpc.StatusCode:
        return _OK

    def cancel(self) -> bool:
        return False


class AioLoopbackMethod:
    """An asyncio unary method (``channel.unary_unary(...)``) that serves each call at once."""

    def __init__(self, server: AioLoopbackServer) -> None:
        self._server = server

    def __call__(
        self,
        request: Any,
        *,
        timeout: float | None = None,
        metadata: Any = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: Any = None,
    ) -> AioLoopbackCall:
        return AioLoopbackCall(*self._server.call(request, tuple(metadata or ())))


class AioLoopbackChannel:
    """The part of a ``grpc.aio.Channel`` the agent's instrumented asyncio channel uses: its methods
    serve each call at once."""

    def __init__(self, server: AioLoopbackServer) -> None:
        self._method = AioLoopbackMethod(server)

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> AioLoopbackMethod:
        return self._method


class AioInterceptedMethod:
    """An asyncio unary method through a unary-unary client interceptor, as ``grpc.aio`` calls it
    (the details a channel builds, a continuation that starts the call), without its task."""

    def __init__(self, interceptor: grpc.aio.UnaryUnaryClientInterceptor, method: AioLoopbackMethod) -> None:
        self._interceptor = interceptor

        async def continuation(details: grpc.aio.ClientCallDetails, request: Any) -> AioLoopbackCall:
            return method(request, metadata=details.metadata)

        self._continuation = continuation

    async def __call__(self, request: Any) -> Any:
        details = grpc.aio.ClientCallDetails(METHOD, None, None, None, None)
        return await self._interceptor.intercept_unary_unary(self._continuation, details, request)


# -- the cases --------------------------------------------------------------------------------------------


def stamped_requests(agent: RpcAgent) -> int:
    """How many requests ``agent`` has sent with a stamp."""
    value = agent.metrics.registry.get_sample_value("stablewatch_agent_rpc_stamped_messages_total", {"kind": "request"})
    return int(value or 0)


def agents(recording: bool) -> tuple[RpcAgent, RpcAgent]:
    """A client and a server agent (no detector); with ``recording``, a snapshot records in both."""
    client, server = RpcAgent("client"), RpcAgent("server")
    if recording:
        for agent in (client, server):
            agent.start_snapshot(1, lifetime=3600)
    return client, server


def least_agents(facts: bool) -> tuple[LeastAgent, LeastAgent]:
    """A client and a server :class:`~least_agent.LeastAgent` (``facts``: the least agent, else bare bookkeeping)."""
    return LeastAgent("client", facts=facts), LeastAgent("server", facts=facts)


def cases() -> tuple[dict[str, Callable[[bytes], Any]], dict[str, RpcAgent | LeastAgent]]:
    """Each sync case's blocking unary method (called with the payload), and the client agent of each
    case that has one."""
    plain = LoopbackChannel(LoopbackServer([])).unary_unary(METHOD)
    stamp_only = StampOnlyMethod(LoopbackChannel(LoopbackServer([StampOnlyServerInterceptor()])).unary_unary(METHOD))

    def channel(server: RpcAgent) -> LoopbackChannel:
        return LoopbackChannel(LoopbackServer([server.server_interceptor(workers=4)]))

    clients: dict[str, RpcAgent | LeastAgent] = {}
    clients["instrumented"], server = agents(False)
    instrumented = clients["instrumented"].instrument_channel(channel(server), "server").unary_unary(METHOD)
    clients["instrumented_recording"], server = agents(True)
    recording = clients["instrumented_recording"].instrument_channel(channel(server), "server").unary_unary(METHOD)
    clients["client_interceptor"], server = agents(False)
    interceptor = clients["client_interceptor"].client_interceptor("server")
    intercepted = grpc.intercept_channel(channel(server), interceptor).unary_unary(METHOD)
    pooled_stamp_only = StampOnlyMethod(
        LoopbackChannel(LoopbackServer([StampOnlyServerInterceptor()], InlinePool(4))).unary_unary(METHOD)
    )
    clients["pooled_instrumented"], server = agents(False)
    pool = InlineWorkerPool(4)
    pooled_channel = LoopbackChannel(LoopbackServer([server.server_interceptor(workers=pool)], pool))
    pooled = clients["pooled_instrumented"].instrument_channel(pooled_channel, "server").unary_unary(METHOD)
    clients["pooled_plain_agent"], server = agents(False)
    plain_pool_channel = LoopbackChannel(LoopbackServer([server.server_interceptor()], InlinePool(4)))
    plain_pooled = clients["pooled_plain_agent"].instrument_channel(plain_pool_channel, "server").unary_unary(METHOD)
    methods = {
        "loopback": plain,
        "stamp_only": stamp_only,
        "instrumented": instrumented,
        "instrumented_recording": recording,
        "client_interceptor": intercepted,
        "pooled_stamp_only": pooled_stamp_only,
        "pooled_instrumented": pooled,
        "pooled_plain_agent": plain_pooled,
    }
    for name, facts in (("least_agent", True), ("bare_bookkeeping", False)):
        clients[name], server = least_agents(facts)
        methods[name] = clients[name].method(
            LoopbackChannel(LoopbackServer([server.server_interceptor()])).unary_unary(METHOD), "server"
        )
    clients["pooled_least_agent"], server = least_agents(True)
    methods["pooled_least_agent"] = clients["pooled_least_agent"].method(
        LoopbackChannel(LoopbackServer([server.server_interceptor()], InlinePool(4))).unary_unary(METHOD), "server"
    )
    return methods, clients


def aio_cases() -> tuple[dict[str, Callable[[bytes], Awaitable[Any]]], dict[str, RpcAgent | LeastAgent]]:
    """Each asyncio case's unary method (awaited with the payload), and its client agent if it has one."""
    plain = AioLoopbackMethod(AioLoopbackServer([]))
    stamp_only = AioStampOnlyMethod(AioLoopbackMethod(AioLoopbackServer([AioStampOnlyServerInterceptor()])))
    clients: dict[str, RpcAgent | LeastAgent] = {}
    clients["aio_instrumented"], server = agents(False)
    loopback = AioLoopbackChannel(AioLoopbackServer([server.aio_server_interceptor()]))
    channel = AioInstrumentedChannel(loopback, clients["aio_instrumented"], "server", True)  # type: ignore[arg-type]
    clients["aio_client_interceptors"], server = agents(False)
    (unary, *_) = clients["aio_client_interceptors"].aio_client_interceptors("server")  # unary-unary comes first
    intercepted = AioInterceptedMethod(unary, AioLoopbackMethod(AioLoopbackServer([server.aio_server_interceptor()])))
    methods = {
        "aio_loopback": plain,
        "aio_stamp_only": stamp_only,
        "aio_instrumented": channel.unary_unary(METHOD),
        "aio_client_interceptors": intercepted,
    }
    for name, facts in (("aio_least_agent", True), ("aio_bare_bookkeeping", False)):
        clients[name], server = least_agents(facts)
        methods[name] = clients[name].aio_method(
            AioLoopbackMethod(AioLoopbackServer([server.aio_server_interceptor()])), "server"
        )
    return methods, clients


class ColdCalls:
    """Times calls one at a time, each after evicting the CPU's caches by copying ``megabytes`` from
    one buffer to another (``--cold``; the copy is not timed).

    A call in a real server runs among gRPC's C core, the kernel and other processes, which leave
    little of its Python (code objects, dicts, the objects it reads) in the caches: a copy of more
    than the last-level cache before each call reproduces that. Each call's time includes one
    read of the clock, in every case alike.
    """

    def __init__(self, megabytes: int) -> None:
        self._source = bytearray(megabytes << 20)
        self._target = bytearray(megabytes << 20)
        self._began_ns = self._timed_ns = self._calls = 0

    def begin(self) -> None:
        """Evict the caches, then start timing one call."""
        self._target[:] = self._source
        self._began_ns = time.thread_time_ns()

    def end(self) -> None:
        """The call has returned."""
        self._timed_ns += time.thread_time_ns() - self._began_ns
        self._calls += 1

    def take(self) -> tuple[float, int]:
        """CPU seconds per call timed since the last take, and the calls timed; counts from zero again."""
        per_call, calls = self._timed_ns / 1e9 / max(self._calls, 1), self._calls
        self._timed_ns = self._calls = 0
        return per_call, calls


def per_call(method: Callable[[bytes], Any], seconds: float, cold: ColdCalls | None = None) -> tuple[float, int]:
    """CPU seconds of this thread per call, calling ``method`` in batches for ``seconds``, and the calls
    made; with ``cold``, one call at a time, each timed alone after the caches are evicted."""
    calls, start = 0, time.thread_time()
    if cold is not None:
        while time.thread_time() - start < seconds:
            cold.begin()
            method(PAYLOAD)
            cold.end()
        return cold.take()
    while (elapsed := time.thread_time() - start) < seconds:
        for _ in range(1000):
            method(PAYLOAD)
        calls += 1000
    return elapsed / calls, calls


async def aio_per_call(
    method: Callable[[bytes], Awaitable[Any]], seconds: float, cold: ColdCalls | None = None
) -> tuple[float, int]:
    """:func:`per_call` for an asyncio method, awaited in the running loop's task."""
    calls, start = 0, time.thread_time()
    if cold is not None:
        while time.thread_time() - start < seconds:
            cold.begin()
            await method(PAYLOAD)
            cold.end()
        return cold.take()
    while (elapsed := time.thread_time() - start) < seconds:
        for _ in range(1000):
            await method(PAYLOAD)
        calls += 1000
    return elapsed / calls, calls


def profile(name: str, seconds: float) -> None:
    """Run case ``name`` under cProfile for ``seconds`` and print where its time goes."""
    methods, _ = cases()
    aio_methods, _ = aio_cases()
    profiler = cProfile.Profile()
    if name in aio_methods:
        loop = asyncio.new_event_loop()
        profiler.runcall(loop.run_until_complete, aio_per_call(aio_methods[name], seconds))
        loop.close()
    else:
        profiler.runcall(per_call, methods[name], seconds)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=1.0, help="seconds per case per round (1)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (5)")
    parser.add_argument("--profile", metavar="CASE", help="profile one case instead of the benchmark")
    parser.add_argument(
        "--cold",
        type=int,
        metavar="MB",
        help="evict the caches before each call by copying MB megabytes (not timed): each call runs cold",
    )
    args = parser.parse_args()
    if args.profile:
        profile(args.profile, args.seconds)
        return
    methods, clients = cases()
    aio_methods, aio_clients = aio_cases()
    clients |= aio_clients
    loop = asyncio.new_event_loop()
    calls: dict[str, int] = {name: 0 for name in (*methods, *aio_methods)}
    cold = ColdCalls(args.cold) if args.cold else None

    def microseconds_per_call(name: str, method: Callable[[bytes], Any]) -> float:
        if name in aio_methods:
            seconds, made = loop.run_until_complete(aio_per_call(method, args.seconds, cold))
        else:
            seconds, made = per_call(method, args.seconds, cold)
        calls[name] += made
        return seconds * 1e6

    try:
        results = interleaved({**methods, **aio_methods}, args.rounds, microseconds_per_call)
    finally:
        loop.close()

    table = Table(
        title=f"one unary call's Python, µs of CPU: {args.rounds} interleaved rounds of {args.seconds:g} s per case"
        + (f", caches evicted before each call ({args.cold} MB copied)" if cold else "")
    )
    for column in ("case", "median", "lowest", "highest", "added to loopback"):
        table.add_column(column, justify="left" if column == "case" else "right")
    summary: dict[str, object] = {"seconds": args.seconds, "rounds": args.rounds, "timer": "thread CPU time"}
    summary["cold_mb"] = args.cold or 0
    summary |= medians_and_spreads(results, "us", 2)
    for name, values in results.items():
        loopback = "aio_loopback" if name.startswith("aio_") else "loopback"
        added = statistics.median(values) - statistics.median(results[loopback])
        table.add_row(name, *spread_row(values, ".2f"), "" if name == loopback else f"{added:.2f}")
        summary[f"{name}_calls"] = calls[name]
        if name != loopback:
            summary[f"{name}_added_us"] = round(added, 2)
        client = clients.get(name)
        if isinstance(client, RpcAgent):  # the agent was really on the path: it stamped every request
            summary[f"{name}_stamped_requests"] = stamped_requests(client)
        elif client is not None:  # and the least agent took in every stamped response
            summary[f"{name}_stamped_responses"] = client.taken_in("server")
    for key, (case, floor) in AGENT_KEYS.items():  # paired within each round, against drift
        above = [value - base for value, base in zip(results[case], results[floor], strict=True)]
        summary[key] = round(statistics.median(above), 2)
        summary[f"{key}_spread"] = spread(above, 2)
        table.add_row(f"{key} ({case} - {floor})", *spread_row(above, ".2f"), "")
    if cold is None:  # the targets are set for the warm measure
        summary["targets"] = {
            f"hot_path_agent_us_at_most_{TARGET_US:g}": summary["hot_path_agent_us"] <= TARGET_US,
            f"aio_hot_path_agent_us_at_most_{TARGET_US:g}": summary["aio_hot_path_agent_us"] <= TARGET_US,
        }
    Console(width=140).print(table)
    json_line(summary)


if __name__ == "__main__":
    main()
