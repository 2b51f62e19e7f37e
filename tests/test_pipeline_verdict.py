"""The pipeline's verdict column says what :meth:`Verdict.of_fields` says, on every combination of fields."""

from __future__ import annotations

import itertools

import pytest
from pyspark.sql import SparkSession

from stablewatch.detector.evaluation import Verdict
from stablewatch.pipeline.verdict import verdict

pytestmark = pytest.mark.timeout(600)

Fields = tuple[bool | None, bool | None, str | None]


def spark_verdicts(spark: SparkSession, rows: list[Fields]) -> list[tuple[Fields, str]]:
    """Each row of result fields ``(holds, unknown, error)`` with the word the column gives it, in a real Spark."""
    frame = spark.createDataFrame(rows, "holds boolean, unknown boolean, error string")
    return [((r[0], r[1], r[2]), r[3]) for r in frame.select("*", verdict()).collect()]


def test_the_column_agrees_with_verdict_of_fields_on_all_eight_combinations(spark: SparkSession) -> None:
    rows = list(itertools.product((False, True), (False, True), ("", "ZeroDivisionError: division by zero")))
    got = spark_verdicts(spark, rows)
    assert sorted(fields for fields, _ in got) == sorted(rows)
    assert [word for _, word in got] == [Verdict.of_fields(*fields) for fields, _ in got]
    assert {word for _, word in got} == {"true", "false", "unknown"}


def test_a_null_counts_as_none_does(spark: SparkSession) -> None:
    rows: list[Fields] = [
        (None, None, None),
        (True, None, None),
        (True, False, None),
        (None, True, None),
        (True, None, "x"),
    ]
    got = spark_verdicts(spark, rows)
    assert [word for _, word in got] == [Verdict.of_fields(*fields) for fields, _ in got]
    assert [word for _, word in got] == ["false", "true", "true", "unknown", "unknown"]
