"""The sync client side of RPC mode as an instrumented channel, without gRPC's per-call interceptor work.

``agent.instrument_channel(channel, peer)`` returns a :class:`grpc.Channel` that stubs use as they
use any channel. It does what the client interceptor does (see
:mod:`stablewatch.agents.rpc.interceptors`: the request's stamp in its initial metadata, the
response's stamp taken in before the caller sees the response, the caller waiting on the callee's
task while it is blocked on the call) with the same agent calls, so the protocol is the same.

Why a channel and not only an interceptor: for every call, ``grpc.intercept_channel`` builds a new
multi-callable (and a call-details tuple, a continuation closure and an outcome object) before the
interceptor runs. Here a unary call keeps one multi-callable per method and goes straight to it:
``bench/rpc_hot_path.py`` measured one call's Python, both sides, at 5.3 µs of CPU this way
against 7.0 µs through the client interceptor (the harness alone 0.6 µs, the stamp-only floor
1.5 µs), with blocking calls made by ``with_call``. A unary ``future()`` is made here too, so that
its caller waits on the callee only while it blocks in ``result()`` or ``exception()`` (the
interceptor cannot tell a future from a blocking call, so through it a future waits from when it
is made). The streaming calls, whose ends come later, go through the client interceptor on the
same channel, so they behave exactly as with ``grpc.intercept_channel``.

Breakable blocking calls (``instrument_channel(..., breakable=True)``): a blocking unary call is
then made as grpc's ``future()`` and waited for with ``result()``, not with ``with_call`` (whose
call grpc never hands out, so no other thread can cancel it). The agent can then cancel it to
break a proven deadlock, and the caller gets :class:`~stablewatch.agents.rpc.calls.DeadlockBroken`
(``ABORTED``). A blocking stream-unary call is likewise the client interceptor's ``future()``,
waited for. The price: grpc completes a future on the channel's polling thread, which it starts
when the channel has no call in flight and stops when the last one ends, so a caller making one
call at a time pays a thread start and two thread switches per call (measured on 2 shared cores:
about twice the client's CPU and 2.5 times the latency of ``with_call``); with calls overlapping,
as in a busy service, about 5 % more. So it is off by default: a blocking call is then reported
with instance 0 (never chosen as a victim). Nothing is lost by that in a deadlock through a worker
pool: every such cycle holds a queued request, which a pool from ``agent.thread_pool`` lets the
agent refuse instead; a cycle through an application's own lock holds that wait (``agent.state``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from stablewatch.agents.rpc.calls import CallEvents, OutgoingCall, RefusedResponse, cancel_future
from stablewatch.agents.rpc.core import STAMP_KEY
from stablewatch.agents.rpc.interceptors import (
    CURRENT_TASK,
    NAMED_TASK,
    ClientInterceptor,
    _current_tasks,
    _current_thread,
    _get_ident,
    _threads,
    _UnaryOutcome,
    current_task_name,
    method_name,
    stamp_of,
    take_in_end,
    with_stamp,
)

__all__ = ["InstrumentedChannel"]


class _UnaryUnary(grpc.UnaryUnaryMultiCallable):
    """One method of an instrumented channel: blocking calls on the fast path (``with_call``, not
    breakable: their waits have instance 0), and futures, which wait only while their caller blocks.

    ``__call__`` runs for every call a stub makes (``bench/rpc_hot_path.py`` times it), so it does
    the blocking call itself rather than through :meth:`_blocking`, with ``with_stamp`` and
    ``take_in_end`` written out, and hands ``with_call`` its arguments in the order
    ``grpc.UnaryUnaryMultiCallable`` gives them.
    """

    def __init__(self, agent: CallEvents, peer: str, instrumented: bool, method: str, plain: Any, intercepted: Any):
        self._agent, self._peer, self._instrumented, self._method = agent, peer, instrumented, method
        self._plain, self._intercepted = plain, intercepted

    def __call__(
        self,
        request: Any,
        timeout: float | None = None,
        metadata: Any = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: Any = None,
    ) -> Any:
        # _blocking(...)[0], written out (see the class docstring), and current_task_name() for a call
        # made by a thread outside any handler and task.
        name = CURRENT_TASK.get()
        if not name and _current_tasks is not None and not _current_tasks:  # a thread outside any task
            thread = _threads.get(_get_ident())
            name = (thread if thread is not None else _current_thread()).name
        elif not name or NAMED_TASK.get() is not None:  # NAMED_TASK: a handler's name, maybe not ours
            name = current_task_name()
        agent = self._agent
        call = agent.call_out(self._peer, self._method, name, self._instrumented)
        try:  # whatever fails from here on ends the call's wait (the stamping too: metadata grpc cannot carry)
            if metadata:
                metadata = with_stamp(metadata, call)
            elif call.metadata:
                metadata = call.metadata
            response, grpc_call = self._plain.with_call(
                request, timeout, metadata, credentials, wait_for_ready, compression
            )
        except BaseException as error:
            _take_in_failure(agent, call, error)
            raise
        stamp = None
        for key, value in grpc_call.trailing_metadata() or ():  # stamp_of(...), written out
            if key == STAMP_KEY:  # the last one is the server's
                stamp = value if type(value) is str else stamp_of(((key, value),))
        # A RefusedResponse propagates to the caller; the status matters only without the stamp.
        agent.call_returned(call, stamp, None if stamp is not None else grpc_call.code())
        return response

    def with_call(
        self,
        request: Any,
        timeout: float | None = None,
        metadata: Any = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: Any = None,
    ) -> tuple[Any, grpc.Call]:
        return self._blocking(request, timeout, metadata, credentials, wait_for_ready, compression)

    def future(
        self,
        request: Any,
        timeout: float | None = None,
        metadata: Any = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: Any = None,
    ) -> Any:
        # Made here, not by the client interceptor, which cannot tell a future from a blocking call:
        # the caller of a future waits on the callee only while it blocks in result() or exception().
        agent = self._agent
        call = agent.call_out(self._peer, self._method, current_task_name(), self._instrumented, False)
        try:
            outcome = self._future(call, request, timeout, metadata, credentials, wait_for_ready, compression)
        except BaseException as error:
            _take_in_failure(agent, call, error)
            raise
        return _UnaryOutcome(agent, call, outcome)

    def _future(
        self,
        call: OutgoingCall,
        request: Any,
        timeout: Any,
        metadata: Any,
        credentials: Any,
        wait_for_ready: Any,
        compression: Any,
    ) -> Any:
        """grpc's future of ``call``, its request stamped."""
        return self._plain.future(
            request,
            timeout=timeout,
            metadata=with_stamp(metadata, call),
            credentials=credentials,
            wait_for_ready=wait_for_ready,
            compression=compression,
        )

    def _blocking(
        self, request: Any, timeout: Any, metadata: Any, credentials: Any, wait_for_ready: Any, compression: Any
    ) -> tuple[Any, grpc.Call]:
        """The blocking call by ``with_call``: cheapest, and not breakable (its wait has instance 0)."""
        agent = self._agent
        call = agent.call_out(self._peer, self._method, current_task_name(), self._instrumented)
        try:
            response, grpc_call = self._plain.with_call(
                request, timeout, with_stamp(metadata, call), credentials, wait_for_ready, compression
            )
        except BaseException as error:
            _take_in_failure(agent, call, error)
            raise
        take_in_end(agent, call, grpc_call)  # a RefusedResponse propagates to the caller
        return response, grpc_call


