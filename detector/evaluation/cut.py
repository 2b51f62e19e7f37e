"""Whether a cut covers the whole system (DESIGN.md, "A cut covers the whole system, or it proves less").

A cut is *closed* when every process that any part of it names is a member, and every member the
detector expected reported. Names come from:

* the detector's expectation, carried in the snapshot: ``expected_members`` (the processes attached
  when it began, plus those declared) and ``expected_member_count`` (a declared number);
* the other end of a member's channel that is not a member (``outside_peers``, kept by assembly);
* the targets of every wait;
* the sender of every recorded message (always a member: assembly keeps only member channels).

Termination and conservation are claims about the whole system: they are decided only on a
closed cut. On an open one they are *unknown*, with the missing processes as evidence.
"""

from __future__ import annotations

from stablewatch.detector.evaluation.text import names, plural
from stablewatch.v1 import CutCoverage, GlobalSnapshot

__all__ = ["coverage", "cut_coverage", "describe_missing"]


def coverage(snapshot: GlobalSnapshot) -> CutCoverage:
    """Return whether `snapshot` is closed, and which processes it lacks (sorted).

    O(processes + waits + targets + channels).

    >>> from stablewatch.v1 import ProcessSnapshot
    >>> s = GlobalSnapshot(processes=[ProcessSnapshot(process_id="A")], expected_members=["A", "B"])
    >>> c = coverage(s)
    >>> c.closed, list(c.missing_processes)
    (False, ['B'])
    """
    members = {p.process_id for p in snapshot.processes}
    named: set[str] = set(snapshot.expected_members)
    named.update(snapshot.outside_peers)
    for process in snapshot.processes:
        for wait in process.state.waits:
            named.update(target.process for target in wait.targets if target.process)
    for channel in snapshot.channels:
        named.add(channel.src)
        named.add(channel.dst)
    return cut_coverage(len(members), sorted(named - members), snapshot.expected_member_count)


def cut_coverage(members: int, missing: list[str], expected_count: int) -> CutCoverage:
    """The coverage of a cut of `members` distinct processes that lacks the processes `missing`
    (named but not members, sorted), when `expected_count` processes were expected by number.

    :func:`coverage` is this over a ``GlobalSnapshot``; :mod:`.columnar` finds the same facts in
    the archive's rows.
    """
    unnamed = max(0, expected_count - members - len(missing))
    return CutCoverage(closed=not missing and not unnamed, missing_processes=missing, missing_unnamed=unnamed)


def describe_missing(cut: CutCoverage) -> str:
    """A short phrase naming what an open cut lacks, for summaries ("" for a closed cut)."""
    pieces = []
    missing = list(cut.missing_processes)
    if missing:
        pieces.append(f"{plural(len(missing), 'process', 'processes')} missing from the cut ({names(missing)})")
    if cut.missing_unnamed:
        pieces.append(
            f"{plural(cut.missing_unnamed, 'more expected process', 'more expected processes')} did not report"
        )
    return "; ".join(pieces)
