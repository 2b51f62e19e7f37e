"""Built-in predicates over one consistent global snapshot, and the :class:`Evaluator` that runs them.

Each predicate is a plain function returning ``stablewatch.v1.PredicateResult`` messages with
evidence. All of them are stable properties: one that holds in a consistent cut still holds now.

* ``deadlock`` — holds when some wait can never be released (see :mod:`.waitfor`).
* ``termination`` — holds when every process is passive and no waking message is in flight.
* ``conservation(<counter>)`` — holds when the units held by processes plus those in flight equal
  the expected total.
"""

from collections.abc import Iterable, Mapping, Sequence

from stablewatch.detector.evaluation.plugins import UserPredicate
from stablewatch.detector.evaluation.waitfor import (
    Deadlock,
    WaitFor,
    build_wait_for,
    evidence_proto,
    find_deadlock,
    label,
    waking_channels,
)
from stablewatch.v1 import (
    ChannelRef,
    ConservationEvidence,
    CounterHolding,
    GlobalSnapshot,
    PredicateResult,
    TerminationEvidence,
)

__all__ = [
    "Evaluator",
    "conservation",
    "counter_holdings",
    "deadlock",
    "deadlock_result",
    "termination",
]

_SHOWN = 6  # names listed in a summary before "..."


def _names(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_SHOWN])
    return shown + (f", ... ({len(items) - _SHOWN} more)" if len(items) > _SHOWN else "")


def _plural(n: int, word: str, words: str = "") -> str:
    return f"{n} {word}" if n == 1 else f"{n} {words or word + 's'}"


def deadlock_result(wf: WaitFor, found: Deadlock) -> PredicateResult:
    """Wrap `found` (from ``find_deadlock(wf)``) as the ``deadlock`` result."""
    result = PredicateResult(name="deadlock", holds=bool(found.deadlocked))
    result.deadlock.CopyFrom(evidence_proto(found))
    if found.deadlocked:
        steps = [label(n) for n in found.cycle]
        if len(steps) > _SHOWN:
            steps = [*steps[: _SHOWN - 1], f"... ({len(steps) - _SHOWN + 1} more)"]
        path = " -> ".join([*steps, label(found.cycle[0])])
        result.summary = f"{_plural(len(found.deadlocked), 'node')} deadlocked: cycle {path}"
        if found.knot:
            result.summary += f"; knot of {_plural(len(found.knot), 'node')}"
    else:
        G = wf.graph
        waiters = sum(1 for _, m in G.nodes(data="model") if m is not None)
        result.summary = (
            f"no deadlock: {_plural(waiters, 'waiter')}, {_plural(G.number_of_edges(), 'wait edge')}, "
            f"{len(wf.discounted)} discounted by messages in flight"
        )
    return result


def deadlock(snapshot: GlobalSnapshot) -> PredicateResult:
    """Return the ``deadlock`` result: holds when some node of the wait-for graph is deadlocked.

    Each waiter uses its own model (AND, OR); the in-flight rule applies. The evidence lists all
    deadlocked nodes, one cycle, the knot when OR waiters are involved, and the empty channels
    along the cycle. O(V + E) in the size of the wait-for graph (plus sorting the evidence).
    """
    wf = build_wait_for(snapshot)
    return deadlock_result(wf, find_deadlock(wf))


def termination(snapshot: GlobalSnapshot) -> PredicateResult:
    """Return the ``termination`` result: holds when every process is passive and no channel holds a
    waking message (heartbeats, ``no_wake``, cannot reactivate anyone). O(processes + messages).
    """
    active = sorted(p.process_id for p in snapshot.processes if p.state.active)
    busy = sorted(waking_channels(snapshot))
    result = PredicateResult(name="termination", holds=not active and not busy)
    result.termination.CopyFrom(
        TerminationEvidence(
            active_processes=active,
            busy_channels=[ChannelRef(src=s, dst=d) for s, d in busy],
        )
    )
    if result.holds:
        processes = _plural(len(snapshot.processes), "process", "processes")
        result.summary = f"terminated: {processes} passive, nothing in flight"
    else:
        parts = []
        if active:
            parts.append(f"{len(active)} active ({_names(active)})")
        if busy:
            channels = _names([f"{s} -> {d}" for s, d in busy])
            parts.append(f"{_plural(len(busy), 'channel')} with waking messages ({channels})")
        result.summary = "not terminated: " + "; ".join(parts)
    return result


