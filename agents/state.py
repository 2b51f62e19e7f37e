"""The local state a service reports when its agent records for a snapshot.

A :class:`LocalStateKeeper` holds what DESIGN.md calls a process's local state: whether it is
``active``, what it ``waits`` on, its conserved ``counters`` and free-form ``attributes``. The
service updates it as it works (from any thread); the agent calls :meth:`LocalStateKeeper.snapshot`
when the protocol core asks it to record, and :meth:`LocalStateKeeper.apply_transfer` when units
leave with a message or arrive with one. One lock guards everything, so a snapshot is always a
state the process really was in: never half of an update.

Every wait has an instance id never reused in the process and the wall-clock time it began
(:mod:`stablewatch.agents.breaking`); a snapshot carries one ``Wait`` per registered wait with
both (the detector merges the waits of one task). The keeper is a
:class:`~stablewatch.agents.breaking.WaitSource`: a detector that proves a deadlock may break one
of its waits, at most once. The waiter learns of it through the wait's :class:`WaitHandle` (an
event and callbacks, for threads) and, when the wait was entered with :meth:`~LocalStateKeeper.waiting`
inside an asyncio task, by :class:`~stablewatch.agents.breaking.DeadlockVictim` raised where
that task awaits.

A new keeper is **active**: a process that never said it is idle must not look idle, or the
detector could report termination while it is still working. A service that wants termination
detection calls ``set_active(False)`` when it runs out of work.

Names are held to the detector's maxima (:mod:`stablewatch.v1.bounds`), so that an
application learns of a name the detector would reject when it sets it, with a ValueError, not
from snapshots that never complete: a counter's or an attribute's name at most 256 bytes (UTF-8),
a task 1024, a wait target's process id 256, none of them with a control character, and each
string inside an attribute's value at most 64 KiB. A task (a waiter's or a target's) may not end
in ``[wait N]``: that is how the detector's wait-for graph names one wait of a task that has
several, so the detector refuses a part that names a task so (the two would be one node).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, TypeAlias

from stablewatch.agents import breaking
from stablewatch.agents.breaking import Broken, DeadlockVictim, OpenWait
from stablewatch.v1 import WAIT_MODEL_AND, WAIT_MODEL_OR, LocalState, Wait, WaitNode
from stablewatch.v1.bounds import (
    MAX_ID_BYTES,
    MAX_NAME_BYTES,
    MAX_TASK_BYTES,
    MAX_TEXT_BYTES,
    names_a_wait,
    quoted_prefix,
    text_problem,
    too_long,
)
from stablewatch.v1.control_pb2 import BREAK_OUTCOME_ALREADY_BROKEN, BREAK_OUTCOME_BROKEN, BreakWait

__all__ = ["LocalStateKeeper", "Target", "Targets", "TaskInterrupt", "WaitHandle"]

_log = logging.getLogger(__name__)

Target: TypeAlias = str | tuple[str, str] | WaitNode
"""A wait target: a process id, a ``(process, task)`` pair, or a :class:`WaitNode`."""
Targets: TypeAlias = Target | Iterable[Target]
"""One target (a string or a WaitNode) or a collection of them; a tuple is always a collection."""

_MODELS = {"and": WAIT_MODEL_AND, "or": WAIT_MODEL_OR}
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True, slots=True)
class _Wait:
    """What one registered wait waits on: immutable, so a snapshot can read it outside the lock."""

    task: str
    targets: tuple[tuple[str, str], ...]
    model: int


class TaskInterrupt:
    """Interrupts the asyncio task a wait began in, at most once, from any thread.

    A cancel scope, as ``asyncio.timeout`` is one: :meth:`interrupt` cancels the task where it
    awaits, and :meth:`leave`, called by the task as it leaves the wait, says whether the
    ``CancelledError`` it leaves with is the one this scope caused (``Task.uncancel`` bookkeeping),
    so that the wait turns exactly that one into :class:`DeadlockVictim` and an outer cancellation
    still propagates. Shared by the application waits here and the blocked sends
    (:mod:`stablewatch.agents.blocked`).
    """

    __slots__ = ("_cancelled", "_cancelling", "_loop", "_open", "_task")

    def __init__(self, task: asyncio.Task[object], loop: asyncio.AbstractEventLoop) -> None:
        self._task = task
        self._loop = loop
        self._cancelling = task.cancelling()
        self._cancelled = False
        self._open = True  # read and written only on the task's loop

    @classmethod
    def here(cls) -> TaskInterrupt | None:
        """The scope of the asyncio task running now, or None outside of one (a plain thread)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None
        task = asyncio.current_task(loop)
        return None if task is None else cls(task, loop)

    @property
    def task_name(self) -> str:
        return self._task.get_name()

    def interrupt(self) -> None:
        """Cancel the task if it is still inside the scope: at once on its loop's thread (the task
        is then suspended at an await, which raises), else as soon as that loop runs a callback."""
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._cancel()
        else:
            with contextlib.suppress(RuntimeError):  # its loop is closed: the task is gone
                self._loop.call_soon_threadsafe(self._cancel)

    def _cancel(self) -> None:
        # On the task's loop: the scope left meanwhile means the wait ended first; nothing to do.
        if self._open and not self._cancelled:
            self._cancelled = True
            self._task.cancel()

    def leave(self, error: BaseException | None) -> bool:
        """Close the scope (in the task, once); True when ``error`` is the cancellation it caused."""
        self._open = False
        if not self._cancelled:
            return False
        return self._task.uncancel() <= self._cancelling and isinstance(error, asyncio.CancelledError)