class _BreakableUnaryUnary(_UnaryUnary):
    """A method of ``instrument_channel(..., breakable=True)``: a blocking call is made by ``future()``
    and ``result()``, so that the agent can cancel it (see the module docstring)."""

    def __call__(
        self,
        request: Any,
        timeout: float | None = None,
        metadata: Any = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: Any = None,
    ) -> Any:
        return self._blocking(request, timeout, metadata, credentials, wait_for_ready, compression)[0]

    def _blocking(
        self, request: Any, timeout: Any, metadata: Any, credentials: Any, wait_for_ready: Any, compression: Any
    ) -> tuple[Any, grpc.Call]:
        """The blocking call by ``future()`` and ``result()``: breakable."""
        agent = self._agent
        call = agent.call_out(self._peer, self._method, current_task_name(), self._instrumented)
        grpc_call = None
        try:
            grpc_call = self._future(call, request, timeout, metadata, credentials, wait_for_ready, compression)
            call.handle, call.cancel = grpc_call, cancel_future  # breakable from now on (cancel last)
            response = grpc_call.result()
        except grpc.RpcError as error:
            _take_in_error(agent, call, error)
            raise
        except grpc.FutureCancelledError:
            # Nobody else holds the future: only the agent cancels it, to break a deadlock.
            agent.call_returned(call, None, grpc.StatusCode.CANCELLED)
            broken = call.broken_error()
            if broken is None:
                raise
            raise broken from None
        except BaseException:  # not sent, or interrupted: nobody knows whether the request arrived
            if grpc_call is not None:
                grpc_call.cancel()
            agent.call_returned(call, None, grpc.StatusCode.UNKNOWN)
            raise
        take_in_end(agent, call, grpc_call)  # a RefusedResponse propagates to the caller
        return response, grpc_call


