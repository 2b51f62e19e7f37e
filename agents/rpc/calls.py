"""What the RPC-mode agent and its interceptors share about one call: its records, the worker pool
of a sync server as the interceptor sees it, the errors a refused response raises, the metadata a
request carries, and :class:`CallEvents`, what the interceptors and the instrumented channel tell
the agent. No behaviour of the agent lives here, so they need not import the agent (which creates
them)."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from stablewatch.agents.rpc.core import STAMP_KEY, Stamp
from stablewatch.v1 import WAIT_MODEL_OR, Wait

__all__ = [
    "BadStamp",
    "CallEvents",
    "IncomingCall",
    "OutgoingCall",
    "RefusedResponse",
    "StaleResponse",
    "WorkerPool",
    "request_entry",
    "split_request",
    "stamp_entry",
]


@functools.lru_cache(maxsize=256)
def stamp_entry(stamp: Stamp) -> tuple[str, str]:
    """The metadata entry that carries ``stamp`` on a response."""
    return (STAMP_KEY, stamp.encode())


def request_entry(stamp: Stamp, seq: int) -> tuple[str, str]:
    """The metadata entry of a request: ``{seq}:{stamp}``, the call's sequence number (its handler
    task is ``"{method}#{caller}:{seq}"``) and the caller's stamp in one entry, since each entry
    costs gRPC work on both sides."""
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


@dataclass(slots=True)
class OutgoingCall:
    """A call this process makes: who waits on whom while it is outstanding."""

    seq: int
    peer: str  # the callee's process id, or grpc://<target> for an uninstrumented one
    method: str
    caller_task: str
    instrumented: bool  # False: the channel leads to a service without an agent; nothing is stamped
    waits: bool = True  # False for a response stream: its caller is not reported waiting on the callee
    metadata: tuple[tuple[str, str], ...] = ()  # what the request carries
    settled: bool = False  # its response (or end) was taken in


@dataclass(slots=True)
class IncomingCall:
    """A call this process serves, from its arrival to the end of its handler."""

    name: str  # the handler's task: "{method}#{caller}:{seq}"
    peer: str | None  # the caller's process id; None until known (an uninstrumented caller)
    instrumented: bool
    error: str | None = None  # a bad or stale stamp: the handler refuses the call with `status`
    status: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
    pool: WorkerPool | None = None
    done: bool = False


@dataclass(slots=True)
class WorkerPool:
    """The worker threads of one sync server, as the server interceptor sees them (``workers=N``).

    ``running`` holds the calls that have (or are about to get) a worker, ``queued`` those that wait
    for one, first in first out, as grpc's thread pool hands them out.
    """

    workers: int
    running: dict[str, None] = field(default_factory=dict)
    queued: dict[str, None] = field(default_factory=dict)

    def arrive(self, name: str) -> None:
        if len(self.running) < self.workers and not self.queued:
            self.running[name] = None
        else:
            self.queued[name] = None

    def start(self, name: str) -> None:
        if self.queued.pop(name, 0) is None:  # our picture lagged behind the pool
            self.running[name] = None

    def end(self, name: str) -> None:
        self.running.pop(name, None)
        self.queued.pop(name, None)
        while self.queued and len(self.running) < self.workers:
            head = next(iter(self.queued))
            del self.queued[head]
            self.running[head] = None

    def waits(self, process_id: str) -> Iterable[Wait]:
        """Every queued call waits on any running handler (OR)."""
        if not self.running:
            return
        targets = [{"process": process_id, "task": name} for name in self.running]
        for name in self.queued:
            yield Wait(task=name, targets=targets, model=WAIT_MODEL_OR)


class CallEvents(Protocol):
    """What the interceptors and the instrumented channel report to the agent, one call per gRPC
    event (:class:`~stablewatch.agents.rpc.agent.RpcAgent` documents each and is the one implementation)."""

    def call_out(
        self, peer: str, method: str, caller_task: str, instrumented: bool, waits: bool = True
    ) -> OutgoingCall: ...

    def call_returned(self, call: OutgoingCall, stamp_text: str | None, code: grpc.StatusCode | None) -> None:
        """Raises a :class:`RefusedResponse` when the response is not handed to the caller."""

    def arrive(
        self, method: str, metadata: Iterable[tuple[str, str | bytes]], pool: WorkerPool | None
    ) -> IncomingCall: ...

    def handler_started(self, call: IncomingCall) -> None: ...

    def respond(self, call: IncomingCall, peer_address: str, active: bool) -> Stamp | None: ...