class WaitHandle:
    """One wait registered with a :class:`LocalStateKeeper`, as :meth:`~LocalStateKeeper.waiting`
    yields it: its instance, and whether stablewatch broke it to end a proven deadlock.

    A thread cannot be interrupted, so a thread that waits learns of a break here: wait on
    :attr:`broken` beside what it waits for, call :meth:`check` when it wakes, or register a
    callback with :meth:`on_break` that wakes it (sets its condition, cancels its future). An
    asyncio task that entered the wait with ``waiting()`` gets :class:`DeadlockVictim` raised where
    it awaits as well. A broken wait is left out of the snapshots from the break on, though only the
    waiter knows when it has stopped waiting: it has been told to, and a cut that still showed it
    would show the deadlock whole, for a detector to break another of its waits.

    ``instance`` is the wait's id, never reused in the process (``Wait.instance``); ``began_at_us``
    when it began, in wall-clock microseconds since the epoch (``Wait.began_at_us``).

    >>> state = LocalStateKeeper()
    >>> with state.waiting("B") as wait:
    ...     wait.broken.is_set(), wait.victim
    (False, None)
    """

    __slots__ = ("_callbacks", "_event", "_interrupt", "_lock", "_victim", "began_at_us", "instance", "wait")

    def __init__(self, wait: _Wait, lock: threading.Lock, interrupt: TaskInterrupt | None) -> None:
        self.instance = breaking.new_instance()
        self.began_at_us = breaking.now_us()
        self.wait = wait
        self._lock = lock  # the keeper's: a break and a registration of a callback do not interleave
        self._interrupt = interrupt
        self._victim: DeadlockVictim | None = None
        self._callbacks: list[Callable[[DeadlockVictim], object]] = []
        self._event: threading.Event | None = None  # made on demand: most waits are never asked

    @property
    def task(self) -> str:
        """The waiting task ("" for the process)."""
        return self.wait.task

    @property
    def broken(self) -> threading.Event:
        """Set when stablewatch breaks this wait (wait on it beside what the thread waits for)."""
        with self._lock:
            if self._event is None:
                self._event = threading.Event()
                if self._victim is not None:
                    self._event.set()
            return self._event

    @property
    def victim(self) -> DeadlockVictim | None:
        """The error that breaking this wait raised or raises, or None while it is not broken."""
        return self._victim

    def check(self) -> None:
        """Raise :class:`DeadlockVictim` if stablewatch broke this wait; else do nothing."""
        victim = self._victim
        if victim is not None:
            raise victim

    def on_break(self, callback: Callable[[DeadlockVictim], object]) -> None:
        """Call ``callback(victim)`` once when this wait is broken, on the thread that breaks it
        (the agent's), so it must be quick and must not block; at once if it is broken already.
        An exception it raises is logged and changes nothing else."""
        with self._lock:
            victim = self._victim
            if victim is None:
                self._callbacks.append(callback)
                return
        _call_back(callback, victim, self.instance)

    def _break(self, order: BreakWait) -> tuple[DeadlockVictim, threading.Event | None, list[Callable[..., object]]]:
        """Mark it broken (under the keeper's lock); what to tell the waiter outside of it."""
        victim = self._victim = DeadlockVictim.of(order)
        callbacks, self._callbacks = self._callbacks, []
        return victim, self._event, callbacks

    def __repr__(self) -> str:
        state = "broken" if self._victim is not None else "waiting"
        return f"<WaitHandle {self.instance} of task {self.task!r} on {_describe(self.wait)}: {state}>"


