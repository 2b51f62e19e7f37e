"""The least RPC-mode agent: what any agent must do on each unary call, written as plainly as Python allows.

Issue 27 sets the agent's Python per call against stamp-only (one entry carried each way, and
nothing else). This module is the yardstick between the two: a client method and a server
interceptor, sync and asyncio, that keep per call only what the detector needs, each fact in the
plainest Python, with no branch for anything rarer than the common call (no refusals, no
breaking, no pools' queues, no metrics, no uninstrumented peers, no streaming, no snapshot taken
part in). It is a floor to measure, not an agent to use. Two levels (``facts``):

* ``facts=False``, *bare bookkeeping*: a count per peer of what was sent and received, the caller's
  wait in a table while its call is out and the handler in the server's table while it runs, each
  under the process's one lock. Less than this tells the detector nothing it can use.
* ``facts=True``, *the least agent*: the facts the detector needs to say something true, kept the
  way the agent keeps them. Each stamp is decoded (once per distinct text) and counted by the
  protocol core (:class:`~stablewatch.agents.rpc.core.ColorCore`, which checks its incarnation,
  session and color). The caller's wait is named by its task (the running handler's call, through
  a context variable, else its thread or asyncio task) and has a wait instance and the time it
  began, as a break and the wait's age need. The handler is named after its call, and that name
  is set in the context variable for the calls it makes. One object is made per call on each side.

``bench/rpc_hot_path.py`` (``bare_bookkeeping``, ``least_agent`` and their ``aio_`` twins) and
``bench/rpc_overhead.py`` (the ``least agent`` cases) set it beside stamp-only and beside the agent.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from stablewatch.agents.breaking import new_instance
from stablewatch.agents.rpc.core import STAMP_KEY, ColorCore, RecordedMessage, Stamp
from stablewatch.agents.rpc.interceptors import stamp_of

#: The running handler's call name, for the calls it makes (the agent's ``CURRENT_TASK``), with the
#: asyncio task it names (None in a sync server, whose threads do not inherit it).
CURRENT_TASK: contextvars.ContextVar[tuple[str, Any] | None] = contextvars.ContextVar("least_task", default=None)
#: What bare bookkeeping carries each way: a stamp of the agent's size, never read.
BARE_STAMP = "1764000000000000.1764000000000000.0."


class Wait:
    """A caller's wait while its call is out: who waits, on whom, since when, and its instance."""

    __slots__ = ("began_at_ns", "callee", "instance", "task")

    def __init__(self, task: str, callee: str, instance: int, began_at_ns: int) -> None:
        self.task, self.callee, self.instance, self.began_at_ns = task, callee, instance, began_at_ns


class Served:
    """A call the server runs: its handler's name and its caller."""

    __slots__ = ("name", "peer")

    def __init__(self, name: str, peer: str) -> None:
        self.name, self.peer = name, peer


def _unrecorded() -> RecordedMessage:
    # The least agent takes part in no snapshot, so its core never records a message.
    raise AssertionError("the least agent's core recorded a message, but it takes part in no snapshot")


