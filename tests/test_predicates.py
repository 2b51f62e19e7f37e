"""Built-in predicates and the one evaluation function on hand-built (closed) global snapshots."""

from collections.abc import Mapping

import pytest
from samples import proc

from stablewatch.detector.evaluation import built_in_results, evaluate, new_baselines
from stablewatch.detector.evaluation.plugins import UserPredicate
from stablewatch.detector.evaluation.predicates import (
    conservation,
    counter_holdings,
    deadlock,
    termination,
)
from stablewatch.detector.evaluation.waitfor import build_wait_for, find_deadlock, wait_counts
from stablewatch.v1 import (
    ChannelSnapshot,
    GlobalSnapshot,
    ProcessSnapshot,
    RecordedMessage,
)


def msg(no_wake: bool = False, **counters: int) -> RecordedMessage:
    return RecordedMessage(payload=b"m", no_wake=no_wake, counters=counters)


def chan(src: str, dst: str, *messages: RecordedMessage) -> ChannelSnapshot:
    return ChannelSnapshot(src=src, dst=dst, sent_before_marker=len(messages), messages=messages)


def snapshot(*processes: ProcessSnapshot, channels: tuple[ChannelSnapshot, ...] = ()) -> GlobalSnapshot:
    return GlobalSnapshot(snapshot_id=1, processes=processes, channels=channels)


def by_name(results: list) -> dict:
    return {r.name: r for r in results}


# --- deadlock ---------------------------------------------------------------------------------


def test_deadlock_result() -> None:
    result = deadlock(snapshot(proc("P1", "P2"), proc("P2", "P3"), proc("P3", "P1"), proc("P4", "P1")))
    assert result.name == "deadlock"
    assert result.holds
    assert result.summary == "4 nodes deadlocked: cycle P1 -> P2 -> P3 -> P1"
    assert result.WhichOneof("evidence") == "deadlock"
    assert [n.process for n in result.deadlock.deadlocked] == ["P1", "P2", "P3", "P4"]
    assert [n.process for n in result.deadlock.cycle] == ["P1", "P2", "P3"]
    assert [(c.src, c.dst) for c in result.deadlock.empty_channels] == [
        ("P2", "P1"),
        ("P3", "P2"),
        ("P1", "P3"),
    ]


def test_no_deadlock_result() -> None:
    s = snapshot(proc("P1", "P2"), proc("P2", "P1"), channels=(chan("P2", "P1", msg()),))
    result = deadlock(s)
    assert not result.holds
    assert result.summary == "no deadlock: 2 waiters, 1 wait edge, 1 discounted by messages in flight"
    assert result.WhichOneof("evidence") == "deadlock"
    assert not result.deadlock.deadlocked


def test_long_cycle_summary_is_abbreviated() -> None:
    n = 50
    result = deadlock(snapshot(*(proc(f"P{i:02}", f"P{(i + 1) % n:02}") for i in range(n))))
    assert result.summary == "50 nodes deadlocked: cycle P00 -> P01 -> P02 -> P03 -> P04 -> ... (45 more) -> P00"


# --- termination ------------------------------------------------------------------------------


def test_terminated() -> None:
    result = termination(snapshot(proc("P1"), proc("P2"), channels=(chan("P1", "P2"),)))
    assert result.name == "termination"
    assert result.holds
    assert result.summary == "terminated: 2 processes passive, nothing in flight"
    assert result.WhichOneof("evidence") == "termination"


def test_message_in_flight_prevents_termination() -> None:
    result = termination(snapshot(proc("P1"), proc("P2"), channels=(chan("P1", "P2", msg(True), msg()),)))
    assert not result.holds
    assert [(c.src, c.dst) for c in result.termination.busy_channels] == [("P1", "P2")]
    assert result.summary == "not terminated: 1 channel with waking messages (P1 -> P2)"


def test_heartbeats_in_flight_do_not_prevent_termination() -> None:
    assert termination(snapshot(proc("P1"), proc("P2"), channels=(chan("P1", "P2", msg(True)),))).holds


def test_active_processes_prevent_termination() -> None:
    result = termination(snapshot(proc("P2", active=True), proc("P1", active=True), proc("P3")))
    assert not result.holds
    assert list(result.termination.active_processes) == ["P1", "P2"]
    assert result.summary == "not terminated: 2 active (P1, P2)"


# --- conservation -----------------------------------------------------------------------------


def bank(p1: int, p2: int, in_flight: int, **extra: int) -> GlobalSnapshot:
    return snapshot(
        proc("P2", tokens=p2),
        proc("P1", tokens=p1, **extra),
        channels=(chan("P1", "P2", msg(tokens=in_flight), msg(True, tokens=1)), chan("P2", "P1")),
    )


def test_counter_holdings() -> None:
    holdings = counter_holdings(bank(5, 0, 3, credits=0))
    assert set(holdings) == {"tokens", "credits"}
    assert holdings["credits"] == []
    where = [(h.process, h.channel.src, h.channel.dst, h.amount) for h in holdings["tokens"]]
    assert where == [("P1", "", "", 5), ("", "P1", "P2", 4)]