def _call_back(callback: Callable[[DeadlockVictim], object], victim: DeadlockVictim, instance: int) -> None:
    try:
        callback(victim)
    except Exception:
        _log.exception("an on_break callback of wait %d failed", instance)


def _describe(wait: _Wait) -> str:
    """The targets as a person reads them: ``B and C:worker``."""
    joiner = " or " if wait.model == WAIT_MODEL_OR else " and "
    return joiner.join(f"{p}:{t}" if t else p for p, t in wait.targets)


class LocalStateKeeper:
    """A thread-safe holder of one process's local state, read atomically by :meth:`snapshot`.

    >>> state = LocalStateKeeper()
    >>> state.add("tokens", 5)
    5
    >>> with state.waiting(["B", ("C", "worker")], model="or", task="main") as wait:
    ...     [(w.task, w.instance == wait.instance) for w in state.snapshot().waits]
    [('main', True)]
    >>> len(state.snapshot().waits)
    0
    """

    def __init__(self, *, active: bool = True) -> None:
        self._lock = threading.Lock()
        self._active = _check_bool(active)
        self._counters: dict[str, int] = {}
        self._attributes: dict[str, object] = {}
        self._waits: dict[int, WaitHandle] = {}  # by instance, in the order they began
        #: Rung after a wait is registered (its BreakDispatcher sets it, for the hint loop).
        self.doorbell = breaking.Doorbell()

    # -- activity ---------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """Whether the process is doing work (a passive one only wakes on a message)."""
        with self._lock:
            return self._active

    @active.setter
    def active(self, value: bool) -> None:
        self.set_active(value)

    def set_active(self, value: bool) -> None:
        """Mark the process active (working) or passive (idle until a message arrives)."""
        value = _check_bool(value)
        with self._lock:
            self._active = value

    # -- counters ---------------------------------------------------------------------------------

    def add(self, name: str, delta: int) -> int:
        """Add `delta` (may be negative) to counter `name` (0 if new); return the new value."""
        _check_name(name)
        _check_int(delta, f"delta for counter {name!r}")
        with self._lock:
            value = _check_range(self._counters.get(name, 0) + delta, name)
            self._counters[name] = value
            return value

    def set_counter(self, name: str, value: int) -> None:
        """Set counter `name` to `value`."""
        _check_name(name)
        _check_range(_check_int(value, f"value of counter {name!r}"), name)
        with self._lock:
            self._counters[name] = value

    def counter(self, name: str) -> int:
        """The value of counter `name`, 0 if it was never set."""
        with self._lock:
            return self._counters.get(name, 0)

    def counters(self) -> dict[str, int]:
        """A copy of all counters."""
        with self._lock:
            return dict(self._counters)

    def apply_transfer(self, counters: Mapping[str, int], sign: int) -> None:
        """Move the units a message carries out of (``sign=-1``) or into (``sign=+1``) the counters.

        The agent calls it at send and at delivery, so units are always either in a process or in a
        channel. All counters change at once or, on a bad argument, none. A counter may go negative:
        user code may legitimately run a balance below zero, and the conservation predicate is what
        judges the totals.
        """
        if sign not in (1, -1) or isinstance(sign, bool):
            raise ValueError(f"sign must be +1 or -1, not {sign!r}")
        for name, amount in counters.items():
            _check_name(name)
            _check_int(amount, f"amount of counter {name!r}")
        with self._lock:
            updated = {
                name: _check_range(self._counters.get(name, 0) + sign * amount, name)
                for name, amount in counters.items()
            }
            self._counters.update(updated)

    # -- attributes -------------------------------------------------------------------------------

    def set_attribute(self, key: str, value: object) -> None:
        """Set attribute `key` to a JSON-like value (None, bool, int, float, str, list, dict).

        The value is copied, so later changes to the caller's object are not seen. Attributes travel
        as a ``google.protobuf.Struct``: numbers become doubles (integers past 2**53 lose precision).
        """
        if not isinstance(key, str):
            raise TypeError(f"attribute key must be a str, not {type(key).__name__}")
        _check_text(key, "attribute name", MAX_NAME_BYTES)
        value = _json_copy(value, key)
        with self._lock:
            self._attributes[key] = value

    def attributes(self) -> dict[str, object]:
        """A deep copy of all attributes."""
        with self._lock:
            attributes = dict(self._attributes)
        return copy.deepcopy(attributes)

    # -- waits ------------------------------------------------------------------------------------

    def add_wait(self, targets: Targets, *, model: Literal["and", "or"] = "and", task: str = "") -> int:
        """Record that the process (`task` empty) or its task `task` is blocked on `targets`.

        `model` ``"and"`` needs every target to release the waiter, ``"or"`` any one. Returns the
        wait's instance id, the token for :meth:`remove_wait` (and :meth:`handle`). Waits of one
        task coexist: each is reported on its own, and the detector merges them.
        """
        return self._add(_make_wait(targets, model, task), None).instance

    def remove_wait(self, token: int) -> None:
        """Remove the wait that :meth:`add_wait` registered under `token`."""
        with self._lock:
            if self._waits.pop(token, None) is None:
                raise ValueError(f"no wait registered under token {token!r} (already removed?)")

    def handle(self, token: int) -> WaitHandle:
        """The :class:`WaitHandle` of the wait registered under `token` (to learn of a break)."""
        with self._lock:
            handle = self._waits.get(token)
        if handle is None:
            raise ValueError(f"no wait registered under token {token!r} (already removed?)")
        return handle

    @contextmanager
    def waiting(self, targets: Targets, *, model: Literal["and", "or"] = "and", task: str = "") -> Iterator[WaitHandle]:
        """Hold a wait (see :meth:`add_wait`) while the ``with`` block runs; removed even on error.

        Typical use wraps the blocking call: ``with state.waiting("B") as wait: reply = await call()``.
        Yields the wait's :class:`WaitHandle`. Entered in an asyncio task, the block is a cancel
        scope: if stablewatch breaks the wait, the task is cancelled where it awaits and the
        block raises :class:`DeadlockVictim` instead of the ``CancelledError`` (an outer
        cancellation still propagates as itself). A block that completes before the break
        reaches it completes normally. A thread learns of a break through the handle.
        """
        handle = self._add(_make_wait(targets, model, task), TaskInterrupt.here())
        try:
            yield handle
        except BaseException as error:
            victim = self._leave(handle, error)
            if victim is not None:
                raise victim from error
            raise
        else:
            self._leave(handle, None)

    def _add(self, wait: _Wait, interrupt: TaskInterrupt | None) -> WaitHandle:
        handle = WaitHandle(wait, self._lock, interrupt)
        with self._lock:
            self._waits[handle.instance] = handle
        self.doorbell.ring()
        return handle

    def _leave(self, handle: WaitHandle, error: BaseException | None) -> DeadlockVictim | None:
        """End a ``waiting()`` block; the error to raise instead when ``error`` is the cancellation
        its break caused."""
        with self._lock:
            self._waits.pop(handle.instance, None)  # (None: the block removed it itself)
        interrupt = handle._interrupt
        if interrupt is not None and interrupt.leave(error):
            return handle._victim  # set before the interrupt
        return None

    # -- breaking (a breaking.WaitSource) ---------------------------------------------------------

    def break_wait(self, order: BreakWait) -> Broken | None:
        """Break the wait ``order.instance`` if it is registered here: once (later breaks say it was
        broken before), from any thread, at once. None when no such wait is registered.

        The handle's event is set, its callbacks run (on this thread, outside the lock) and, for a
        wait entered with :meth:`waiting` in an asyncio task, that task is cancelled where it
        awaits and raises :class:`DeadlockVictim`.
        """
        with self._lock:
            handle = self._waits.get(order.instance)
            if handle is None:
                return None
            if handle._victim is not None:
                return Broken(BREAK_OUTCOME_ALREADY_BROKEN, f"wait {order.instance} was broken before: nothing done")
            victim, event, callbacks = handle._break(order)
        interrupt = handle._interrupt
        if interrupt is not None:
            interrupt.interrupt()
        if event is not None:
            event.set()
        for callback in callbacks:
            _call_back(callback, victim, handle.instance)
        who = f"task {handle.task!r}" if handle.task else "the process"
        told = (
            f"DeadlockVictim raised in asyncio task {interrupt.task_name!r}"
            if interrupt is not None
            else f"its handle set, {len(callbacks)} callback(s) called"
        )
        return Broken(BREAK_OUTCOME_BROKEN, f"application wait of {who} on {_describe(handle.wait)} broken: {told}")

    def open_waits(self) -> list[OpenWait]:
        """Every registered wait (for the long-wait hints)."""
        with self._lock:
            handles = list(self._waits.values())
        return [OpenWait(h.instance, h.wait.task, h.began_at_us) for h in handles]

    def idle(self) -> bool:
        """True when no wait is registered."""
        with self._lock:
            return not self._waits

    # -- the recording ----------------------------------------------------------------------------

    def snapshot(self) -> LocalState:
        """An atomic copy of the whole state as a ``LocalState`` message.

        One ``Wait`` per registered wait, in the order they began, with its instance and the time it
        began; the detector merges the waits of one task (see
        :mod:`stablewatch.detector.evaluation.waitfor`). A broken wait is left out, as a blocked
        send's is: its waiter has been told to leave it, so it no longer holds the deadlock, and a
        cut taken before the waiter gets round to it must not show the deadlock whole (a detector
        would break another wait of it: a second victim).
        """
        with self._lock:
            active = self._active
            counters = dict(self._counters)
            attributes = dict(self._attributes)  # values are never mutated in place
            waits = list(self._waits.values())  # their fields read below are never changed
        kept = [_to_proto(h) for h in waits if h._victim is None]
        state = LocalState(active=active, waits=kept, counters=counters)
        if attributes:
            state.attributes.update(attributes)
        return state

    def waiting_in(self, task: asyncio.Task[object] | None) -> bool:
        """Whether asyncio task `task` is inside a :meth:`waiting` block whose wait is not broken (one
        :meth:`snapshot` reports): the agent asks this of its message handler's task. A block cannot
        outlast the handler's run, where a wait of :meth:`add_wait` is the process's, and may
        (a reply awaited across runs, while the handler takes what comes)."""
        if task is None:
            return False
        with self._lock:
            return any(
                h._interrupt is not None and h._interrupt._task is task and h._victim is None
                for h in self._waits.values()
            )


