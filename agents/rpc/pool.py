"""The worker pool of a sync gRPC server in RPC mode: a thread pool whose queued calls can be refused.

``agent.thread_pool(8)`` makes a :class:`WorkerExecutor` for ``grpc.server(pool, ...)``, and
``agent.server_interceptor(workers=pool)`` takes its size from it. What it adds to a plain
``ThreadPoolExecutor``: it knows which queued work item is which call, so that a call queued in a
pool deadlock (every worker blocked, waiting, through other services, on calls queued behind them)
can be refused with ``ABORTED`` before its handler runs (DESIGN.md, "Breaking a proven deadlock").

How a work item is tied to its call: grpc's sync server runs a call's interceptors and then its
handler in one ``contextvars.Context`` made for the call, and submits the handler as
``pool.submit(context.run, behavior, ...)``. The server interceptor has already put the call's
:class:`~stablewatch.agents.rpc.calls.IncomingCall` in a variable of that context, so ``submit``
reads it from ``fn.__self__`` (the context) and leaves the work item on the call.

The work item stays on the call only while the call may still be queued: the agent drops it when
the handler starts (in the worker, which frees the call's objects then, as a plain pool frees them
there) or when gRPC ends the call, whichever comes first. Left until the call ends, the objects it
holds (the call's context, grpc's call and its state) would be freed by grpc's polling thread,
which takes in, submits and ends every call in turn: it did cost that thread several µs of CPU a
call (``bench/rpc_overhead.py``, measured in place).

A call gRPC ends before its handler starts (cancelled by its caller, or its deadline passed, while
it waited for a worker) must leave the agent's picture of the pool: it no longer exists, and a
worker it seemed to hold or wait for would hide a pool deadlock or show a call that is gone. grpc
runs no handler for it (the work item finds the call over and returns), so nothing of the
interceptor's runs. For a call queued in the picture, ``submit`` therefore asks grpc to tell the
agent when the call ends, as a servicer context's ``add_callback`` does (grpc's per-call state is
the work item's third argument; its callbacks run once the call is over, whether or not a handler
ran). A call that runs at once has a worker free for it, and is asked no such thing: a callback per
call cost grpc's polling thread about 1 µs a call, warm (``bench/README.md``). Its work item
says whether gRPC has ended it (:meth:`QueuedWork.call_over`), which the agent asks of the calls
that ran at once and never started, each time it reads the picture or the picture fills up. Should
a grpc version lay its work items out otherwise, every item is wrapped instead, to tell the agent
once it has run, which for a queued call is when a worker frees up rather than when it was
cancelled.

Breaking a queued call (:meth:`QueuedWork.take` and :meth:`QueuedWork.run_aside`): its future is
cancelled, so that no worker will run it (a worker that reaches it skips it; the queue, a
``SimpleQueue``, cannot give it back), and the work item runs at once on a thread of its own, where
the wrapped handler finds the call's error and aborts with it without running the service's code.
If a worker took the item first, the cancel fails and nothing is broken: the handler runs.
"""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

from stablewatch.agents.rpc.calls import IncomingCall

try:  # grpc's per-call state of its sync server, where a call's end callbacks are kept
    from grpc._server import _CANCELLED as _GRPC_CANCELLED
    from grpc._server import _RPCState as _GRPC_CALL_STATE
except ImportError:  # pragma: no cover - another grpc: the work item is wrapped instead
    _GRPC_CALL_STATE = _GRPC_CANCELLED = None

__all__ = ["QueuedWork", "WorkerExecutor"]


