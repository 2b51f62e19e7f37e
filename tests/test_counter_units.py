"""From a review (read only) of the predicates: counter totals past 64 bits.

Each amount a part reports is a 64-bit integer, but their sums were not: two processes holding
2**62 each made the evaluation raise (``observed`` out of range) after the cut was complete, and
the detector lost the snapshot without a word; the archive's channel sums and the pipeline's Spark
sums would overflow too. The assembler now counts each counter's units in the cut (amounts by
magnitude, in states and on recorded messages) and gives the snapshot up, saying why, when they add
up past ``MAX_COUNTER_UNITS`` (2**62 - 1): every total, channel sum and drift from an expected total
(also bounded) then stays a 64-bit integer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_assembly import SNAPSHOT, channel_part, message, started, state_part

from stablewatch.cli.main import main
from stablewatch.detector.assembly import Completed, PartRejected
from stablewatch.detector.evaluation import evaluate, result_named, verdict
from stablewatch.detector.evaluation.predicates import expected_total
from stablewatch.detector.service.detector import DetectorConfig
from stablewatch.v1.bounds import MAX_COUNTER_UNITS


def test_units_past_the_bound_give_the_snapshot_up_with_the_reason() -> None:
    assembler = started()
    assert assembler.add_part(state_part("a", {"b": 0}, tokens=2**61), sender="a") is None
    with pytest.raises(PartRejected) as rejected:
        assembler.add_part(state_part("b", {"a": 0}, tokens=-(2**62)), sender="b")  # by magnitude: 3 * 2**61
    assert rejected.value.reason == "too_many_units"
    assert str(rejected.value) == (
        f"too_many_units: part of snapshot {SNAPSHOT} from b: the units of counter 'tokens' in snapshot {SNAPSHOT} "
        f"add up to {3 * 2**61} (amounts by magnitude), past the {MAX_COUNTER_UNITS} a total is counted in"
    )
    aborted = rejected.value.aborted
    assert aborted is not None and aborted.reason == str(rejected.value).removeprefix("too_many_units: ")
    assert assembler.running == []


def test_units_on_recorded_messages_count_too() -> None:
    assembler = started()
    assembler.add_part(state_part("a", {"b": 2}, tokens=1), sender="a")
    assembler.add_part(state_part("b", {"a": 0}, tokens=1), sender="b")
    big = message(b"x", tokens=2**61, receive_index=1)
    with pytest.raises(PartRejected, match="too_many_units"):
        assembler.add_part(channel_part("b", "a", 0, [big, big]), sender="b")


def test_units_up_to_the_bound_are_evaluated() -> None:
    assembler = started()
    assembler.add_part(state_part("a", {"b": 1}, tokens=2**61), sender="a")
    assembler.add_part(state_part("b", {"a": 0}, tokens=2**60), sender="b")
    assembler.add_part(channel_part("a", "b", 0, []), sender="a")
    last = channel_part("b", "a", 0, [message(b"x", tokens=2**60 - 1, receive_index=1)])
    done = assembler.add_part(last, sender="b")
    assert isinstance(done, Completed)
    total = 2**61 + 2**60 + 2**60 - 1
    assert total == MAX_COUNTER_UNITS
    conservation = result_named(evaluate(done.snapshot, {"tokens": -MAX_COUNTER_UNITS}), "conservation(tokens)")
    assert conservation is not None and verdict(conservation) == "false"
    assert conservation.conservation.drift == 2 * MAX_COUNTER_UNITS  # still a 64-bit integer


def test_an_expected_total_past_the_bound_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert expected_total(f"tokens={MAX_COUNTER_UNITS}") == ("tokens", MAX_COUNTER_UNITS)
    with pytest.raises(ValueError, match=r"the total of tokens must be within ±4611686018427387903, not -4611"):
        expected_total(f"tokens={-MAX_COUNTER_UNITS - 1}")
    with pytest.raises(SystemExit) as exited:
        main(["detector", "--expect", f"tokens={2**63}"])
    assert exited.value.code == 2
    assert f"the total of tokens must be within ±{MAX_COUNTER_UNITS}, not {2**63}" in capsys.readouterr().err


def test_an_expected_total_past_the_bound_is_refused_through_the_library(tmp_path: Path) -> None:
    # From a review (read only) of the first version, which held the command line's --expect only.
    with pytest.raises(ValueError, match=r"the total of tokens must be within ±4611686018427387903, not -4611"):
        DetectorConfig(data_dir=tmp_path, expected_totals={"tokens": -MAX_COUNTER_UNITS - 1})
    DetectorConfig(data_dir=tmp_path, expected_totals={"tokens": -MAX_COUNTER_UNITS})
