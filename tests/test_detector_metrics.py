"""The detector's predicate gauges read each result through the one verdict rule."""

from __future__ import annotations

import itertools

import pytest

from stablewatch.detector.evaluation import Verdict
from stablewatch.detector.service.metrics import DetectorMetrics
from stablewatch.v1 import ConservationEvidence, PredicateResult


def publish(metrics: DetectorMetrics, *results: PredicateResult) -> None:
    """Publish one completed snapshot whose evaluation holds `results`."""
    metrics.completed(0.01)
    metrics.latest(1, results, 1.0, 0, 0)


def sample(metrics: DetectorMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


@pytest.mark.parametrize(
    ("holds", "unknown", "error"), list(itertools.product((False, True), (False, True), ("", "ValueError: boom")))
)
def test_value_is_one_only_when_true_and_unknown_only_when_unknown(holds: bool, unknown: bool, error: str) -> None:
    metrics = DetectorMetrics()
    publish(metrics, PredicateResult(name="p", holds=holds, unknown=unknown, error=error))
    word = Verdict.of_fields(holds, unknown, error)
    assert sample(metrics, "stablewatch_predicate_value", predicate="p") == (1 if word is Verdict.TRUE else 0)
    assert sample(metrics, "stablewatch_predicate_unknown", predicate="p") == (1 if word is Verdict.UNKNOWN else 0)


def test_a_conservation_result_that_says_unknown_withdraws_its_numbers() -> None:
    metrics = DetectorMetrics()
    evidence = ConservationEvidence(counter="tokens", expected=10, observed=9, drift=-1)
    publish(metrics, PredicateResult(name="conservation(tokens)", holds=False, conservation=evidence))
    assert sample(metrics, "stablewatch_conservation_drift", counter="tokens") == -1
    assert sample(metrics, "stablewatch_counter_total", counter="tokens") == 9
    failed = PredicateResult(name="conservation(tokens)", holds=False, error="boom", conservation=evidence)
    publish(metrics, failed)  # an error, with unknown unset, is still unknown: no stale numbers
    assert sample(metrics, "stablewatch_conservation_drift", counter="tokens") is None
    assert sample(metrics, "stablewatch_counter_total", counter="tokens") is None
