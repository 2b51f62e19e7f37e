"""The asyncio client side of RPC mode as an instrumented channel, without grpc.aio's interceptor machinery.

``agent.instrument_channel(grpc.aio.insecure_channel(address), peer)`` returns a
:class:`grpc.aio.Channel` that stubs use as they use any channel. It does what the asyncio client
interceptors do (:mod:`stablewatch.agents.rpc.interceptors`: the request's stamp in its initial
metadata, the response's stamp taken in before the caller sees the response or the end of the
response stream, the caller waiting on the callee's task while a unary-response call is out), with
the same agent calls (a unary call's wait begun at its await as ``RpcAgent.awaited`` begins it,
written out), so the protocol is the same. One difference: the caller waits only once it awaits the
call (or while it writes its request stream), in the name of the task that made it; a call made and
not yet awaited holds nobody up.

Why a channel: grpc.aio runs every intercepted call through an extra task of its own (its
``InterceptedCall``) that runs the interceptors and then awaits the real call, and takes
interceptors only when a channel is made. Here each call goes straight to the channel's own
multi-callable, with the stamp added to its metadata, and the caller gets grpc's call object
behind a thin proxy that takes the call's end in where the caller meets it: when it awaits the
response or reads the end of the stream (until then the response is in flight to the caller, as
the protocol counts it), or when grpc ends the call: for a response stream or a written request
stream (a done callback), whether or not its caller still holds it, and for any other call once its
caller dropped it. Beyond cost, this keeps what the interceptors cannot: an asyncio call made
outside a handler waits in the caller's own task's name, a unary call's metadata accessors see the
server's metadata, and a request stream may be written with ``call.write``.

Stamps are per hop (:func:`~stablewatch.agents.rpc.interceptors.stamped`): a stamp in metadata the
caller passes along is another hop's, and is dropped; the request carries the call's own only.

Every call whose response is unary (unary-unary, stream-unary) is breakable: the agent cancels it
on the channel's loop to break a proven deadlock, and the caller's ``await`` raises
:class:`~stablewatch.agents.rpc.calls.DeadlockBroken` (``ABORTED``) where grpc would have raised
a cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable, Generator
from typing import Any

import grpc

from stablewatch.agents import breaking
from stablewatch.agents.rpc.calls import CallEvents, DeadlockBroken, OutgoingCall, RefusedResponse
from stablewatch.agents.rpc.core import STAMP_KEY
from stablewatch.agents.rpc.interceptors import (
    CURRENT_TASK,
    NAMED_TASK,
    HandlersLoop,
    _cancel_soon,
    _current_task,
    _current_tasks,
    _current_thread,
    method_name,
    on_loop,
    runs_handlers_loop,
    stamp_of,
    task_waiter_name,
    unless_cancelling,
    with_stamp,
)

__all__ = ["AioInstrumentedChannel"]

_AioRpcError, _CancelledError, _EOF = grpc.aio.AioRpcError, asyncio.CancelledError, grpc.aio.EOF
_CANCELLED = grpc.StatusCode.CANCELLED
_new, _new_instance, _time_ns = object.__new__, breaking.new_instance, time.time_ns


async def _end_of(grpc_call: Any) -> tuple[str | None, grpc.StatusCode | None]:
    """A finished asyncio call's stamp, and its status when it has none (the status matters only then)."""
    stamp = stamp_of(await grpc_call.trailing_metadata())
    return stamp, None if stamp is not None else await grpc_call.code()


def _awaiter(handler_name: str, handler: Any, awaiting: Any) -> str:
    """The waiter of a call an asyncio handler's own task, or a sync handler's loop's main task
    (``handler``, named ``handler_name``), made and ``awaiting``, another task, begins to await:
    still the handler while it is blocked on
    ``awaiting`` until it ends (see :func:`_blocked_on`: the task of ``ensure_future``, ``gather``
    with ``return_exceptions=True`` or Python 3.11's ``wait_for`` around the call); else
    ``awaiting``, in its handler's name if it is a handler's own task. A call handed to another task
    may not be waited for by the handler, and a wait in its name could make a deadlock up."""
    if awaiting is None or _blocked_on(handler, awaiting):
        return handler_name
    return task_waiter_name(awaiting)