def _run_then_end(
    ended: Callable[[IncomingCall], None], call: IncomingCall, fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """A work item that tells the agent it has run (when grpc's call state could not be found)."""
    try:
        return fn(*args, **kwargs)
    finally:
        ended(call)


class QueuedWork(NamedTuple):
    """One call's work item as the pool holds it until a worker takes it."""

    future: Future[Any]
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def take(self) -> bool:
        """Take the item out of the pool (its future cancelled): True if no worker has started it.

        Call once: a second call would find the future cancelled and answer True again.
        """
        return self.future.cancel()

    def call_over(self) -> bool:
        """Whether gRPC has ended the item's call (cancelled it, or finished with it), as grpc's state
        of the call says; False when the item carries no such state."""
        state = self.args[2] if len(self.args) > 2 else None
        return type(state) is _GRPC_CALL_STATE and (state.client is _GRPC_CANCELLED or state.callbacks is None)

    def run_aside(self, name: str) -> None:
        """Run the taken item now, on a thread of its own rather than a worker of the pool."""
        threading.Thread(target=self.fn, args=self.args, kwargs=self.kwargs, name=name, daemon=True).start()


class WorkerExecutor(ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` for one sync gRPC server whose queued calls a break can refuse.

    Serve one server only, with the agent's interceptor given this pool as ``workers``; submitted
    work that is not a call of that server runs as in any thread pool.
    """

    def __init__(self, max_workers: int, thread_name_prefix: str = "") -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, not {max_workers}")
        super().__init__(max_workers, thread_name_prefix=thread_name_prefix)
        self.max_workers = max_workers
        self._served: contextvars.ContextVar[IncomingCall] | None = None
        self._ended: Callable[[IncomingCall], None] = _ignore

    def serve(self, served: contextvars.ContextVar[IncomingCall], ended: Callable[[IncomingCall], None]) -> None:
        """Tie work items to calls through ``served``, the server interceptor's variable (once), and
        call ``ended(call)`` when gRPC ends a call (the agent frees its place if no handler ran)."""
        if self._served is not None and self._served is not served:
            raise ValueError("this worker pool already serves another server interceptor: give each server its own")
        self._served, self._ended = served, ended

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        # This runs for every call, in grpc's polling thread, which serves every call in turn
        # (``bench/rpc_hot_path.py`` times it, ``pooled_instrumented``): the QueuedWork is made
        # without the Python frame of a NamedTuple's __new__.
        served = self._served
        context = getattr(fn, "__self__", None)  # grpc submits a call's context.run
        call = context.get(served, None) if served is not None and type(context) is contextvars.Context else None
        if call is None:
            return super().submit(fn, *args, **kwargs)
        # grpc's sync server (1.85 here) submits ``context.run, _unary_response_in_pool, rpc_event,
        # state, ...`` (``_stream_response_in_pool`` alike): the call's state is the third argument.
        state = args[2] if len(args) > 2 else None
        if _GRPC_CALL_STATE is not None and type(state) is _GRPC_CALL_STATE:
            callbacks = ()
            if call.instance:  # queued in the picture (a call that runs at once asks nothing: see above)
                # Tell the agent once the call is over, as ``ServicerContext.add_callback`` would:
                # grpc runs the state's callbacks in its polling thread then (None: it is over
                # already). grpc holds the state's condition while it submits (it is re-entrant); it
                # is taken here by the lock's own acquire and release, which a Condition keeps on
                # itself (its ``__enter__`` and ``__exit__`` are Python frames).
                condition = state.condition
                condition.acquire()
                try:
                    callbacks = state.callbacks
                    if callbacks is not None:
                        callbacks.append(functools.partial(self._ended, call))
                finally:
                    condition.release()
        else:
            callbacks = ()
            fn, args = _run_then_end, (self._ended, call, fn, *args)
        future = super().submit(fn, *args, **kwargs)
        # Left on the call after the submit: a break reads it only for a call still queued, and a
        # worker that has started the item makes take() fail. The agent drops it when the handler
        # starts (in the worker, so that the call's objects are freed there, as a plain pool frees
        # them, and not in grpc's polling thread when the call ends) or when gRPC ends the call
        # (told, or found by the agent when it reads the picture).
        call.work = _new_work((future, fn, args, kwargs))
        if callbacks is None:  # over already: told now (after the work item, which it drops)
            self._ended(call)
        elif call.started:  # a worker started its handler first, and found no item to drop
            call.work = None
        return future


#: ``QueuedWork(future, fn, args, kwargs)`` from one tuple, without the Python ``__new__``.
_new_work: Callable[[tuple[Any, ...]], QueuedWork] = functools.partial(tuple.__new__, QueuedWork)


def _ignore(call: IncomingCall) -> None:
    """No agent to tell (a pool not serving an interceptor gets no calls of one)."""
