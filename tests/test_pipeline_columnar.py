"""A large snapshot through the pipeline: read and evaluated whole in compact form, or reduced on
DataFrames until a round releases little and finished in compact form; either way the detector's
results, and the evidence's JSON exactly as protobuf's ``MessageToJson`` writes it.
"""

from __future__ import annotations

import json
import random
from datetime import timedelta
from pathlib import Path

import pytest
from google.protobuf import json_format
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql import SparkSession
from snapshot_gen import START, Archived, detector_evaluations, summary_of, write_archive

from stablewatch.pipeline.defaults import Reduction
from stablewatch.pipeline.evaluate import EVALUATIONS, evaluate_archive, evidence_json
from stablewatch.pipeline.reduce import reduce_wait_for
from stablewatch.pipeline.tables import open_archive
from stablewatch.v1 import (
    WAIT_MODEL_AND,
    WAIT_MODEL_OR,
    ChannelRef,
    ChannelSnapshot,
    CounterHolding,
    DeadlockEvidence,
    GlobalSnapshot,
    LocalState,
    PredicateResult,
    ProcessSnapshot,
    RecordedMessage,
    TerminationEvidence,
    Wait,
    WaitNode,
)

pytestmark = pytest.mark.timeout(900)

_NAMES = st.text(alphabet=st.sampled_from(["a", "Z", '"', "\\", "\n", "é", "\u2028", "💥", " ", "/"]), max_size=4)


@st.composite
def results(draw: st.DrawFn) -> PredicateResult:
    """A result with each kind of built-in evidence, names with quotes, escapes and non-ASCII."""
    result = PredicateResult(name="x")
    kind = draw(st.sampled_from(["deadlock", "conservation", "termination", "none"]))
    nodes = st.lists(st.builds(WaitNode, process=_NAMES, task=_NAMES), max_size=4)
    channels = st.lists(st.builds(ChannelRef, src=_NAMES, dst=_NAMES), max_size=3)
    if kind == "deadlock":
        result.deadlock.CopyFrom(
            DeadlockEvidence(
                deadlocked=draw(nodes),
                cycle=draw(nodes),
                knot=draw(nodes),
                empty_channels=draw(channels),
                separate_deadlocks=draw(st.integers(0, 2**32 - 1)),
            )
        )
    elif kind == "conservation":
        evidence = result.conservation
        evidence.SetInParent()
        evidence.counter = draw(_NAMES)
        evidence.expected, evidence.observed, evidence.drift = (
            draw(st.integers(-(2**63), 2**63 - 1)) for _ in range(3)
        )
        evidence.baseline = draw(st.booleans())
        for _ in range(draw(st.integers(0, 3))):
            holding = CounterHolding(amount=draw(st.integers(-(2**63), 2**63 - 1)), process=draw(_NAMES))
            if draw(st.booleans()):
                holding.channel.CopyFrom(ChannelRef(src=draw(_NAMES), dst=draw(_NAMES)))
            evidence.holdings.append(holding)
    elif kind == "termination":
        result.termination.CopyFrom(
            TerminationEvidence(active_processes=draw(st.lists(_NAMES, max_size=3)), busy_channels=draw(channels))
        )
    return result


@settings(max_examples=500, derandomize=True, deadline=None)
@given(results())
def test_evidence_json_is_message_to_json(result: PredicateResult) -> None:
    kind = result.WhichOneof("evidence")
    expected = (
        json_format.MessageToJson(getattr(result, kind), indent=None, preserving_proto_field_name=True, sort_keys=True)
        if kind
        else ""
    )
    assert evidence_json(result) == expected


