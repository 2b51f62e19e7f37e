"""The sync server interceptor hands each call to its handler through the call's own context.

grpc's sync server runs a call's interceptors and its handler in one ``contextvars.Context`` made
for that call; the agent's interceptor puts the call there and returns a handler wrapped once per
method. These tests drive the interceptors as grpc does (its own service pipeline, a fresh context
per call), without a network: each call is served as its own, whichever interceptors share the
pipeline, and a handler run outside its call's context fails with a clear error.
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from typing import Any, NamedTuple

import grpc
import pytest
from grpc import _interceptor

from stablewatch.agents.rpc.agent import RpcAgent
from stablewatch.agents.rpc.calls import request_entry
from stablewatch.agents.rpc.core import STAMP_KEY, Stamp
from stablewatch.agents.rpc.interceptors import CURRENT_TASK

METHOD = "/test.Svc/Echo"
INCARNATION = 0x1F  # the callers' incarnation, in their requests' stamps (in hex in handlers' names)


class _Details(NamedTuple):
    method: str
    invocation_metadata: Sequence[tuple[str, str]]


class Details(_Details, grpc.HandlerCallDetails):
    pass


class Context:
    """What a sync servicer context gives the agent: metadata in, trailing metadata out."""

    def __init__(self) -> None:
        self.trailing: Sequence[tuple[str, str]] = ()

    def trailing_metadata(self) -> Sequence[tuple[str, str]]:
        return self.trailing

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.trailing = metadata

    def is_active(self) -> bool:
        return True

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"


def request_from(caller: str, seq: int) -> tuple[tuple[str, str], ...]:
    """The metadata of a request that ``caller`` (incarnation INCARNATION) sent as its call ``seq``
    (color 0, session 0)."""
    return (request_entry(Stamp(0, INCARNATION, 0, caller), seq),)


def arrive(pipeline: Any, handler: grpc.RpcMethodHandler, metadata: Any) -> tuple[contextvars.Context, Any]:
    """A call arriving, as grpc's sync server takes it: its handler found through the interceptors
    in a context of the call's own."""
    context = contextvars.Context()
    wrapped = context.run(pipeline.execute, lambda details: handler, Details(METHOD, metadata))
    return context, wrapped


def test_each_call_is_served_as_its_own_by_a_handler_wrapped_once() -> None:
    server = RpcAgent("server")
    served: list[str | None] = []

    def echo(request: bytes, context: Any) -> bytes:
        served.append(CURRENT_TASK.get())
        return request

    handler = grpc.unary_unary_rpc_method_handler(echo)
    pipeline = _interceptor.service_pipeline([server.server_interceptor(workers=2)])
    first, first_handler = arrive(pipeline, handler, request_from("a", 1))
    second, second_handler = arrive(pipeline, handler, request_from("b", 7))
    assert first_handler is second_handler  # wrapped once for the method, not per call
    contexts = [Context(), Context()]
    # Handlers run in either order, each in its own call's context.
    assert second.run(second_handler.unary_unary, b"2", contexts[1]) == b"2"
    assert first.run(first_handler.unary_unary, b"1", contexts[0]) == b"1"
    assert served == [f"{METHOD}#b@1f:7", f"{METHOD}#a@1f:1"]  # named after caller and incarnation
    responses = [dict(context.trailing)[STAMP_KEY] for context in contexts]
    assert [Stamp.decode(text).process_id for text in responses] == ["server", "server"]
    assert server._core.sent_count("a") == 1 and server._core.sent_count("b") == 1  # each answered once
    assert server._core.received_count("a") == 1 and server._core.received_count("b") == 1


def test_two_agents_interceptors_in_one_pipeline_keep_their_calls_apart() -> None:
    outer, inner = RpcAgent("outer"), RpcAgent("inner")
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    pipeline = _interceptor.service_pipeline([outer.server_interceptor(), inner.server_interceptor()])
    context, wrapped = arrive(pipeline, handler, request_from("a", 3))
    servicer = Context()
    assert context.run(wrapped.unary_unary, b"x", servicer) == b"x"
    # Each agent took the request in and answered it once, in its own name; the response carries one
    # stamp (stamps are per hop), the outer agent's, which answered last and replaced the inner's.
    assert outer._core.received_count("a") == inner._core.received_count("a") == 1
    assert outer._core.sent_count("a") == inner._core.sent_count("a") == 1
    assert [Stamp.decode(value).process_id for key, value in servicer.trailing] == ["outer"]


def test_a_handler_run_outside_its_calls_context_fails_clearly() -> None:
    server = RpcAgent("server")
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    pipeline = _interceptor.service_pipeline([server.server_interceptor()])
    _, wrapped = arrive(pipeline, handler, request_from("a", 1))
    with pytest.raises(RuntimeError, match="outside its call's context"):
        contextvars.Context().run(wrapped.unary_unary, b"x", Context())
