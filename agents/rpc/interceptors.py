"""gRPC interceptors of the RPC-mode agent, for the sync and the asyncio APIs, server and client side.

They are thin: each translates a gRPC event into one call of the agent, as
:class:`~stablewatch.agents.rpc.calls.CallEvents` names them (:class:`~stablewatch.agents.rpc.agent.RpcAgent`
holds the lock, the core and the wait edges, and creates the interceptors), and carries stamps in metadata.

What travels (gRPC has metadata per call, not per message):

* A request carries the call's sequence number and its caller's stamp in one entry of its initial
  metadata, ``stablewatch-stamp: {seq}:{stamp}`` (one entry: each costs gRPC work on both sides). A
  response carries the server's stamp under the same key in the trailing metadata, set when the
  handler ends (returns, raises or aborts). So every call is two messages of the
  protocol: its opening, q -> p, and its end, p -> q. The messages inside a stream carry no stamp and are
  not counted: they are data of the call, never part of a channel state.
* Server side, the request is taken in (counted, recording first if its color asks) when the
  interceptor sees the call arrive, before the handler can run; a bad stamp makes the handler abort the
  call with ``INVALID_ARGUMENT`` without running the service's code. A stale stamp (the request was sent
  before the counts between the two processes restarted) makes it abort with ``ABORTED`` the same way,
  but the refusal carries the server's stamp: it is a response like any other, and the caller may retry.
  The handler runs with :data:`CURRENT_TASK` set to the call's name, so the calls it makes wait in its
  name. A call from a caller without an agent is named ``{method}#?:{seq}`` on arrival (neither
  server tells its interceptors the caller's address) and ``{method}#grpc://{host}:{seq}`` when its
  handler starts (see :class:`~stablewatch.agents.rpc.calls.IncomingCall` for why that is safe).
  Both servers' handlers are wrapped once per method: the call reaches its handler through a
  context variable the interceptor sets, since each server runs a call's interceptors and its
  handler in one context (the sync server's per-call ``contextvars.Context``, the asyncio server's
  task for the call). The asyncio server's wrapped handler is a coroutine (or an async generator),
  so a sync handler there is run as grpc.aio would run it, in threads of the call's context: with a
  sync servicer context, its request stream as an iterator, its response stream taken from it.
* Client side, the end of the call is taken in before the caller sees it: the unary response (or the
  error) before ``result()``/``await`` returns it, the end of a response stream before the iterator
  stops (or when grpc ends the call, if that comes first: a caller may never read a stream to its
  end). A bad stamp in the response raises :class:`~stablewatch.agents.rpc.calls.BadStamp` (an
  ``RpcError``, ``INTERNAL``), a stale one :class:`~stablewatch.agents.rpc.calls.StaleResponse`
  (``ABORTED``: the server ran the call, its response is not delivered), and the call's ``code()`` and
  ``details()`` say so too; an error without our server's stamp restarts the pair's counts (the
  request or the response may or may not have arrived).
* Breaking a deadlock: a unary-response call the agent can cancel from another thread (a sync
  ``future()``, an asyncio call) leaves its cancel on the call's record; the agent cancels it to
  break a proven deadlock, and the caller's code gets
  :class:`~stablewatch.agents.rpc.calls.DeadlockBroken` (``ABORTED``, the deadlock named) where
  grpc would have reported a cancellation. Its end is taken in like any end without the server's
  stamp. A blocking call through ``grpc.intercept_channel`` cannot be cancelled (grpc waits for it
  inside the continuation, on a call it never hands out): it is reported unbreakable (instance 0);
  :meth:`~stablewatch.agents.rpc.agent.RpcAgent.instrument_channel` makes blocking calls breakable.

Wait edges: a call with a response stream (unary-stream, stream-stream) makes none (its messages carry no
stamp, so a message in flight inside it could wake a caller the cut shows waiting); a stream-unary call
waits like a unary one, for the whole call.

Limits of the asyncio client interceptors (the instrumented asyncio channel of
:mod:`stablewatch.agents.rpc.aio_channel` has none of them): grpc.aio runs client interceptors in a
task of its own, so a call waits in the name of the task that awaits that task as the call starts
(the caller, when it awaits the call at once), else of grpc's task (a deadlock through it is missed);
a unary call returns its response (the call object's metadata accessors see none); and a request
stream must be given as an iterator (not written with ``call.write``).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import sys
import threading
import types
import weakref
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from concurrent import futures
from typing import Any, NamedTuple

import grpc

from stablewatch.agents.rpc.calls import (
    CallEvents,
    DeadlockBroken,
    IncomingCall,
    OutgoingCall,
    RefusedResponse,
    WorkerPool,
    cancel_future,
)
from stablewatch.agents.rpc.core import STAMP_KEY

__all__ = ["CURRENT_TASK", "AioServerInterceptor", "ClientInterceptor", "ServerInterceptor", "aio_client_interceptors"]

_log = logging.getLogger(__name__)

#: The name of the handler task running in this context (``"{method}#{caller}@{incarnation}:{seq}"``), else None.
CURRENT_TASK: contextvars.ContextVar[str | None] = contextvars.ContextVar("stablewatch_current_task", default=None)
#: The call whose handler's context this is, which set :data:`CURRENT_TASK` to its name (None
#: outside a handler's context); the call's ``own_task`` is the handler's asyncio task, or a sync
#: handler's thread, while the handler runs, then None. A task the handler starts inherits both
#: variables, and so does a thread that code hands the handler's context
#: (``contextvars.copy_context().run``, ``asyncio.to_thread``), but their calls are their own: the
#: handler may not be waiting for them, and their calls in the handler's name could make a
#: deadlock up. (The variable holds the call, not the task: a variable of the task's own context
#: naming the task would make a cycle, task -> its context -> the task, that only the garbage
#: collector frees, with the call's coroutine, request and response, on every call. The call's
#: link to its task is cut as the handler ends.)
NAMED_TASK: contextvars.ContextVar[IncomingCall | None] = contextvars.ContextVar("stablewatch_named_task", default=None)


_running_loop, _current_thread, _get_ident = asyncio._get_running_loop, threading.current_thread, threading.get_ident
#: asyncio's current task of each loop running a task step now (``_asyncio``'s own dict on Python 3.11
#: to 3.13; later versions keep it elsewhere, and this stays None). When it is empty, no task runs in
#: this thread, and the running loop need not be looked up: that costs a ``getpid()`` on every call.
_current_tasks: dict[Any, Any] | None = (
    getattr(asyncio.tasks, "_current_tasks", None) if sys.version_info < (3, 14) else None
)
#: The Thread of each thread's ident, as ``threading.current_thread()`` reads it (without its frame).
_threads: dict[int, threading.Thread] = threading._active  # type: ignore[attr-defined]


def current_task_name() -> str:
    """The waiter of a call made here: the running handler's call name, else the asyncio task's or
    thread's name. A handler's name reaches the tasks it starts and any thread its context is copied
    into, but names only its own task or thread (see :data:`NAMED_TASK`)."""
    name = CURRENT_TASK.get()
    if name and ((named := NAMED_TASK.get()) is None or _is_own_task(named)):
        return name
    if _current_tasks is not None and not _current_tasks:  # no task runs here: a thread's call
        thread = _threads.get(_get_ident())  # current_thread(), written out
        return (thread if thread is not None else _current_thread()).name
    loop = _running_loop()
    if loop is None:  # a thread without a loop: no exception to raise and catch
        return _current_thread().name
    task = asyncio.current_task(loop)
    return task.get_name() if task is not None else _current_thread().name


def _is_own_task(named: IncomingCall) -> bool:
    """Whether a call made here, blocking this thread, is ``named``'s handler's own wait: the code
    running here is its asyncio handler's own task, or runs in a sync handler's thread (not a task
    it started, a callback it scheduled or a thread its context was copied into, whose calls it may
    not wait for)."""
    own = named.own_task
    if own is None:  # the handler ended
        return False
    # A sync handler's thread: a blocking call here blocks the handler, even when a task of an event
    # loop the handler runs (asyncio.run) makes it.
    if own is _current_thread():
        return True
    loop = _running_loop()  # this thread's: another thread's current task is not the code running here
    return loop is not None and asyncio.current_task(loop) is own


def on_loop(loop: asyncio.AbstractEventLoop, soon: Callable[[], object], closed: Callable[[], object]) -> None:
    """Run `soon` on `loop`'s thread: at once when that is this thread, else as soon as the loop
    runs a callback; `closed` instead when the loop is closed (its calls with it). For grpc's done
    callbacks, which run in whatever thread ends the call (a garbage collection, too)."""
    if getattr(loop, "_thread_id", None) == _get_ident():  # a BaseEventLoop's thread: the common case
        soon()
        return
    try:
        loop.call_soon_threadsafe(soon)
    except RuntimeError:
        closed()


def stamp_of(metadata: Any) -> str | None:
    """The text of the server's stamp among a call's trailing ``metadata``, or None: the last entry
    of ours (each hop sends one, added last: see :func:`stamped`)."""
    stamp = None
    for key, value in metadata or ():
        if key == STAMP_KEY:
            stamp = value
    return stamp.decode(errors="replace") if isinstance(stamp, bytes) else stamp


def stamped(metadata: Any, entries: tuple[tuple[str, str], ...]) -> Any:
    """``metadata`` with ``entries`` (this hop's stamp, or nothing) as the only entries of ours.

    Stamps are per hop: a handler may pass its own call's metadata along to the next call, or copy
    the trailing metadata of a call it made into its own, as gateways do. A stamp there is another
    hop's; carried on, it would count this hop's message on another pair's channel.
    """
    if metadata and any(entry[0] == STAMP_KEY for entry in metadata):
        metadata = tuple(entry for entry in metadata if entry[0] != STAMP_KEY)
    if not entries:
        return metadata
    return (*metadata, *entries) if metadata else entries


def method_name(method: str | bytes) -> str:
    """A call's method as text (gRPC hands it over as bytes in places)."""
    return method.decode() if isinstance(method, bytes) else method


def take_in_end(agent: CallEvents, call: OutgoingCall, ended: Any) -> None:
    """Take in the end of the sync ``call`` from the finished gRPC call ``ended``: the server's stamp,
    or, without one, its status (which matters only then). Raises a :class:`RefusedResponse` when
    the response is refused."""
    stamp = stamp_of(ended.trailing_metadata())
    agent.call_returned(call, stamp, None if stamp is not None else ended.code())


# -- server side ----------------------------------------------------------------------------------


def _start(agent: CallEvents, call: IncomingCall, context: Any) -> None:
    """Tell the agent the call's handler starts; a caller without an agent is named by its address now
    (the interceptor was not told it), and the handler's own calls wait in that name."""
    if call.peer is None:
        agent.handler_started(call, context.peer())
        CURRENT_TASK.set(call.name)
    else:
        agent.handler_started(call)


def _end_sync(agent: CallEvents, call: IncomingCall, context: grpc.ServicerContext) -> None:
    entry = agent.respond(call, "" if call.peer is not None else context.peer(), context.is_active())
    if entry is not None:
        context.set_trailing_metadata(stamped(context.trailing_metadata(), (entry,)))


def _served(served: contextvars.ContextVar[IncomingCall]) -> IncomingCall:
    """The call the running handler serves, as its server interceptor set it on arrival."""
    call = served.get(None)
    if call is None:
        raise RuntimeError(
            "stablewatch: a handler ran outside its call's context (grpc's sync server runs a call's "
            "interceptors and its handler in one context; did something run the handler on its own?)"
        )
    return call


def _unary_sync(agent: CallEvents, served: contextvars.ContextVar[IncomingCall], behavior: Callable[..., Any]) -> Any:
    # This runs for every call (``bench/rpc_hot_path.py`` times it): the common case (a caller with
    # an agent, a call still active) is written out here rather than through _start and _end_sync.
    handler_started, respond, get, current_thread = agent.handler_started, agent.respond, served.get, _current_thread

    def run(request: Any, context: grpc.ServicerContext) -> Any:
        call = get(None)
        if call is None:
            call = _served(served)  # raises
        if call.peer is None:
            _start(agent, call, context)
        else:
            handler_started(call)
        call.own_task = current_thread()  # its calls wait in its name here only (see NAMED_TASK)
        try:
            if call.error is not None:
                context.abort(call.status, call.error)
            return behavior(request, context)
        finally:
            call.own_task = None
            if call.peer is None:
                _end_sync(agent, call, context)
            else:
                entry = respond(call, "", context.is_active())
                if entry is not None:
                    trailing = context.trailing_metadata()
                    context.set_trailing_metadata(stamped(trailing, (entry,)) if trailing else (entry,))

    return run


def _streaming_sync(
    agent: CallEvents, served: contextvars.ContextVar[IncomingCall], behavior: Callable[..., Any]
) -> Any:
    def run(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        call = _served(served)
        _start(agent, call, context)
        # grpc's sync server takes every response in the worker the generator started in.
        call.own_task = _current_thread()
        try:
            if call.error is not None:
                context.abort(call.status, call.error)
            yield from behavior(request, context)
        finally:
            call.own_task = None
            _end_sync(agent, call, context)

    return run


class _Handler(NamedTuple):
    request_streaming: bool
    response_streaming: bool
    request_deserializer: Any
    response_serializer: Any
    unary_unary: Any
    unary_stream: Any
    stream_unary: Any
    stream_stream: Any


class _MethodHandler(_Handler, grpc.RpcMethodHandler):
    """A method handler with its behavior wrapped (a plain tuple, as grpc reads it)."""


def _own_pool(behavior: Any) -> futures.ThreadPoolExecutor | None:
    """The thread pool a method's ``behavior`` runs in instead of the server's, if it has one: grpc's sync
    server reads ``behavior.experimental_thread_pool`` (``_select_thread_pool_for_behavior``)."""
    pool = getattr(behavior, "experimental_thread_pool", None)
    return pool if isinstance(pool, futures.ThreadPoolExecutor) else None


def _wrap(
    handler: grpc.RpcMethodHandler,
    wrap_unary: Callable[[Callable[..., Any]], Any],
    wrap_streaming: Callable[[Callable[..., Any]], Any],
) -> Any:
    """``handler`` with its behavior wrapped (``wrap_unary`` for a unary response); a behavior's own
    thread pool is kept on the wrapped one, so that grpc's sync server still runs the method there."""
    requests, responses = handler.request_streaming, handler.response_streaming
    behavior = _behavior(handler)
    wrapped = (wrap_streaming if responses else wrap_unary)(behavior)
    pool = _own_pool(behavior)
    if pool is not None:
        wrapped.experimental_thread_pool = pool
    behaviors: list[Any] = [None, None, None, None]  # unary_unary, unary_stream, stream_unary, stream_stream
    behaviors[2 * requests + responses] = wrapped
    return _MethodHandler(requests, responses, handler.request_deserializer, handler.response_serializer, *behaviors)


def _behavior(handler: grpc.RpcMethodHandler) -> Any:
    """The one behavior a method handler has (the one its kinds of request and response name)."""
    if handler.request_streaming:
        return handler.stream_stream if handler.response_streaming else handler.stream_unary
    return handler.unary_stream if handler.response_streaming else handler.unary_unary


# Wrapped handlers kept per server interceptor: one per method, unless an interceptor behind ours
# makes a new handler for every call (then every call is wrapped anew, and the cache starts again
# whenever it holds this many).
_MAX_WRAPPED = 64


class _Wrapped(NamedTuple):
    handler: grpc.RpcMethodHandler  # kept alive, so that its id is not reused while it is a key
    wrapped: Any
    pool: WorkerPool | None  # the pool its calls queue in: None for a method with a pool of its own


def _kept(
    cache: dict[int, _Wrapped], handler: grpc.RpcMethodHandler, wrapped: Any, pool: WorkerPool | None
) -> _Wrapped:
    """Keep ``wrapped``, the wrapping of ``handler``, in ``cache`` (bounded); returns what it keeps."""
    if len(cache) >= _MAX_WRAPPED:
        cache.clear()
    kept = cache[id(handler)] = _Wrapped(handler, wrapped, pool)
    return kept


class ServerInterceptor(grpc.ServerInterceptor):
    """The sync server's interceptor (``agent.server_interceptor(workers=N)``).

    grpc calls ``intercept_service`` in the server's polling thread when a call arrives, before the
    call is queued for the thread pool: that is where the request is taken in (and, with ``workers``,
    where it joins the queue). The handler runs later in a worker, in the same ``contextvars.Context``
    (the sync server makes one per call for its interceptors and its handler): the interceptor puts
    the call there, in a variable of its own, and in :data:`CURRENT_TASK` and :data:`NAMED_TASK`
    (its name, for the calls the handler makes in its own thread), so the handler is wrapped once
    per method, not per call. A method whose handler runs in a thread pool of its own (grpc's
    ``experimental_thread_pool``) keeps it, and its calls never queue in ``workers``.
    """

    def __init__(self, agent: CallEvents, pool: WorkerPool | None) -> None:
        self._agent = agent
        self._pool = pool
        # One variable per interceptor: two of them in one server must not read each other's calls.
        self._served: contextvars.ContextVar[IncomingCall] = contextvars.ContextVar("stablewatch_served_call")
        self._wrapped: dict[int, _Wrapped] = {}  # id(handler) -> its wrapping

    @property
    def served(self) -> contextvars.ContextVar[IncomingCall]:
        """The context variable that holds the call a handler serves (a WorkerExecutor reads it)."""
        return self._served

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], handler_call_details: grpc.HandlerCallDetails
    ) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        kept = self._wrapped.get(id(handler))
        if kept is None or kept.handler is not handler:
            if handler.response_streaming and getattr(_behavior(handler), "experimental_non_blocking", False):
                # Its responses are sent from other threads after the handler returns: neither the
                # response's stamp nor the handler's end is where the wrapping looks for them.
                raise TypeError(
                    f"stablewatch: the handler of {method_name(handler_call_details.method)} is "
                    "experimental_non_blocking, which RPC mode's server interceptor does not support"
                )
            agent, served = self._agent, self._served
            wrapped = _wrap(
                handler,
                functools.partial(_unary_sync, agent, served),
                functools.partial(_streaming_sync, agent, served),
            )
            kept = _kept(self._wrapped, handler, wrapped, None if _own_pool(_behavior(handler)) else self._pool)
        call = self._agent.arrive(handler_call_details.method, handler_call_details.invocation_metadata, kept.pool)
        if handler.request_streaming:
            call.streams_requests = True
        self._served.set(call)
        CURRENT_TASK.set(call.name)  # the calls its handler makes wait in its name
        NAMED_TASK.set(call)  # in its own thread only: the context may be copied to others
        return kept.wrapped


