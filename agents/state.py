"""The local state a service reports when its agent records for a snapshot.

A :class:`LocalStateKeeper` holds what DESIGN.md calls a process's local state: whether it is
``active``, what it ``waits`` on, its conserved ``counters`` and free-form ``attributes``. The
service updates it as it works (from any thread); the agent calls :meth:`LocalStateKeeper.snapshot`
when the protocol core asks it to record, and :meth:`LocalStateKeeper.apply_transfer` when units
leave with a message or arrive with one. One lock guards everything, so a snapshot is always a
state the process really was in: never half of an update.

A new keeper is **active**: a process that never said it is idle must not look idle, or the
detector could report termination while it is still working. A service that wants termination
detection calls ``set_active(False)`` when it runs out of work.

Names are held to the detector's maxima (:mod:`stablewatch.v1.bounds`), so that an
application learns of a name the detector would reject when it sets it, with a ValueError, not
from snapshots that never complete: a counter's or an attribute's name at most 256 bytes (UTF-8),
a task 1024, a wait target's process id 256, none of them with a control character, and each
string inside an attribute's value at most 64 KiB.
"""

from __future__ import annotations

import copy
import itertools
import math
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, TypeAlias

from stablewatch.v1 import WAIT_MODEL_AND, WAIT_MODEL_OR, LocalState, Wait, WaitNode
from stablewatch.v1.bounds import (
    MAX_ID_BYTES,
    MAX_NAME_BYTES,
    MAX_TASK_BYTES,
    MAX_TEXT_BYTES,
    quoted_prefix,
    text_problem,
    too_long,
)

__all__ = ["LocalStateKeeper", "Target", "Targets"]

Target: TypeAlias = str | tuple[str, str] | WaitNode
"""A wait target: a process id, a ``(process, task)`` pair, or a :class:`WaitNode`."""
Targets: TypeAlias = Target | Iterable[Target]
"""One target (a string or a WaitNode) or a collection of them; a tuple is always a collection."""

_MODELS = {"and": WAIT_MODEL_AND, "or": WAIT_MODEL_OR}
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True, slots=True)
class _Wait:
    """One registered wait: immutable, so a snapshot can share it without copying."""

    task: str
    targets: tuple[tuple[str, str], ...]
    model: int


class LocalStateKeeper:
    """A thread-safe holder of one process's local state, read atomically by :meth:`snapshot`.

    >>> state = LocalStateKeeper()
    >>> state.add("tokens", 5)
    5
    >>> with state.waiting(["B", ("C", "worker")], model="or", task="main"):
    ...     [w.task for w in state.snapshot().waits]
    ['main']
    >>> len(state.snapshot().waits)
    0
    """

    def __init__(self, *, active: bool = True) -> None:
        self._lock = threading.Lock()
        self._active = _check_bool(active)
        self._counters: dict[str, int] = {}
        self._attributes: dict[str, object] = {}
        self._waits: dict[int, _Wait] = {}
        self._tokens = itertools.count(1)

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

        `model` ``"and"`` needs every target to release the waiter, ``"or"`` any one. Returns a
        token for :meth:`remove_wait`. Waits of one task coexist and are merged in a snapshot.
        """
        wait = _make_wait(targets, model, task)
        with self._lock:
            token = next(self._tokens)
            self._waits[token] = wait
        return token

    def remove_wait(self, token: int) -> None:
        """Remove the wait that :meth:`add_wait` registered under `token`."""
        with self._lock:
            if self._waits.pop(token, None) is None:
                raise ValueError(f"no wait registered under token {token!r} (already removed?)")

    @contextmanager
    def waiting(self, targets: Targets, *, model: Literal["and", "or"] = "and", task: str = "") -> Iterator[int]:
        """Hold a wait (see :meth:`add_wait`) while the ``with`` block runs; removed even on error.

        Typical use wraps the blocking call: ``with state.waiting("B"): reply = stub.Call(req)``.
        """
        token = self.add_wait(targets, model=model, task=task)
        try:
            yield token
        finally:
            self.remove_wait(token)

    # -- the recording ----------------------------------------------------------------------------

    def snapshot(self) -> LocalState:
        """An atomic copy of the whole state as a ``LocalState`` message.

        Waits of the same task are merged into one ``Wait`` in order of registration: targets are
        concatenated without repeats; the model stays if all agree, else it is AND (the rule the
        detector applies too, see :mod:`stablewatch.detector.evaluation.waitfor`).
        """
        with self._lock:
            active = self._active
            counters = dict(self._counters)
            attributes = dict(self._attributes)  # values are never mutated in place
            waits = list(self._waits.values())
        state = LocalState(active=active, waits=_merge_waits(waits), counters=counters)
        if attributes:
            state.attributes.update(attributes)
        return state


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
    _check_text(task, "wait target task", MAX_TASK_BYTES)
    return process, task


def _make_wait(targets: Targets, model: str, task: str) -> _Wait:
    if model not in _MODELS:
        raise ValueError(f"wait model must be 'and' or 'or', not {model!r}")
    if not isinstance(task, str):
        raise TypeError(f"task must be a str, not {type(task).__name__}")
    _check_text(task, "task", MAX_TASK_BYTES)
    items = [targets] if isinstance(targets, str | WaitNode) else list(targets)
    if not items:
        raise ValueError("a wait needs at least one target")
    return _Wait(task, tuple(_target(t) for t in items), _MODELS[model])


def _merge_waits(waits: list[_Wait]) -> list[Wait]:
    merged: dict[str, tuple[int, dict[tuple[str, str], None]]] = {}
    for wait in waits:
        if wait.task in merged:
            model, targets = merged[wait.task]
            targets.update(dict.fromkeys(wait.targets))
            merged[wait.task] = (model if model == wait.model else WAIT_MODEL_AND, targets)
        else:
            merged[wait.task] = (wait.model, dict.fromkeys(wait.targets))
    return [
        Wait(task=task, model=model, targets=[WaitNode(process=p, task=t) for p, t in targets])
        for task, (model, targets) in merged.items()
    ]


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
