"""The one evaluation: a global snapshot in, one :class:`~stablewatch.v1.Evaluation` out.

:func:`evaluate` is a pure function. The detector calls it on every completed snapshot and stores
its value; the query API, metrics, CLI and demo read that stored value; the Spark pipeline calls
the same function per archived snapshot. So the same predicate on the same snapshot gives the
same answer everywhere, by construction.

Conservation needs an expected total per counter. The caller keeps those totals (configured, or
a baseline taken from the first closed cut that saw the counter) and passes them in;
:func:`new_baselines` reads from an evaluation the totals it just set.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from stablewatch.detector.evaluation.cut import coverage
from stablewatch.detector.evaluation.plugins import UserPredicate
from stablewatch.detector.evaluation.predicates import conservation, deadlock_result, termination
from stablewatch.detector.evaluation.verdict import Verdict
from stablewatch.detector.evaluation.waitfor import (
    Deadlock,
    WaitCounts,
    build_wait_for,
    find_deadlock,
    to_proto,
    wait_counts,
)
from stablewatch.v1 import CutCoverage, Evaluation, GlobalSnapshot, PredicateResult

__all__ = ["built_in_results", "evaluate", "new_baselines", "result_named", "verdict"]


def evaluate(
    snapshot: GlobalSnapshot,
    expected_totals: Mapping[str, int] | None = None,
    plugins: Sequence[UserPredicate] = (),
) -> Evaluation:
    """Evaluate every predicate on `snapshot` and return results, wait-for graph and coverage.

    Results come in a fixed order: ``deadlock``, ``termination``, one ``conservation(<counter>)``
    per counter by name, then `plugins` in the order given. Each is true, false or unknown
    (``unknown`` set; see :mod:`.predicates` for what an open cut may claim). User predicates
    never raise (see :mod:`.plugins`). Does not modify its arguments.

    Complexity: O(V + E) for the wait-for graph of V nodes and E edges, plus O(processes +
    recorded messages) for the other built-ins, plus whatever the plugins cost.
    """
    cut = coverage(snapshot)
    wait_for = build_wait_for(snapshot)
    found = find_deadlock(wait_for)
    results = built_in_results(snapshot, found, wait_counts(wait_for), expected_totals or {}, cut)
    results += [predicate(snapshot) for predicate in plugins]
    return Evaluation(
        snapshot_id=snapshot.snapshot_id,
        results=results,
        wait_for=to_proto(wait_for, found),
        coverage=cut,
    )


def built_in_results(
    snapshot: GlobalSnapshot,
    found: Deadlock,
    counts: WaitCounts,
    expected_totals: Mapping[str, int],
    cut: CutCoverage | None = None,
) -> list[PredicateResult]:
    """The built-in results of `snapshot`, in :func:`evaluate`'s order, given its wait-for graph's
    deadlock evidence `found` (``find_deadlock``) and size `counts` (``wait_counts``).

    :func:`evaluate` is this plus the wait-for graph and the plugins. A caller that builds and
    reduces the wait-for graph elsewhere (the pipeline, for a snapshot too large for one worker)
    finishes with this same function, so the answer is the same by construction. `snapshot`'s
    waits are not read here, only through `cut` (default ``coverage(snapshot)``): a snapshot
    without its waits gives the same results when `cut` is the whole snapshot's.
    """
    cut = coverage(snapshot) if cut is None else cut
    terminated = termination(snapshot, cut)
    results = [deadlock_result(found, counts, cut, terminated), terminated]
    results += conservation(snapshot, expected_totals, cut)
    return results


def new_baselines(evaluation: Evaluation) -> dict[str, int]:
    """The expected totals that `evaluation` set as baselines (counters seen first on this closed cut)."""
    return {
        r.conservation.counter: r.conservation.expected
        for r in evaluation.results
        if r.WhichOneof("evidence") == "conservation" and r.conservation.baseline
    }


def result_named(evaluation: Evaluation, name: str) -> PredicateResult | None:
    """The result of predicate `name` in `evaluation`, or None."""
    return next((r for r in evaluation.results if r.name == name), None)


def verdict(result: PredicateResult) -> Verdict:
    """``"true"``, ``"false"`` or ``"unknown"`` (a failed user predicate is unknown): :meth:`Verdict.of`."""
    return Verdict.of(result)