class _StampingContext:
    """An aio servicer context whose ``abort`` carries the response's stamp (aio sends the status at once)."""

    __slots__ = ("_agent", "_call", "_context")  # one is made per call

    def __init__(self, agent: CallEvents, call: IncomingCall, context: grpc.aio.ServicerContext) -> None:
        self._agent, self._call, self._context = agent, call, context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        # grpc.aio sends the status now, with these trailing metadata in place of the context's: the
        # response's stamp goes into them first, as the handler's end would add it.
        if trailing_metadata:
            self._context.set_trailing_metadata(tuple(trailing_metadata))
        _end_aio(self._agent, self._call, self._context)
        await self._context.abort(code, details, tuple(self._context.trailing_metadata() or ()))

    async def abort_with_status(self, status: grpc.Status) -> None:
        # grpc.aio's own calls its context's abort, not this one: it would send no stamp.
        await self.abort(status.code, status.details, status.trailing_metadata)


def _end_aio(agent: CallEvents, call: IncomingCall, context: grpc.aio.ServicerContext, cancelled: bool = False) -> None:
    """The handler ended: count its response unless the call is over, or ``cancelled`` (its task is:
    grpc.aio cancels the handler's task when the call is cancelled or its deadline passes, and its
    context says neither done nor cancelled while the task unwinds)."""
    active = not cancelled and not context.done() and not context.cancelled()
    entry = agent.respond(call, "" if call.peer is not None else context.peer(), active)
    if entry is not None:
        context.set_trailing_metadata(stamped(context.trailing_metadata(), (entry,)))