def _blocked_on(task: Any, awaited: Any) -> bool:
    """Whether ``task`` is blocked on the task ``awaited`` until it ends: awaiting it, a ``gather`` of
    it with ``return_exceptions=True`` (without, one failing lets ``task`` go on while the others
    run), or the future Python 3.11's ``wait_for`` releases when it ends. It reads asyncio's private
    attributes, only for a call awaited by a task other than its maker; what it does not know says no."""
    try:
        blocking = getattr(task, "_fut_waiter", None)
        if blocking is None:
            return False
        if blocking is awaited:
            return True
        callbacks = getattr(awaited, "_callbacks", None) or ()
        if awaited in getattr(blocking, "_children", ()):
            return any(_gathers_every_end(callback) for callback, _ in callbacks)
        return any(type(callback) is functools.partial and blocking in callback.args for callback, _ in callbacks)
    except Exception:  # an unknown future's attributes
        return False


def _gathers_every_end(callback: Any) -> bool:
    """Whether ``callback`` is the one ``asyncio.gather(..., return_exceptions=True)`` put on a child."""
    code = getattr(callback, "__code__", None)
    if code is None or "return_exceptions" not in code.co_freevars:
        return False
    return callback.__closure__[code.co_freevars.index("return_exceptions")].cell_contents is True


