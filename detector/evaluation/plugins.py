"""User predicates: Python callables over the global state, loaded as plugins.

The contract. A user predicate is a callable taking one ``stablewatch.v1.GlobalSnapshot`` (a
private copy: changing it affects nobody else) and returning one of:

* a ``bool`` — whether the predicate holds — or ``None``: the cut cannot decide it (unknown);
* a pair ``(holds: bool | None, summary: str)``;
* a mapping ``{"holds": bool | None, "summary": str, "details": dict}``; only ``holds`` is
  required, and ``details`` must be JSON-like (it becomes the result's ``google.protobuf.Struct``).

A predicate about the whole system should answer ``None`` on an open cut: the snapshot says what
the detector expected (``expected_members``, ``expected_member_count``) and
:func:`stablewatch.detector.evaluation.cut.coverage` tells whether it is closed.

It is loaded by import path (``"package.module:function"``, the attribute may be dotted) or
installed by a distribution under the entry point group ``stablewatch.predicates``, the entry
point's name becoming the predicate's name::

    [project.entry-points."stablewatch.predicates"]
    queue_bounded = "myservice.checks:queue_bounded"

Evaluation never crashes because of a plugin: an exception raised inside it, or a result of the
wrong shape, becomes an unknown ``PredicateResult`` with ``error`` set (the traceback
is logged). ``KeyboardInterrupt`` and ``SystemExit`` still propagate. Predicates run in the
evaluating thread, without a time limit.
"""

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points

from stablewatch.v1 import GlobalSnapshot, PredicateResult

GROUP = "stablewatch.predicates"

__all__ = ["GROUP", "PluginError", "UserPredicate", "entry_point_predicates", "load_predicate", "to_result"]

log = logging.getLogger(__name__)

_SHAPES = "expected bool or None, (bool | None, str) or a mapping with 'holds' (and optional 'summary', 'details')"


class PluginError(Exception):
    """A user predicate could not be loaded (bad import path, missing module or attribute)."""


def to_result(name: str, value: object) -> PredicateResult:
    """Convert a user predicate's return `value` to a ``PredicateResult`` named `name`.

    Raises TypeError (or ValueError, for details a Struct cannot hold) when `value` breaks the
    contract in the module docstring.
    """
    summary = ""
    details: Mapping[str, object] | None = None
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], str):
        holds, summary = value
    elif isinstance(value, Mapping):
        unknown = value.keys() - {"holds", "summary", "details"}
        if "holds" not in value or unknown:
            raise TypeError(f"returned a mapping with keys {sorted(value, key=str)}; {_SHAPES}")
        holds, summary, details = value["holds"], value.get("summary", ""), value.get("details")
        if not isinstance(summary, str) or not (details is None or isinstance(details, Mapping)):
            raise TypeError(f"'summary' must be a str and 'details' a mapping; {_SHAPES}")
    else:
        holds = value
    if holds is not None and not isinstance(holds, bool):
        raise TypeError(f"returned {type(holds).__name__} where a bool or None was due; {_SHAPES}")
    default = "unknown" if holds is None else "holds" if holds else "does not hold"
    result = PredicateResult(name=name, holds=bool(holds), unknown=holds is None, summary=summary or default)
    if details is not None:
        result.details.update(details)
    return result


def _failure(name: str, error: str) -> PredicateResult:
    return PredicateResult(name=name, holds=False, unknown=True, summary=f"user predicate failed: {error}", error=error)


@dataclass(frozen=True, slots=True)
class UserPredicate:
    """A named user predicate. Calling it returns a ``PredicateResult`` and never raises."""

    name: str
    func: Callable[[GlobalSnapshot], object]

    def __call__(self, snapshot: GlobalSnapshot) -> PredicateResult:
        private = GlobalSnapshot()
        private.CopyFrom(snapshot)
        try:
            return to_result(self.name, self.func(private))
        except Exception as exc:
            log.warning("user predicate %r failed", self.name, exc_info=True)
            return _failure(self.name, f"{type(exc).__name__}: {exc}")


def _resolve(spec: str) -> Callable[[GlobalSnapshot], object]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise PluginError(f"bad predicate path {spec!r}: expected 'package.module:function'")
    try:
        target: object = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise PluginError(f"cannot load predicate {spec!r}: {exc}") from exc
    if not callable(target):
        raise PluginError(f"predicate {spec!r} is a {type(target).__name__}, not a callable")
    return target


def load_predicate(spec: str, name: str | None = None) -> UserPredicate:
    """Load the callable at import path `spec` (``"module:function"``) as a user predicate.

    Its name is `name`, or else the attribute path after the colon. Raises PluginError if the
    module or attribute cannot be loaded or is not callable: a configuration mistake, reported
    at start-up rather than at every evaluation.
    """
    return UserPredicate(name or spec.partition(":")[2], _resolve(spec))


def _broken(error: str) -> Callable[[GlobalSnapshot], object]:
    def fail(snapshot: GlobalSnapshot) -> object:
        raise PluginError(error)

    return fail


def entry_point_predicates(group: str = GROUP) -> list[UserPredicate]:
    """Return the user predicates installed under entry point `group`, sorted by name.

    An entry point that fails to load does not stop the others: it becomes a predicate whose
    every result carries the load error.
    """
    predicates = []
    for ep in sorted(entry_points(group=group), key=lambda ep: ep.name):
        try:
            func = ep.load()
            if not callable(func):
                raise PluginError(f"{ep.value!r} is a {type(func).__name__}, not a callable")
        except Exception as exc:
            log.warning("cannot load user predicate %r (%s)", ep.name, ep.value, exc_info=True)
            func = _broken(f"cannot load {ep.value!r}: {type(exc).__name__}: {exc}")
        predicates.append(UserPredicate(ep.name, func))
    return predicates
