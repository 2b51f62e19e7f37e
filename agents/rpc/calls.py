"""What the RPC-mode agent and its interceptors share about one call: its records, the worker pool
of a sync server as the interceptor sees it, the errors a refused response raises (and the one a
broken call raises), the metadata a request carries, and :class:`CallEvents`, what the interceptors
and the instrumented channel tell the agent. No behaviour of the agent lives here, so they need not
import the agent (which creates them)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from stablewatch.agents import breaking
from stablewatch.agents.rpc.core import STAMP_KEY, Stamp
from stablewatch.v1 import WAIT_MODEL_OR, RecordedMessage, Wait

__all__ = [
    "BadStamp",
    "CallEvents",
    "DeadlockBroken",
    "IncomingCall",
    "OutgoingCall",
    "RefusedResponse",
    "StaleResponse",
    "WorkerPool",
    "caller_tag",
    "cancel_future",
    "request_entry",
    "split_request",
    "stamp_entry",
]


@functools.lru_cache(maxsize=256)
def stamp_entry(stamp: Stamp) -> tuple[str, str]:
    """The metadata entry that carries ``stamp`` on a response."""
    return (STAMP_KEY, stamp.encode())


def caller_tag(process_id: str, incarnation: int) -> str:
    """How a handler's name names its caller: ``{process_id}@{incarnation in hex}``.

    A restarted caller numbers its calls from 1 again, while a server may still run a call of its
    old incarnation (a sync handler runs on after its caller is gone): the incarnation keeps the
    two calls' handlers apart."""
    return f"{process_id}@{incarnation:x}"


def request_entry(stamp: Stamp, seq: int) -> tuple[str, str]:
    """The metadata entry of a request: ``{seq}:{stamp}``, the call's sequence number (its handler
    task is ``"{method}#{caller}@{incarnation}:{seq}"``, :func:`caller_tag`) and the caller's stamp
    in one entry, since each entry costs gRPC work on both sides."""
    return (STAMP_KEY, f"{seq}:{stamp_entry(stamp)[1]}")


def split_request(value: str | bytes) -> tuple[str, str | bytes]:
    """A request's entry as (sequence number, stamp text); ValueError if it holds no sequence number.

    The first ``:`` ends the number: a stamp starts with its color's digits, and only its process id
    (last) may hold a ``:``."""
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    seq, colon, stamp = text.partition(":")
    if not colon or not (seq.isascii() and seq.isdigit()) or len(seq) > 20:
        raise ValueError(f"request stamp {text[:80]!r} is not seq:color.incarnation.session.process_id")
    return seq, stamp if isinstance(value, str) else value[len(seq) + 1 :]


class RefusedResponse(grpc.RpcError):
    """A response the agent does not hand to its caller: the call fails client side with :meth:`code`."""

    status = grpc.StatusCode.INTERNAL

    def code(self) -> grpc.StatusCode:
        return self.status

    def details(self) -> str:
        return str(self)


class BadStamp(RefusedResponse):
    """A server's stamp was malformed or impossible: the call fails client side (status INTERNAL),
    nothing is recorded, and the pair's counts restart."""


class StaleResponse(RefusedResponse):
    """A response sent before the counts between the two processes restarted (a stale stamp): the
    server ran the call, but its response is not delivered. The call fails client side (status
    ABORTED); nothing changes, and the pair's counts do not restart again (the loss is known)."""

    status = grpc.StatusCode.ABORTED


class DeadlockBroken(RefusedResponse, grpc.Call):
    """The call was cancelled by stablewatch to end a proven deadlock (DESIGN.md, "Breaking a proven
    deadlock"): status ``ABORTED``, its details name the deadlock. The request may or may not have
    reached the server, and may have run there: retry after a back-off if the call is safe to repeat.

    Also a finished :class:`grpc.Call`, like the errors grpc raises for a failed call.
    """

    status = grpc.StatusCode.ABORTED

    def __init__(self, message: str, *, instance: int = 0) -> None:
        super().__init__(message)
        self.instance = instance

    def initial_metadata(self) -> tuple[()]:
        return ()

    def trailing_metadata(self) -> tuple[()]:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return False