# -- validation and conversion --------------------------------------------------------------------


def _check_bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"active must be a bool, not {type(value).__name__}")
    return value


def _check_name(name: object) -> None:
    if not isinstance(name, str):
        raise TypeError(f"counter name must be a str, not {type(name).__name__}")
    if not name:
        raise ValueError("counter name must not be empty")
    _check_text(name, "counter name", MAX_NAME_BYTES)


def _check_text(text: str, what: str, limit: int) -> None:
    """Refuse what the detector would reject: ``text`` over ``limit`` bytes, or with a control character."""
    problem = text_problem(text, limit)
    if problem is not None:
        raise ValueError(f"{what} {quoted_prefix(text)} {problem}, which the detector refuses")


def task_problem(task: str) -> str | None:
    """What makes ``task`` a task name the detector refuses, or None: over its length, a control
    character, or ending in ``[wait N]`` (the detector's name for one wait of a task with
    several: the two would be one node)."""
    problem = text_problem(task, MAX_TASK_BYTES)
    if problem is not None:
        return f"{problem}, which the detector refuses"
    if names_a_wait(task):
        return "ends in '[wait N]', the form the detector gives one wait of a task, which it refuses as a task name"
    return None


def _check_task(task: str, what: str) -> None:
    """Refuse a task name the detector would reject (see :func:`task_problem`)."""
    problem = task_problem(task)
    if problem is not None:
        raise ValueError(f"{what} {quoted_prefix(task)} {problem}")


