"""The agent side of the control stream: one ``Control.Attach`` stream from the agent to the detector.

The agent dials the detector and keeps a single bidirectional stream open. On it the agent sends
``Register`` first and then heartbeats, its local snapshot parts, snapshot failures and ``Pong``
replies; the detector answers ``Registered`` (or ``Refused``) and then sends ``StartSnapshot`` (with
the snapshots that ended since the last one), ``SnapshotsEnded``, ``AbortSnapshot``, ``Ping`` and,
to an agent in RPC mode, ``ChannelTarget``. This
module only carries those messages; the protocol itself lives in :mod:`stablewatch.agents.core`
(and :mod:`stablewatch.agents.rpc.core` in RPC mode).

What the agent promises, and what :class:`ControlClient` guarantees for it:

* **Never in the service's way.** Every public method returns at once and never raises because of
  the detector: while the detector is down or slow, parts are refused (``report_part`` returns
  False) or dropped from a bounded queue, and the detector aborts those snapshots by its deadline.
* **In order.** ``on_start`` callbacks run one at a time, in the order the detector sent them, and
  ``on_finish(k)`` runs after an earlier ``on_start(k)`` has returned. A start that finds no
  callback running or waiting is first offered to ``on_start_now``, when given, right where it was
  read: it records at once and says so, or declines when it would have to wait (one turn of the
  event loop less between the detector's start and the recording); in RPC mode
  ``on_channel_target(target)`` runs in the same order (after the start of its snapshot that the
  detector sent before it). Outgoing messages are sent in
  the order they were queued. A ``Ping`` is answered at once, even while an ``on_start`` runs.
* **Deadlines pass through.** ``on_start(k, lifetime)`` gets the start's ``deadline_ms`` in
  seconds (None when the detector sent 0): the agent drops its recording of ``k`` after that long.
* **Epochs.** When a registration reports another ``detector_epoch`` than the one before (a new
  detector store: its ids start again), ``on_epoch(epoch)`` runs before any start of the new
  stream, so the agent can forget every snapshot of the old epoch. Markers from agents that
  already follow the new detector do not wait for the control stream, so the agent must not take
  part before it has forgotten: it registers with the epoch it follows (``known_epoch``), and when
  that is another one the detector admits it to snapshots only once a heartbeat, sent as soon as
  ``on_epoch`` has returned, carries the new epoch.
* **Forget on loss.** When the stream breaks, queued messages are dropped and ``on_finish(k)`` is
  called for every snapshot started through this client and not yet finished: the detector aborts
  them, so the agent must not keep recording them. Starts and channel targets still waiting to
  run are skipped.
* **Id spaces.** ``Registered`` names the detector's id space (its replica,
  :mod:`stablewatch.v1.ids`), kept in :attr:`ControlClient.id_space`. ``on_registered(space)``,
  when given, may refuse it (say, another detector of this agent already owns that space, and
  their ids could collide): the stream is closed, reported as ``refused``, and retried with
  backoff. (The agent sends a snapshot's parts to the detector whose space holds its id.)
* **Policies.** ``Registered`` states the detector's resolve policy, kept in
  :attr:`ControlClient.resolve_policy`. With :attr:`ControlClient.policies` (a
  :class:`~stablewatch.agents.breaking.PolicyAgreement` that all of an agent's clients share, set
  by :class:`~stablewatch.agents.detectors.DetectorLinks`), the client tells it each policy and
  logs once when the detectors come to disagree; while they do, it answers an automatic
  ``BreakWait`` ``BREAK_OUTCOME_POLICIES_DISAGREE`` itself, without calling ``on_break``.
* **Reconnect.** The client retries with exponential backoff and jitter, capped at
  ``backoff_max``, until :meth:`ControlClient.stop`. A ``Refused`` registration (the same process
  id may still be attached through a previous, dying stream) is retried the same way, and so is
  one the detector refuses with a status (PERMISSION_DENIED when the certificate does not name
  this process id): both are logged as warnings and reported as ``refused``, with the detector's
  code even where grpc.aio reports INTERNAL for it (see :func:`_send_register`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Literal, NamedTuple, NoReturn, TypeVar

import grpc

from stablewatch.agents.breaking import PolicyAgreement, failed_report
from stablewatch.v1 import AgentMessage, DetectorMessage, LocalSnapshotPart
from stablewatch.v1.control_pb2 import (
    BREAK_OUTCOME_GONE,
    BreakReport,
    BreakWait,
    ChannelTarget,
    Heartbeat,
    Pong,
    Register,
    SnapshotFailure,
    WaitHint,
)
from stablewatch.v1.control_pb2_grpc import ControlStub

__all__ = ["EVENTS", "ControlClient"]

_log = logging.getLogger(__name__)

#: The kinds passed to ``on_event(kind, detail)``.
EVENTS = (
    "connected",  # registered; detail: the detector id
    "disconnected",  # a registered stream ended; detail: why
    "refused",  # the detector refused the registration; detail: its reason
    "unreachable",  # the attempt failed before registering; detail: why
    "dropped",  # an outgoing message was dropped; detail: its kind
    "callback-error",  # on_start, on_finish, on_epoch or on_channel_target raised; detail: the exception
)

DEFAULT_MAX_QUEUED = 10_000
# The detector's status codes for a registration it will not take (its certificate does not name
# this process, no certificate, over its limits, a malformed Register): logged as refusals, not as a
# detector that is down.
_REFUSALS = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)
# A detector that accepts the stream but never answers Register is treated as down.
_REGISTER_TIMEOUT = 10.0

_T = TypeVar("_T")


class _Job(NamedTuple):
    """One callback to run, in order: a start, a finish, a channel target, a lost stream or a new epoch."""

    kind: Literal["start", "finish", "target", "lost", "epoch"]
    value: int  # the snapshot id, or the epoch
    generation: int  # the stream's: starts and targets of a lost stream are skipped
    lifetime: float | None = None  # of a start
    target: ChannelTarget | None = None  # of a channel target


class ControlClient:
    """Keeps one ``Control.Attach`` stream to the detector at ``target`` open for ``process_id``.

    ``on_start(k, lifetime)`` is awaited when the detector asks to start snapshot ``k`` (``lifetime``:
    its deadline in seconds, or None), unless ``on_start_now(k, lifetime)`` took it first (returned
    True); ``on_finish(k)`` is called when the detector says ``k`` ended, and for every open
    snapshot when the stream is lost; ``on_epoch(epoch)`` when the
    detector's epoch changed between two registrations. ``on_event(kind, detail)`` reports
    connection changes (see :data:`EVENTS`). With ``rpc_mode`` the registration asks the detector
    for a ``ChannelTarget`` per count another member reports towards this process, and
    ``on_channel_target(target)`` is called with each. ``on_break(order)`` breaks the wait a
    ``BreakWait`` names and returns the report sent back (see :mod:`stablewatch.agents.breaking`),
    unless :attr:`policies` refuses it. All methods must be called on the event loop that runs the client.
    """

    def __init__(
        self,
        process_id: str,
        address: str,
        target: str,
        *,
        on_start: Callable[[int, float | None], Awaitable[None]],
        on_finish: Callable[[int], None],
        on_start_now: Callable[[int, float | None], bool] | None = None,
        on_epoch: Callable[[int], None] | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
        incarnation: int = 0,
        agent_version: str = "",
        heartbeat_interval: float = 1.0,
        backoff_initial: float = 0.05,
        backoff_max: float = 2.0,
        max_queued: int = DEFAULT_MAX_QUEUED,
        on_event: Callable[[str, str], None] | None = None,
        rpc_mode: bool = False,
        on_channel_target: Callable[[ChannelTarget], None] | None = None,
        on_break: Callable[[BreakWait], BreakReport] | None = None,
        on_registered: Callable[[int], str | None] | None = None,
        policies: PolicyAgreement | None = None,
    ) -> None:
        self.process_id = process_id
        #: The detector's address, as dialled.
        self.target = target
        #: The id space of the detector's snapshot ids, once a registration named it.
        self.id_space: int | None = None
        #: The resolve policy the detector stated at its latest registration ("" when it states
        #: none; None before one).
        self.resolve_policy: str | None = None
        #: Where the detectors' policies are compared: an automatic break is refused while they
        #: disagree (None: every break is carried out). :class:`DetectorLinks` sets one shared by
        #: all the agent's clients.
        self.policies = policies
        self._register = Register(
            process_id=process_id,
            address=address,
            incarnation=incarnation,
            agent_version=agent_version,
            rpc_mode=rpc_mode,
        )
        self._target = target
        self._credentials = credentials
        # grpc's own reconnect backoff (1 s up to 120 s by default) would otherwise delay our retries.
        options = {
            "grpc.initial_reconnect_backoff_ms": max(1, int(backoff_initial * 1000)),
            "grpc.max_reconnect_backoff_ms": max(1, int(backoff_max * 1000)),
        }
        options.update(dict(channel_options))
        self._channel_options = list(options.items())
        self._on_start = on_start
        self._on_start_now = on_start_now
        self._on_finish = on_finish
        self._on_epoch = on_epoch
        self._on_channel_target = on_channel_target
        self._on_break = on_break
        self._on_registered = on_registered
        self._on_event = on_event
        self._heartbeat_interval = heartbeat_interval
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._max_queued = max_queued

        self._channel: grpc.aio.Channel | None = None
        self._run_task: asyncio.Task[None] | None = None
        self._jobs_task: asyncio.Task[None] | None = None
        self._jobs: asyncio.Queue[_Job] = asyncio.Queue()
        self._job_running = False
        self._outbox: asyncio.Queue[AgentMessage] | None = None  # set while registering and registered
        self._connected = asyncio.Event()
        self._generation = 0  # bumped when a registered stream is lost; stale starts are skipped
        self._open: set[int] = set()  # snapshots passed to on_start and not yet to on_finish
        self._epoch: int | None = None  # the detector epoch of the latest registration
        self._followed_epoch = 0  # the epoch whose ids the agent follows: on_epoch has run for it
        self._heartbeats = 0
        self._dropped = 0

    # -- public API -------------------------------------------------------------------------------

    @property
    def dropped(self) -> int:
        """Outgoing messages lost: the queue was full, or they were still queued when the stream broke
        or its registration failed."""
        return self._dropped

    @property
    def connected(self) -> bool:
        """Whether the detector has accepted the registration on the current stream."""
        return self._connected.is_set()

    async def start(self) -> None:
        """Start connecting in the background and return at once; calling it again does nothing."""
        if self._run_task is not None:
            return
        if self._credentials is None:
            self._channel = grpc.aio.insecure_channel(self._target, options=self._channel_options)
        else:
            self._channel = grpc.aio.secure_channel(self._target, self._credentials, options=self._channel_options)
        self._jobs_task = asyncio.create_task(self._run_jobs(), name=f"control-jobs-{self.process_id}")
        self._run_task = asyncio.create_task(self._run(), name=f"control-{self.process_id}")

    async def stop(self) -> None:
        """Close the stream and the channel and cancel every task; open snapshots get ``on_finish``.

        An ``on_start`` still running is cancelled.
        """
        for task in (self._run_task, self._jobs_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._run_task = self._jobs_task = None
        self._jobs = asyncio.Queue()
        for snapshot_id in sorted(self._open):
            self._finish(snapshot_id)
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def wait_connected(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a registered stream; return whether there is one."""
        try:
            await asyncio.wait_for(self._connected.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def report_part(self, part: LocalSnapshotPart) -> bool:
        """Queue ``part`` for the detector; False (and dropped) when no stream is registering or
        registered, or the queue is full."""
        if self._outbox is None:  # spare the copy into an AgentMessage
            return False
        return self._send(AgentMessage(part=part), "part")

    def send_hint(self, hint: WaitHint) -> bool:
        """Tell the detector a wait has lasted past the hint threshold; False when dropped."""
        return self._send(AgentMessage(hint=hint), "hint")

    def report_failure(self, snapshot_id: int, reason: str) -> bool:
        """Tell the detector this process cannot take part in ``snapshot_id``; False when dropped."""
        failure = SnapshotFailure(snapshot_id=snapshot_id, process_id=self.process_id, reason=reason)
        return self._send(AgentMessage(failure=failure), "failure")

    # -- connection loop --------------------------------------------------------------------------

    async def _run(self) -> None:
        delay = self._backoff_initial
        while True:
            registered = False
            try:
                registered = await self._attach()
            except TimeoutError:
                self._event("unreachable", f"no answer to Register within {_REGISTER_TIMEOUT} s")
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _REFUSALS:  # not down: it will not have us as we are
                    _log.warning("detector refused %s: %s", self.process_id, _describe(exc))
                    self._event("refused", _describe(exc))
                else:
                    self._event("unreachable", _describe(exc))
            except Exception as exc:
                self._event("unreachable", _describe(exc))
            if registered:
                delay = self._backoff_initial
            # Jitter keeps a fleet of agents from reconnecting to a restarted detector in lockstep.
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, self._backoff_max)

    async def _attach(self) -> bool:
        """Run one stream until it ends; return whether the detector accepted the registration."""
        assert self._channel is not None
        call = ControlStub(self._channel).Attach()
        # The detector counts this agent a member as soon as it answers, and a peer's marker can
        # make the agent record before the answer is read here: its part waits in the outbox.
        outbox: asyncio.Queue[AgentMessage] = asyncio.Queue(self._max_queued)
        self._outbox = outbox
        registered = False
        try:
            self._register.known_epoch = self._followed_epoch
            reply = await _send_register(call, AgentMessage(register=self._register))
            if reply is grpc.aio.EOF:
                self._event("unreachable", "the detector closed the stream before registering")
                return False
            kind = reply.WhichOneof("kind")
            if kind == "refused":
                _log.warning("detector refused %s: %s", self.process_id, reply.refused.reason)
                self._event("refused", reply.refused.reason)
                return False
            if kind != "registered":
                self._event("unreachable", f"expected Registered, got {kind}")
                return False
            space = reply.registered.id_space
            refusal = self._on_registered(space) if self._on_registered is not None else None
            if refusal is not None:
                _log.warning("%s does not attach to the detector at %s: %s", self.process_id, self._target, refusal)
                self._event("refused", refusal)
                return False
            # The policy first: a status that shows the replica (registered) shows its policy too.
            self._stated(reply.registered.resolve_policy)
            self.id_space = space
            registered = True
            epoch = reply.registered.detector_epoch
            if self._epoch is None:
                self._followed_epoch = epoch  # the first detector: there is nothing to forget
            elif epoch != self._epoch:
                # Queued before any start of this stream is read: the old epoch is forgotten first.
                self._jobs.put_nowait(_Job("epoch", epoch, self._generation))
            self._epoch = epoch
            interval_ms = reply.registered.heartbeat_interval_ms
            interval = interval_ms / 1000 if interval_ms else self._heartbeat_interval
            self._connected.set()
            self._event("connected", reply.registered.detector_id)
            try:
                reason = await self._serve(call, outbox, interval)
            finally:
                self._lose(outbox)
            self._event("disconnected", reason)
            return True
        finally:
            if not registered:  # no detector took this agent in: what waited goes nowhere
                self._outbox = None
                self._dropped += outbox.qsize()
            call.cancel()

    async def _serve(
        self, call: grpc.aio.StreamStreamCall, outbox: asyncio.Queue[AgentMessage], interval: float
    ) -> str:
        """Read, write and heartbeat until one of them stops; return why the stream ended."""
        tasks = [
            asyncio.create_task(self._read(call)),
            asyncio.create_task(self._write(call, outbox)),
            asyncio.create_task(self._heartbeat(interval)),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        task = done.pop()
        if task.cancelled():  # a read or write of a call cancelled locally (channel closed) ends so
            return "the call was cancelled"
        return _describe(task.exception()) if task.exception() else task.result()

    def _lose(self, outbox: asyncio.Queue[AgentMessage]) -> None:
        """Drop what was queued and have the job runner finish every open snapshot."""
        self._outbox = None
        self._connected.clear()
        self._dropped += outbox.qsize()
        self._generation += 1
        self._jobs.put_nowait(_Job("lost", 0, self._generation))

    async def _read(self, call: grpc.aio.StreamStreamCall) -> str:
        while True:
            message: DetectorMessage = await call.read()
            if message is grpc.aio.EOF:
                return "the detector closed the stream"
            kind = message.WhichOneof("kind")
            if kind == "start":
                start = message.start
                lifetime = start.deadline_ms / 1000 if start.deadline_ms else None
                if self._jobs.empty() and not self._job_running:  # nothing to keep order with
                    for ended in start.ended:
                        self._finish(ended)
                    if self._start_now(start.snapshot_id, lifetime):
                        continue
                else:
                    for ended in start.ended:  # forgotten before the new one records
                        self._jobs.put_nowait(_Job("finish", ended, self._generation))
                self._jobs.put_nowait(_Job("start", start.snapshot_id, self._generation, lifetime))
            elif kind == "abort":
                self._jobs.put_nowait(_Job("finish", message.abort.snapshot_id, self._generation))
            elif kind == "ended":
                for ended in message.ended.snapshot_ids:
                    self._jobs.put_nowait(_Job("finish", ended, self._generation))
            elif kind == "channel_target":
                target = message.channel_target
                self._jobs.put_nowait(_Job("target", target.snapshot_id, self._generation, target=target))
            elif kind == "ping":
                self._send(AgentMessage(pong=Pong(nonce=message.ping.nonce)), "pong")
            elif kind == "break_wait":
                # At once, not in the jobs' order: a break does not depend on any snapshot's state.
                self._send(AgentMessage(break_report=self._break(message.break_wait)), "break_report")
            elif kind == "refused":
                return f"refused: {message.refused.reason}"
            # Anything else (a repeated Registered, a kind newer than this agent) is ignored.

    async def _write(self, call: grpc.aio.StreamStreamCall, outbox: asyncio.Queue[AgentMessage]) -> NoReturn:
        while True:
            message = await outbox.get()
            if message.WhichOneof("kind") == "part":
                _merge_queued_parts(message.part, outbox)
            await call.write(message)

    async def _heartbeat(self, interval: float) -> NoReturn:
        while True:
            await asyncio.sleep(interval)
            self._send_heartbeat()

    def _send_heartbeat(self) -> None:
        self._heartbeats += 1
        heartbeat = Heartbeat(sequence=self._heartbeats, epoch=self._followed_epoch)
        self._send(AgentMessage(heartbeat=heartbeat), "heartbeat")

    def _send(self, message: AgentMessage, kind: str) -> bool:
        outbox = self._outbox
        if outbox is None:
            return False
        try:
            outbox.put_nowait(message)
        except asyncio.QueueFull:
            self._dropped += 1
            self._event("dropped", kind)
            return False
        return True

    # -- callbacks --------------------------------------------------------------------------------

    async def _run_jobs(self) -> None:
        """Run start, finish, channel target and epoch callbacks one at a time, in the order they came."""
        while True:
            job = await self._jobs.get()
            self._job_running = True
            try:
                await self._run_job(job)
            finally:
                self._job_running = False

    async def _run_job(self, job: _Job) -> None:
        kind, snapshot_id, generation, lifetime, target = job
        if kind == "start":
            if generation != self._generation:
                return  # its stream is gone: the detector aborts it
            self._open.add(snapshot_id)
            try:
                await self._on_start(snapshot_id, lifetime)
            except Exception as exc:
                self._start_failed(snapshot_id, exc)
        elif kind == "finish":
            self._finish(snapshot_id)
        elif kind == "target":
            if generation == self._generation and target is not None:
                self._channel_target(target)
        elif kind == "epoch":
            self._new_epoch(snapshot_id)
        else:
            for open_id in sorted(self._open):
                self._finish(open_id)

    def _start_now(self, snapshot_id: int, lifetime: float | None) -> bool:
        """Offer a start to ``on_start_now``; whether it took it (recorded, or failed and reported)."""
        if self._on_start_now is None:
            return False
        try:
            if not self._on_start_now(snapshot_id, lifetime):
                return False
        except Exception as exc:
            self._open.add(snapshot_id)
            self._start_failed(snapshot_id, exc)
            return True
        self._open.add(snapshot_id)
        return True

    def _start_failed(self, snapshot_id: int, exc: Exception) -> None:
        _log.exception("on_start(%d) failed", snapshot_id)
        self._event("callback-error", _describe(exc))
        self.report_failure(snapshot_id, f"the agent could not start: {_describe(exc)}")

    def _finish(self, snapshot_id: int) -> None:
        self._open.discard(snapshot_id)
        try:
            self._on_finish(snapshot_id)
        except Exception as exc:
            _log.exception("on_finish(%d) failed", snapshot_id)
            self._event("callback-error", _describe(exc))

    def _stated(self, policy: str) -> None:
        self.resolve_policy = policy
        if self.policies is None:
            return
        change = self.policies.stated(self._target, policy)
        if change is not None:  # once per change, not per refused break
            level = logging.WARNING if self.policies.disagreement() is not None else logging.INFO
            _log.log(level, "%s: %s", self.process_id, change)

    def _break(self, order: BreakWait) -> BreakReport:
        refused = self.policies.refusal(order) if self.policies is not None else None
        if refused is not None:
            _log.debug("%s refused break %d: %s", self.process_id, order.break_id, refused.detail)
            return refused
        if self._on_break is None:
            detail = "this agent does not break waits"
            return BreakReport(
                break_id=order.break_id, instance=order.instance, outcome=BREAK_OUTCOME_GONE, detail=detail
            )
        try:
            return self._on_break(order)
        except Exception as exc:
            # Not "gone": the callback may have broken the wait, or it may still hold the deadlock;
            # a detector told "gone" would name another victim of it.
            _log.exception("on_break(%d) failed", order.instance)
            self._event("callback-error", _describe(exc))
            return failed_report(order, f"the agent failed to break it: {_describe(exc)}")

    def _channel_target(self, target: ChannelTarget) -> None:
        if self._on_channel_target is None:
            return
        try:
            self._on_channel_target(target)
        except Exception as exc:
            _log.exception("on_channel_target(%d, %s) failed", target.snapshot_id, target.src)
            self._event("callback-error", _describe(exc))

    def _new_epoch(self, epoch: int) -> None:
        _log.info("detector epoch of %s changed to %d: snapshots of the old one are forgotten", self.process_id, epoch)
        if self._on_epoch is not None:
            try:
                self._on_epoch(epoch)
            except Exception as exc:  # reported; the agent still joins, or it never would
                _log.exception("on_epoch(%d) failed", epoch)
                self._event("callback-error", _describe(exc))
        self._followed_epoch = epoch
        self._send_heartbeat()  # tells the detector at once: it admits this agent to snapshots now

    def _event(self, kind: str, detail: str) -> None:
        if kind == "disconnected":
            _log.warning("control stream of %s lost: %s", self.process_id, detail)
        elif kind == "unreachable":  # repeats every backoff period while the detector is down
            _log.debug("detector unreachable for %s: %s", self.process_id, detail)
        if self._on_event is None:
            return
        try:
            self._on_event(kind, detail)
        except Exception:
            _log.exception("on_event(%r, %r) failed", kind, detail)


def _merge_queued_parts(part: LocalSnapshotPart, outbox: asyncio.Queue[AgentMessage]) -> None:
    """Fold the parts of the same snapshot queued right behind ``part`` into it: one write, not many.

    Only the run at the head of the queue is merged, so the order of messages is kept.
    """
    queued = outbox._queue  # type: ignore[attr-defined]  # peeking is not in Queue's public API
    while queued and queued[0].WhichOneof("kind") == "part" and queued[0].part.snapshot_id == part.snapshot_id:
        part.MergeFrom(outbox.get_nowait().part)


async def _send_register(call: grpc.aio.StreamStreamCall, register: AgentMessage) -> Any:
    """Write ``register`` on ``call`` and return what the detector answers (a DetectorMessage, or
    EOF); raise the detector's refusal with the code it sent, TimeoutError after ``_REGISTER_TIMEOUT``.

    grpc.aio may lose that code. When the detector ends a stream before reading it (a certificate
    that names no process, too many unregistered streams), a write still in flight fails, and
    grpc.aio then sets the call's status to INTERNAL ("Internal error from Core": ``_write`` in
    grpc/aio/_call.py calls ``set_internal_error``) and raises it. If the detector's status was
    set first, ``code()`` says INTERNAL from then on, but a done callback has seen the status: it
    runs once, when the first status is set, and a finished call's ``code()`` and ``details()``
    return without waiting. If the detector's status comes after, it replaces INTERNAL without a
    callback; the read, started before the write, ends with the stream, and then ``code()`` says it.
    """
    first: list[tuple[grpc.StatusCode | None, str | None]] = []
    call.add_done_callback(lambda ended: first.append((_at_once(ended.code()), _at_once(ended.details()))))
    reading = asyncio.ensure_future(call.read())
    try:
        failure: BaseException | None = None
        try:
            await call.write(register)
        except Exception as exc:  # the stream has ended: the read ends with it
            failure = exc
        # Not asyncio.wait_for, nor awaiting the read: both can drop a cancellation (stop) that comes
        # as the read ends (wait_for before Python 3.12; grpc.aio's read awaits a task that ignores one).
        done, _ = await asyncio.wait([reading], timeout=_REGISTER_TIMEOUT)
        if failure is None:
            if not done:
                raise TimeoutError
            if (failure := reading.exception()) is None:
                return reading.result()
        statuses = [*first, (await call.code(), await call.details())] if call.done() else first
        for code, details in statuses:
            if code in _REFUSALS:
                if isinstance(failure, grpc.aio.AioRpcError) and failure.code() == code:
                    raise failure  # grpc.aio has it right
                raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details) from failure
        raise failure
    finally:
        reading.cancel()


def _at_once(coroutine: Coroutine[Any, Any, _T]) -> _T | None:
    """What ``coroutine`` returns when it finishes without waiting; None (and it is closed) when it would wait."""
    try:
        coroutine.send(None)
    except StopIteration as finished:
        return finished.value
    coroutine.close()
    return None


def _describe(exc: BaseException | None) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return repr(exc)