class LeastAgent:
    """One process's bookkeeping, shared by its client methods and its server interceptors: the four
    steps of a call (:meth:`call_out`, :meth:`returned`, :meth:`arrive`, :meth:`respond`)."""

    def __init__(self, process_id: str, *, facts: bool = True) -> None:
        self.process_id = process_id
        self.facts = facts
        self.lock = threading.Lock()
        self.seqs = itertools.count(1)
        self.waits: dict[int, Any] = {}  # seq -> Wait (facts) or the callee (bare)
        self.running: dict[str, None] = {}  # the handlers running now
        self.sent: dict[str, int] = {}  # bare: messages sent to each peer (the core counts them otherwise)
        self.received: dict[str, int] = {}  # bare: messages received from each peer
        self.core = ColorCore(process_id, incarnation=time.time_ns() // 1000)
        self._stamps: dict[str, Stamp] = {}
        self._bare_entry = (STAMP_KEY, f"{BARE_STAMP}{process_id}")

    def method(self, method: grpc.UnaryUnaryMultiCallable, peer: str) -> LeastMethod:
        """A blocking unary method of a sync channel to ``peer``, through this process's bookkeeping."""
        return LeastMethod(self, method, peer)

    def aio_method(self, method: Any, peer: str) -> AioLeastMethod:
        """The same for an asyncio channel's unary method."""
        return AioLeastMethod(self, method, peer)

    def server_interceptor(self) -> grpc.ServerInterceptor:
        """The sync server's interceptor."""
        return LeastServerInterceptor(self)

    def aio_server_interceptor(self) -> grpc.aio.ServerInterceptor:
        """The asyncio server's interceptor."""
        return AioLeastServerInterceptor(self)

    def taken_in(self, peer: str) -> int:
        """How many messages from ``peer`` this process has counted."""
        return self.core.received_count(peer) if self.facts else self.received.get(peer, 0)

    def call_out(self, peer: str, task: str | None) -> tuple[int, tuple[str, str]]:
        """A request to ``peer`` goes out now, made by ``task`` (None for bare bookkeeping, which names
        no waiter): count it, register the wait. Returns the call's number and the request's entry."""
        seq = next(self.seqs)
        if self.facts:
            wait = Wait(task, peer, new_instance(), time.time_ns())  # type: ignore[arg-type]
            with self.lock:
                entry = self.core.send_entry(peer)
                self.waits[seq] = wait
        else:
            with self.lock:
                self.sent[peer] = self.sent.get(peer, 0) + 1
                self.waits[seq] = peer
            entry = self._bare_entry
        return seq, (STAMP_KEY, f"{seq}:{entry[1]}")

    def returned(self, seq: int, peer: str, text: str | None) -> None:
        """Call ``seq``'s end reached its caller, with the server's stamp ``text`` (None: none came):
        count the response, end the wait."""
        stamp = self._stamp(text) if self.facts and text is not None else None
        with self.lock:
            if stamp is not None:
                self._take_in(stamp)
            elif text is not None:
                self.received[peer] = self.received.get(peer, 0) + 1
            del self.waits[seq]

    def arrive(self, method: str, text: str) -> Served:
        """A request of ``method`` with the entry ``text`` arrives: count it; its handler is named after it."""
        seq, _, stamp_text = text.partition(":")
        if self.facts:
            stamp = self._stamp(stamp_text)
            call = Served(f"{method}#{stamp.process_id}:{seq}", stamp.process_id)
            with self.lock:
                self._take_in(stamp)
                self.running[call.name] = None
        else:
            peer = stamp_text.rpartition(".")[2]
            call = Served(f"{method}#{peer}:{seq}", peer)
            with self.lock:
                self.received[peer] = self.received.get(peer, 0) + 1
                self.running[call.name] = None
        return call

    def respond(self, call: Served) -> tuple[str, str]:
        """``call``'s handler ended: count its response, free its place. Returns the response's entry."""
        with self.lock:
            del self.running[call.name]
            if self.facts:
                return self.core.send_entry(call.peer)
            self.sent[call.peer] = self.sent.get(call.peer, 0) + 1
        return self._bare_entry

    def _stamp(self, text: str) -> Stamp:
        """``text`` decoded, once per distinct text (a sender's stamp changes once per color)."""
        stamp = self._stamps.get(text)
        if stamp is None:
            stamp = self._stamps[text] = Stamp.decode(text)
        return stamp

    def _take_in(self, stamp: Stamp) -> None:
        """Count a message with ``stamp`` (under the lock)."""
        core = self.core
        if core.receive_checked(stamp, _unrecorded) is None:
            core.receive(stamp, _unrecorded, time.monotonic(), time.time())


class LeastMethod:
    """A sync unary method through the least agent: its caller (the running handler's call, else its
    thread) waits while the call is out."""

    def __init__(self, agent: LeastAgent, method: Any, peer: str) -> None:
        self._agent, self._method, self._peer = agent, method, peer

    def __call__(self, request: Any, metadata: Any = None, **options: Any) -> Any:
        agent, peer = self._agent, self._peer
        if agent.facts:
            current = CURRENT_TASK.get()
            task = current[0] if current is not None else threading.current_thread().name
        else:
            task = None
        seq, entry = agent.call_out(peer, task)
        text = None
        try:
            response, call = self._method.with_call(
                request, metadata=(*metadata, entry) if metadata else (entry,), **options
            )
            text = stamp_of(call.trailing_metadata())
        finally:
            agent.returned(seq, peer, text)
        return response


class AioLeastMethod(LeastMethod):
    """An asyncio unary method through the least agent: its caller is the running handler's call if
    the handler's own task makes it, else its task."""

    async def __call__(self, request: Any, metadata: Any = None, **options: Any) -> Any:  # type: ignore[override]
        agent, peer = self._agent, self._peer
        if agent.facts:
            current, own = CURRENT_TASK.get(), asyncio.current_task()
            task = current[0] if current is not None and current[1] is own else own.get_name()  # type: ignore[union-attr]
        else:
            task = None
        seq, entry = agent.call_out(peer, task)
        text = None
        try:
            call = self._method(request, metadata=(*metadata, entry) if metadata else (entry,), **options)
            response = await call
            text = stamp_of(await call.trailing_metadata())
        finally:
            agent.returned(seq, peer, text)
        return response


class _Wrapping:
    """Each method's handler wrapped once, as the agent's interceptors wrap it (kept by the handler's
    id), and its calls taken in as they arrive: both APIs run a call's interceptors and its handler
    in one context (the sync server's per call, in a worker; the asyncio call's task), where the
    handler finds its call in a variable of the interceptor's."""

    def __init__(self, agent: LeastAgent) -> None:
        self._agent = agent
        self._served: contextvars.ContextVar[Served] = contextvars.ContextVar("least_served")
        self._wrapped: dict[int, tuple[Any, Any]] = {}

    def _arrived(self, handler: Any, handler_call_details: Any) -> Any:
        """The handler to run for an arriving call (passed through, uncounted, if it is not a unary
        call with our entry)."""
        text = stamp_of(handler_call_details.invocation_metadata)
        if handler is None or handler.unary_unary is None or text is None:
            return handler
        self._served.set(self._agent.arrive(handler_call_details.method, text))
        kept = self._wrapped.get(id(handler))
        if kept is None or kept[0] is not handler:
            kept = self._wrapped[id(handler)] = (handler, handler._replace(unary_unary=self._wrap(handler.unary_unary)))
        return kept[1]

    def _wrap(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        raise NotImplementedError


class LeastServerInterceptor(_Wrapping, grpc.ServerInterceptor):
    """The least agent's sync server side: the call is taken in as it arrives (in grpc's polling
    thread), and its handler, in a worker, runs in its name and counts its response."""

    def intercept_service(self, continuation: Callable[..., Any], handler_call_details: Any) -> Any:
        return self._arrived(continuation(handler_call_details), handler_call_details)

    def _wrap(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        agent, served = self._agent, self._served

        def run(request: Any, context: grpc.ServicerContext) -> Any:
            call = served.get()
            if agent.facts:  # the calls it makes wait in its name (a worker's context is the call's)
                CURRENT_TASK.set((call.name, None))
            try:
                return behavior(request, context)
            finally:
                context.set_trailing_metadata((agent.respond(call),))

        return run


class AioLeastServerInterceptor(_Wrapping, grpc.aio.ServerInterceptor):
    """The least agent's asyncio server side, as the sync one, in the call's task."""

    async def intercept_service(self, continuation: Callable[..., Awaitable[Any]], handler_call_details: Any) -> Any:
        return self._arrived(await continuation(handler_call_details), handler_call_details)

    def _wrap(self, behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        agent, served = self._agent, self._served

        async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
            call = served.get()
            # Named with its task: a task the handler starts inherits the variable, but not its name.
            token = CURRENT_TASK.set((call.name, asyncio.current_task())) if agent.facts else None
            try:
                return await behavior(request, context)
            finally:
                if token is not None:
                    CURRENT_TASK.reset(token)  # else the task's context holds the task: a cycle per call
                context.set_trailing_metadata((agent.respond(call),))

        return run