@dataclass(slots=True)
class OutgoingCall:
    """A call this process makes: who waits on whom while it is outstanding, and how to break it.

    ``instance`` names the caller's wait (a number never reused in the process); the wait can be
    broken once ``cancel`` is set, by the channel or the interceptor that holds a handle on the
    call it can cancel from another thread (before that, and for a blocking call through
    ``grpc.intercept_channel``, it is reported with instance 0: not breakable). ``cancel(handle)``
    cancels it and returns whether the call was still running (``handle`` is grpc's call object,
    set before ``cancel``: a break reads ``cancel`` under the agent's lock and the handle after; the
    asyncio channel's one function serves all its calls, with no object made per call for it);
    ``broken`` holds the victim's message from the moment it is cancelled for a break, so the
    caller's code raises :class:`DeadlockBroken` instead of a cancellation.
    """

    seq: int
    peer: str  # the callee's process id, or grpc://<target> for an uninstrumented one
    method: str
    caller_task: str
    instrumented: bool  # False: the channel leads to a service without an agent; nothing is stamped
    waits: bool = True  # its caller is blocked on it now (a future's or asyncio call's: once awaited)
    metadata: tuple[tuple[str, str], ...] = ()  # what the request carries
    settled: bool = False  # its response (or end) was taken in
    instance: int = 0
    # When its wait began, wall clock in ns (a wait's ``began_at_us`` is this // 1000, divided only
    # when a capture or a hint reads it: on a cold call, the division's code costs cache misses).
    began_at_ns: int = 0
    cancel: Callable[[Any], bool] | None = None
    handle: Any = None  # what ``cancel`` is given: grpc's call object
    broken: str | None = None
    # For a call that the main task of an event loop a sync handler runs (``asyncio.run``) made in
    # the handler's name: that task and handler (an ``interceptors.HandlersLoop``). The handler waits
    # on the task only while it runs the loop until the task ends; a loop stopped early
    # (``loop.stop()``, an exception out of it) leaves the task, and its call, behind while the
    # handler goes on: the task waits then.
    handlers_loop: Any = None
    # Its other blockers, while more than one thread or task blocks on it (a call shared by several
    # awaiters, a future several threads wait on): (name, began_at_ns) each, in the order they began.
    # None with one blocker (the common case: nothing more is made per call). Each waits on the
    # callee's task as the first does, with the call's instance (breaking any of them cancels the one
    # call, which frees them all); when the first leaves, the next takes its place.
    others: list[tuple[str, int]] | None = None

    def waiter(self) -> str:
        """The name the call's caller waits in now: ``caller_task``, unless that was a sync handler's
        name through ``handlers_loop`` and the handler no longer runs the loop until the task ends."""
        held = self.handlers_loop
        if held is None or held.blocks_handler():
            return self.caller_task
        return held.task.get_name()

    def broken_error(self) -> DeadlockBroken | None:
        """The error the caller gets when this call was cancelled to break a deadlock, else None."""
        message = self.broken
        return None if message is None else DeadlockBroken(message, instance=self.instance)

    def response_message(self) -> RecordedMessage:
        """The call's response as a channel state holds it: it wakes only its caller's task. The
        core builds it only if a recording needs it (a bound method costs less than a partial)."""
        return RecordedMessage(wakes_task=self.caller_task)


def cancel_future(future: Any) -> bool:
    """A sync call's ``OutgoingCall.cancel``: grpc's future (the handle) cancelled, from any thread;
    whether it was still running."""
    return future.cancel()


@dataclass(slots=True)
class IncomingCall:
    """A call this process serves, from its arrival to the end of its handler.

    A call that has to queue for a worker gets a wait ``instance`` and the time it began
    (``began_at_us``); with the agent's :class:`~stablewatch.agents.rpc.pool.WorkerExecutor`,
    ``work`` is its queued work item, which a break takes out of the pool's queue.

    A call from a caller without an agent is named ``"{method}#?:{seq}"`` on arrival (a sync
    server's interceptor is not told the caller's address) and ``"{method}#grpc://{host}:{seq}"``
    when its handler starts, where ``peer`` becomes ``grpc://{host}``. Renaming then is safe: the
    name a recorded state can hold before is a queued wait's (it stops waiting as it starts) or a
    running target that waits on nothing yet; neither can be part of a deadlock, and a task in
    one keeps its name.
    """

    name: str  # the handler's task: "{method}#{caller}@{incarnation}:{seq}" (caller_tag)
    peer: str | None  # the caller's process id, or grpc://<host> once the handler of an uninstrumented call starts
    instrumented: bool
    pool: WorkerPool | None = None  # before the defaults set less often: one is made per call, positionally
    error: str | None = None  # a bad or stale stamp, or a break: the handler refuses the call with `status`
    status: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
    started: bool = False  # its handler started
    done: bool = False  # its handler ended, or gRPC ended the call before it started
    instance: int = 0
    began_at_us: int = 0
    work: Any = None  # a pool.QueuedWork while it waits in a WorkerExecutor's queue
    own_task: Any = None  # its handler's asyncio task, or a sync one's thread, while it runs (interceptors.NAMED_TASK)
    # Its request is a stream: grpc's sync server runs its handler even after the call ended (a
    # unary request's is skipped), so it leaves the pool only when its queued work is taken back.
    streams_requests: bool = False

    def request_message(self) -> RecordedMessage:
        """The call's request as a channel state holds it: it will start the call's handler, and wakes
        no other task (a server waiting on the requester is not woken by a request). The core builds
        it only if a recording needs it."""
        return RecordedMessage(wakes_task=self.name)