class _Ends:
    """Takes in the end of one asyncio call where its caller meets it, exactly once.

    The caller meets the end when its ``await`` returns (or raises), or when it reads the end of the
    response stream; the proxy takes the end in there, before handing it over, so a refused response
    replaces it. Until then the response is in flight to the caller, as the protocol counts it. A
    call its caller may hold without meeting its end (a response stream it does not read to its end,
    a request stream it wrote: :meth:`_watch`), or drops before meeting it (:func:`_abandoned`), has
    the end taken in when grpc ends the call, so no wait or response in flight outlives the call.
    """

    _call: OutgoingCall | None = None
    _refused: RefusedResponse | None = None  # a refused response, for every await of the call
    _agent: CallEvents
    _grpc_call: Any
    _loop: asyncio.AbstractEventLoop
    # The asyncio handler's own task (or the main task of a sync handler's loop) that made the call
    # in the handler's name; None for any other maker, whose name nobody waits on (only a handler's
    # task is waited on), so no deadlock is made up through it whoever awaits the call.
    _handler: Any = None
    _watched = False  # a done callback takes the end in (_watch)

    def __del__(self) -> None:
        call = self._call
        if call is not None and not call.settled and not self._watched:
            _abandoned(self._agent, call, self._grpc_call, self._loop)

    def _watch(self) -> None:
        """Take the end in when grpc ends the call, whoever meets it then (the sync channel's and the
        asyncio interceptors' calls do so for every call). Only for a call its caller may hold
        without meeting its end while something stands on it: a response stream (its response
        stays in flight, and no snapshot of the pair completes) or a written request stream (a
        wait): a unary call's done callback would cost every call, and its end comes at its await."""
        self._watched = True
        self._grpc_call.add_done_callback(self._ended)

    def _ended(self, _grpc_call: Any) -> None:
        """grpc's done callback: unless its caller took the end in already, it is taken in now, on the
        call's loop (a call dropped by its caller may end in a garbage collection, in any thread)."""
        if not self._call.settled:  # type: ignore[union-attr]
            on_loop(self._loop, self._take_in_soon, self._take_in_closed)

    def _take_in_closed(self) -> None:
        """The ended call's end, its loop closed: its caller is gone, and nothing is kept for it."""
        with contextlib.suppress(RefusedResponse):
            self._take_in(None, _CANCELLED)

    def _take_in_soon(self) -> None:
        """Take the ended call's end in, in a task of its loop (reading it is a coroutine)."""
        task = self._loop.create_task(self._take_in_ended())
        _taking_in.add(task)  # the loop keeps only weak references to its tasks
        task.add_done_callback(_taking_in.discard)

    async def _take_in_ended(self) -> None:
        """The ended call's end, taken in; a refused response is kept for the caller (see _take_in)."""
        with contextlib.suppress(RefusedResponse):
            await self._take_in_status()

    def _take_in(self, stamp: str | None, code: grpc.StatusCode | None) -> None:
        """Take the end in (once: the agent ignores a second end); a refusal is kept and raised."""
        call = self._call
        if not call.settled:  # type: ignore[union-attr]
            try:
                self._agent.call_returned(call, stamp, code)  # type: ignore[arg-type]
            except RefusedResponse as refused:
                self._refused = refused
        if self._refused is not None:
            raise self._refused

    async def _take_in_status(self) -> None:
        """The finished call's end, from its trailing metadata."""
        self._take_in(*await _end_of(self._grpc_call))

    def _awaits_too(self) -> None:
        """Another task (or a write) holds the call's wait, and this task awaits it too (a call shared
        by its awaiters, as request coalescing does): it waits on the callee beside the first
        (:meth:`RpcAgent.awaited`), until the end is taken in. It leaves no sooner: grpc cancels
        the call when a task awaiting it is cancelled. Named as a first awaiter would be (see
        :func:`_awaiter`): a call made outside a handler waits in its maker's name only, whoever
        awaits it (nobody waits on that name). Not on the per-call path: a call awaited once
        begins its wait in ``__await__``."""
        call, handler = self._call, self._handler
        awaiting = asyncio.current_task(self._loop)
        if handler is None or awaiting is None:
            return
        if awaiting is handler or _blocked_on(handler, awaiting):  # the handler itself is blocked on it
            named = NAMED_TASK.get()
            if named is None or named.own_task is not handler:
                return  # (a sync handler's loop: its name is the call's own waiter's)
            name = named.name
        else:
            name = task_waiter_name(awaiting)
        if name != call.waiter() and all(name != other for other, _ in call.others or ()):  # type: ignore[union-attr]
            self._agent.awaited(call, name)  # type: ignore[arg-type]

    def _broken_now(self) -> DeadlockBroken | None:
        """The error of a call the agent cancelled to break a deadlock, once grpc ended it; else None.

        grpc reports a call cancelled while one of its writes waited as INTERNAL and not cancelled,
        so its own call is asked whether it was cancelled here (its private attribute, read only
        when the agent broke the call)."""
        call, grpc_call = self._call, self._grpc_call
        if call.broken is None:
            return None
        cython_call = getattr(grpc_call, "_cython_call", None)
        if grpc_call.cancelled() or (cython_call is not None and cython_call.is_locally_cancelled()):
            return call.broken_error()
        return None

    def _raise_if_broken(self) -> None:
        """A write failed because the agent broke the call (and the caller's task was not cancelled
        itself): take the end in and raise DeadlockBroken, as the call's await does."""
        broken = unless_cancelling(self._broken_now())
        if broken is not None:
            self._take_in(None, _CANCELLED)
            raise broken from None

    def _take_in_error(self, error: grpc.aio.AioRpcError) -> None:
        """The call failed with ``error``: take its end in; a refused response replaces the error."""
        try:
            self._take_in(stamp_of(error.trailing_metadata()), error.code())
        except RefusedResponse as refused:
            raise refused from error

    def _take_in_cancelled(self) -> None:
        """The call or its caller was cancelled; a cancellation for a break becomes DeadlockBroken."""
        self._take_in(None, _CANCELLED)
        broken = unless_cancelling(self._call.broken_error())  # type: ignore[union-attr]
        if broken is not None:
            raise broken from None

    # -- what grpc's call objects offer, passed through ---------------------------------------

    def cancelled(self) -> bool:
        return self._grpc_call.cancelled() and self._call.broken is None

    def cancel(self) -> bool:
        return self._grpc_call.cancel()

    def done(self) -> bool:
        return self._grpc_call.done()

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self._grpc_call.add_done_callback(lambda _: callback(self))

    def time_remaining(self) -> float | None:
        return self._grpc_call.time_remaining()

    async def initial_metadata(self) -> Any:
        return await self._grpc_call.initial_metadata()

    async def trailing_metadata(self) -> Any:
        return await self._grpc_call.trailing_metadata()

    def _met_instead(self) -> RefusedResponse | None:
        """What the caller meets in place of the call's own end: its refused response, or the error
        of a break; else None."""
        return self._refused or self._broken_now()

    async def code(self) -> grpc.StatusCode:
        instead = self._met_instead()
        return instead.code() if instead is not None else await self._grpc_call.code()

    async def details(self) -> str:
        instead = self._met_instead()
        return instead.details() if instead is not None else await self._grpc_call.details()

    async def debug_error_string(self) -> str | None:
        return await self._grpc_call.debug_error_string()

    async def wait_for_connection(self) -> None:
        try:
            await self._grpc_call.wait_for_connection()
        except _CancelledError:  # grpc raises a finished call's end here: a break's is DeadlockBroken
            self._raise_if_broken()
            raise

    def __repr__(self) -> str:
        return f"<instrumented {self._grpc_call!r}>"