def counter_holdings(snapshot: GlobalSnapshot) -> dict[str, list[CounterHolding]]:
    """Return, for every counter named anywhere in `snapshot`, where its non-zero units are.

    Processes first (by id), then channels (by src, dst), each summing its recorded messages.
    A counter seen only with zero amounts maps to an empty list. O(processes + messages).
    """
    holdings: dict[str, list[CounterHolding]] = {}
    for p in sorted(snapshot.processes, key=lambda p: p.process_id):
        for name, amount in p.state.counters.items():
            found = holdings.setdefault(name, [])
            if amount:
                found.append(CounterHolding(process=p.process_id, amount=amount))
    for c in sorted(snapshot.channels, key=lambda c: (c.src, c.dst)):
        in_flight: dict[str, int] = {}
        for m in c.messages:
            for name, amount in m.counters.items():
                in_flight[name] = in_flight.get(name, 0) + amount
        for name, amount in in_flight.items():
            found = holdings.setdefault(name, [])
            if amount:
                found.append(CounterHolding(channel=ChannelRef(src=c.src, dst=c.dst), amount=amount))
    return holdings


def _where(holding: CounterHolding) -> str:
    return holding.process or f"{holding.channel.src} -> {holding.channel.dst}"


def _conservation_result(
    counter: str, expected: int, holdings: list[CounterHolding], baseline: bool
) -> PredicateResult:
    observed = sum(h.amount for h in holdings)
    drift = observed - expected
    result = PredicateResult(name=f"conservation({counter})", holds=drift == 0)
    result.conservation.CopyFrom(
        ConservationEvidence(counter=counter, expected=expected, observed=observed, drift=drift, holdings=holdings)
    )
    if baseline:
        result.summary = f"{counter}: baseline set to {observed}"
    elif drift == 0:
        result.summary = f"{counter}: {observed} as expected"
    else:
        largest = sorted(holdings, key=lambda h: -abs(h.amount))[:_SHOWN]
        where = ", ".join(f"{_where(h)} {h.amount}" for h in largest) or "nowhere"
        result.summary = f"{counter}: observed {observed}, expected {expected} (drift {drift:+d}); held by {where}"
    return result


def conservation(
    snapshot: GlobalSnapshot, expected: Mapping[str, int], *, baselines: Iterable[str] = ()
) -> list[PredicateResult]:
    """Return one ``conservation(<counter>)`` result per counter, sorted by counter name.

    The counters are those named in `snapshot` (process states or recorded messages) plus those
    in `expected`: a configured counter that vanished entirely is reported with its whole drift.
    observed = units held by processes + units on recorded messages; holds when observed equals
    ``expected[counter]``. Counters in `baselines` just had their expected total taken from this
    snapshot; their summary says so. O(processes + messages + counters).

    Raises KeyError if a counter in `snapshot` has no expected total (use :class:`Evaluator` to
    take missing totals from a baseline).
    """
    return _conservation_results(counter_holdings(snapshot), expected, set(baselines))


def _conservation_results(
    holdings: Mapping[str, list[CounterHolding]], expected: Mapping[str, int], baselines: set[str]
) -> list[PredicateResult]:
    return [
        _conservation_result(name, expected[name], holdings.get(name, []), name in baselines)
        for name in sorted(holdings.keys() | expected.keys())
    ]


class Evaluator:
    """Runs every predicate on a snapshot: deadlock, termination, conservation, then user predicates.

    Conservation compares with `expected_totals` where configured; any other counter takes its
    expected total from the first snapshot this evaluator sees it in (normally the first one
    evaluated): that evaluation holds by definition and says the baseline was set. Keeps that
    state, so use one evaluator per monitored system, from one thread.
    """

    def __init__(self, expected_totals: Mapping[str, int] | None = None, plugins: Sequence[UserPredicate] = ()) -> None:
        self._expected: dict[str, int] = dict(expected_totals or {})
        self._plugins = tuple(plugins)
        #: The wait-for graph and deadlock found by the latest evaluation (for graphs and metrics).
        self.last_wait_for: WaitFor | None = None
        self.last_deadlock: Deadlock | None = None

    @property
    def expected_totals(self) -> dict[str, int]:
        """The expected total of every counter so far, configured or baseline (a copy)."""
        return dict(self._expected)

    def evaluate(self, snapshot: GlobalSnapshot) -> list[PredicateResult]:
        """Return the results for `snapshot`, in the order: deadlock, termination, conservation by
        counter name, plugins in the order given. User predicates never raise (see :mod:`.plugins`).
        """
        holdings = counter_holdings(snapshot)
        new = {name for name in holdings if name not in self._expected}
        for name in new:
            self._expected[name] = sum(h.amount for h in holdings[name])
        self.last_wait_for = build_wait_for(snapshot)
        self.last_deadlock = find_deadlock(self.last_wait_for)
        results = [deadlock_result(self.last_wait_for, self.last_deadlock), termination(snapshot)]
        results += _conservation_results(holdings, self._expected, new)
        results += [predicate(snapshot) for predicate in self._plugins]
        return results
