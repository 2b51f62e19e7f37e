"""User predicates: Python callables over the global state, loaded as plugins.

The contract. A user predicate is a callable taking one ``stablewatch.v1.GlobalSnapshot`` (a
private copy: changing it affects nobody else) and returning one of:

* a ``bool`` — whether the predicate holds — or ``None``: the cut cannot decide it (unknown);
* a pair ``(holds: bool | None, summary: str)``;
* a mapping ``{"holds": bool | None, "summary": str, "details": dict, "whole_system": bool}``;
  only ``holds`` is required, and ``details`` must be JSON-like (it becomes the result's
  ``google.protobuf.Struct``).

A predicate about the whole system must answer ``None`` on an open cut (DESIGN.md: nothing holds on
a cut that lacks the facts). Saying ``"whole_system": True`` does that for it: on an open cut its
answer becomes unknown, with the missing processes, whatever it said. Or it can look itself: the
snapshot says what the detector expected (``expected_members``, ``expected_member_count``) and
:func:`stablewatch.detector.evaluation.cut.coverage` tells whether it is closed.

It is loaded by import path (``"package.module:function"``, the attribute may be dotted) or
installed by a distribution under the entry point group ``stablewatch.predicates``, the entry
point's name becoming the predicate's name::

    [project.entry-points."stablewatch.predicates"]
    queue_bounded = "myservice.checks:queue_bounded"

Evaluation never crashes because of a plugin: an exception raised inside it (any
``BaseException``, ``asyncio.CancelledError`` included), or a result of the wrong shape, becomes an
unknown ``PredicateResult`` with ``error`` set (the traceback is logged). Only ``KeyboardInterrupt``
and ``SystemExit`` propagate. Predicates run in the evaluating thread, without a time limit.

A user predicate's name is its result's name, which the metrics, the store and the pipeline key
on: it must not be a built-in's (``deadlock``, ``termination``, ``conservation(<counter>)``) nor
another user predicate's. Such a name is refused with :class:`PluginError` when the predicate is
made (:func:`load_predicate`, :func:`entry_point_predicates`, :class:`UserPredicate`), and
:func:`check_names` refuses two of the same name (the detector calls it on its plugins).
"""

import importlib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points

from stablewatch.detector.evaluation.cut import coverage
from stablewatch.detector.evaluation.predicates import unknown as unknown_on_open_cut
from stablewatch.v1 import GlobalSnapshot, PredicateResult
from stablewatch.v1.bounds import non_finite

GROUP = "stablewatch.predicates"

__all__ = [
    "GROUP",
    "PluginError",
    "UserPredicate",
    "built_in_name",
    "check_names",
    "entry_point_predicates",
    "load_predicate",
    "to_result",
]

log = logging.getLogger(__name__)

_SHAPES = (
    "expected bool or None, (bool | None, str) or a mapping with 'holds' "
    "(and optional 'summary', 'details', 'whole_system')"
)


# The built-in predicates' result names. .predicates writes them inline, with no constant to import;
# tests/test_plugins_review.py checks these against what evaluate() gives.
_BUILT_IN_NAMES = frozenset({"deadlock", "termination"})
_BUILT_IN_PREFIX = "conservation("  # one result per counter: "conservation(<counter>)"


class PluginError(Exception):
    """A user predicate could not be loaded (bad import path, missing module or attribute, an
    attribute that is not callable) or is misnamed (a built-in's name, or two of the same name)."""


def built_in_name(name: str) -> str | None:
    """The built-in predicate whose results `name` could be mistaken for, or None when it is free."""
    if name in _BUILT_IN_NAMES:
        return name
    if name.startswith(_BUILT_IN_PREFIX):
        return f"{_BUILT_IN_PREFIX}<counter>)"
    return None


def _refuse_built_in(name: str, origin: str) -> None:
    """Raise PluginError if `name` (of the user predicate from `origin`) is a built-in's."""
    built_in = built_in_name(name)
    if built_in is not None:
        raise PluginError(
            f"user predicate {name!r} (from {origin}) is named like the built-in predicate {built_in}, "
            "whose results it would be mistaken for: give it another name"
        )


