"""The pipeline's ``evaluate`` gives the detector's results, snapshot by snapshot, on a real local Spark.

The archive holds 260 generated snapshots (AND and OR waits, tasks, flow control, in-flight
messages that do and do not wake, acknowledgements in transit or not, counters on processes and
channels, open and closed cuts),
some aborted and some archived without their blob. The detector's side is the shared
``evaluate`` called in the order the snapshots finished, keeping baselines as the detector does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from google.protobuf import json_format
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from snapshot_gen import Archived, detector_evaluations, random_archive, write_archive

from stablewatch.detector.evaluation import load_predicate
from stablewatch.pipeline import cli
from stablewatch.pipeline.defaults import Reduction
from stablewatch.pipeline.evaluate import (
    EVALUATIONS,
    PLAIN_COLUMNS,
    Evaluated,
    _in_background,
    evaluate_archive,
    write_evaluations,
)
from stablewatch.pipeline.tables import Archive, open_archive
from stablewatch.v1 import Evaluation, PredicateResult

pytestmark = pytest.mark.timeout(900)

COUNT = 260
BLOBLESS = set(range(7, COUNT + 1, 11))  # archived as rows only: rebuilt and reduced on DataFrames
# ... and these too: snapshots whose deadlock the acknowledgement rule decides (an acknowledgement
# in transit releases a flow-control wait that would otherwise close a cycle).
BLOBLESS |= {89, 169}


@pytest.fixture(scope="module")
def items() -> list[Archived]:
    return random_archive(seed=418, count=COUNT, aborted_every=19)


@pytest.fixture(scope="module")
def archive_dir(items: list[Archived], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_archive(tmp_path_factory.mktemp("archive"), items, batch_size=30, blobless=BLOBLESS)


@pytest.fixture(scope="module")
def archive(spark: SparkSession, archive_dir: Path) -> Archive:
    return open_archive(spark, archive_dir)


def evaluated_rows(evaluated: Evaluated) -> dict[tuple[int, int], dict[str, Any]]:
    rows = evaluated.evaluations.toArrow().cast(EVALUATIONS).to_pylist()
    keyed = {(row["snapshot_id"], row["position"]): row for row in rows}
    assert len(keyed) == len(rows), "a result appears twice"
    return keyed


def expected_results(evaluations: Mapping[int, Evaluation]) -> Iterator[tuple[tuple[int, int], PredicateResult]]:
    for sid, evaluation in evaluations.items():
        for position, result in enumerate(evaluation.results):
            yield (sid, position), result


def assert_same_results(rows: dict[tuple[int, int], dict[str, Any]], evaluations: Mapping[int, Evaluation]) -> None:
    """Every result of the detector is in `rows`, byte for byte, with its columns; nothing else is."""
    expected = dict(expected_results(evaluations))
    assert rows.keys() == expected.keys()
    for key, result in expected.items():
        row = rows[key]
        assert row["result"] == result.SerializeToString(deterministic=True), (key, row["summary"], result.summary)
        kind = result.WhichOneof("evidence")
        evidence = json_format.MessageToDict(getattr(result, kind), preserving_proto_field_name=True) if kind else None
        assert (json.loads(row["evidence"]) if row["evidence"] else None) == evidence, key
        assert (row["name"], row["holds"], row["unknown"], row["summary"], row["error"]) == (
            result.name,
            result.holds,
            result.unknown,
            result.summary,
            result.error,
        )
        assert row["missing_processes"] == list(result.missing_processes)


def test_generated_archive_covers_what_the_rules_distinguish(items: list[Archived]) -> None:
    """The archive exercises every case the equivalence below is about (a check on the generator)."""
    evaluations = detector_evaluations(items)
    assert len(evaluations) >= 200
    verdicts = {(r.name, r.holds, r.unknown) for e in evaluations.values() for r in e.results}
    for name in ("deadlock", "termination", "conservation(tokens)"):
        assert {(name, True, False), (name, False, False), (name, False, True)} <= verdicts, name
    edges = [edge for e in evaluations.values() for edge in e.wait_for.edges]
    assert any(edge.discounted for edge in edges) and any(edge.flow_control for edge in edges)
    assert {edge.model for edge in edges} == {1, 2}  # AND (unspecified counts as AND) and OR
    assert any(edge.waiter.task for edge in edges)
    assert any("[wait " in edge.target.task for edge in edges)  # several waits of one waiter, not all AND
    deadlocks = [e.results[0].deadlock for e in evaluations.values() if e.results[0].holds]
    assert any(d.knot for d in deadlocks) and any(d.empty_channels for d in deadlocks)
    assert any(d.separate_deadlocks > 1 for d in deadlocks)
    assert sum(1 for e in evaluations.values() if any(r.conservation.baseline for r in e.results)) >= 2


def test_every_result_is_the_detectors(archive: Archive, items: list[Archived]) -> None:
    evaluated = evaluate_archive(archive)
    assert (evaluated.snapshots, evaluated.aborted) == (COUNT - COUNT // 19, COUNT // 19)
    assert evaluated.large == len(BLOBLESS - {i for i in BLOBLESS if i % 19 == 0})
    assert_same_results(evaluated_rows(evaluated), detector_evaluations(items))


def test_configured_totals_give_the_detectors_results(archive: Archive, items: list[Archived]) -> None:
    expected = {"tokens": 60, "gone": 5}  # "gone" is never seen: its whole total is missing
    evaluated = evaluate_archive(archive, expected)
    assert_same_results(evaluated_rows(evaluated), detector_evaluations(items, expected))


@pytest.mark.parametrize("max_rounds", [0, 3])
def test_the_dataframe_reduction_gives_the_same_results(
    archive: Archive, items: list[Archived], max_rounds: int
) -> None:
    """Every snapshot through the reduction (each has wait edges): none, or a few, rounds on DataFrames,
    the rest by the shared function."""
    reduction = Reduction(reduce_above=0, max_rounds=max_rounds, finish_edges=0)
    evaluated = evaluate_archive(archive, reduction=reduction)
    assert evaluated.large == evaluated.snapshots
    assert evaluated.rounds == max_rounds  # the generated graphs need more rounds than that to settle
    assert_same_results(evaluated_rows(evaluated), detector_evaluations(items))


def test_a_range_of_ids_and_days(spark: SparkSession, archive_dir: Path) -> None:
    second_day = open_archive(spark, archive_dir, first_day="2026-03-02", last_day="2026-03-02")
    ids = {sid for sid, _ in evaluated_rows(evaluate_archive(second_day, first_id=5, last_id=15))}
    assert ids == set(range(10, 16))  # snapshot n starts at 23:50 + n minutes: the second day from id 10


def test_user_predicates_run_as_in_the_detector(spark: SparkSession, archive: Archive, items: list[Archived]) -> None:
    spark.sparkContext.addPyFile(str(Path(__file__).with_name("pipeline_plugin.py")))
    spec = "pipeline_plugin:queues_short"
    rows = evaluated_rows(evaluate_archive(archive, predicates=[spec]))
    expected = detector_evaluations(items, plugins=[load_predicate(spec)])
    plugin_rows = {key: row for key, row in rows.items() if row["name"] == "queues_short"}
    assert len(plugin_rows) == len(expected)
    for (sid, _), row in plugin_rows.items():
        if sid in BLOBLESS:  # a snapshot too large for one worker is never handed whole to user code
            assert row["unknown"] and "too large" in row["error"]
        else:
            assert row["result"] == expected[sid].results[-1].SerializeToString(deterministic=True)
    assert {row["holds"] for row in plugin_rows.values()} == {True, False}
    builtins = {key: row for key, row in rows.items() if key not in plugin_rows}
    assert_same_results(builtins, {sid: detector_evaluations(items)[sid] for sid in expected})


def test_the_command_writes_parquet_and_a_summary(
    spark: SparkSession, archive_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = cli.main(["evaluate", "--archive", str(archive_dir), "--out", str(tmp_path), "--json", "--to-id", "40"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert status == 0
    assert printed["snapshots"] == 40 - 2  # 19 and 38 aborted
    assert [p["name"] for p in printed["predicates"]][:2] == ["deadlock", "termination"]
    table = pq.read_table(tmp_path / "evaluations")
    assert set(EVALUATIONS.names) <= set(table.column_names)
    assert len(set(table.column("snapshot_id").to_pylist())) == 38
    assert sum(p["true"] + p["false"] + p["unknown"] for p in printed["predicates"]) == table.num_rows


def test_the_command_stops_the_rounds_at_min_release(
    spark: SparkSession, archive_dir: Path, items: list[Archived], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--min-release 1`` stops after the first round (none removes every edge of these graphs), and
    the shared function finishes what is left with the detector's results; a fraction above 1 is refused."""
    flags = ["--reduce-above", "0", "--finish-edges", "0", "--max-rounds", "8", "--to-id", "40", "--json"]
    status = cli.main(["evaluate", "--archive", str(archive_dir), "--out", str(tmp_path), *flags, "--min-release", "1"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert status == 0 and printed["rounds"] == 1
    rows = {(row["snapshot_id"], row["position"]): row for row in pq.read_table(tmp_path / "evaluations").to_pylist()}
    expected = {sid: e for sid, e in detector_evaluations(items).items() if sid <= 40}
    assert_same_results(rows, expected)

    with pytest.raises(SystemExit) as exited:
        cli.main(["evaluate", "--archive", str(archive_dir), "--out", str(tmp_path), "--min-release", "1.5"])
    assert exited.value.code == 2
    assert "--min-release: must be from 0 to 1, not 1.5" in capsys.readouterr().err


_DICTIONARY = {"PLAIN_DICTIONARY", "RLE_DICTIONARY"}


def dictionary_columns(out: Path) -> dict[str, list[bool]]:
    """Per column, whether each column chunk of the Parquet files under `out` (in file order) has a dictionary."""
    found: dict[str, list[bool]] = {}
    for path in sorted(out.glob("day=*/*.parquet")):
        metadata = pq.ParquetFile(path).metadata
        for group in range(metadata.num_row_groups):
            for i in range(metadata.num_columns):
                column = metadata.row_group(group).column(i)
                encoded = column.has_dictionary_page or bool(_DICTIONARY & set(column.encodings))
                found.setdefault(column.path_in_schema, []).append(encoded)
    return found


def test_evidence_and_results_are_written_without_a_dictionary(archive: Archive, tmp_path: Path) -> None:
    """Nearly every value of ``evidence`` and ``result`` differs: they are written plain, while the other
    columns keep Parquet's dictionary wherever Spark's default write uses one, on the same rows."""
    rows = evaluate_archive(archive, last_id=60).evaluations.localCheckpoint()
    write_evaluations(rows, tmp_path / "written", archive)
    rows.write.partitionBy("day").parquet(str(tmp_path / "default"))
    written, default = dictionary_columns(tmp_path / "written"), dictionary_columns(tmp_path / "default")
    assert set(PLAIN_COLUMNS) == {"evidence", "result"}
    for name in PLAIN_COLUMNS:
        assert any(default[name]), name  # these rows would get one: the option is what removes it
        assert not any(written[name]), name
    assert {k: v for k, v in written.items() if k not in PLAIN_COLUMNS} == {
        k: v for k, v in default.items() if k not in PLAIN_COLUMNS
    }
    assert any(written["name"])


def test_a_job_run_meanwhile_reports_in_the_callers_thread(spark: SparkSession, archive: Archive) -> None:
    """The outcome count runs in a thread while the driver reads the large snapshots: it has the
    caller's local properties (pinned-thread mode), and its failure is raised by the caller, inside
    ``Archive.reading`` as if the job had run there."""
    context = spark.sparkContext
    context.setLocalProperty("stablewatch.test", "caller")
    try:
        assert _in_background(spark, lambda: context.getLocalProperty("stablewatch.test")).result() == "caller"
    finally:
        context.setLocalProperty("stablewatch.test", None)  # type: ignore[arg-type]  # None removes it
    failing = _in_background(spark, lambda: spark.range(1).select(F.raise_error(F.lit("no count"))).first())
    with pytest.raises(PySparkException, match="no count"), archive.reading():
        failing.result()