def test_conservation_with_configured_total() -> None:
    (result,) = conservation(bank(5, 2, 3), {"tokens": 11})
    assert result.name == "conservation(tokens)"
    assert result.holds
    assert result.summary == "tokens: 11 as expected"
    assert (result.conservation.expected, result.conservation.observed, result.conservation.drift) == (
        11,
        11,
        0,
    )


def test_conservation_drift_reports_holdings() -> None:
    (result,) = conservation(bank(5, 0, 3), {"tokens": 11})
    assert not result.holds
    evidence = result.conservation
    assert (evidence.counter, evidence.expected, evidence.observed, evidence.drift) == ("tokens", 11, 9, -2)
    assert [(h.process or f"{h.channel.src}->{h.channel.dst}", h.amount) for h in evidence.holdings] == [
        ("P1", 5),
        ("P1->P2", 4),
    ]
    assert result.summary == "tokens: observed 9, expected 11 (drift -2); held by P1 5, P1 -> P2 4"


def test_configured_counter_that_vanished_is_reported() -> None:
    results = conservation(bank(1, 1, 1), {"tokens": 4, "gold": 10})
    assert [(r.name, r.holds, r.conservation.drift) for r in results] == [
        ("conservation(gold)", False, -10),
        ("conservation(tokens)", True, 0),
    ]


def test_a_counter_without_an_expected_total_takes_a_baseline() -> None:
    (result,) = conservation(bank(1, 1, 1), {})
    assert result.holds and result.conservation.baseline
    assert result.conservation.expected == 4  # 1 + 1 held, 2 in flight


def _run(snapshots: list[GlobalSnapshot], totals: Mapping[str, int] | None = None) -> list[dict]:
    """Evaluate in order, carrying baselines forward as the detector does."""
    expected = dict(totals or {})
    out = []
    for s in snapshots:
        evaluation = evaluate(s, expected)
        expected.update(new_baselines(evaluation))
        out.append(by_name(evaluation.results))
    return out


def test_evaluation_takes_the_baseline_from_the_first_snapshot() -> None:
    first, steady, lost = _run([bank(5, 2, 3), bank(0, 10, 0), bank(0, 7, 0)])
    assert first["conservation(tokens)"].holds
    assert first["conservation(tokens)"].summary == "tokens: baseline set to 11"
    assert steady["conservation(tokens)"].holds
    assert not lost["conservation(tokens)"].holds
    assert lost["conservation(tokens)"].conservation.drift == -3


def test_configured_totals_and_late_counters() -> None:
    first, later = _run([bank(5, 2, 3), bank(5, 2, 4, credits=3)], {"tokens": 12})
    assert first["conservation(tokens)"].conservation.drift == -1
    # A counter first seen later gets its baseline then.
    assert later["conservation(tokens)"].holds
    assert later["conservation(credits)"].summary == "credits: baseline set to 3"
    assert new_baselines(evaluate(bank(5, 2, 4, credits=3), {"tokens": 12})) == {"credits": 3}


def test_evaluation_order_and_plugins() -> None:
    def explode(snapshot: GlobalSnapshot) -> bool:
        raise RuntimeError("boom")

    plugins = [UserPredicate("explode", explode), UserPredicate("two", lambda s: len(s.processes) == 2)]
    results = list(evaluate(bank(1, 1, 1, credits=2), plugins=plugins).results)
    assert [r.name for r in results] == [
        "deadlock",
        "termination",
        "conservation(credits)",
        "conservation(tokens)",
        "explode",
        "two",
    ]
    assert not results[4].holds and results[4].unknown
    assert results[4].error == "RuntimeError: boom"
    assert results[5].holds


@pytest.mark.parametrize(
    "whole",
    [
        snapshot(proc("P1", "P2"), proc("P2", "P1", tokens=3), proc("P3", "P1")),  # a deadlock
        snapshot(proc("P1", "P2"), proc("P2", "P1"), channels=(chan("P2", "P1", msg(tokens=1)),)),  # discounted
        snapshot(proc("P1", "P9"), proc("P2", "P1", active=True)),  # an open cut: P9 only named by a wait
        GlobalSnapshot(snapshot_id=1, processes=[proc("P1", "P2"), proc("P2", active=True)], outside_peers=["c"]),
    ],
    ids=["deadlock", "discounted", "open", "open-decided"],
)
def test_built_in_results_from_the_graphs_pieces_are_evaluates(whole: GlobalSnapshot) -> None:
    """What the pipeline does for a snapshot too large for one worker: the graph's evidence and size,
    and the snapshot without its waits (the processes they name kept), give evaluate's results."""
    wf = build_wait_for(whole)
    light = GlobalSnapshot()
    light.CopyFrom(whole)
    for process in light.processes:
        del process.state.waits[:]
    light.outside_peers.extend(sorted({t.process for p in whole.processes for w in p.state.waits for t in w.targets}))
    results = built_in_results(light, find_deadlock(wf), wait_counts(wf), {"tokens": 3})
    assert results == list(evaluate(whole, {"tokens": 3}).results)