def to_result(name: str, value: object, snapshot: GlobalSnapshot | None = None) -> PredicateResult:
    """Convert a user predicate's return `value` on `snapshot` to a ``PredicateResult`` named `name`.

    Raises TypeError (or ValueError, for details a Struct cannot hold) when `value` breaks the
    contract in the module docstring. A ``whole_system`` answer on an open cut of `snapshot` is
    unknown.
    """
    summary = ""
    details: Mapping[str, object] | None = None
    whole_system = False
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], str):
        holds, summary = value
    elif isinstance(value, Mapping):
        unknown = value.keys() - {"holds", "summary", "details", "whole_system"}
        if "holds" not in value or unknown:
            raise TypeError(f"returned a mapping with keys {sorted(value, key=str)}; {_SHAPES}")
        holds, summary, details = value["holds"], value.get("summary", ""), value.get("details")
        whole_system = value.get("whole_system", False)
        if not isinstance(summary, str) or not (details is None or isinstance(details, Mapping)):
            raise TypeError(f"'summary' must be a str and 'details' a mapping; {_SHAPES}")
        if not isinstance(whole_system, bool):
            raise TypeError(f"'whole_system' must be a bool; {_SHAPES}")
    else:
        holds = value
    if holds is not None and not isinstance(holds, bool):
        raise TypeError(f"returned {type(holds).__name__} where a bool or None was due; {_SHAPES}")
    default = "unknown" if holds is None else "holds" if holds else "does not hold"
    result = PredicateResult(name=name, holds=bool(holds), unknown=holds is None, summary=summary or default)
    if details is not None:
        result.details.update(details)
        if (number := non_finite(result.details)) is not None:
            # No JSON holds it: the archive could not keep the snapshot, nor the pipeline write it.
            raise ValueError(f"'details' holds {number[1]} under {number[0]!r}: numbers must be finite")
    if whole_system and holds is not None and snapshot is not None:
        cut = coverage(snapshot)
        if not cut.closed:
            return unknown_on_open_cut(result, cut, summary or default)
    return result


def _failure(name: str, error: str) -> PredicateResult:
    return PredicateResult(name=name, holds=False, unknown=True, summary=f"user predicate failed: {error}", error=error)


@dataclass(frozen=True, slots=True)
class UserPredicate:
    """A named user predicate. Calling it returns a ``PredicateResult`` and never raises (but for
    ``KeyboardInterrupt`` and ``SystemExit``).

    `source` says where it came from, for error messages (an import path or an entry point; by
    default the callable's ``module:qualname``). A built-in's name raises PluginError.
    """

    name: str
    func: Callable[[GlobalSnapshot], object]
    source: str = ""

    def __post_init__(self) -> None:
        _refuse_built_in(self.name, self.origin)

    @property
    def origin(self) -> str:
        """Where this predicate came from: `source`, or else the callable's ``module:qualname``."""
        if self.source:
            return self.source
        return f"{getattr(self.func, '__module__', '?')}:{getattr(self.func, '__qualname__', repr(self.func))}"

    def __call__(self, snapshot: GlobalSnapshot) -> PredicateResult:
        private = GlobalSnapshot()
        private.CopyFrom(snapshot)
        try:
            return to_result(self.name, self.func(private), snapshot)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            # Any other, asyncio.CancelledError included: the predicate runs synchronously, so it
            # cannot be the evaluating task's own cancellation, and letting it out would cancel the
            # detector's snapshot task and lose the completed snapshot without a word.
            log.warning("user predicate %r failed", self.name, exc_info=True)
            return _failure(self.name, f"{type(exc).__name__}: {exc}")


def check_names(predicates: Iterable[UserPredicate]) -> tuple[UserPredicate, ...]:
    """Return `predicates` as a tuple; raise PluginError if two of them share a name (each result
    must be told apart by name) or one is named like a built-in (possible only by bypassing
    ``UserPredicate``'s own check, e.g. ``object.__setattr__``)."""
    listed = tuple(predicates)
    seen: dict[str, UserPredicate] = {}
    for predicate in listed:
        _refuse_built_in(predicate.name, predicate.origin)
        first = seen.get(predicate.name)
        if first is not None:
            raise PluginError(
                f"two user predicates are named {predicate.name!r} (from {first.origin} and from "
                f"{predicate.origin}): give one another name"
            )
        seen[predicate.name] = predicate
    return listed


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
    module or attribute cannot be loaded or is not callable, or if the name is a built-in's: a
    configuration mistake, reported at start-up rather than at every evaluation.
    """
    name = name or spec.partition(":")[2]
    _refuse_built_in(name, spec)  # before importing anything: the name alone is the mistake
    return UserPredicate(name, _resolve(spec), spec)


def _broken(error: str) -> Callable[[GlobalSnapshot], object]:
    def fail(snapshot: GlobalSnapshot) -> object:
        raise PluginError(error)

    return fail


def entry_point_predicates(group: str = GROUP) -> list[UserPredicate]:
    """Return the user predicates installed under entry point `group`, sorted by name.

    An entry point that fails to load does not stop the others: it becomes a predicate whose
    every result carries the load error. A misnamed one (a built-in's name, or two installed
    under the same name) raises PluginError: its results could not be told apart.
    """
    predicates = []
    for ep in sorted(entry_points(group=group), key=lambda ep: ep.name):
        dist = getattr(ep, "dist", None)
        source = f"entry point {ep.name} = {ep.value} in group {group}" + (f" of {dist.name}" if dist else "")
        _refuse_built_in(ep.name, source)  # before loading it: the name alone is the mistake
        try:
            func = ep.load()
            if not callable(func):
                raise PluginError(f"{ep.value!r} is a {type(func).__name__}, not a callable")
        except Exception as exc:
            log.warning("cannot load user predicate %r (%s)", ep.name, ep.value, exc_info=True)
            func = _broken(f"cannot load {ep.value!r}: {type(exc).__name__}: {exc}")
        predicates.append(UserPredicate(ep.name, func, source))
    return list(check_names(predicates))