class _UnaryResponse(_Ends):
    """A call with a unary response (unary-unary, stream-unary): awaiting it gives the response
    after its end was taken in."""

    def __await__(self) -> Generator[Any, None, Any]:
        # This runs for every asyncio unary call (``bench/rpc_hot_path.py`` times it), so
        # _take_in_status and _take_in are written out for a response.
        grpc_call, call = self._grpc_call, self._call
        # self._agent.awaited(call), written out (a call and a frame less on every call): the caller
        # that made it waits now, in its own name (a caller awaiting a gather() of its calls is
        # blocked on each, though gather's own tasks await them), unless it handed the call to
        # another task (see _awaiter); nothing once it waits or ended.
        if not call.waits and not call.settled:  # type: ignore[union-attr]
            handler = self._handler
            if handler is not None:  # made by a handler: is the handler still the one that waits?
                loop = self._loop
                awaiting = _current_task(loop) if _current_tasks is None else _current_tasks.get(loop)  # (the same)
                if awaiting is not handler:
                    waiter = _awaiter(call.caller_task, handler, awaiting)  # type: ignore[union-attr]
                    if waiter != call.caller_task:  # not the handler's name: the loop's task is not the waiter
                        call.caller_task, call.handlers_loop = waiter, None  # type: ignore[union-attr]
            call.instance, call.began_at_ns = _new_instance(), _time_ns()  # type: ignore[union-attr]
            call.waits = True  # type: ignore[union-attr]  # last: captures and breaks read a wait once it is set
            doorbell = self._agent.doorbell
            if doorbell.asleep:
                doorbell.ring()
        elif not call.settled:  # type: ignore[union-attr]  # awaited already: this task waits beside
            self._awaits_too()
        try:
            response = yield from grpc_call.__await__()
        except _AioRpcError as error:
            self._take_in_error(error)
            raise
        except _CancelledError:
            self._take_in_cancelled()
            raise
        except BaseException:  # interrupted here: nobody knows whether the request arrived
            self._take_in(None, _CANCELLED)
            raise
        if call.settled:  # awaited before  # type: ignore[union-attr]
            if self._refused is not None:
                raise self._refused
            return response
        stamp = None
        for key, value in (yield from grpc_call.trailing_metadata().__await__()) or ():  # stamp_of(...)
            if key == STAMP_KEY:  # the last one is the server's
                stamp = value if type(value) is str else stamp_of(((key, value),))
        code = None if stamp is not None else (yield from grpc_call.code().__await__())
        try:
            self._agent.call_returned(call, stamp, code)
        except RefusedResponse as refused:
            self._refused = refused
            raise
        return response


class _StreamResponse(_Ends):
    """A call with a response stream (unary-stream, stream-stream): its iterator stops, and ``read()``
    returns ``EOF``, only after its end was taken in."""

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[Any]:
        while (response := await self.read()) is not _EOF:
            yield response

    async def read(self) -> Any:
        try:
            response = await self._grpc_call.read()
        except _AioRpcError as error:
            self._take_in_error(error)
            raise
        except BaseException as error:
            grpc_call = self._grpc_call
            if isinstance(error, _CancelledError) and not grpc_call.done():
                # grpc cancels a call when its reader is cancelled, except while its request is still
                # being sent (it then keeps running, unread): cancel it here as well.
                grpc_call.cancel()
            # Ended: take that in. Else its end comes later, and is taken in then (see _watch) if
            # nobody reads it.
            if grpc_call.done():
                self._take_in(None, _CANCELLED)
            raise
        if response is _EOF:
            await self._take_in_status()
        return response


