"""What a consistent cut proves, as pure functions over a ``GlobalSnapshot``: no I/O, no clocks.

The public API is small:

* :func:`evaluate` — every predicate on one snapshot, as one :class:`~stablewatch.v1.Evaluation`;
* :func:`built_in_results` — the built-in predicates from a wait-for graph's deadlock evidence and
  size, for a caller that reduces the graph elsewhere (the pipeline's snapshots too large for one worker);
* :func:`new_baselines` — the conservation totals an evaluation just set;
* :class:`Verdict` (and :func:`verdict`) — a result as ``"true"``, ``"false"`` or ``"unknown"``;
* :func:`coverage` — whether a cut is closed, and what it lacks;
* :func:`wait_for_dot` — the wait-for graph as Graphviz DOT;
* :func:`choose_victims` (policies :data:`POLICIES`) — the wait to break per proven deadlock, as a
  :class:`Victim`;
* :class:`UserPredicate` and :func:`load_predicate` — user predicates as plugins.

The modules underneath are the algorithms: :mod:`.deadlock` (graph reduction, on networkx graphs
and on compact ones), :mod:`.waitfor` (snapshot to wait-for graph), :mod:`.victims` (which wait
ends a deadlock), :mod:`.cut`, :mod:`.predicates`, :mod:`.plugins`; and :mod:`.columnar`, the
built-in results of a snapshot from its archive rows as columns, for snapshots of millions of
processes (it needs numpy, and is not imported here).
"""

from stablewatch.detector.evaluation.cut import coverage
from stablewatch.detector.evaluation.dot import wait_for_dot
from stablewatch.detector.evaluation.evaluate import built_in_results, evaluate, new_baselines, result_named, verdict
from stablewatch.detector.evaluation.plugins import UserPredicate, load_predicate
from stablewatch.detector.evaluation.verdict import Verdict
from stablewatch.detector.evaluation.victims import POLICIES, Victim, choose_victims

__all__ = [
    "POLICIES",
    "UserPredicate",
    "Verdict",
    "Victim",
    "built_in_results",
    "choose_victims",
    "coverage",
    "evaluate",
    "load_predicate",
    "new_baselines",
    "result_named",
    "verdict",
    "wait_for_dot",
]
