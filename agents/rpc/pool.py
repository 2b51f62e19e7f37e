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

Breaking a queued call (:meth:`QueuedWork.take` and :meth:`QueuedWork.run_aside`): its future is
cancelled, so that no worker will run it (a worker that reaches it skips it; the queue, a
``SimpleQueue``, cannot give it back), and the work item runs at once on a thread of its own, where
the wrapped handler finds the call's error and aborts with it without running the service's code.
If a worker took the item first, the cancel fails and nothing is broken: the handler runs.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

from stablewatch.agents.rpc.calls import IncomingCall

__all__ = ["QueuedWork", "WorkerExecutor"]


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

    def serve(self, served: contextvars.ContextVar[IncomingCall]) -> None:
        """Tie work items to calls through ``served``, the server interceptor's variable (once)."""
        if self._served is not None and self._served is not served:
            raise ValueError("this worker pool already serves another server interceptor: give each server its own")
        self._served = served

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future = super().submit(fn, *args, **kwargs)
        served = self._served
        context = getattr(fn, "__self__", None)  # grpc submits a call's context.run
        if served is not None and type(context) is contextvars.Context:
            call = context.get(served, None)
            if call is not None:
                # Left on the call after the submit: a break reads it only for a call still queued,
                # and a worker that has started the item makes take() fail.
                call.work = QueuedWork(future, fn, args, kwargs)
        return future