class _RequestStream(_Ends):
    """Writing a request stream (``call.write``, ``call.done_writing``): a write the agent's break
    ended raises DeadlockBroken, as the call's await does. A call with a unary response waits while
    its caller writes (a write can block on the server), as while it awaits the call: from a write's
    start to its return, when its caller is free again (it may do other things, cancel or drop the
    call); an await of the call holds the wait from then on, to the call's end. A written call's end
    is taken in when grpc ends it (:meth:`_watch`), so a call that ends while its caller holds it
    unawaited holds no wait either."""

    _waits_when_written = False
    _writing = 0  # writes under way (counted: a call may be written from two tasks)
    _write_began = False  # the writes under way began the call's wait (an await had not)
    _awaited = False  # an await of the call began: it holds the wait until the end (_StreamUnaryCall)
    # The call's waiter before a write took the wait in another task's name (see _awaiter): its
    # caller_task and handlers_loop, put back when that wait ends.
    _maker: tuple[str, Any] | None = None

    def _writes(self) -> bool:
        """A write begins: a call with a unary response waits on the callee while it is written (begun
        as :meth:`RpcAgent.awaited` begins an await's wait). Returns whether the write holds the wait,
        and so must end with :meth:`_written`."""
        call = self._call
        if not self._waits_when_written or call.settled:  # type: ignore[union-attr]
            return False
        if not self._watched:
            self._watch()
        self._writing += 1
        if not call.waits:  # type: ignore[union-attr]
            self._write_began = True
            waiter = None
            if self._handler is not None and (writer := asyncio.current_task(self._loop)) is not self._handler:
                waiter = _awaiter(call.caller_task, self._handler, writer)  # type: ignore[union-attr]
                if waiter != call.caller_task:  # type: ignore[union-attr]
                    self._maker = (call.caller_task, call.handlers_loop)  # type: ignore[union-attr]
                    call.handlers_loop = None  # type: ignore[union-attr]
            self._agent.awaited(call, waiter)  # type: ignore[arg-type]
        return True

    def _written(self) -> None:
        """A write that held the wait returned (or raised): the caller is free unless another write
        or an await holds it, or the end was taken in (which ended the wait)."""
        self._writing -= 1
        call = self._call
        if self._writing or not self._write_began or call.settled or not call.waits:  # type: ignore[union-attr]
            return
        self._write_began = False
        if self._awaited:
            # An await began while it was written. Awaited in another name, it waits beside the
            # writer (_awaits_too): the writer, free now, leaves, and the awaiter waits in its place.
            # Awaited in the writer's own name (the handler blocked on the task that awaits), or in
            # its maker's (nobody waits on that name), the wait stays as it is.
            if call.others:  # type: ignore[union-attr]
                self._agent.not_awaited(call)  # type: ignore[arg-type]
            return
        self._agent.not_awaited(call)  # type: ignore[arg-type]
        maker = self._maker
        if maker is not None:  # waits no longer: its next waiter is named afresh (no capture reads it now)
            call.caller_task, call.handlers_loop = maker  # type: ignore[union-attr]
            self._maker = None

    async def write(self, request: Any) -> None:
        holds = self._writes()
        try:
            await self._grpc_call.write(request)
        except (_CancelledError, asyncio.InvalidStateError):  # ended, perhaps by a break
            self._raise_if_broken()
            raise
        finally:
            if holds:
                self._written()

    async def done_writing(self) -> None:
        holds = self._writes()
        try:
            await self._grpc_call.done_writing()
        except _CancelledError:
            self._raise_if_broken()
            raise
        finally:
            if holds:
                self._written()


class _UnaryUnaryCall(_UnaryResponse, grpc.aio.UnaryUnaryCall):
    pass


class _StreamUnaryCall(_RequestStream, _UnaryResponse, grpc.aio.StreamUnaryCall):
    _waits_when_written = True

    def __await__(self) -> Generator[Any, None, Any]:
        self._awaited = True  # from now on its writes' returns leave the wait to the await
        return _UnaryResponse.__await__(self)


