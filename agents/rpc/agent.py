"""The RPC-mode agent: ordinary gRPC services take part in snapshots through interceptors.

A service creates one :class:`RpcAgent`, starts it, and installs its interceptors on its existing
server and channels (see :mod:`stablewatch.agents.rpc.interceptors`; a sync channel is best
wrapped by :meth:`RpcAgent.instrument_channel`, which does the client interceptor's work more
cheaply, :mod:`stablewatch.agents.rpc.channel`)::

    agent = RpcAgent("orders", detector="127.0.0.1:50051").start()
    pool = agent.thread_pool(8)
    server = grpc.server(pool, interceptors=[agent.server_interceptor(workers=pool)])
    channel = agent.instrument_channel(grpc.insecure_channel(addr), "payments")

The protocol (Lai–Yang coloring, DESIGN.md "RPC mode") lives in the pure
:class:`~stablewatch.agents.rpc.core.ColorCore`; this module owns one core behind one
``threading.Lock`` and carries out its actions: it captures the local state (``agent.state`` plus the
wait edges of the calls in progress) inside the same lock as the event that asked for it, reports
parts and failures on the control stream (a :class:`~stablewatch.agents.control.ControlClient` in RPC
mode, on a background event-loop thread), and drops recordings past their deadline on a timer.

Wait edges (what the recorded state holds about calls; users add their own through ``agent.state``):

* **Outgoing call.** While its caller is blocked on a call, the caller waits (AND) on the callee's
  task for that call, ``(callee, "{method}#{caller}@{incarnation}:{seq}")``: one ``Wait`` per call, with its own
  instance and the time the wait began, and one more per other thread or task blocked on the same
  call at once (``OutgoingCall.others``: a shared call, a future several threads wait on), with
  the call's instance and the time that one began. The caller is the task of the handler the call is made
  from (the same name, set by the server interceptor), else the thread's name (sync) or the asyncio
  task's name (aio). A task a handler starts, or a thread its context is copied into, inherits its
  context but is a caller of its own: the handler may not wait for it (but a sync handler that runs
  an event loop waits on its main task, and is blocked by a blocking call of any of its tasks). A blocking call's edge
  appears in the critical section that counts the request; a future's or an asyncio call's when
  something blocks on it (:meth:`RpcAgent.awaited`: a call made and not awaited holds nobody up,
  and reporting it would invent deadlocks). The edge goes in the critical section that takes in
  the response (or ends the call).
* **Response streams.** A call with a response stream (unary-stream, stream-stream) makes no wait
  edge. gRPC carries metadata per call, not per message, so the messages inside a stream are neither
  counted nor recorded: one in flight could wake a caller that the cut shows waiting, and a deadlock
  would be reported that is not there. A call with a request stream and a unary response keeps its
  wait: the server's handler reading the request stream waits on nothing (a free node).
* **Queued request.** With ``server_interceptor(workers=pool)`` (or ``workers=N``), a request that
  arrives while all N workers are taken is queued: its task waits (OR) on every handler task running
  then, with an instance of its own from its arrival. It turns into a running handler when a worker
  frees up (the pool is first in, first out). With a pool from :meth:`RpcAgent.thread_pool`, a call
  gRPC ends before its handler runs (its caller cancelled it, or its deadline passed) leaves the
  picture then; a plain pool gives no sign of it (see :meth:`RpcAgent.server_interceptor`).
* **Names.** A handler's task is ``{method}#{caller}@{incarnation}:{seq}``: the caller's process
  id, its incarnation in hex (a restarted caller numbers its calls from 1 again, while a sync
  handler of its old incarnation may still run) and its sequence number for the call. A caller
  without an agent is named by its address, ``{method}#grpc://{host}:{seq}`` (our own sequence
  number), from the moment the handler starts; until then (a call that waits for a worker, or is
  about to get one) it is ``{method}#?:{seq}``, as neither grpc server tells its interceptors the
  caller's address.
* **Received.** A request is received when the server's interceptor takes it (its arrival in the
  process): a request waiting for a worker is part of the process's state (the queued wait above),
  not of the channel, so that a snapshot completes even when the request never runs (a deadlock). A
  response is received when the interceptor hands it to the caller. A recording the message needs
  always happens first.
* **Stale messages.** A request or response stamped with a session or incarnation older than this
  process's view of its sender (sent before the pair's counts restarted, and overtaken by a message
  sent after) is not delivered. A stale request is refused with ``ABORTED`` and its handler does not
  run (safe to retry); the refusal carries this process's stamp, so the caller takes it in like any
  response. A stale response fails its call with :class:`StaleResponse` (``ABORTED``; the server ran
  the call) and restarts no count: the loss is known. Both are counted
  (``stablewatch_agent_rpc_stale_messages_total{side}``).
* A callee task the callee does not report (its request still in flight, its handler already done)
  is a free node: never a false deadlock. A recorded response wakes only its caller's task
  (``wakes_task``); a recorded request wakes only the handler it will start (``wakes_task``, the
  call's name), a task not yet running: no wait of the server's, but the cut is not terminated.

Breaking a proven deadlock (DESIGN.md): the agent is a
:class:`~stablewatch.agents.breaking.WaitSource` for its calls, beside ``agent.state``, and
:attr:`RpcAgent.breaks` routes the detector's ``BreakWait`` to them, at most once per instance and
only while the wait lasts:

* an **outgoing call** is cancelled at the caller, whose code gets
  :class:`~stablewatch.agents.rpc.calls.DeadlockBroken` (``ABORTED``, the deadlock named); its end
  is taken in as an error without the server's stamp (the pair's counts restart). Breakable:
  ``future()`` calls (instrumented channel or client interceptor), asyncio calls, and the blocking
  calls of ``instrument_channel(..., breakable=True)``; other blocking calls cannot be cancelled
  (``with_call``, or ``grpc.intercept_channel``'s) and are reported with instance 0 (the detector
  never picks such a wait);
* a **queued request** is refused with ``ABORTED`` before its handler runs (safe to retry): taken
  out of the queue of the server's :meth:`RpcAgent.thread_pool` and its handler run at once beside
  the pool, where it aborts. With a plain pool (``workers=N``) a queued request could only be
  refused when a worker took it, which in a deadlock never happens: it is reported with instance 0.

Whatever wait was broken (a call's or ``agent.state``'s), the core hears of it before the report
goes out, and recordings kept from before serve no later start (see "Breaks" in
:mod:`stablewatch.agents.rpc.core`): a cut begun after the report never shows the broken wait.

Waits that last past ``hint_after`` are hinted to the detector (once each), which then takes a
snapshot at once instead of at its next scheduled one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, overload

import grpc
import prometheus_client

from stablewatch import __version__
from stablewatch.agents import breaking
from stablewatch.agents.breaking import BreakDispatcher, Broken, Doorbell, HintWatch, OpenWait
from stablewatch.agents.certificates import TlsConfig
from stablewatch.agents.control import ControlClient
from stablewatch.agents.core import Action, RecordState, RemoteProtocolError, ReportPart, SnapshotFailed
from stablewatch.agents.detectors import DetectorLinks, DetectorStatus, detector_addresses
from stablewatch.agents.loop_thread import LoopThread
from stablewatch.agents.rpc.aio_channel import AioInstrumentedChannel
from stablewatch.agents.rpc.calls import (
    BadStamp,
    DeadlockBroken,
    IncomingCall,
    OutgoingCall,
    RefusedResponse,
    StaleResponse,
    WorkerPool,
    caller_tag,
    split_request,
)
from stablewatch.agents.rpc.channel import InstrumentedChannel
from stablewatch.agents.rpc.core import STAMP_KEY, ColorCore, StaleStamp, Stamp
from stablewatch.agents.rpc.interceptors import (
    AioServerInterceptor,
    ClientInterceptor,
    ServerInterceptor,
    aio_client_interceptors,
)
from stablewatch.agents.rpc.metrics import RpcAgentMetrics
from stablewatch.agents.rpc.pool import QueuedWork, WorkerExecutor
from stablewatch.agents.state import LocalStateKeeper
from stablewatch.v1 import WAIT_MODEL_AND, LocalSnapshotPart, LocalState
from stablewatch.v1.control_pb2 import (
    BREAK_OUTCOME_ALREADY_BROKEN,
    BREAK_OUTCOME_BROKEN,
    BreakWait,
    ChannelTarget,
)

__all__ = ["STAMP_KEY", "BadStamp", "DeadlockBroken", "RefusedResponse", "RpcAgent", "StaleResponse", "WorkerExecutor"]

_log = logging.getLogger(__name__)

#: A request as a channel state holds it, built only if the core records it (see ``MessageSource``).
#: Stamps seen repeat from call to call (they change with a color or a session): each text is
#: decoded once, and the stamp looked up by its text (a plain dict: a lookup costs less than an
#: ``lru_cache`` call). Bounded: it starts again when full. A bad stamp raises and is never kept.
#: (The stamps sent are encoded once each by the core: ``ColorCore.send_entry``.)
_stamps: dict[str | bytes, tuple[Stamp, str]] = {}
_MAX_STAMPS = 256


def _decode(text: str | bytes) -> tuple[Stamp, str]:
    """``Stamp.decode(text)``, kept in ``_stamps`` (look there first: ``_stamps.get(text) or
    _decode(text)``), with what the name of a handler of a request so stamped puts between the
    method and the call's number: ``#{caller_tag}:``."""
    stamp = Stamp.decode(text)
    known = stamp, f"#{caller_tag(stamp.process_id, stamp.incarnation)}:"
    if len(_stamps) >= _MAX_STAMPS:
        _stamps.clear()
    _stamps[text] = known
    return known