class _StreamUnary(grpc.StreamUnaryMultiCallable):
    """One stream-unary method: every call through the client interceptor's ``future()``, so that a
    blocking one can be broken too (see the module docstring)."""

    def __init__(self, intercepted: Any) -> None:
        self._intercepted = intercepted

    def __call__(
        self,
        request_iterator: Any,
        timeout: float | None = None,
        metadata: Any = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: Any = None,
    ) -> Any:
        return self.with_call(request_iterator, timeout, metadata, credentials, wait_for_ready, compression)[0]

    def with_call(
        self,
        request_iterator: Any,
        timeout: float | None = None,
        metadata: Any = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: Any = None,
    ) -> tuple[Any, grpc.Call]:
        outcome = self.future(request_iterator, timeout, metadata, credentials, wait_for_ready, compression)
        try:
            return outcome.result(), outcome
        except grpc.RpcError:
            raise
        except BaseException:  # interrupted: the call must not go on with nobody waiting for it
            outcome.cancel()
            raise

    def future(
        self,
        request_iterator: Any,
        timeout: float | None = None,
        metadata: Any = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: Any = None,
    ) -> Any:
        return self._intercepted.future(
            request_iterator,
            timeout=timeout,
            metadata=metadata,
            credentials=credentials,
            wait_for_ready=wait_for_ready,
            compression=compression,
        )


def _take_in_failure(agent: CallEvents, call: OutgoingCall, error: BaseException) -> None:
    """A blocking call raised ``error``: take its end in (the caller re-raises it, unless a refused
    response replaces it)."""
    if isinstance(error, grpc.RpcError):
        _take_in_error(agent, call, error)
    else:  # not sent, or interrupted: nobody knows whether the request arrived
        agent.call_returned(call, None, grpc.StatusCode.UNKNOWN)


def _take_in_error(agent: CallEvents, call: OutgoingCall, error: grpc.RpcError) -> None:
    """The call ended in an error: take its end in (the server's stamp, if it set one) before the
    caller sees it; a refused response replaces the error."""
    try:
        if isinstance(error, grpc.Call):
            take_in_end(agent, call, error)
        else:
            agent.call_returned(call, None, grpc.StatusCode.UNKNOWN)
    except RefusedResponse as refused:
        raise refused from error


class InstrumentedChannel(grpc.Channel):
    """A sync channel whose calls take part in snapshots (``agent.instrument_channel(channel, peer)``).

    Closing it closes the channel it wraps.
    """

    def __init__(
        self, channel: grpc.Channel, agent: CallEvents, peer: str, instrumented: bool, breakable: bool = False
    ) -> None:
        if isinstance(channel, grpc.aio.Channel):
            raise TypeError("InstrumentedChannel takes a sync channel; an asyncio one takes AioInstrumentedChannel")
        self._channel = channel
        self._agent, self._peer, self._instrumented = agent, peer, instrumented
        self._breakable = breakable
        self._intercepted = grpc.intercept_channel(channel, ClientInterceptor(agent, peer, instrumented))

    def unary_unary(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool | None = False,
    ) -> grpc.UnaryUnaryMultiCallable:
        plain = self._channel.unary_unary(method, request_serializer, response_deserializer, _registered_method)
        intercepted = self._intercepted.unary_unary(
            method, request_serializer, response_deserializer, _registered_method
        )
        kind = _BreakableUnaryUnary if self._breakable else _UnaryUnary
        return kind(self._agent, self._peer, self._instrumented, method_name(method), plain, intercepted)

    def unary_stream(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool | None = False,
    ) -> grpc.UnaryStreamMultiCallable:
        return self._intercepted.unary_stream(method, request_serializer, response_deserializer, _registered_method)

    def stream_unary(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool | None = False,
    ) -> grpc.StreamUnaryMultiCallable:
        intercepted = self._intercepted.stream_unary(
            method, request_serializer, response_deserializer, _registered_method
        )
        return _StreamUnary(intercepted) if self._breakable else intercepted

    def stream_stream(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool | None = False,
    ) -> grpc.StreamStreamMultiCallable:
        return self._intercepted.stream_stream(method, request_serializer, response_deserializer, _registered_method)

    def subscribe(self, callback: Callable[[grpc.ChannelConnectivity], None], try_to_connect: bool = False) -> None:
        self._channel.subscribe(callback, try_to_connect=try_to_connect)

    def unsubscribe(self, callback: Callable[[grpc.ChannelConnectivity], None]) -> None:
        self._channel.unsubscribe(callback)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> InstrumentedChannel:
        return self

    def __exit__(self, *exc_info: object) -> bool:
        self.close()
        return False