class _UnaryStreamCall(_StreamResponse, grpc.aio.UnaryStreamCall):
    pass


class _StreamStreamCall(_RequestStream, _StreamResponse, grpc.aio.StreamStreamCall):
    pass


class _Method:
    """One method of an instrumented asyncio channel: stamps each call and wraps grpc's call object."""

    def __init__(
        self, channel: AioInstrumentedChannel, method: str, plain: Any, kind: type[_Ends], waits: bool
    ) -> None:
        self._channel, self._method, self._plain, self._kind, self._waits = channel, method, plain, kind, waits

    def __call__(
        self,
        request: Any = None,
        timeout: float | None = None,
        metadata: Any = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: Any = None,
    ) -> Any:
        # This runs for every asyncio call a stub makes (``bench/rpc_hot_path.py`` times it), so
        # current_task_name is written out.
        channel = self._channel
        loop = channel._loop or channel._running_loop()
        task = _current_task(loop) if _current_tasks is None else _current_tasks.get(loop)  # (the same)
        name = CURRENT_TASK.get()
        handler = None  # the asyncio handler's own task, making the call in the handler's name
        if name and (named := NAMED_TASK.get()) is not None:
            if task is not None and (named.own_task is task or runs_handlers_loop(named, task)):
                handler = task
            else:  # in a task its handler started, a callback it scheduled, a loop a sync one runs (NAMED_TASK)
                name = None
        if not name:  # the task's (or the thread's) own name
            name = task.get_name() if task is not None else _current_thread().name
        agent = channel._agent
        # Not waiting yet: the caller waits once it awaits the call (_UnaryResponse.__await__).
        call = agent.call_out(channel._peer, self._method, name, channel._instrumented, False)
        if metadata:
            metadata = with_stamp(metadata, call)
        elif call.metadata:
            metadata = call.metadata
        try:
            if timeout is None and credentials is None and wait_for_ready is None and compression is None:
                grpc_call = self._plain(request, metadata=metadata)  # grpc's defaults: each keyword costs
            else:
                grpc_call = self._plain(
                    request,
                    timeout=timeout,
                    metadata=metadata,
                    credentials=credentials,
                    wait_for_ready=wait_for_ready,
                    compression=compression,
                )
        except BaseException:  # not sent
            agent.call_returned(call, None, _CANCELLED)
            raise
        proxy = _new(self._kind)  # its fields set here: one frame less per call than an __init__
        proxy._agent, proxy._call, proxy._grpc_call, proxy._loop = agent, call, grpc_call, loop
        if self._waits:
            call.handle, call.cancel = grpc_call, channel._cancel  # breakable from now on (cancel last)
        else:  # a response stream, which its caller may hold without reading its end
            proxy._watch()
        if handler is not None:
            proxy._handler = handler
            if handler is not named.own_task:  # a sync handler's loop's main task (runs_handlers_loop)
                call.handlers_loop = HandlersLoop(handler, named)
        return proxy


class _StreamRequestMethod(_Method):
    """A method whose request is a stream: grpc.aio names it ``request_iterator``, and so may its callers."""

    def __call__(
        self,
        request_iterator: Any = None,
        timeout: float | None = None,
        metadata: Any = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: Any = None,
    ) -> Any:
        return _Method.__call__(self, request_iterator, timeout, metadata, credentials, wait_for_ready, compression)


def _cancel_unless_ended(loop: asyncio.AbstractEventLoop, grpc_call: Any) -> bool:
    """The agent's cancel of an asyncio call, from its own thread: False (nothing broken) when the
    call has ended already, its end waiting for its caller, who gets that end; else it is cancelled
    on its loop (:func:`_cancel_soon`). A call that ends in the moment between this look and the
    cancel running on its loop is still reported broken (a deadlocked call ends only by a deadline)."""
    return not grpc_call.done() and _cancel_soon(loop, grpc_call)


_taking_in: set[asyncio.Task[None]] = set()