@dataclass(slots=True)
class WorkerPool:
    """The worker threads of one sync server, as the server interceptor sees them (``workers=N``).

    ``running`` holds the calls that have (or are about to get) a worker, ``queued`` those that wait
    for one, first in first out, as grpc's thread pool hands them out. A method whose handler has a
    pool of its own (grpc's ``experimental_thread_pool``) does not queue here: its calls are not in
    it. A call leaves when its handler ends, or, with a
    :class:`~stablewatch.agents.rpc.pool.WorkerExecutor`, when gRPC ends it before its handler
    started (cancelled by its caller or its deadline): a queued call as gRPC ends it, a call that
    ran at once by the time the picture is next read (see ``RpcAgent``). ``breakable``: the pool is a
    :class:`~stablewatch.agents.rpc.pool.WorkerExecutor`, which can take a queued call out of its
    queue; a plain pool's queued calls are reported with instance 0 (a break could only refuse one
    when a worker takes it, which in a deadlock never happens).
    """

    workers: int
    breakable: bool = False
    running: dict[str, IncomingCall] = field(default_factory=dict)
    queued: dict[str, IncomingCall] = field(default_factory=dict)

    def arrive(self, call: IncomingCall) -> bool:
        """``call`` arrived: it runs at once, or queues (and its wait gets an instance and begins
        now). Returns True if it queues."""
        if len(self.running) < self.workers and not self.queued:
            self.running[call.name] = call
            return False
        call.instance, call.began_at_us = breaking.new_instance(), breaking.now_us()
        self.queued[call.name] = call
        return True

    def start(self, name: str) -> None:
        call = self.queued.pop(name, None)
        if call is not None:  # our picture lagged behind the pool
            self.running[name] = call

    def rename(self, name: str, new_name: str) -> None:
        """The running call ``name`` is called ``new_name`` from now on (its handler started)."""
        call = self.running.pop(name, None)
        if call is not None:
            self.running[new_name] = call

    def leave(self, name: str) -> None:
        """A queued call left the queue without a worker (broken: it runs beside the pool)."""
        self.queued.pop(name, None)

    def end(self, name: str) -> None:
        """The call ``name`` left (its handler ended, or gRPC ended it): a queued call takes its worker."""
        if self.running.pop(name, False) is False:  # not running (rare): it may have been queued
            self.queued.pop(name, None)
        while self.queued and len(self.running) < self.workers:
            head = next(iter(self.queued))
            self.running[head] = self.queued.pop(head)

    def waits(self, process_id: str) -> Iterable[Wait]:
        """Every queued call waits on any running handler (OR)."""
        if not self.running:
            return
        targets = [{"process": process_id, "task": name} for name in self.running]
        for name, call in self.queued.items():
            instance = call.instance if self.breakable else 0
            yield Wait(task=name, targets=targets, model=WAIT_MODEL_OR, instance=instance, began_at_us=call.began_at_us)


class CallEvents(Protocol):
    """What the interceptors and the instrumented channel report to the agent, one call per gRPC
    event (:class:`~stablewatch.agents.rpc.agent.RpcAgent` documents each and is the one implementation),
    but for the wait an asyncio unary call begins at its await (see ``doorbell``)."""

    #: Rung after a wait begins. The asyncio channel begins a call's wait itself, as :meth:`awaited`
    #: would (its code written out in the channel: it runs on every call).
    doorbell: breaking.Doorbell

    def call_out(
        self, peer: str, method: str, caller_task: str, instrumented: bool, waits: bool = True
    ) -> OutgoingCall: ...

    def awaited(self, call: OutgoingCall, waiter: str | None = None) -> bool: ...

    def not_awaited(self, call: OutgoingCall, waiter: str | None = None) -> None: ...

    def call_returned(self, call: OutgoingCall, stamp_text: str | None, code: grpc.StatusCode | None) -> None:
        """Raises a :class:`RefusedResponse` when the response is not handed to the caller."""

    def arrive(
        self, method: str, metadata: Iterable[tuple[str, str | bytes]], pool: WorkerPool | None
    ) -> IncomingCall: ...

    def handler_started(self, call: IncomingCall, peer_address: str | None = None) -> None:
        """Needed for a call in a pool (it leaves the queue) or without a peer (named by
        ``peer_address`` now); for any other call it changes nothing."""

    def respond(self, call: IncomingCall, peer_address: str, active: bool) -> tuple[str, str] | None:
        """Returns the response's stamp as the metadata entry to add to the trailing metadata, or None."""
