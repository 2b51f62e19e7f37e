"""What a cut may claim: whole-system predicates are unknown on an open cut, never true.

DESIGN.md, "A cut covers the whole system, or it proves less".
"""

from __future__ import annotations

from samples import proc

from stablewatch.detector.evaluation import coverage, evaluate, new_baselines, verdict
from stablewatch.detector.evaluation.cut import describe_missing
from stablewatch.v1 import (
    WAIT_MODEL_OR,
    ChannelSnapshot,
    Evaluation,
    GlobalSnapshot,
    RecordedMessage,
)


def verdicts(evaluation: Evaluation) -> dict[str, str]:
    return {r.name: verdict(r) for r in evaluation.results}


def test_a_closed_cut_decides_everything() -> None:
    s = GlobalSnapshot(snapshot_id=1, processes=[proc("A", tokens=2), proc("B", tokens=3)], expected_members=["A", "B"])
    assert coverage(s).closed
    assert verdicts(evaluate(s, {"tokens": 5})) == {
        "deadlock": "false",
        "termination": "true",
        "conservation(tokens)": "true",
    }


def test_an_expected_member_missing_makes_termination_and_conservation_unknown() -> None:
    # The worker W is still working, but its control stream is down: it is not in the cut.
    s = GlobalSnapshot(
        snapshot_id=1, processes=[proc("A", tokens=2), proc("B", tokens=3)], expected_members=["A", "B", "W"]
    )
    cut = coverage(s)
    assert not cut.closed and list(cut.missing_processes) == ["W"]
    evaluation = evaluate(s, {"tokens": 10})
    assert verdicts(evaluation) == {
        "deadlock": "unknown",
        "termination": "unknown",
        "conservation(tokens)": "unknown",
    }
    termination = evaluation.results[1]
    assert list(termination.missing_processes) == ["W"]
    assert "1 process missing from the cut (W)" in termination.summary
    assert not termination.holds


def test_a_process_named_only_by_a_channel_or_a_wait_opens_the_cut() -> None:
    by_channel = GlobalSnapshot(snapshot_id=1, processes=[proc("A"), proc("B")], outside_peers=["client"])
    by_wait = GlobalSnapshot(snapshot_id=1, processes=[proc("A", "db"), proc("B")])
    for s, missing in ((by_channel, ["client"]), (by_wait, ["db"])):
        assert list(coverage(s).missing_processes) == missing
        assert verdicts(evaluate(s))["termination"] == "unknown"


def test_an_expected_count_opens_the_cut_until_enough_processes_report() -> None:
    s = GlobalSnapshot(snapshot_id=1, processes=[proc("A"), proc("B")], expected_member_count=3)
    cut = coverage(s)
    assert not cut.closed and cut.missing_unnamed == 1
    assert describe_missing(cut) == "1 more expected process did not report"
    s.expected_member_count = 2
    assert coverage(s).closed


def test_activity_is_a_fact_on_any_cut() -> None:
    s = GlobalSnapshot(snapshot_id=1, processes=[proc("A", active=True)], expected_members=["A", "W"])
    assert verdicts(evaluate(s))["termination"] == "false"
    busy = GlobalSnapshot(
        snapshot_id=1,
        processes=[proc("A"), proc("B")],
        channels=[ChannelSnapshot(src="A", dst="B", sent_before_marker=1, messages=[RecordedMessage(payload=b"go")])],
        expected_members=["A", "B", "W"],
    )
    assert verdicts(evaluate(busy))["termination"] == "false"


def test_a_deadlock_among_members_is_real_on_an_open_cut() -> None:
    s = GlobalSnapshot(snapshot_id=1, processes=[proc("A", "B"), proc("B", "A")], expected_members=["A", "B", "W"])
    result = evaluate(s).results[0]
    assert verdict(result) == "true"
    assert [n.process for n in result.deadlock.cycle] == ["A", "B"]


def test_an_or_wait_on_a_process_outside_the_cut_is_never_blocked() -> None:
    # A needs B or X; B needs A; X is outside the cut and may well answer.
    s = GlobalSnapshot(snapshot_id=1, processes=[proc("A", "B", "X", model=WAIT_MODEL_OR), proc("B", "A")])
    result = evaluate(s).results[0]
    assert not result.deadlock.deadlocked
    assert verdict(result) == "unknown"  # no deadlock among members; X itself is not observed


def test_a_baseline_is_taken_only_from_a_closed_cut() -> None:
    partial = GlobalSnapshot(snapshot_id=1, processes=[proc("A", tokens=2)], expected_members=["A", "B"])
    evaluation = evaluate(partial)
    assert verdicts(evaluation)["conservation(tokens)"] == "unknown"
    assert new_baselines(evaluation) == {}
    whole = GlobalSnapshot(snapshot_id=2, processes=[proc("A", tokens=2), proc("B", tokens=3)])
    assert new_baselines(evaluate(whole)) == {"tokens": 5}
