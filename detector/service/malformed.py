"""Requests that are not protobuf: refused with INVALID_ARGUMENT and counted, never UNKNOWN.

gRPC parses a request with the method's deserializer before it calls the handler (one request)
or while the handler reads (a stream of them). A deserializer that raises ends the call with
UNKNOWN and an ERROR traceback in the log, and the servicer never hears of it. So
:class:`MalformedInterceptor` gives every async handler a deserializer that returns a
:class:`Malformed` marker instead of raising, and a behaviour that refuses the marker with
INVALID_ARGUMENT (``malformed`` in ``stablewatch_refused_total``) before the servicer sees it:
for a stream, when the servicer reads that message, so what came before it was served.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError

__all__ = ["Malformed", "MalformedInterceptor"]


@dataclass(frozen=True)
class Malformed:
    """A request that did not parse: its size and the parser's complaint (neither grows with it)."""

    size: int
    error: str


def tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """`deserializer`, returning :class:`Malformed` where it would raise DecodeError."""

    def deserialize(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except DecodeError as error:
            return Malformed(len(raw), str(error)[:200])

    return deserialize


class MalformedInterceptor(grpc.aio.ServerInterceptor):
    """Refuses requests that are not protobuf; ``on_refused(reason, detail)`` counts them.

    Only async handlers are wrapped (the detector's services, health and reflection are all
    async); a sync handler or one without a deserializer is served as gRPC would. A stream's
    messages are checked as the servicer iterates them: one that reads with ``context.read()``
    would be handed the marker itself.
    """

    def __init__(self, on_refused: Callable[[str, str], None]) -> None:
        self._on_refused = on_refused

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        behaviour = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
        if not (inspect.iscoroutinefunction(behaviour) or inspect.isasyncgenfunction(behaviour)):
            return handler
        return _checked(handler, behaviour, self._refuser(handler_call_details.method))

    def _refuser(self, method: str) -> Callable[[Malformed, grpc.aio.ServicerContext], Awaitable[NoReturn]]:
        async def refuse(request: Malformed, context: grpc.aio.ServicerContext) -> NoReturn:
            message = f"{method}: a request of {request.size} bytes that is not protobuf ({request.error})"
            self._on_refused("malformed", f"{context.peer()}: {message}")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
            raise AssertionError("unreachable")  # context.abort raises

        return refuse


class _Refused(Exception):
    """A malformed request met by a task of the handler: the handler refuses it (see ``generator``)."""

    def __init__(self, request: Malformed) -> None:
        super().__init__(f"a malformed request of {request.size} bytes")
        self.request = request


_HANDLER_OF = {  # (request_streaming, response_streaming) -> how grpc makes such a handler
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _checked(
    handler: grpc.RpcMethodHandler,
    behaviour: Callable[..., Any],
    refuse: Callable[[Malformed, grpc.aio.ServicerContext], Awaitable[NoReturn]],
) -> grpc.RpcMethodHandler:
    """``handler`` with a tolerant deserializer, and `behaviour` behind a check for its marker."""

    async def requests(
        iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext, later: bool = False
    ) -> AsyncIterator[Any]:
        """The request stream up to a malformed request, refused here, or (``later``) raised as
        :class:`_Refused` for the handler to refuse in its own flow."""
        async for request in iterator:
            if isinstance(request, Malformed):
                if later:
                    raise _Refused(request)
                await refuse(request, context)
            yield request

    async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
        """The request, or the request iterator, `behaviour` is given."""
        if handler.request_streaming:
            return requests(request, context)
        if isinstance(request, Malformed):
            await refuse(request, context)
        return request

    # grpc.aio tells async handlers by their function type, so the wrapper keeps the behaviour's:
    # an async generator function, or a coroutine function (which may stream with context.write).
    wrapped: Callable[..., Any]
    if inspect.isasyncgenfunction(behaviour):

        async def generator(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            # A request stream may be read by a task of the behaviour's own while a response is
            # being sent: aborted there, the status would meet that send (grpc fails both, and the
            # caller hears nothing). The refusal is raised there, and sent here, between responses.
            given = requests(request, context, later=True) if handler.request_streaming else None
            try:
                # Closed when this one is, not when collected: a control stream's end detaches its member.
                async with contextlib.aclosing(
                    behaviour(given if given is not None else await checked(request, context), context)
                ) as responses:
                    async for response in responses:
                        yield response
            except _Refused as refused:
                await refuse(refused.request, context)

        wrapped = generator
    else:

        async def coroutine(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await behaviour(await checked(request, context), context)

        wrapped = coroutine
    return _HANDLER_OF[handler.request_streaming, handler.response_streaming](
        wrapped,
        request_deserializer=tolerant(handler.request_deserializer),
        response_serializer=handler.response_serializer,
    )