def _check_int(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    return value


def _check_range(value: int, name: str) -> int:
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise ValueError(f"counter {name!r} would be {value}, outside the int64 range")
    return value


def _target(target: object) -> tuple[str, str]:
    if isinstance(target, WaitNode):
        process, task = target.process, target.task
    elif isinstance(target, str):
        process, task = target, ""
    elif isinstance(target, tuple) and len(target) == 2:
        process, task = target
    else:
        raise TypeError(f"wait target must be 'P', ('P', 'task') or a WaitNode, not {target!r}")
    if not isinstance(process, str) or not isinstance(task, str):
        raise TypeError(f"wait target process and task must be str, got {target!r}")
    if not process:
        raise ValueError(f"wait target {target!r} names no process")
    _check_text(process, "wait target process", MAX_ID_BYTES)
    _check_task(task, "wait target task")
    return process, task


def _make_wait(targets: Targets, model: str, task: str) -> _Wait:
    if model not in _MODELS:
        raise ValueError(f"wait model must be 'and' or 'or', not {model!r}")
    if not isinstance(task, str):
        raise TypeError(f"task must be a str, not {type(task).__name__}")
    _check_task(task, "task")
    items = [targets] if isinstance(targets, str | WaitNode) else list(targets)
    if not items:
        raise ValueError("a wait needs at least one target")
    return _Wait(task, tuple(_target(t) for t in items), _MODELS[model])


def _to_proto(handle: WaitHandle) -> Wait:
    wait = handle.wait
    return Wait(
        task=wait.task,
        model=wait.model,
        targets=[WaitNode(process=p, task=t) for p, t in wait.targets],
        instance=handle.instance,
        began_at_us=handle.began_at_us,
    )


def _json_copy(value: object, path: str) -> object:
    """A deep copy of a JSON-like value, or TypeError naming where in `path` it is not JSON-like
    (ValueError where a text is longer than the detector takes)."""
    if isinstance(value, str):
        if too_long(value, MAX_TEXT_BYTES):
            raise ValueError(
                f"attribute {path}: a text longer than {MAX_TEXT_BYTES} bytes, the most the detector takes"
            )
        return value
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"attribute {path}: {value} is not a finite number")
        return value
    if isinstance(value, list | tuple):
        return [_json_copy(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        copied: dict[str, object] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"attribute {path}: key {k!r} is not a str")
            if too_long(k, MAX_TEXT_BYTES):
                raise ValueError(
                    f"attribute {path}: a key longer than {MAX_TEXT_BYTES} bytes, the most the detector takes"
                )
            copied[k] = _json_copy(v, f"{path}.{k}")
        return copied
    raise TypeError(f"attribute {path}: {type(value).__name__} is not JSON-like")
