"""Built-in predicates over one consistent global snapshot, each true, false or unknown.

Each predicate is a plain function returning ``stablewatch.v1.PredicateResult`` messages with
evidence. All of them are stable properties: one that holds in a consistent cut still holds now.
What a cut may claim depends on whether it is closed (:mod:`.cut`):

* ``deadlock`` — true when some wait can never be released (see :mod:`.waitfor`); a deadlock
  among members is real whatever the others do. False on a closed cut without one, and on an
  open cut when, besides, no counted wait leads to a process outside it (a caller outside that
  only calls in cannot be part of a cycle) and none to a whole member process that the quiet rule
  left free while every member is passive with nothing in flight (closed, the cut could be
  quiet); otherwise unknown.
* ``termination`` — true when every process is passive and no waking message is in flight; an
  active member or a waking message makes it false on any cut; otherwise unknown on an open cut.
* ``conservation(<counter>)`` — true when the units held by processes plus those in flight equal
  the expected total. Unknown on an open cut (units may sit outside it); a counter without an
  expected total takes this closed cut's sum as its baseline.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

from stablewatch.detector.evaluation.cut import coverage, describe_missing
from stablewatch.detector.evaluation.text import SHOWN, names, plural
from stablewatch.detector.evaluation.waitfor import (
    Channel,
    Deadlock,
    WaitCounts,
    build_wait_for,
    evidence_proto,
    find_deadlock,
    label,
    sends_going_on,
    wait_counts,
    waking_channels,
)
from stablewatch.v1 import (
    ChannelRef,
    CounterHolding,
    CutCoverage,
    GlobalSnapshot,
    PredicateResult,
)
from stablewatch.v1.bounds import MAX_COUNTER_UNITS

__all__ = [
    "Holding",
    "check_expected_totals",
    "conservation",
    "conservation_results",
    "counter_holdings",
    "deadlock",
    "deadlock_result",
    "expected_total",
    "held",
    "termination",
    "termination_result",
    "unknown",
]


def expected_total(text: str) -> tuple[str, int]:
    """Parse ``COUNTER=TOTAL``, the expected total of a conserved counter (``--expect``): ValueError
    saying what is wrong. The total is at most ``MAX_COUNTER_UNITS`` either way, as the units of a
    counter in a cut are, so that a drift from it is a 64-bit integer too."""
    counter, sep, total = text.partition("=")
    if not sep or not counter.strip():
        raise ValueError(f"expected COUNTER=TOTAL, e.g. tokens=300, not {text!r}")
    try:
        amount = int(total.strip())
    except ValueError:
        raise ValueError(f"expected an integer total, not {total.strip()!r} (in {text!r})") from None
    check_expected_totals({counter.strip(): amount})
    return counter.strip(), amount


def check_expected_totals(totals: Mapping[str, int]) -> None:
    """ValueError naming the first expected total past ``MAX_COUNTER_UNITS`` either way (or not an
    integer): a drift from it would not be a 64-bit integer."""
    for counter, amount in totals.items():
        if not isinstance(amount, int) or isinstance(amount, bool):
            raise ValueError(f"the total of {counter} must be an integer, not {amount!r}")
        if abs(amount) > MAX_COUNTER_UNITS:
            raise ValueError(f"the total of {counter} must be within ±{MAX_COUNTER_UNITS}, not {amount}")


def unknown(result: PredicateResult, cut: CutCoverage, finding: str) -> PredicateResult:
    """Mark `result` unknown because `cut` is open; the summary says what was found and what is missing."""
    result.holds = False
    result.unknown = True
    result.missing_processes[:] = cut.missing_processes
    result.summary = f"unknown: {finding}, but {describe_missing(cut)}"
    return result


def deadlock_result(
    found: Deadlock, counts: WaitCounts, cut: CutCoverage, termination: PredicateResult
) -> PredicateResult:
    """Wrap `found` (``find_deadlock`` of a wait-for graph of size `counts`) as the ``deadlock`` result
    for a cut of coverage `cut`, whose ``termination`` result is `termination`.

    Only the evidence and the counts are read, not the graph: a caller that built and reduced the
    graph elsewhere (the pipeline, for a snapshot too large for one worker) gets the same result.
    """
    result = PredicateResult(name="deadlock", holds=bool(found.deadlocked))
    result.deadlock.CopyFrom(evidence_proto(found))
    if found.deadlocked:
        steps = [label(n) for n in found.cycle]
        if len(steps) > SHOWN:
            steps = [*steps[: SHOWN - 1], f"... ({len(steps) - SHOWN + 1} more)"]
        path = " -> ".join([*steps, label(found.cycle[0])])
        result.summary = f"{plural(len(found.deadlocked), 'node')} deadlocked: cycle {path}"
        if found.knot:
            result.summary += f"; knot of {plural(len(found.knot), 'node')}"
        return result
    size = (
        f"{plural(counts.waiters, 'waiter')}, {plural(counts.edges, 'wait edge')}, "
        f"{counts.discounted} discounted by messages in flight"
    )
    if not cut.closed:
        # Why "no counted edge into an outside process" makes false sound on an open cut. Every
        # waiter is a member node and every outside node is free here, so with no such edge no
        # member node reaches an outside one. Closing the cut adds the outside processes' nodes,
        # their edges, and channels from them: their edges start outside (into the cut, or among
        # themselves), and their messages can only satisfy a member's wait on them (the in-flight
        # rule: a message on q -> p wakes only p's waits on q), of which there is none counted.
        # So each member's counted edges stay what they are (an OR waiter released stays released),
        # all on members, and the reduction that released every member here releases them there.
        # An edge into an outside process is different: that process may wait on the waiter (a
        # cycle, or a knot for an OR waiter, which the free outside node now hides). Unknown then.
        if counts.outside:
            edges = plural(counts.outside, "wait edge")
            return unknown(result, cut, f"no deadlock among the processes in the cut ({size}; {edges} to outside it)")
        # A wait on a whole member process left free by the quiet rule is another: with every member
        # passive and nothing in flight among them, the cut closed may be quiet, and the process
        # node then an OR over its tasks, which may close a cycle. (A member active, or a message
        # in flight among them, keeps the closed cut from being quiet: the node stays free.)
        evidence = termination.termination
        if counts.undecided and not (evidence.active_processes or evidence.busy_channels or evidence.released_sends):
            edges = plural(counts.undecided, "wait edge")
            return unknown(
                result,
                cut,
                f"no deadlock among the processes in the cut ({size}; {edges} to whole processes of it, "
                "all passive: whether those processes are ever woken depends on the processes outside it)",
            )
        result.summary = f"no deadlock among the processes in the cut, none waits outside it: {size}"
        return result
    result.summary = f"no deadlock: {size}"
    return result


def deadlock(snapshot: GlobalSnapshot) -> PredicateResult:
    """Return the ``deadlock`` result: true when some node of the wait-for graph is deadlocked.

    Each waiter uses its own model (AND, OR); the in-flight rule applies. The evidence lists all
    deadlocked nodes, one cycle, the knot when OR waiters are involved, and the empty channels
    along the cycle. O(V + E) in the size of the wait-for graph (plus sorting the evidence).
    """
    wf = build_wait_for(snapshot)
    cut = coverage(snapshot)
    return deadlock_result(find_deadlock(wf), wait_counts(wf), cut, termination(snapshot, cut))


def termination(snapshot: GlobalSnapshot, cut: CutCoverage | None = None) -> PredicateResult:
    """Return the ``termination`` result: true when every process is passive, no channel holds a
    waking message (heartbeats, ``no_wake``, cannot reactivate anyone) and no blocked send is about
    to go on (:func:`~.waitfor.sends_going_on`), on a closed cut.

    An active member, a waking message or a send about to go on is a fact on any cut: the result is
    then false. With none, an open cut is unknown. O(processes + waits + messages + channels).
    """
    cut = coverage(snapshot) if cut is None else cut
    active = sorted(p.process_id for p in snapshot.processes if p.state.active)
    busy = sorted(waking_channels(snapshot))
    return termination_result(active, busy, len(snapshot.processes), cut, sends_going_on(snapshot))


def termination_result(
    active: Sequence[str],
    busy: Sequence[Channel],
    processes: int,
    cut: CutCoverage,
    released: Sequence[Channel] = (),
) -> PredicateResult:
    """The ``termination`` result from its facts: the `active` processes, the `busy` channels (those
    with a waking message) and the channels of `released` sends (blocked, about to go on), all
    sorted, among `processes` processes, on a cut of coverage `cut`.

    :func:`termination` is this over a ``GlobalSnapshot``; :mod:`.columnar` finds the same facts in
    the archive's rows. O(active + busy + released).
    """
    result = PredicateResult(name="termination", holds=not active and not busy and not released)
    evidence = result.termination
    evidence.SetInParent()  # the evidence is there, empty as it may be
    evidence.active_processes.extend(active)
    for src, dst in busy:
        evidence.busy_channels.add(src=src, dst=dst)
    for src, dst in released:
        evidence.released_sends.add(src=src, dst=dst)
    if active or busy or released:
        parts = []
        if active:
            parts.append(f"{len(active)} active ({names(active)})")
        if busy:
            channels = names([f"{s} -> {d}" for s, d in busy])
            parts.append(f"{plural(len(busy), 'channel')} with waking messages ({channels})")
        if released:
            channels = names([f"{s} -> {d}" for s, d in released])
            parts.append(f"{plural(len(released), 'blocked send')} about to go on ({channels})")
        result.summary = "not terminated: " + "; ".join(parts)
        return result
    count = plural(processes, "process", "processes")
    if not cut.closed:
        return unknown(result, cut, f"{count} in the cut passive, nothing in flight among them")
    result.summary = f"terminated: {count} passive, nothing in flight"
    return result


#: Where units of a counter are: ``(process, amount)``, or ``((src, dst), amount)`` for a channel.
Holding = tuple[str | Channel, int]


def held(snapshot: GlobalSnapshot) -> dict[str, list[Holding]]:
    """Return, for every counter named anywhere in `snapshot`, where its non-zero units are.

    Processes first (by id), then channels (by src, dst), each summing its recorded messages.
    A counter seen only with zero amounts maps to an empty list. O(processes + messages).
    """
    holdings: dict[str, list[Holding]] = {}
    for p in sorted(snapshot.processes, key=lambda p: p.process_id):
        for name, amount in p.state.counters.items():
            found = holdings.setdefault(name, [])
            if amount:
                found.append((p.process_id, amount))
    for c in sorted(snapshot.channels, key=lambda c: (c.src, c.dst)):
        in_flight: dict[str, int] = {}
        for m in c.messages:
            for name, amount in m.counters.items():
                in_flight[name] = in_flight.get(name, 0) + amount
        for name, amount in in_flight.items():
            found = holdings.setdefault(name, [])
            if amount:
                found.append(((c.src, c.dst), amount))
    return holdings


def counter_holdings(snapshot: GlobalSnapshot) -> dict[str, list[CounterHolding]]:
    """:func:`held` as ``CounterHolding`` messages."""
    return {name: [_holding_proto(h) for h in found] for name, found in held(snapshot).items()}


def _holding_proto(holding: Holding) -> CounterHolding:
    where, amount = holding
    if isinstance(where, str):
        return CounterHolding(process=where, amount=amount)
    return CounterHolding(channel=ChannelRef(src=where[0], dst=where[1]), amount=amount)


def _where(holding: Holding) -> str:
    where = holding[0]
    return where if isinstance(where, str) else f"{where[0]} -> {where[1]}"


def _conservation_result(
    counter: str, expected: int | None, holdings: Sequence[Holding], cut: CutCoverage
) -> PredicateResult:
    observed = sum(amount for _, amount in holdings)
    result = PredicateResult(name=f"conservation({counter})")
    evidence = result.conservation
    evidence.counter = counter
    evidence.observed = observed
    add = evidence.holdings.add  # in place: a million holdings are a million messages
    for where, amount in holdings:
        if isinstance(where, str):
            add(process=where, amount=amount)
        else:
            add(channel=ChannelRef(src=where[0], dst=where[1]), amount=amount)
    if not cut.closed:
        if expected is not None:
            evidence.expected = expected
        return unknown(result, cut, f"{counter}: {observed} in the cut")
    if expected is None:  # the first closed cut to see this counter sets its expected total
        evidence.expected = observed
        evidence.baseline = True
        result.holds = True
        result.summary = f"{counter}: baseline set to {observed}"
        return result
    drift = observed - expected
    evidence.expected = expected
    evidence.drift = drift
    result.holds = drift == 0
    if drift == 0:
        result.summary = f"{counter}: {observed} as expected"
    else:
        largest = heapq.nsmallest(SHOWN, holdings, key=lambda h: -abs(h[1]))  # sorted(...)[:SHOWN], in O(n)
        where = ", ".join(f"{_where(h)} {h[1]}" for h in largest) or "nowhere"
        result.summary = f"{counter}: observed {observed}, expected {expected} (drift {drift:+d}); held by {where}"
    return result


def conservation(
    snapshot: GlobalSnapshot, expected: Mapping[str, int], cut: CutCoverage | None = None
) -> list[PredicateResult]:
    """Return one ``conservation(<counter>)`` result per counter, sorted by counter name.

    The counters are those named in `snapshot` (process states or recorded messages) plus those
    in `expected`: a configured counter that vanished entirely is reported with its whole drift.
    observed = units held by processes + units on recorded messages; true when observed equals
    ``expected[counter]``. On a closed cut, a counter without an expected total takes observed as
    its baseline (true, ``evidence.baseline`` set); on an open cut every counter is unknown.
    O(processes + messages + counters).
    """
    cut = coverage(snapshot) if cut is None else cut
    return conservation_results(held(snapshot), expected, cut)


def conservation_results(
    holdings: Mapping[str, Sequence[Holding]], expected: Mapping[str, int], cut: CutCoverage
) -> list[PredicateResult]:
    """The ``conservation(<counter>)`` results from their facts: where each counter's non-zero units
    are (:func:`held`'s form and order), on a cut of coverage `cut`.

    :func:`conservation` is this over a ``GlobalSnapshot``; :mod:`.columnar` finds the same
    holdings in the archive's rows. O(holdings + counters).
    """
    return [
        _conservation_result(name, expected.get(name), holdings.get(name, ()), cut)
        for name in sorted(holdings.keys() | expected.keys())
    ]