# Looked up once: each runs for every call.
_new_instance = breaking.new_instance
_time_ns, _monotonic, _time = time.time_ns, time.monotonic, time.time


_OK = grpc.StatusCode.OK

#: Ends of a call without our server's stamp that leave open whether the request or the response
#: arrived: the pair's counts restart (``reset_peer``).
_UNKNOWN_OUTCOME = "ended in {code} without the server's stamp: channel counts restarted"


#: Broken instances remembered after their wait ended, so that a repeated break says "already
#: broken" rather than "gone" (a detector does not repeat one, but a second detector may).
_REMEMBERED_BREAKS = 4096


class RpcAgent:
    """One process's RPC-mode agent; see the module docstring.

    ``detector``: the detector's address, or several (a sequence, or separated by commas) when
    detectors run side by side (None: no detector, parts go to :meth:`on_part` listeners only).
    ``tls``: credentials for the control stream. Recording bounds and lifetimes are the core's
    (``max_recordings``, ``max_recorded_bytes``, ``recording_lifetime``, ``max_skew``: how far in
    the future a stamp's color may lie, in seconds of wall time). ``incarnation`` defaults to the
    start time in nanoseconds, so that peers see a restart. ``hint_after``: a wait lasting this many
    seconds is hinted to the detector, which then takes a snapshot at once (None: no hints).
    """

    def __init__(
        self,
        process_id: str,
        *,
        detector: str | Sequence[str] | None = None,
        tls: TlsConfig | None = None,
        metrics_registry: prometheus_client.CollectorRegistry | None = None,
        metrics_port: int | None = None,
        metrics_address: str = "127.0.0.1",
        max_recordings: int | None = None,
        max_recorded_bytes: int | None = None,
        recording_lifetime: float | None = None,
        max_skew: float | None = None,
        expire_interval: float = 1.0,
        heartbeat_interval: float = 1.0,
        incarnation: int | None = None,
        call_timeout: float = 30.0,
        hint_after: float | None = breaking.DEFAULT_HINT_AFTER,
    ) -> None:
        self.process_id = process_id
        self.state = LocalStateKeeper()
        #: Rung when a call begins to wait or a request queues (the dispatcher sets it; see breaking.Doorbell).
        self.doorbell = Doorbell()
        #: Breaks a detector's ``BreakWait`` (the control stream's ``on_break``): ``agent.state``'s
        #: waits and this agent's calls.
        self.breaks = BreakDispatcher([self.state, self], on_broken=self._wait_broken)
        self._hint_watch = HintWatch(hint_after) if hint_after is not None else None
        self.metrics = RpcAgentMetrics(metrics_registry)
        # The stamped-messages counts, added to under the lock on every call (what metrics.stamped()
        # does, without the method call).
        self._stamped = self.metrics.stamped_counts
        self.incarnation = incarnation if incarnation is not None else time.time_ns()
        options: dict[str, Any] = {
            "max_recordings": max_recordings,
            "max_recorded_bytes": max_recorded_bytes,
            "default_lifetime": recording_lifetime,
            "max_skew": max_skew,
        }
        self._core = ColorCore(
            process_id, incarnation=self.incarnation, **{k: v for k, v in options.items() if v is not None}
        )
        self._lock = threading.Lock()
        self._detector_addresses = detector_addresses(detector)
        self._tls = tls
        self._heartbeat_interval = heartbeat_interval
        self._expire_interval = expire_interval
        self._call_timeout = call_timeout
        self._metrics_port = metrics_port
        self._metrics_bind = metrics_address
        self._metrics_server: Any = None
        self._seqs = itertools.count(1)
        self._caller_tag = caller_tag(process_id, self.incarnation)  # in our calls' handlers' names
        self._outgoing: dict[int, OutgoingCall] = {}
        self._pools: list[WorkerPool] = []
        self._broken: collections.OrderedDict[int, None] = collections.OrderedDict()  # instances broken here
        self._part_listeners: list[Callable[[LocalSnapshotPart], None]] = []
        self._loop_thread = LoopThread(f"stablewatch-rpc-{process_id}")
        self._loop = self._loop_thread.loop
        self._links: DetectorLinks | None = None
        self._expiry: asyncio.Task[None] | None = None
        self._hints: asyncio.Task[None] | None = None
        self._started = False

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> RpcAgent:
        """Start the agent's thread and dial the detector (without waiting for it); returns the agent."""
        if self._started:
            return self
        self._started = True
        self._loop_thread.start()
        self._run(self._start())
        if self._metrics_port is not None:
            self._metrics_server, _ = self.metrics.serve_http(self._metrics_port, self._metrics_bind)
        return self

    def stop(self) -> None:
        """Close the control stream and stop the agent's thread. Interceptors pass calls through after."""
        if not self._started or not self._loop_thread.is_alive():
            return
        if self._loop_thread.is_current():
            raise RuntimeError("RpcAgent.stop() was called from the agent's own thread; stop it from another thread")
        try:
            self._run(self._stop())
        finally:
            self._loop_thread.stop(self._call_timeout)
            if self._metrics_server is not None:
                self._metrics_server.shutdown()
                self._metrics_server.server_close()

    def __enter__(self) -> RpcAgent:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def detector_connected(self) -> bool:
        """Whether a detector (at least one, when several are given) has accepted this agent."""
        return self._links is not None and self._links.connected

    @property
    def detectors(self) -> tuple[DetectorStatus, ...]:
        """Each detector's control stream: its address, whether it is up, its id space, its latest event."""
        # Read from any thread: each field is one attribute the loop replaces whole.
        return self._links.status() if self._links is not None else ()

    @property
    def color(self) -> int:
        """The highest snapshot id this process has recorded (0 before any)."""
        with self._lock:
            return self._core.color

    @property
    def metrics_address(self) -> str | None:
        """Where /metrics is served (host:port), when ``metrics_port`` was given."""
        if self._metrics_server is None:
            return None
        return f"{self._metrics_bind}:{self._metrics_server.server_port}"

    def on_part(self, listener: Callable[[LocalSnapshotPart], None]) -> None:
        """Also hand every local snapshot part to ``listener`` (called under the agent's lock: be quick)."""
        self._part_listeners.append(listener)

    def start_snapshot(self, snapshot_id: int, *, lifetime: float | None = None) -> None:
        """Record for ``snapshot_id`` now, as a detector's start would (for tests and detector-less use)."""
        with self._lock:
            self._carry_out(self._core.start_snapshot(snapshot_id, now=time.monotonic(), lifetime=lifetime))

    # -- interceptors -----------------------------------------------------------------------------

    def thread_pool(self, max_workers: int, *, thread_name_prefix: str | None = None) -> WorkerExecutor:
        """A thread pool for ``grpc.server(pool, ...)`` whose queued calls a break can refuse.

        Give the same pool to :meth:`server_interceptor` as ``workers``; it serves one server only.
        Its threads are named ``{thread_name_prefix}_{n}`` (default prefix: ``{process_id}-worker``).
        """
        prefix = thread_name_prefix if thread_name_prefix is not None else f"{self.process_id}-worker"
        return WorkerExecutor(max_workers, thread_name_prefix=prefix)

    def server_interceptor(self, workers: WorkerExecutor | int | None = None) -> grpc.ServerInterceptor:
        """The interceptor for a sync ``grpc.server``; ``workers``: its thread pool, made by
        :meth:`thread_pool` (best), or that pool's ``max_workers``.

        With ``workers``, requests that wait for a worker are reported as queued (waiting on the
        running handlers); without it they never are (a deadlock through a full pool is then missed,
        never invented). The pool must serve only this server; a method whose handler has a pool of
        its own (``experimental_thread_pool``) runs there, and its calls are not counted in it.

        Only a pool made by :meth:`thread_pool` lets a queued request be broken (refused before its
        handler runs), and tells the agent when gRPC ends a call whose handler never ran (its
        caller cancelled it, or its deadline passed, while it waited), which then leaves the
        picture. A plain pool gives no such sign (grpc runs nothing of the interceptor's for that
        call): the call stays in the picture as holding or waiting for a worker, which can hide a
        pool deadlock or show a call that is gone. Neither pool hears of a call grpc refuses after
        the interceptor saw it (``maximum_concurrent_rpcs`` exceeded).
        """
        if isinstance(workers, WorkerExecutor):
            interceptor = ServerInterceptor(self, self._pool(workers.max_workers, breakable=True))
            workers.serve(interceptor.served, self.call_ended)
            return interceptor
        if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool)):
            raise TypeError(f"workers: the pool from agent.thread_pool(n), or its size; not {workers!r}")
        return ServerInterceptor(self, self._pool(workers))

    def client_interceptor(self, peer: str | None = None, *, target: str | None = None) -> Any:
        """The interceptor for ``grpc.intercept_channel`` (unary and streaming calls).

        ``peer``: the process id of the service the channel leads to (as its agent registers it).
        Without ``peer`` the channel leads to a service without an agent: give its ``target``; calls
        pass through unstamped and the part names the peer ``grpc://<target>``.
        """
        return ClientInterceptor(self, *_peer_of(peer, target))

    @overload
    def instrument_channel(
        self, channel: grpc.aio.Channel, peer: str | None = None, *, target: str | None = None, breakable: bool = False
    ) -> AioInstrumentedChannel: ...

    @overload
    def instrument_channel(
        self, channel: grpc.Channel, peer: str | None = None, *, target: str | None = None, breakable: bool = False
    ) -> InstrumentedChannel: ...

    def instrument_channel(
        self, channel: Any, peer: str | None = None, *, target: str | None = None, breakable: bool = False
    ) -> InstrumentedChannel | AioInstrumentedChannel:
        """``channel`` (sync or ``grpc.aio``) with its calls taking part in snapshots: the client
        interceptors' work, without gRPC's interceptor machinery (see
        :mod:`stablewatch.agents.rpc.channel` and :mod:`stablewatch.agents.rpc.aio_channel`).

        ``peer`` and ``target`` as for :meth:`client_interceptor`. The fastest way for a client.
        ``breakable`` (sync): blocking calls can be cancelled to break a deadlock, at a cost per
        call (a call's ``future()`` always can be, and so can every asyncio call).
        """
        if isinstance(channel, grpc.aio.Channel):
            return AioInstrumentedChannel(channel, self, *_peer_of(peer, target))
        return InstrumentedChannel(channel, self, *_peer_of(peer, target), breakable=breakable)

    def aio_server_interceptor(self) -> grpc.aio.ServerInterceptor:
        """The interceptor for ``grpc.aio.server(interceptors=[...])`` (no worker pool: nothing queues)."""
        return AioServerInterceptor(self)

    def aio_client_interceptors(self, peer: str | None = None, *, target: str | None = None) -> list[Any]:
        """The interceptors for ``grpc.aio.insecure_channel(addr, interceptors=...)``; ``peer`` and
        ``target`` as for :meth:`client_interceptor`."""
        return aio_client_interceptors(self, *_peer_of(peer, target))

    # -- events from the interceptors (each in one critical section) ------------------------------
    #
    # These run for every call (``bench/rpc_hot_path.py`` times them): the lock is taken with
    # acquire() and release() rather than ``with`` (about 50 ns less each time), and the helpers
    # ``request_entry`` and ``breaking.now_us`` are written out where they would cost a call.

    def call_out(
        self, peer: str, method: str, caller_task: str, instrumented: bool, waits: bool = True
    ) -> OutgoingCall:
        """A request is handed to gRPC now: count it, and (``waits``) make its caller wait on the callee's task.

        ``waits`` is True for a blocking call. A future or an asyncio call waits only once something
        blocks on it (:meth:`awaited`); a call with a response stream never does (see "Response
        streams" in the module docstring).
        """
        seq = next(self._seqs)
        if waits:  # the fields in order (metadata and settled at their defaults): no attribute set after
            instance, began_at_ns = _new_instance(), _time_ns()
            call = OutgoingCall(seq, peer, method, caller_task, instrumented, True, (), False, instance, began_at_ns)
        else:
            call = OutgoingCall(seq, peer, method, caller_task, instrumented, False)
        lock = self._lock
        lock.acquire()
        try:
            entry = self._core.send_entry(peer)
            self._outgoing[seq] = call
            if instrumented:
                self._stamped["request"] += 1  # self.metrics.stamped("request")
        finally:
            lock.release()
        if waits and self.doorbell.asleep:
            self.doorbell.ring()
        if instrumented:
            call.metadata = ((STAMP_KEY, f"{seq}:{entry[1]}"),)  # request_entry(stamp, seq)
        return call

    def awaited(self, call: OutgoingCall, waiter: str | None = None) -> bool:
        """A thread or task blocks on ``call``'s end now (a future's ``result()``, an asyncio call's
        ``await``): from now until it leaves (:meth:`not_awaited`) or the end is taken in, ``waiter``
        (by default the call's caller) waits on the callee's task. A call made with ``waits`` False
        and not yet awaited waits on nothing: its caller is free to do other things, and may never
        block on it. Returns whether this blocker was added (False once the call ended).

        Each blocker of a call is a waiter of its own: a second thread or task that blocks on a
        call another already awaits (request coalescing, a cached call, several ``result()``
        callers) is one of ``call.others``, so that a deadlock through it is seen, with the
        call's instance (breaking it cancels the one call, which frees every blocker).
        """
        # The asyncio channel's unary await (aio_channel._UnaryResponse.__await__) writes the first
        # blocker's part out for a call made by its awaiting caller: keep the two in step. Under the
        # lock: two threads may block on one future at once, and each must be counted.
        ring = False
        with self._lock:
            if call.settled:  # its end was taken in: it left _outgoing, and nobody waits on it
                return False
            if not call.waits:
                if waiter is not None:
                    call.caller_task = waiter
                call.instance, call.began_at_ns = _new_instance(), _time_ns()
                call.waits = True  # last: a break reads a wait once it is set
            else:
                entry = (waiter if waiter is not None else call.caller_task, _time_ns())
                if call.others is None:
                    call.others = [entry]
                else:
                    call.others.append(entry)
            ring = self.doorbell.asleep
        if ring:
            self.doorbell.ring()
        return True

    def not_awaited(self, call: OutgoingCall, waiter: str | None = None) -> None:
        """The blocker ``waiter`` (None: the call's first blocker) no longer blocks on ``call`` (its
        ``result(timeout)`` ran out): its wait ends, and the call goes on. The first blocker leaving
        hands the call's wait to the next one still blocked, if any."""
        with self._lock:
            others = call.others
            if not others:
                call.waits = False
                return
            if waiter is not None and waiter != call.caller_task:
                for i, (name, _) in enumerate(others):
                    if name == waiter:
                        del others[i]
                        break
                return
            # The first blocker left: the next one waits in its place, from when it began.
            call.caller_task, call.began_at_ns = others.pop(0)
            call.handlers_loop = None  # the next blocker's name was read as it began to block
            if not others:
                call.others = None

    def call_returned(self, call: OutgoingCall, stamp_text: str | None, code: grpc.StatusCode | None) -> None:
        """The call's response (or its end, with ``code``) is about to reach the caller.

        Takes the response in (recording first if its color asks for it) and ends the wait, in one
        critical section; an error without our server's stamp restarts the pair's counts. Raises
        :class:`BadStamp` when the server's stamp is bad or names another process, and
        :class:`StaleResponse` when it is stale (nothing taken in, no restart). Runs once per call.
        """
        stamp = error = stale = None
        if stamp_text is not None and call.instrumented:
            try:
                stamp = (_stamps.get(stamp_text) or _decode(stamp_text))[0]
                if stamp.process_id != call.peer:
                    raise RemoteProtocolError(f"the stamp names {stamp.process_id!r}, not the channel's peer")
            except RemoteProtocolError as exc:
                error = str(exc)
        lock, core = self._lock, self._core
        lock.acquire()
        try:
            if call.settled:
                return
            call.settled = True
            try:
                if stamp is not None:
                    try:
                        actions = core.receive_checked(stamp, call.response_message)
                        if actions is None:
                            actions = core.receive(stamp, call.response_message, _monotonic(), _time())
                    except RemoteProtocolError as exc:
                        error = str(exc)
                    except StaleStamp as exc:
                        stale = str(exc)
                    else:
                        if actions:
                            self._carry_out(actions)
                if error is not None:
                    reason = (
                        f"call {call.method} to {call.peer} returned a bad stamp ({error}): channel counts restarted"
                    )
                    self._carry_out(self._core.reset_peer(call.peer, reason))
                    self.metrics.peer_reset()
                elif stamp is None and call.instrumented and code not in (None, _OK):
                    reason = f"call {call.method} to {call.peer} " + _UNKNOWN_OUTCOME.format(code=code.name)
                    self._carry_out(self._core.reset_peer(call.peer, reason))
                    self.metrics.peer_reset()
            finally:
                self._outgoing.pop(call.seq, None)
        finally:
            lock.release()
        if error is not None:
            self.metrics.bad_stamp("client")
            raise BadStamp(f"stablewatch: the response of {call.method} from {call.peer} has a bad stamp: {error}")
        if stale is not None:
            self.metrics.stale("client")
            raise StaleResponse(
                f"stablewatch: {call.peer} ran {call.method}, but its response was sent before the counts between "
                f"{call.peer} and {self.process_id} restarted, and is not delivered ({stale})"
            )
        if stamp is None and (code in (None, _OK) or not call.instrumented):
            self.metrics.uninstrumented("outbound")

    def arrive(self, method: str, metadata: Iterable[tuple[str, str | bytes]], pool: WorkerPool | None) -> IncomingCall:
        """A request reaches the server's interceptor: take it in (recording first if its color asks)."""
        entry = None
        for key, value in metadata or ():
            if key == STAMP_KEY:  # the last one is the caller's own (see interceptors.stamped)
                entry = value
        if entry is None:
            call = IncomingCall(f"{method}#?:{next(self._seqs)}", None, False, pool)
            self.metrics.uninstrumented("inbound")
            if pool is not None:
                with self._lock:
                    pool.arrive(call)
                self.doorbell.ring()
            return call
        try:
            # split_request(entry), written out for a text entry that holds a sequence number.
            seq_text, colon, stamp_text = entry.partition(":") if type(entry) is str else ("", "", "")
            if not (colon and seq_text.isdigit() and seq_text.isascii() and len(seq_text) <= 20):
                seq_text, stamp_text = split_request(entry)  # bytes, or a bad entry (ValueError)
            stamp, caller = _stamps.get(stamp_text) or _decode(stamp_text)
        except (ValueError, RemoteProtocolError) as exc:
            return self._refuse(method, str(exc), pool)
        call = IncomingCall(f"{method}{caller}{seq_text}", stamp.process_id, True, pool)  # caller: "#{tag}:"
        queued = False
        lock, core = self._lock, self._core
        lock.acquire()
        try:
            try:
                actions = core.receive_checked(stamp, call.request_message)
                if actions is None:
                    actions = core.receive(stamp, call.request_message, _monotonic(), _time())
            except RemoteProtocolError as exc:
                error = str(exc)
            except StaleStamp as exc:
                # Refused, but with our stamp (respond()): the caller takes the refusal in as a
                # response, and its counts need no restart.
                error = None
                call.status = grpc.StatusCode.ABORTED
                call.error = (
                    f"stablewatch: the call of {method} was sent before the counts between {stamp.process_id} and "
                    f"{self.process_id} restarted, and is not delivered ({exc}); it did not run: safe to retry"
                )
                self.metrics.stale("server")
                if pool is not None:
                    pool.arrive(call)
                    queued = True
            else:
                error = None
                if actions:
                    self._carry_out(actions)
                if pool is not None:
                    if not pool.queued and len(pool.running) < pool.workers:
                        pool.running[call.name] = call  # pool.arrive(call): it runs at once, written out
                    else:
                        self._forget_ended(pool)  # a full picture may hold calls that gRPC ended
                        queued = pool.arrive(call)
        finally:
            lock.release()
        if queued:
            self.doorbell.ring()
        if error is not None:
            return self._refuse(method, error, pool)
        return call

    def _refuse(self, method: str, error: str, pool: WorkerPool | None) -> IncomingCall:
        self.metrics.bad_stamp("server")
        reason = f"stablewatch: bad stamp on a call of {method}: {error}"
        call = IncomingCall(f"{method}#?:{next(self._seqs)}", None, False, pool, error=reason)
        if pool is not None:
            with self._lock:
                pool.arrive(call)
            self.doorbell.ring()
        return call

    def handler_started(self, call: IncomingCall, peer_address: str | None = None) -> None:
        """The call's handler runs now (a queued call has its worker). A call with a peer and no pool
        (every call of an asyncio server from a caller with an agent) needs no word: nothing changes.

        ``peer_address``: the caller's address (``context.peer()``), given for a call whose caller
        has no agent; the call is named by it from now on, ``{method}#grpc://{host}:{seq}``.
        """
        call.started = True
        # Its queued work item (a WorkerExecutor's) is dropped now, in the worker, which then frees
        # the call's objects (its context, grpc's call), as a plain pool does: left until gRPC ends
        # the call, they would be freed in grpc's polling thread, which serves every call in turn.
        call.work = None
        pool = call.pool
        if peer_address is not None and call.peer is None:
            self._name_by_address(call, _outside_peer(peer_address))
        # Once out of the queue a call never goes back: only a queued one needs the lock.
        elif pool is not None and call.name in pool.queued:
            with self._lock:
                pool.start(call.name)

    def _name_by_address(self, call: IncomingCall, peer: str) -> None:
        """Rename ``call`` (``{method}#?:{seq}``) after its caller's address ``peer`` as its handler starts."""
        method, _, seq = call.name.rpartition("#?:")
        name = f"{method}#{peer}:{seq}"
        pool = call.pool
        if pool is None:  # nothing else holds its name
            call.peer, call.name = peer, name
            return
        with self._lock:  # renamed in the pool's picture at once: a capture sees one name or the other
            pool.start(call.name)
            pool.rename(call.name, name)
            call.peer, call.name = peer, name

    def call_ended(self, call: IncomingCall) -> None:
        """gRPC ended the queued ``call`` (its :class:`WorkerExecutor` tells, in grpc's polling
        thread; a call that ran at once is found by ``_forget_ended`` instead): if its
        handler never started (cancelled by its caller or its deadline before a worker ran it), it
        leaves the pool's picture now, so that it no longer seems to wait for a worker or hold one.
        Its queued work is taken back, so that no worker runs it; a request-stream call whose work
        a worker took already stays: grpc runs its handler all the same, which holds the worker.

        Nothing is counted: the request was taken in on arrival, and no response goes out; the
        caller sees the call end without this server's stamp and restarts the pair's counts.
        """
        # Its work item goes in any case: the item holds the call's context, which holds the call,
        # so keeping it would leave every call a reference cycle for the garbage collector.
        if call.started or call.done:  # the common case: its handler ran, and ended it
            call.work = None
            return
        with self._lock:
            self._end_unstarted(call)

    def _end_unstarted(self, call: IncomingCall) -> None:
        """gRPC ended ``call``, whose handler had not started when it was told: it leaves the pool's
        picture, unless it streams requests and a worker has its work item (under the lock)."""
        work, call.work = call.work, None
        if call.started or call.done:
            return
        # A break may have taken the work already (then its refusal runs aside: it ends the call).
        taken = work is not None and work.take()
        if call.streams_requests and not taken and work is not None:
            return  # a worker has it: its handler runs, and ends the call's place
        call.done = True
        if call.pool is not None:
            call.pool.end(call.name)

    def _forget_ended(self, pool: WorkerPool) -> None:
        """Calls that ran at once leave ``pool``'s picture here if gRPC ended them before their
        handler started (under the lock).

        A :class:`WorkerExecutor` has gRPC tell the agent when a queued call ends. A call that runs
        at once is not told of (a callback per call cost grpc's polling thread, which serves every
        call in turn, about 1 µs a call, warm: ``bench/README.md``): it is found here, where the
        picture is read (each recording) or fills up (an arrival that would queue). Until then it
        only holds a place in the picture that a worker has in fact freed: a recording never shows
        it, and an arrival that finds no room looks for it first.
        """
        for call in [c for c in pool.running.values() if not c.started and c.work is not None and c.work.call_over()]:
            self._end_unstarted(call)

    def respond(self, call: IncomingCall, peer_address: str, active: bool) -> tuple[str, str] | None:
        """The handler ended: count the response (when the call is still ``active``) and free the worker.

        Returns the stamp's metadata entry to add to the trailing metadata, or None (calls refused for a bad stamp,
        uninstrumented or cancelled calls; a call refused as stale gets one). A caller without an
        agent is counted as ``grpc://<host>`` so that the part names it as a peer outside the cut
        (``peer_address`` is read only if the call was not named by its address when it started).
        """
        lock = self._lock
        lock.acquire()
        try:
            if call.done:
                return None
            call.done = True
            pool = call.pool
            # pool.end(call.name), in a call only when a call queues or this one did not run (rare).
            if pool is not None and (pool.queued or pool.running.pop(call.name, False) is False):
                pool.end(call.name)
            if not active or (call.error is not None and not call.instrumented):
                return None  # a refusal for a bad stamp is counted nowhere; one for a stale stamp is a response
            if not call.instrumented:
                self._core.send(call.peer if call.peer is not None else _outside_peer(peer_address))
                return None
            entry = self._core.send_entry(call.peer)  # type: ignore[arg-type]  # an instrumented call has its peer
            self._stamped["response"] += 1  # self.metrics.stamped("response")
        finally:
            lock.release()
        return entry

    def callee_task(self, call: OutgoingCall) -> str:
        """The name the callee gives the handler of ``call``: ``"{method}#{caller}@{incarnation}:{seq}"``."""
        return f"{call.method}#{self._caller_tag}:{call.seq}"

    # -- breaking waits (a breaking.WaitSource: the calls' waits; agent.state is another) ------------

    def break_wait(self, order: BreakWait) -> Broken | None:
        """Break the outgoing call or queued request ``order.instance``, if it still waits (once).

        Returns at once: a cancelled call fails in its caller's thread or task, a refused request
        aborts on a thread of its own. None when the instance is no call of this agent, has ended,
        or cannot be broken (reported with instance 0).
        """
        instance = order.instance
        with self._lock:
            if instance in self._broken:
                return Broken(BREAK_OUTCOME_ALREADY_BROKEN, f"wait {instance} was broken before: nothing done")
            outgoing = next((c for c in self._outgoing.values() if c.instance == instance), None)
            if outgoing is not None:
                cancel = outgoing.cancel
                if cancel is None or outgoing.settled or not outgoing.waits:
                    return None
                outgoing.broken = breaking.victim_message(order)  # before the cancel: the caller reads it
                self._claim(instance)
            else:
                queued = next(((p, c) for p in self._pools for c in p.queued.values() if c.instance == instance), None)
                if queued is None or not queued[0].breakable or queued[1].work is None:
                    return None  # (a call not yet handed to the pool: microseconds after its arrival)
                pool, incoming = queued
                work: QueuedWork = incoming.work
                incoming.work = None  # taken here, once
                self._claim(instance)
        if outgoing is not None:
            return self._cancel_outgoing(outgoing, cancel)
        return self._refuse_queued(pool, incoming, work, breaking.victim_message(order))

    def open_waits(self) -> list[OpenWait]:
        """The outgoing calls and queued requests now waiting (for the long-wait hints)."""
        with self._lock:
            waits = [
                OpenWait(c.instance, c.waiter(), c.began_at_ns // 1000)
                for c in self._outgoing.values()
                if c.waits and c.broken is None
            ]
            for pool in self._pools:
                waits.extend(OpenWait(c.instance, name, c.began_at_us) for name, c in pool.queued.items())
        return waits

    def idle(self) -> bool:
        """True when no outgoing call waits and no request is queued."""
        with self._lock:
            return not any(c.waits and c.broken is None for c in self._outgoing.values()) and not any(
                p.queued for p in self._pools
            )

    def _wait_broken(self, order: BreakWait) -> None:
        """A wait (a call's, or ``agent.state``'s) was broken, its report not sent yet: recordings
        kept from before must serve no later start (see "Breaks" in the core's docstring)."""
        with self._lock:
            self._core.wait_broken()

    def _claim(self, instance: int) -> None:
        """Remember ``instance`` as broken (under the lock), so that it is never broken twice."""
        self._broken[instance] = None
        if len(self._broken) > _REMEMBERED_BREAKS:
            self._broken.popitem(last=False)

    def _cancel_outgoing(self, call: OutgoingCall, cancel: Callable[[Any], bool]) -> Broken | None:
        """Cancel the claimed outgoing ``call`` (outside the lock: grpc may end it right here)."""
        if not cancel(call.handle):  # it ended first: its caller sees its own end
            with self._lock:
                call.broken = None
                self._broken.pop(call.instance, None)
            return None
        self.metrics.broke("call")
        return Broken(
            BREAK_OUTCOME_BROKEN,
            f"outgoing call {call.method} to {call.peer} cancelled: {call.waiter()} gets ABORTED",
        )

    def _refuse_queued(self, pool: WorkerPool, call: IncomingCall, work: QueuedWork, message: str) -> Broken | None:
        """Take the claimed queued ``call`` out of its pool and run it aside, refused with ABORTED."""
        if not work.take():  # a worker took it first: its handler runs
            with self._lock:
                self._broken.pop(call.instance, None)
            return None
        call.status, call.error = grpc.StatusCode.ABORTED, message  # seen by the thread started below
        with self._lock:
            pool.leave(call.name)
        work.run_aside(f"stablewatch-refuse-{call.name}")
        self.metrics.broke("queued")
        return Broken(BREAK_OUTCOME_BROKEN, f"queued request {call.name} refused with ABORTED before its handler ran")

    # -- internals --------------------------------------------------------------------------------

    def _pool(self, workers: int | None, breakable: bool = False) -> WorkerPool | None:
        if workers is None:
            return None
        if workers < 1:
            raise ValueError(f"workers must be at least 1, not {workers}")
        pool = WorkerPool(workers, breakable)
        with self._lock:
            self._pools.append(pool)
        return pool

    def _capture(self) -> LocalState:
        """The local state with the calls' wait edges, one per call; called under the lock."""
        state = self.state.snapshot()
        for call in self._outgoing.values():
            # A call broken for a deadlock waits no longer, though its caller may not have woken to
            # the cancel yet (an asyncio one's runs on its loop, later): the break's report has gone
            # to the detector, and a cut begun after it must not show the deadlock whole (the
            # detector would name another wait of it). Application waits are left out alike.
            if call.waits and call.broken is None:
                targets = [{"process": call.peer, "task": self.callee_task(call)}]
                instance = call.instance if call.cancel is not None else 0  # 0: cannot be broken
                waiter = call.waiter()
                state.waits.add(
                    task=waiter,
                    targets=targets,
                    model=WAIT_MODEL_AND,
                    instance=instance,
                    began_at_us=call.began_at_ns // 1000,
                )
                # One wait per other blocker of the call, each from when it began, with the call's
                # instance: whichever a detector picks, the break cancels the call, freeing them all.
                # A name blocked twice (two threads of one name, or a maker that waits from the call's
                # making and then blocks in result()) waits once.
                if call.others:
                    named = {waiter}
                    for name, began_at_ns in call.others:
                        if name not in named:
                            named.add(name)
                            state.waits.add(
                                task=name,
                                targets=targets,
                                model=WAIT_MODEL_AND,
                                instance=instance,
                                began_at_us=began_at_ns // 1000,
                            )
        for pool in self._pools:
            self._forget_ended(pool)
            state.waits.extend(pool.waits(self.process_id))
        return state

    def _carry_out(self, actions: Iterable[Action]) -> None:
        """Do what the core asks, in order; called under the lock."""
        for action in actions:
            if isinstance(action, RecordState):
                self.metrics.snapshot_recorded()
                self._carry_out(self._core.record_state(action.snapshot_id, self._capture()))
            elif isinstance(action, ReportPart):
                self._report(action.part)
            elif isinstance(action, SnapshotFailed):
                self.metrics.snapshot_failed()
                _log.info("snapshot %d failed in %s: %s", action.snapshot_id, self.process_id, action.reason)
                if self._links is not None and self._started:
                    self._loop.call_soon_threadsafe(self._links.report_failure, action.snapshot_id, action.reason)

    def _report(self, part: LocalSnapshotPart) -> None:
        if self._links is not None and self._started:
            self._loop.call_soon_threadsafe(self._links.report_part, part)
        for listener in self._part_listeners:
            listener(part)

    def _run(self, coroutine: Any) -> Any:
        return self._loop_thread.run(coroutine, self._call_timeout)

    async def _start(self) -> None:
        self._expiry = asyncio.create_task(self._expire_forever(), name=f"rpc-expiry-{self.process_id}")
        if not self._detector_addresses:
            return
        self._links = DetectorLinks(self._detector_addresses, self._control_client, self._detector_changed)
        await self._links.start()
        if self._hint_watch is not None:
            hints = breaking.hint_forever(self.breaks, self._hint_watch, self._links.send_hint)
            self._hints = asyncio.create_task(hints, name=f"rpc-hints-{self.process_id}")

    async def _stop(self) -> None:
        for task in (self._hints, self._expiry):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._links is not None:
            await self._links.stop()

    async def _detector_start(self, snapshot_id: int, lifetime: float | None) -> None:
        self.start_snapshot(snapshot_id, lifetime=lifetime)

    def _channel_target(self, target: ChannelTarget) -> None:
        with self._lock:
            self._carry_out(
                self._core.channel_target(
                    target.snapshot_id, target.src, target.sent, target.src_incarnation, target.session
                )
            )

    def _finish(self, snapshot_id: int) -> None:
        with self._lock:
            self._core.finish_snapshot(snapshot_id)

    def _control_client(
        self, address: str, on_registered: Callable[[int], str | None], on_event: Callable[[str, str], None]
    ) -> ControlClient:
        """The control stream to the detector at ``address`` (see :class:`DetectorLinks`)."""

        def new_epoch(epoch: int) -> None:
            # That detector's ids start again (a new store): forget its old snapshots, not the others'.
            with self._lock:
                self._core.new_epoch(client.id_space or 0)

        client = ControlClient(
            self.process_id,
            "",
            address,
            on_start=self._detector_start,
            on_finish=self._finish,
            on_epoch=new_epoch,
            credentials=self._tls.channel_credentials() if self._tls else None,
            channel_options=self._tls.control_channel_options() if self._tls else (),
            incarnation=self.incarnation,
            agent_version=__version__,
            heartbeat_interval=self._heartbeat_interval,
            on_event=on_event,
            rpc_mode=True,
            on_channel_target=self._channel_target,
            on_break=self.breaks.handle,
            on_registered=on_registered,
        )
        return client

    def _detector_changed(self, address: str, connected: bool) -> None:
        self.metrics.detector_connected(address, connected)
        self.metrics.control_connected(self._links is not None and self._links.connected)

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(self._expire_interval)
            with self._lock:
                self._carry_out(self._core.expire(time.monotonic()))


def _peer_of(peer: str | None, target: str | None) -> tuple[str, bool]:
    """The peer id a client channel counts its calls under, and whether the peer has an agent."""
    if peer is not None:
        return peer, True
    if not target:
        raise ValueError("give the peer's process id, or the target of a service without an agent")
    return f"grpc://{target}", False


def _outside_peer(address: str) -> str:
    """``grpc://<host>`` for a caller without an agent (``context.peer()`` without its port)."""
    kind, _, rest = address.partition(":")
    return f"grpc://{rest.rsplit(':', 1)[0]}" if kind in ("ipv4", "ipv6") else f"grpc://{address}"