def _abandoned(agent: CallEvents, call: OutgoingCall, grpc_call: Any, loop: asyncio.AbstractEventLoop) -> None:
    """The caller dropped ``grpc_call`` before meeting its end: take the end in when grpc ends it (a
    refused response is then handed to nobody). This may run in any thread (a garbage collection),
    so it goes through the call's loop."""

    async def take_in() -> None:
        stamp, code = await _end_of(grpc_call)
        with contextlib.suppress(RefusedResponse):
            agent.call_returned(call, stamp, code)

    def ended(_grpc_call: Any) -> None:
        task = loop.create_task(take_in())
        _taking_in.add(task)  # the loop keeps only weak references to its tasks
        task.add_done_callback(_taking_in.discard)

    try:
        loop.call_soon_threadsafe(grpc_call.add_done_callback, ended)
    except RuntimeError:  # the loop is closed, and its calls with it
        agent.call_returned(call, None, _CANCELLED)


class _UnaryUnary(_Method, grpc.aio.UnaryUnaryMultiCallable):
    pass


class _UnaryStream(_Method, grpc.aio.UnaryStreamMultiCallable):
    pass


class _StreamUnary(_StreamRequestMethod, grpc.aio.StreamUnaryMultiCallable):
    pass


class _StreamStream(_StreamRequestMethod, grpc.aio.StreamStreamMultiCallable):
    pass


class AioInstrumentedChannel(grpc.aio.Channel):
    """An asyncio channel whose calls take part in snapshots (``agent.instrument_channel(channel, peer)``
    with a ``grpc.aio`` channel). Closing it closes the channel it wraps."""

    def __init__(self, channel: grpc.aio.Channel, agent: CallEvents, peer: str, instrumented: bool) -> None:
        self._channel = channel
        self._agent, self._peer, self._instrumented = agent, peer, instrumented
        # A grpc.aio channel belongs to the loop it was made in; found at the first call and kept,
        # since asyncio's lookup of the running loop costs a getpid() per call.
        self._loop: asyncio.AbstractEventLoop | None = None
        # Its calls' cancel (OutgoingCall.cancel), on that loop: one for all of them.
        self._cancel: Callable[[Any], bool] | None = None

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None:
            loop = asyncio.get_running_loop()
            self._cancel = functools.partial(_cancel_unless_ended, loop)
            self._loop = loop
        return loop

    def _method(
        self,
        open_method: Callable[..., Any],
        kind: type[_Method],
        call_kind: type[_Ends],
        waits: bool,
        method: str,
        request_serializer: Callable[[Any], bytes] | None,
        response_deserializer: Callable[[bytes], Any] | None,
        _registered_method: bool | None,
    ) -> Any:
        plain = open_method(method, request_serializer, response_deserializer, _registered_method)
        return kind(self, method_name(method), plain, call_kind, waits)

    def unary_unary(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool | None = False,
    ) -> grpc.aio.UnaryUnaryMultiCallable:
        return self._method(
            self._channel.unary_unary, _UnaryUnary, _UnaryUnaryCall, True,
            method, request_serializer, response_deserializer, _registered_method,
        )  # fmt: skip

    def unary_stream(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool | None = False,
    ) -> grpc.aio.UnaryStreamMultiCallable:
        # A response stream makes no wait edge: its messages carry no stamp (see the interceptors).
        return self._method(
            self._channel.unary_stream, _UnaryStream, _UnaryStreamCall, False,
            method, request_serializer, response_deserializer, _registered_method,
        )  # fmt: skip

    def stream_unary(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool | None = False,
    ) -> grpc.aio.StreamUnaryMultiCallable:
        return self._method(
            self._channel.stream_unary, _StreamUnary, _StreamUnaryCall, True,
            method, request_serializer, response_deserializer, _registered_method,
        )  # fmt: skip

    def stream_stream(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool | None = False,
    ) -> grpc.aio.StreamStreamMultiCallable:
        return self._method(
            self._channel.stream_stream, _StreamStream, _StreamStreamCall, False,
            method, request_serializer, response_deserializer, _registered_method,
        )  # fmt: skip

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self._channel.channel_ready()

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)

    async def __aenter__(self) -> AioInstrumentedChannel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