def tangle(snapshot_id: int, n: int, seed: int) -> GlobalSnapshot:
    """`n` processes waiting at random (AND and OR, some on tasks), a chain into them, messages that
    wake some; most deadlocked, a few released round by round."""
    rng = random.Random(seed)
    pids = [f"p{i:04d}" for i in range(n)]
    snapshot = GlobalSnapshot(snapshot_id=snapshot_id, expected_members=pids)
    started = START + timedelta(minutes=snapshot_id)
    snapshot.started_at.FromDatetime(started)
    snapshot.completed_at.FromDatetime(started)
    for i, pid in enumerate(pids):
        state = LocalState(active=rng.random() < 0.05)
        if i >= n - 50:  # a chain, each on the next; the last on the tangle
            state.waits.append(Wait(targets=[WaitNode(process=pids[i + 1] if i + 1 < n else pids[0])]))
        elif rng.random() < 0.9:
            for _ in range(rng.choice([1, 1, 2])):
                model = WAIT_MODEL_OR if rng.random() < 0.3 else WAIT_MODEL_AND
                targets = [WaitNode(process=rng.choice(pids), task=rng.choice(["", "", "w"])) for _ in range(3)]
                state.waits.append(Wait(task=rng.choice(["", "", "w"]), model=model, targets=targets))
        state.counters["tokens"] = rng.randint(0, 3)
        snapshot.processes.append(ProcessSnapshot(process_id=pid, state=state))
    for _ in range(n // 10):
        src, dst = rng.sample(pids, 2)
        message = RecordedMessage(payload=b"m", wakes_task=rng.choice(["", "w"]))
        message.counters["tokens"] = 1
        snapshot.channels.append(ChannelSnapshot(src=src, dst=dst, sent_before_marker=1, messages=[message]))
    return snapshot


@pytest.fixture(scope="module")
def tangles() -> list[GlobalSnapshot]:
    return [tangle(1, 3_000, 1), tangle(2, 2_000, 2)]


@pytest.fixture(scope="module")
def archive_dir(tangles: list[GlobalSnapshot], tmp_path_factory: pytest.TempPathFactory) -> Path:
    items = [Archived(summary_of(s), s) for s in tangles]
    return write_archive(tmp_path_factory.mktemp("tangles"), items, batch_size=1, blobless={1, 2})


def rows_by_snapshot(evaluated_rows: list[dict]) -> dict[int, list[dict]]:
    by: dict[int, list[dict]] = {}
    for row in sorted(evaluated_rows, key=lambda r: (r["snapshot_id"], r["position"])):
        by.setdefault(row["snapshot_id"], []).append(row)
    return by


def detectors(tangles: list[GlobalSnapshot]) -> dict[int, list[PredicateResult]]:
    items = [Archived(summary_of(s), s) for s in tangles]
    return {sid: list(evaluation.results) for sid, evaluation in detector_evaluations(items).items()}


@pytest.mark.parametrize(
    "reduction",
    [
        Reduction(),  # read and evaluated whole, in compact form
        Reduction(finish_edges=0, max_rounds=50, min_release=0.2),  # rounds until one releases little
        Reduction(finish_edges=0, max_rounds=2),  # rounds up to the cap
    ],
    ids=["whole", "released-little", "capped"],
)
def test_large_snapshots_give_the_detectors_results(
    spark: SparkSession, archive_dir: Path, tangles: list[GlobalSnapshot], reduction: Reduction
) -> None:
    evaluated = evaluate_archive(open_archive(spark, archive_dir), reduction=reduction)
    assert evaluated.large == 2
    assert evaluated.reduced == (0 if reduction == Reduction() else 2)
    if reduction.min_release:
        assert 1 <= evaluated.rounds < 50  # stopped by a round that released little, not by the cap
    rows = rows_by_snapshot(evaluated.evaluations.toArrow().cast(EVALUATIONS).to_pylist())
    for sid, expected in detectors(tangles).items():
        assert [row["result"] for row in rows[sid]] == [r.SerializeToString(deterministic=True) for r in expected]
        for row, result in zip(rows[sid], expected, strict=True):
            kind = result.WhichOneof("evidence")
            assert json.loads(row["evidence"]) == json_format.MessageToDict(
                getattr(result, kind), preserving_proto_field_name=True
            )
            assert row["evidence"] == evidence_json(result)  # written from the values: the same text
    assert rows[1][0]["holds"]  # the tangle is deadlocked


def test_rounds_stop_when_one_releases_little(spark: SparkSession) -> None:
    """A 1 000-link chain releases one link per round: a round that releases under a tenth stops them."""
    edges = spark.createDataFrame([(i, i + 1, False) for i in range(1_000)], "waiter long, target long, is_or boolean")
    remaining, rounds = reduce_wait_for(edges, max_rounds=20, min_release=0.1)
    assert (rounds, remaining.count()) == (1, 999)
    remaining, rounds = reduce_wait_for(edges, max_rounds=20)
    assert (rounds, remaining.count()) == (20, 980)