#: What a sync handler's iterator gives when it has no more (``next(iterator, _END)``).
_END: Any = object()


class _SyncContext:
    """The servicer context of a sync handler on an asyncio server, as grpc.aio gives such a handler
    one (grpc.aio sees only the interceptor's wrapped handler, a coroutine, and gives it an asyncio one).

    ``abort`` (and ``abort_with_status``) ends the call and raises, and ``send_initial_metadata``
    sends, each on the call's loop, from the handler's thread; ``add_callback``'s callbacks run when
    the handler has ended without an error. Everything else is the asyncio context's: the stamping
    one, so that an abort carries the response's stamp.
    """

    __slots__ = ("_callbacks", "_context", "_loop")

    def __init__(self, context: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._context, self._loop = context, loop
        self._callbacks: list[Callable[[], None]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    def _on_loop(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        self._on_loop(self._context.abort(code, details, trailing_metadata))  # raises grpc.aio's AbortError

    def abort_with_status(self, status: grpc.Status) -> None:
        self.abort(status.code, status.details, status.trailing_metadata)

    def send_initial_metadata(self, initial_metadata: Any) -> None:
        self._on_loop(self._context.send_initial_metadata(initial_metadata))

    def add_callback(self, callback: Callable[[], None]) -> bool:
        self._callbacks.append(callback)
        return True

    def ended(self) -> None:
        """The handler ended without an error: run its callbacks (in the loop, as grpc.aio runs them)."""
        for callback in self._callbacks:
            callback()


def _sync_requests(requests: Any, loop: asyncio.AbstractEventLoop) -> Iterator[Any]:
    """An asyncio request stream as a sync handler reads it, from its thread (as grpc.aio gives it)."""
    iterator = requests.__aiter__()

    async def next_request() -> Any:
        try:
            return await iterator.__anext__()
        except StopAsyncIteration:
            return _END

    while (request := asyncio.run_coroutine_threadsafe(next_request(), loop).result()) is not _END:
        yield request


def _awaitable(behavior: Callable[..., Any], requests: bool = False) -> Callable[..., Any]:
    """``behavior`` (with a unary response) as a coroutine function: itself, or a sync one run in a
    thread, as grpc.aio runs it: with a sync context (:class:`_SyncContext`) and, for a request stream
    (``requests``), a sync iterator of it. The thread runs in the call's context (``asyncio.to_thread``
    copies it), as the handler's own while it runs there (see :func:`_as_handler`), so the handler's
    own calls wait in its name; it is one of the loop's default executor
    (the interceptor is not told of a ``migration_thread_pool`` given to the server). Decided once per
    method."""
    if inspect.iscoroutinefunction(behavior):
        return behavior

    async def in_thread(request: Any, context: Any) -> Any:
        loop = asyncio.get_running_loop()
        sync_context = _SyncContext(context, loop)
        if requests:
            request = _sync_requests(request, loop)
        response = await asyncio.to_thread(_as_handler, NAMED_TASK.get(), behavior, request, sync_context)
        sync_context.ended()
        return response

    return in_thread


def _as_handler(call: IncomingCall | None, function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` in this thread as the sync handler of ``call`` on an asyncio server: the
    call's ``own_task`` is this thread meanwhile (the handler's task awaits it), so the calls made
    here wait in the handler's name (the blocking calls of a loop it runs here too), and not those
    of a task it schedules on the server's loop."""
    if call is None:
        return function(*args)
    task, thread = call.own_task, _current_thread()
    call.own_task = thread
    try:
        return function(*args)
    finally:
        if call.own_task is thread:  # not if the handler's task ended meanwhile (cancelled): it is over
            call.own_task = task


def _nested_code(function: Callable[..., Any], name: str) -> types.CodeType:
    """The code of the function ``name`` defined inside ``function``."""
    return next(c for c in function.__code__.co_consts if isinstance(c, types.CodeType) and c.co_name == name)


#: The code of the agent's frames that run a sync handler, each with the handler's ``call`` a local.
_HANDLER_CODES = frozenset(
    (_nested_code(_unary_sync, "run"), _nested_code(_streaming_sync, "run"), _as_handler.__code__)
)


def _iterator_of(behavior: Callable[..., Any], request: Any, context: Any) -> Iterator[Any]:
    return iter(behavior(request, context))


def _in_threads(behavior: Callable[..., Any], requests: bool) -> Callable[..., AsyncIterator[Any]]:
    """A sync handler with a response stream (a generator function, or one returning an iterator) as
    an async generator function, as grpc.aio runs one: called with a sync context, its request stream
    (``requests``) as a sync iterator, and each of its responses taken in a thread, in the call's context."""

    async def produce(request: Any, context: Any) -> AsyncIterator[Any]:
        loop = asyncio.get_running_loop()
        sync_context = _SyncContext(context, loop)
        if requests:
            request = _sync_requests(request, loop)
        call = NAMED_TASK.get()
        responses = await asyncio.to_thread(_as_handler, call, _iterator_of, behavior, request, sync_context)
        while (response := await asyncio.to_thread(_as_handler, call, next, responses, _END)) is not _END:
            yield response
        sync_context.ended()

    return produce


class _AioServed:
    """Where an asyncio handler, wrapped once per method, finds the call it serves.

    grpc.aio runs a call's server interceptors and then its handler in one task (``_handle_rpc``
    awaits the interceptors' chain, then the handler), so a variable the interceptor sets is the
    handler's too. Not so if an interceptor ahead of ours awaits the rest of the chain in a task
    of its own (``asyncio.wait_for`` on Python 3.11 does): the handler then runs unobserved (its
    caller waits on a task this process does not report: a deadlock through it is missed, never
    invented), and a warning says so once.
    """

    def __init__(self) -> None:
        self.var: contextvars.ContextVar[IncomingCall] = contextvars.ContextVar("stablewatch_aio_served_call")
        # The thread and loop of the last call looked up the long way (one tuple, read at once:
        # two servers' loops in two threads may set it by turns). A handler's task is looked up in
        # that loop only from that thread (where it is the one running loop, if it runs), which
        # spares asyncio's lookup of the running loop, a getpid() a call.
        self.home: tuple[int | None, Any] = (None, None)
        self._warned = False

    def own_task(self) -> Any:
        """The asyncio task running now (the call's, where its handler runs)."""
        thread, loop = self.home
        if _current_tasks is not None and thread == _get_ident():
            task = _current_tasks.get(loop)
            if task is not None:
                return task
        task = asyncio.current_task()  # another loop: the interceptor serves a second server, or a new asyncio.run
        if task is not None:
            self.home = (_get_ident(), task.get_loop())
        return task

    def get(self) -> IncomingCall | None:
        call = self.var.get(None)
        if call is None and not self._warned:
            self._warned = True
            _log.warning(
                "stablewatch: an asyncio handler ran outside the task its server interceptor saw the call in "
                "(does an interceptor ahead of the agent's await its continuation in a task of its own?): "
                "such calls are served without taking part in snapshots"
            )
        return call


def _unary_aio(
    agent: CallEvents, served: _AioServed, behavior: Callable[..., Any], requests: bool = False
) -> Callable[..., Any]:
    # This runs for every call (``bench/rpc_hot_path.py`` times it): the common case (a caller with
    # an agent) is written out here rather than through _start and _end_aio.
    behave, get, respond = _awaitable(behavior, requests), served.var.get, agent.respond
    set_task, set_named, tasks, get_ident = CURRENT_TASK.set, NAMED_TASK.set, _current_tasks, _get_ident

    async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
        call = get(None)
        if call is None:
            call = served.get()  # None again, and warned once
            if call is None:
                return await behave(request, context)
        if call.peer is None:  # named by its caller's address from now on
            _start(agent, call, context)
        # Else nothing to tell as the handler starts: an asyncio server's call has no pool to leave.
        set_task(call.name)  # the handler's own task: nothing to restore
        # served.own_task(), its common case written out.
        home = served.home
        own = tasks.get(home[1]) if tasks is not None and home[0] == get_ident() else None
        if own is None:
            own = served.own_task()
        call.own_task = own
        set_named(call)
        try:
            if call.error is not None:
                await _StampingContext(agent, call, context).abort(call.status, call.error)
            return await behave(request, _StampingContext(agent, call, context))
        finally:
            call.own_task = None
            # A cancelled call's task is cancelled (see _end_aio): no response goes out. The task is
            # let go here: a traceback through this frame (an abort's) must not hold it, a cycle.
            cancelled, own = own is not None and own.cancelling() > 0, None
            if call.peer is None:
                _end_aio(agent, call, context, cancelled)
            else:
                entry = respond(call, "", not cancelled and not context.done() and not context.cancelled())
                if entry is not None:
                    trailing = context.trailing_metadata()
                    context.set_trailing_metadata(stamped(trailing, (entry,)) if trailing else (entry,))

    return run


def _streaming_aio(
    agent: CallEvents, served: _AioServed, behavior: Callable[..., Any], requests: bool = False
) -> Callable[..., Any]:
    """A response-stream handler, wrapped: an async generator function (a sync handler's responses
    are taken from it in threads), or, for a coroutine function (one that writes with
    ``context.write()``), as a unary one."""
    if inspect.iscoroutinefunction(behavior):
        return _unary_aio(agent, served, behavior)
    produce = behavior if inspect.isasyncgenfunction(behavior) else _in_threads(behavior, requests)

    async def generate(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        call = served.get()
        if call is None:
            async for response in produce(request, context):
                yield response
            return
        _start(agent, call, context)
        CURRENT_TASK.set(call.name)
        own = call.own_task = served.own_task()
        NAMED_TASK.set(call)
        closed = False
        try:
            if call.error is not None:
                await _StampingContext(agent, call, context).abort(call.status, call.error)
            async for response in produce(request, _StampingContext(agent, call, context)):
                yield response
        except GeneratorExit:
            # Closed before its end: the call was cancelled, or the generator is finalized after
            # the server stopped, when touching the context crashes grpc. No response goes out.
            closed = True
            raise
        finally:
            call.own_task = None
            cancelled, own = own is not None and own.cancelling() > 0, None  # (as in _unary_aio)
            if closed:
                agent.respond(call, "", False)
            else:
                _end_aio(agent, call, context, cancelled)

    return generate


class AioServerInterceptor(grpc.aio.ServerInterceptor):
    """The asyncio server's interceptor (``agent.aio_server_interceptor()``).

    It takes the request in when the call arrives and puts the call in a variable of the call's
    task, where the handler, wrapped once per method, finds it (see :class:`_AioServed`). Nothing
    queues in an asyncio server, so a call from a caller without an agent is named by the caller's
    address when its handler starts, before its name can appear in a recorded state.
    """

    def __init__(self, agent: CallEvents) -> None:
        self._agent = agent
        self._served = _AioServed()  # one per interceptor, as for the sync one
        self._served_var = self._served.var
        self._wrapped: dict[int, _Wrapped] = {}  # id(handler) -> its wrapping

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], handler_call_details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        kept = self._wrapped.get(id(handler))
        if kept is None or kept.handler is not handler:
            agent, served = self._agent, self._served
            requests = handler.request_streaming  # a sync handler reads its request stream as an iterator
            wrapped = _wrap(
                handler,
                functools.partial(_unary_aio, agent, served, requests=requests),
                functools.partial(_streaming_aio, agent, served, requests=requests),
            )
            kept = _kept(self._wrapped, handler, wrapped, None)
        call = self._agent.arrive(handler_call_details.method, handler_call_details.invocation_metadata, None)
        self._served_var.set(call)
        return kept.wrapped


# -- client side ----------------------------------------------------------------------------------


class _Details(NamedTuple):
    method: Any
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _CallDetails(_Details, grpc.ClientCallDetails):
    """Call details with the stamp added to the metadata."""


def with_stamp(metadata: Any, call: OutgoingCall) -> Any:
    """A call's request metadata with the stamp of ``call`` (if it carries one) as the only one of ours."""
    return stamped(metadata, call.metadata)


def _details_with(details: Any, call: OutgoingCall) -> Any:
    """The sync call's details with the stamp added to its metadata."""
    if not call.metadata and not details.metadata:
        return details
    metadata = with_stamp(details.metadata, call)
    wait_for_ready = getattr(details, "wait_for_ready", None)
    compression = getattr(details, "compression", None)
    return _CallDetails(details.method, details.timeout, metadata, details.credentials, wait_for_ready, compression)


def _aio_details_with(details: Any, call: OutgoingCall) -> Any:
    """The asyncio call's details with the stamp added to its metadata."""
    if (not call.metadata and not details.metadata) or not isinstance(details, grpc.aio.ClientCallDetails):
        return _details_with(details, call)
    metadata = with_stamp(details.metadata, call)
    wait_for_ready = getattr(details, "wait_for_ready", None)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials, wait_for_ready)


class _Settled:
    """Takes in the end of one sync call exactly once, from whichever comes first: the caller or
    the call's termination callback (a call the caller abandons still ends its wait).

    It holds grpc's call object weakly, and its callback leads back to nothing but itself: grpc
    cancels a call whose object its caller drops, when the object is collected (a response stream
    read halfway, then dropped), and a strong reference from here would keep it open for good.
    Its proxy (:class:`_UnaryOutcome`) holds the object, so while the caller can reach the call,
    so can this.
    """

    def __init__(self, agent: CallEvents, call: OutgoingCall, outcome: Any) -> None:
        self.agent, self._call = agent, call
        self._outcome: Callable[[], Any] = weakref.ref(outcome)
        self._lock = threading.Lock()
        self.refused: RefusedResponse | None = None  # the call's response, refused
        self._done = False
        # grpc.Call's callback, not the future's done callback: grpc keeps that one bound to the call
        # object (a partial), which would keep the object alive from its own callback list.
        try:
            registered = outcome.add_callback(self._ended)
        except NotImplementedError:  # grpc's _InactiveRpcError (a call that failed at once) has none
            registered = False
        if not registered:  # it ended already
            self.settle(quiet=True)

    def _ended(self) -> None:
        """grpc's callback: the call ended (or was cancelled when its dropped object was collected)."""
        self.settle(quiet=True)

    def settle(self, quiet: bool = False) -> None:
        """Take the end in (once); raise a refused response unless ``quiet``. Only for a call that
        ended: reading the end of one still out blocks until it ends."""
        with self._lock:
            if not self._done:
                outcome = self._outcome()
                try:
                    if outcome is None:  # collected: grpc cancelled it, and nobody knows what arrived
                        self.agent.call_returned(self._call, None, grpc.StatusCode.CANCELLED)
                    else:
                        take_in_end(self.agent, self._call, outcome)
                except RefusedResponse as error:
                    self.refused = error
                # Done only now: a caller interrupted while it took the end in leaves it to the callback.
                self._done = True
        if self.refused is not None and not quiet:
            raise self.refused


class _UnaryOutcome(grpc.Call, grpc.Future):
    """A sync unary call's result, handed over only after its end was taken in.

    A call cancelled to break a deadlock fails with :class:`DeadlockBroken` (its ``code()`` is
    ``ABORTED``), not as a cancelled future.
    """

    caller_waits = True  # the caller is reported waiting on the callee while the call is out

    def __init__(self, agent: CallEvents, call: OutgoingCall, outcome: Any) -> None:
        self._outcome = outcome
        self._call: OutgoingCall | None = call
        self._settled = _Settled(agent, call, outcome)
        if self.caller_waits:
            call.handle, call.cancel = outcome, cancel_future  # breakable from now on (cancel last)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._outcome, name)

    def _broken(self) -> DeadlockBroken | None:
        """The error of a call cancelled to break a deadlock, else None."""
        call = self._call
        if call is None or call.broken is None or not self._outcome.cancelled():
            return None
        return call.broken_error()

    def _block(self) -> str | None:
        """This thread blocks on the call now: it waits on the callee's task (a future of the
        instrumented channel waits only from here), beside any other thread blocked on it. Returns
        the name it waits in, for :meth:`_unblock`, or None if it began no wait (the call ended, or
        its maker waits on it already: a call of the client interceptor waits from when it is made)."""
        call = self._call
        if call is None or self._outcome.done():
            return None
        # Each blocking thread is a blocker of its own, even of a name already waiting (two threads
        # of one name, or the maker of a client interceptor's call, which waits from its making):
        # one leaving ends only its own part (RpcAgent.not_awaited).
        name = current_task_name()
        return name if self._settled.agent.awaited(call, name) else None

    def _unblock(self, waiter: str | None) -> None:
        """The thread that began the wait ``waiter`` (:meth:`_block`) stops blocking, the call still out."""
        if waiter is not None:
            self._settled.agent.not_awaited(self._call, waiter)  # type: ignore[arg-type]

    def result(self, timeout: float | None = None) -> Any:
        began = self._block()
        try:
            value = self._outcome.result(timeout)
        except grpc.FutureTimeoutError:
            self._unblock(began)
            raise
        except grpc.FutureCancelledError:
            self._settled.settle()
            broken = self._broken()
            if broken is not None:
                raise broken from None
            raise
        except BaseException:
            # Interrupted (Ctrl-C) while it waited: the caller gets it at once. A call still out goes
            # on, and its end is taken in by the callback when it comes (reading it now would block
            # until then); its caller no longer blocks on it.
            if self._outcome.done():
                self._settled.settle()
            else:
                self._unblock(began)
            raise
        self._settled.settle()
        return value

    def exception(self, timeout: float | None = None) -> Any:
        began = self._block()
        try:
            error = self._outcome.exception(timeout)
        except grpc.FutureTimeoutError:
            self._unblock(began)
            raise
        except grpc.FutureCancelledError:
            broken = self._broken()
            if broken is None:
                raise
            self._settled.settle(quiet=True)
            return broken
        except BaseException:  # interrupted while it waited: as in result(), the call goes on
            self._unblock(began)
            raise
        try:
            self._settled.settle()
        except RefusedResponse as refused:
            return refused
        return error

    def traceback(self, timeout: float | None = None) -> Any:
        return self._outcome.traceback(timeout)

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        self._outcome.add_done_callback(lambda _: fn(self))

    def cancel(self) -> bool:
        return self._outcome.cancel()

    def cancelled(self) -> bool:
        return self._outcome.cancelled() and self._broken() is None

    def running(self) -> bool:
        return self._outcome.running()

    def done(self) -> bool:
        return self._outcome.done()

    def is_active(self) -> bool:
        return self._outcome.is_active()

    def time_remaining(self) -> float | None:
        return self._outcome.time_remaining()

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return self._outcome.add_callback(callback)

    def initial_metadata(self) -> Any:
        return self._outcome.initial_metadata()

    def trailing_metadata(self) -> Any:
        return self._outcome.trailing_metadata()

    def _met_instead(self) -> RefusedResponse | None:
        """What the caller meets in place of the finished call's own end: its refused response (the
        end is taken in now, if its done callback has not run yet), or the error of a break; else None."""
        self._settled.settle(quiet=True)
        return self._settled.refused or self._broken()

    def code(self) -> grpc.StatusCode:
        code = self._outcome.code()  # once the call has ended
        instead = self._met_instead()
        return instead.code() if instead is not None else code

    def details(self) -> str | None:
        details = self._outcome.details()
        instead = self._met_instead()
        return instead.details() if instead is not None else details


class _RefusedOutcome(_UnaryOutcome):
    """A call whose end was taken in already and whose response is refused: its result is the error."""

    def __init__(self, outcome: Any, error: RefusedResponse) -> None:
        self._outcome, self._error, self._call = outcome, error, None

    def result(self, timeout: float | None = None) -> Any:
        raise self._error

    def exception(self, timeout: float | None = None) -> Any:
        return self._error

    def code(self) -> grpc.StatusCode:
        return self._error.code()

    def details(self) -> str:
        return self._error.details()


class _StreamOutcome(_UnaryOutcome):
    """A sync response stream: the iterator stops (or raises) only after the call's end was taken in."""

    caller_waits = False  # its messages are not counted: a wait on it could be a false deadlock

    def __iter__(self) -> _StreamOutcome:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._outcome)
        except (StopIteration, grpc.RpcError):
            self._settled.settle()
            raise


class ClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """The sync client's interceptor (``agent.client_interceptor(peer)``), for every kind of call."""

    def __init__(self, agent: CallEvents, peer: str, instrumented: bool) -> None:
        self._agent, self._peer, self._instrumented = agent, peer, instrumented

    def _invoke(self, continuation: Callable[..., Any], details: Any, request: Any, kind: type[_UnaryOutcome]) -> Any:
        agent = self._agent
        method = method_name(details.method)
        call = agent.call_out(self._peer, method, current_task_name(), self._instrumented, kind.caller_waits)
        try:
            outcome = continuation(_details_with(details, call), request)
        except BaseException:
            agent.call_returned(call, None, grpc.StatusCode.UNKNOWN)
            raise
        if kind is _UnaryOutcome and outcome.done():
            # A blocking call (``__call__``, ``with_call``): the continuation returned its end. Take it
            # in now, before the caller sees it; nothing is left to wait for, so nothing to wrap.
            try:
                take_in_end(agent, call, outcome)
            except RefusedResponse as refused:
                return _RefusedOutcome(outcome, refused)
            return outcome
        return kind(agent, call, outcome)

    def intercept_unary_unary(self, continuation: Callable[..., Any], client_call_details: Any, request: Any) -> Any:
        return self._invoke(continuation, client_call_details, request, _UnaryOutcome)

    def intercept_stream_unary(
        self, continuation: Callable[..., Any], client_call_details: Any, request_iterator: Any
    ) -> Any:
        return self._invoke(continuation, client_call_details, request_iterator, _UnaryOutcome)

    def intercept_unary_stream(self, continuation: Callable[..., Any], client_call_details: Any, request: Any) -> Any:
        return self._invoke(continuation, client_call_details, request, _StreamOutcome)

    def intercept_stream_stream(
        self, continuation: Callable[..., Any], client_call_details: Any, request_iterator: Any
    ) -> Any:
        return self._invoke(continuation, client_call_details, request_iterator, _StreamOutcome)


_AioDetails = grpc.aio.ClientCallDetails
_current_task = asyncio.current_task
_new_tuple, _partial = tuple.__new__, functools.partial
#: asyncio's task types: a task awaiting a future is woken by a method bound to it.
_TASK_TYPES = tuple({asyncio.Task, getattr(asyncio.tasks, "_PyTask", asyncio.Task)})


def _interceptors_caller(task: asyncio.Task[Any] | None) -> str:
    """The waiter's name of an asyncio call made through the client interceptors, which grpc.aio runs
    in ``task``, a task of its own: the task that awaits that task (the caller, when it awaited the
    call at once), named as a handler's call if it is the handler's own task, else by its own name;
    else ``task``'s name. Not the inherited :data:`CURRENT_TASK`: a task a handler started inherits
    it, and its calls in the handler's name could make a deadlock up. A call awaited later, or
    through a wrapper (``gather``, ``wait_for``), waits in grpc's task's name: a deadlock through it
    is missed, never made up."""
    if task is None:
        return _current_thread().name
    # A private attribute of asyncio's futures: the task awaiting this one has put its wake-up there.
    for callback, _ in getattr(task, "_callbacks", None) or ():
        caller = getattr(callback, "__self__", None)
        if isinstance(caller, _TASK_TYPES):
            return task_waiter_name(caller)
    return task.get_name()


def task_waiter_name(task: asyncio.Task[Any]) -> str:
    """The name ``task`` waits in, read in this context: :data:`CURRENT_TASK` (a handler's call name,
    or the application's) unless a handler set it and ``task`` is not that handler's own task (see
    :data:`NAMED_TASK`); else the task's own name."""
    name = CURRENT_TASK.get()
    if name and ((named := NAMED_TASK.get()) is None or named.own_task is task):
        return name
    return task.get_name()


def runs_handlers_loop(named: IncomingCall, task: Any) -> bool:
    """Whether ``task`` is the one a sync handler of ``named`` runs an event loop until, now, in this
    thread, its own (the main task of ``asyncio.run``, or ``run_until_complete``'s): the handler is
    blocked on that task as on itself while the loop runs (see :class:`HandlersLoop`). Not another
    task of that loop, which the handler may not wait for."""
    if task is None or named.own_task is not _current_thread():
        return False
    return _until_frame(named, task, sys._getframe()) is not None and _runs_here(task.get_loop(), _get_ident())


#: The code of ``run_until_complete``, whose frame on a thread's stack means the thread runs the
#: loop until its ``future`` ends (``asyncio.run`` calls it); None for an asyncio laid out otherwise.
_RUN_UNTIL_COMPLETE = getattr(getattr(asyncio.BaseEventLoop, "run_until_complete", None), "__code__", None)


def _until_frame(call: IncomingCall, task: Any, frame: Any) -> Any:
    """The frame of ``run_until_complete`` with ``task`` its ``future`` in the stack whose top is
    ``frame``, inside the sync handler of ``call`` (above one of the agent's handler frames with that
    ``call``), else None. The frames of a stack taken at one instant tell of that instant: a
    frame below a live one does not change, and one that returned keeps its locals and its caller."""
    until = None
    while frame is not None:
        code = frame.f_code
        if code is _RUN_UNTIL_COMPLETE and frame.f_locals.get("future") is task:
            until = frame
        elif until is not None and code in _HANDLER_CODES and frame.f_locals.get("call") is call:
            return until
        frame = frame.f_back
    return None


def _runs_here(loop: Any, thread: int) -> bool:
    """Whether ``loop`` runs in the thread ``thread`` (an ident) now, with no stop pending (a
    ``stop()`` ends the loop once the callbacks of its turn have run). asyncio's private attributes
    of a BaseEventLoop; another loop says no. The thread is read on both sides of the stop: a run
    that ends clears the stop before the thread, so a stop read as cleared between two reads of
    the thread was read during one run (the caller makes sure it is one run: the same frame)."""
    return (
        getattr(loop, "_thread_id", None) == thread
        and getattr(loop, "_stopping", True) is False
        and getattr(loop, "_thread_id", None) == thread
    )


class HandlersLoop:
    """The main task of an event loop that a sync handler runs in its own thread, and the handler's
    call: a call the task made waits in the handler's name while the handler runs the loop until
    the task ends (``OutgoingCall.handlers_loop``). Asked from any thread (a capture, a hint)."""

    __slots__ = ("call", "task")

    def __init__(self, task: asyncio.Task[Any], call: IncomingCall) -> None:
        self.task, self.call = task, call

    def blocks_handler(self) -> bool:
        """Whether the handler runs the loop until the task now: looks at its thread's stack, each
        taken at one instant (``sys._current_frames()``), and at the loop between them. A loop
        stopped or stopping early, a handler that went on or ended, or another call of that thread
        (a pool's) running the loop until the task, is not this handler blocked on it."""
        ident = getattr(self.call.own_task, "ident", None)  # the handler's thread, while it runs
        if ident is None:
            return False
        call, task = self.call, self.task
        until = _until_frame(call, task, sys._current_frames().get(ident))
        if until is None or not _runs_here(task.get_loop(), ident):
            return False
        # The same run_until_complete call on a second look (its frame is kept alive by ``until``,
        # so no later call gets its identity): the loop was read while that call ran it, not
        # during another run of the loop the handler went on to.
        return _until_frame(call, task, sys._current_frames().get(ident)) is until


class _AioClient:
    def __init__(self, agent: CallEvents, peer: str, instrumented: bool) -> None:
        self._agent, self._peer, self._instrumented = agent, peer, instrumented
        # The loop of the latest call (a BaseEventLoop's only) and a call's cancel on it, in one
        # tuple: read once, the two agree even if another thread (another loop, sharing these
        # interceptors) sets them meanwhile. The loop finds the running loop without asyncio's
        # lookup, which costs a getpid() per call: a BaseEventLoop knows the thread it runs in, and
        # a thread runs one loop at a time.
        self._bound: tuple[asyncio.BaseEventLoop | None, Callable[[Any], bool] | None] = (None, None)

    def _running_loop(self) -> Any:
        """The running loop (``asyncio._get_running_loop()``), as cheaply as it can be known."""
        loop = self._bound[0]
        if loop is not None and loop._thread_id == _get_ident():  # type: ignore[attr-defined]
            return loop
        loop = _running_loop()
        self._bound = (loop, _partial(_cancel_soon, loop)) if isinstance(loop, asyncio.BaseEventLoop) else (None, None)
        return loop

    async def _unary(self, continuation: Callable[..., Any], client_call_details: Any, request: Any) -> Any:
        # This runs for every asyncio unary call (``bench/rpc_hot_path.py`` times it): the unary-unary
        # interceptor is this method itself (no coroutine around it), and the common case of
        # _aio_details_with, method_name and self._running_loop is written out.
        agent = self._agent
        loop, cancel = self._bound  # looked up once: for the caller's name and for the cancel
        bound_loop = loop
        if loop is None or loop._thread_id != _get_ident():  # type: ignore[attr-defined]
            loop = self._running_loop()
        name = CURRENT_TASK.get()
        if not name or NAMED_TASK.get() is not None:  # not a name the application set: find the caller
            name = _interceptors_caller(_current_task(loop) if _current_tasks is None else _current_tasks.get(loop))
        method = client_call_details.method
        text = method if type(method) is str else method_name(method)
        call = agent.call_out(self._peer, text, name, self._instrumented)
        entries = call.metadata
        if entries and type(client_call_details) is _AioDetails:
            metadata = client_call_details.metadata
            details = _new_tuple(  # _AioDetails(...) with the stamp added, without its __new__'s frame
                _AioDetails,
                (
                    method,
                    client_call_details.timeout,
                    stamped(metadata, entries) if metadata else entries,
                    client_call_details.credentials,
                    client_call_details.wait_for_ready,
                ),
            )
        else:
            details = _aio_details_with(client_call_details, call)
        try:
            grpc_call = await continuation(details, request)
            # Breakable from now on (cancel last); the cancel bound to the latest loop is kept.
            call.handle, call.cancel = grpc_call, cancel if bound_loop is loop else _partial(_cancel_soon, loop)
            response = await grpc_call
        except grpc.aio.AioRpcError as error:
            agent.call_returned(call, stamp_of(error.trailing_metadata()), error.code())
            raise
        except asyncio.CancelledError:  # nobody knows whether the request arrived
            agent.call_returned(call, None, grpc.StatusCode.CANCELLED)
            broken = unless_cancelling(call.broken_error())
            if broken is not None:
                raise broken from None
            raise
        except BaseException:  # interrupted here: nobody knows whether the request arrived
            agent.call_returned(call, None, grpc.StatusCode.CANCELLED)
            raise
        stamp = None
        for key, value in await grpc_call.trailing_metadata() or ():  # stamp_of(...), written out
            if key == STAMP_KEY:  # the last one is the server's
                stamp = value if type(value) is str else stamp_of(((key, value),))
        # The status matters only without the server's stamp (as in take_in_end).
        agent.call_returned(call, stamp, None if stamp is not None else await grpc_call.code())
        return response

    async def _streaming(self, continuation: Callable[..., Any], details: Any, request: Any) -> AsyncIterator[Any]:
        agent = self._agent
        call = agent.call_out(self._peer, method_name(details.method), current_task_name(), self._instrumented, False)
        try:
            grpc_call = await continuation(_aio_details_with(details, call), request)
        except BaseException:
            agent.call_returned(call, None, grpc.StatusCode.CANCELLED)
            raise
        end = _StreamEnd(agent, call, grpc_call, self._running_loop())
        grpc_call.add_done_callback(end.ended)
        return end.responses()


#: The tasks taking in the ends of response streams grpc ended first (the loop keeps weak references only).
_stream_ends: set[asyncio.Task[None]] = set()


class _StreamEnd:
    """The end of one asyncio response stream, taken in exactly once: where its reader meets it (the
    iterator stops, or raises), or when grpc ends the call, whichever comes first, as the sync
    interceptor's done callback does. A caller may never read the stream to its end (it cancels or
    drops the call, or its deadline passes): its end must still be taken in. Taken in before its
    reader meets it, it wakes nobody early: a response stream makes no wait. A refused response is
    kept and raised to the reader."""

    __slots__ = ("_agent", "_call", "_grpc_call", "_loop", "_refused")

    def __init__(self, agent: CallEvents, call: OutgoingCall, grpc_call: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._agent, self._call, self._grpc_call, self._loop = agent, call, grpc_call, loop
        self._refused: RefusedResponse | None = None

    def _settle(self, stamp: str | None, code: grpc.StatusCode | None, quiet: bool = False) -> None:
        """Take the end in (once: the agent ignores a second); raise a refused response unless ``quiet``."""
        if not self._call.settled:
            try:
                self._agent.call_returned(self._call, stamp, code)
            except RefusedResponse as refused:
                self._refused = refused  # set in the same step as the end is taken in: no reader misses it
        if self._refused is not None and not quiet:
            raise self._refused

    async def _take_in(self, quiet: bool = False) -> None:
        """Take in the end of the finished call, from its trailing metadata and status."""
        grpc_call = self._grpc_call
        stamp = stamp_of(await grpc_call.trailing_metadata())
        self._settle(stamp, None if stamp is not None else await grpc_call.code(), quiet)

    def ended(self, _grpc_call: Any) -> None:
        """grpc's done callback: the call ended. Unless its reader took the end in already, it is taken
        in now, on the call's loop (a call dropped by its caller may end in a garbage collection, in
        any thread)."""
        if self._call.settled:
            return
        on_loop(self._loop, self._take_in_soon, lambda: self._settle(None, grpc.StatusCode.CANCELLED, quiet=True))

    def _take_in_soon(self) -> None:
        """Take the end in, in a task of the call's loop (reading it is a coroutine)."""
        task = self._loop.create_task(self._take_in(quiet=True))
        _stream_ends.add(task)
        task.add_done_callback(_stream_ends.discard)

    async def responses(self) -> AsyncIterator[Any]:
        """The call's responses; the iterator stops (or raises) once the end was taken in."""
        grpc_call = self._grpc_call
        try:
            async for response in grpc_call:
                yield response
        except grpc.aio.AioRpcError as error:
            self._settle(stamp_of(error.trailing_metadata()), error.code())
            raise
        except BaseException:  # interrupted, or closed before its end: the call must not go on
            grpc_call.cancel()
            self._settle(None, grpc.StatusCode.CANCELLED, quiet=True)
            raise
        await self._take_in()


def unless_cancelling(broken: DeadlockBroken | None) -> DeadlockBroken | None:
    """``broken`` (the error of an asyncio call cancelled for a break), unless the running task was
    cancelled itself: then the cancellation is the caller's own, and goes on as one."""
    if broken is None:
        return None
    task = asyncio.current_task()
    return broken if task is None or not task.cancelling() else None


def _cancel_soon(loop: asyncio.AbstractEventLoop, grpc_call: Any) -> bool:
    """Cancel the asyncio ``grpc_call`` from any thread: it runs on ``loop``, the call's (grpc.aio
    objects belong to their loop). True when it was scheduled (the call ends cancelled unless it ends
    first); False when the loop is closed. An asyncio client interceptor's call's cancel is this with
    its loop bound (a partial), given the call as its handle."""
    try:
        loop.call_soon_threadsafe(grpc_call.cancel)
    except RuntimeError:  # the loop is closed: so is the call
        return False
    return True


class _AioUnaryUnary(_AioClient, grpc.aio.UnaryUnaryClientInterceptor):
    intercept_unary_unary = _AioClient._unary  # one coroutine less per call than a method awaiting it


class _TakenIn:
    """A unary response already taken in, as grpc.aio needs a stream-unary interceptor to return it: a
    finished call (grpc.aio wraps a unary-unary interceptor's response this way itself, not this one)."""

    def __init__(self, response: Any) -> None:
        self._response = response

    def __await__(self) -> Generator[None, None, Any]:
        yield from ()
        return self._response

    def done(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return False

    def cancel(self) -> bool:
        return False

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        callback(self)

    def time_remaining(self) -> float | None:
        return None

    async def initial_metadata(self) -> None:
        return None

    async def trailing_metadata(self) -> None:
        return None

    async def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.OK

    async def details(self) -> str:
        return ""

    async def debug_error_string(self) -> None:
        return None

    async def wait_for_connection(self) -> None:
        return None


class _AioStreamUnary(_AioClient, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self, continuation: Callable[..., Any], client_call_details: Any, request_iterator: Any
    ) -> Any:
        return _TakenIn(await self._unary(continuation, client_call_details, request_iterator))


class _AioUnaryStream(_AioClient, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: Any, request: Any
    ) -> Any:
        return await self._streaming(continuation, client_call_details, request)


class _AioStreamStream(_AioClient, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self, continuation: Callable[..., Any], client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await self._streaming(continuation, client_call_details, request_iterator)


def aio_client_interceptors(agent: CallEvents, peer: str, instrumented: bool) -> list[Any]:
    """One asyncio client interceptor per kind of call (grpc.aio takes each for one kind only)."""
    return [
        cls(agent, peer, instrumented) for cls in (_AioUnaryUnary, _AioStreamUnary, _AioUnaryStream, _AioStreamStream)
    ]
