"""The watch stream's changes read each result through the one verdict rule."""

from __future__ import annotations

from stablewatch.detector.service.watch import WatchHub
from stablewatch.v1 import PredicateResult


def test_a_user_predicate_that_fails_is_a_change_to_unknown_not_false() -> None:
    hub = WatchHub()
    hub.changes([PredicateResult(name="quota", holds=False)])
    changes = hub.changes([PredicateResult(name="quota", holds=False, error="ZeroDivisionError")])
    assert len(changes) == 1
    change = changes[0]
    assert (change.holds, change.unknown, change.previous_holds, change.previous_unknown) == (False, True, False, False)
    assert hub.changes([PredicateResult(name="quota", holds=False, error="again")]) == []  # still unknown


def test_unknown_to_true_and_back_are_changes() -> None:
    hub = WatchHub()
    first = hub.changes([PredicateResult(name="termination", unknown=True)])
    assert first[0].first and first[0].unknown
    to_true = hub.changes([PredicateResult(name="termination", holds=True)])
    assert (to_true[0].holds, to_true[0].previous_unknown, to_true[0].first) == (True, True, False)
    assert hub.changes([PredicateResult(name="termination", holds=True)]) == []
