"""What a consistent cut proves, as pure functions over a ``GlobalSnapshot``: no I/O, no clocks.

The public API is small:

* :func:`evaluate` — every predicate on one snapshot, as one :class:`~stablewatch.v1.Evaluation`;
* :func:`new_baselines` — the conservation totals an evaluation just set;
* :class:`Verdict` (and :func:`verdict`) — a result as ``"true"``, ``"false"`` or ``"unknown"``;
* :func:`coverage` — whether a cut is closed, and what it lacks;
* :func:`wait_for_dot` — the wait-for graph as Graphviz DOT;
* :class:`UserPredicate` and :func:`load_predicate` — user predicates as plugins.

The modules underneath are the algorithms: :mod:`.deadlock` (graph reduction), :mod:`.waitfor`
(snapshot to wait-for graph), :mod:`.cut`, :mod:`.predicates`, :mod:`.plugins`.
"""

from stablewatch.detector.evaluation.cut import coverage
from stablewatch.detector.evaluation.dot import wait_for_dot
from stablewatch.detector.evaluation.evaluate import evaluate, new_baselines, result_named, verdict
from stablewatch.detector.evaluation.plugins import UserPredicate, load_predicate
from stablewatch.detector.evaluation.verdict import Verdict

__all__ = [
    "UserPredicate",
    "Verdict",
    "coverage",
    "evaluate",
    "load_predicate",
    "new_baselines",
    "result_named",
    "verdict",
    "wait_for_dot",
]
