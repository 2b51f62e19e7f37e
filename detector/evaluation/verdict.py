"""What a predicate's result says: true, false or unknown, the one rule every reader applies.

A :class:`~stablewatch.v1.PredicateResult` carries ``holds``, ``unknown`` and ``error``. A result
the cut cannot decide (``unknown``), or a user predicate that failed (``error``), says neither true
nor false: nothing holds on a cut that lacks the facts. Every place that shows, counts or alerts on
a result (the CLI, the metrics, the pipeline's history) reads it through :meth:`Verdict.of`.
"""

from __future__ import annotations

import enum

from stablewatch.v1 import PredicateResult

__all__ = ["Verdict"]


class Verdict(enum.StrEnum):
    """A result as one of three words; a ``str``, so it prints and compares as its text."""

    TRUE = "true"
    FALSE = "false"
    UNKNOWN = "unknown"

    @classmethod
    def of(cls, result: PredicateResult) -> Verdict:
        """The verdict of `result` (a failed user predicate is unknown)."""
        return cls.of_fields(result.holds, result.unknown, result.error)

    @classmethod
    def of_fields(cls, holds: bool, unknown: bool, error: str | None) -> Verdict:
        """The same rule over a result's three fields, as an archived row holds them."""
        if unknown or error:
            return cls.UNKNOWN
        return cls.TRUE if holds else cls.FALSE
