"""The CLI's rendering: one vocabulary for a result (true, false, unknown), and the demo's summary."""

from __future__ import annotations

import re

import pytest
from rich.console import Console

from stablewatch.cli.demo import demo_summary
from stablewatch.cli.live_demo import DemoReport
from stablewatch.cli.render import members_table, predicate_table, snapshot_report, verdict_text
from stablewatch.v1 import GlobalSnapshot, PredicateResult
from stablewatch.v1.query_pb2 import Member

RESULTS = [
    PredicateResult(name="deadlock", holds=True, summary="cycle A -> B -> A"),
    PredicateResult(name="termination", holds=False, summary="A is active"),
    PredicateResult(name="conservation(tokens)", unknown=True, summary="B is missing"),
    PredicateResult(name="mine", unknown=True, error="ZeroDivisionError: division by zero"),
]


def _text(renderable: object) -> str:
    console = Console(record=True, width=240, color_system=None)
    console.print(renderable)
    return console.export_text()


def _value_column(text: str) -> dict[str, str]:
    """Predicate name -> the word in the value column of a predicate table."""
    rows = (re.split(r"\s*│\s*", line.strip("│ ")) for line in text.splitlines() if line.startswith("│"))
    return {cells[0]: cells[1] for cells in rows if len(cells) >= 2 and cells[0] != "predicate"}


def test_a_predicate_table_says_true_false_or_unknown() -> None:
    text = _text(predicate_table(RESULTS))
    assert _value_column(text) == {
        "deadlock": "true",
        "termination": "false",
        "conservation(tokens)": "unknown",
        "mine": "unknown",  # a failed user predicate proves nothing either way; its error is the summary
    }
    assert "ZeroDivisionError: division by zero" in text
    assert not re.search(r"\b(yes|no|error)\b", text.replace("ZeroDivisionError", ""))


@pytest.mark.parametrize(
    ("result", "word", "style"),
    [
        (RESULTS[0], "deadlock=true", "red bold"),  # bad news
        (RESULTS[1], "termination=false", "green"),
        (RESULTS[2], "conservation(tokens)=unknown", "yellow"),
        (RESULTS[3], "mine=unknown", "red bold"),  # a failing user predicate needs someone to look
        (PredicateResult(name="conservation(tokens)", holds=False), "conservation(tokens)=false", "red bold"),
    ],
)
def test_the_demo_shows_name_and_verdict_styled_by_the_news(result: PredicateResult, word: str, style: str) -> None:
    text = verdict_text(result, named=True)
    assert (text.plain, str(text.style)) == (word, style)


def test_a_snapshot_report_has_a_verdict_per_predicate() -> None:
    snapshot = GlobalSnapshot(snapshot_id=7)
    text = _text(snapshot_report([(snapshot, RESULTS[:3])], title="1 snapshot"))
    row = next(line for line in text.splitlines() if line.startswith("│") and "7" in line)
    assert re.findall(r"\b(true|false|unknown)\b", row) == ["true", "false", "unknown"]


def test_one_agent_is_singular() -> None:
    assert "1 agent attached" in _text(members_table([Member(process_id="A")], now=0))
    assert "2 agents attached" in _text(members_table([Member(process_id="A"), Member(process_id="B")], now=0))


def test_the_demo_summary_tells_what_was_found() -> None:
    report = DemoReport(
        snapshots_completed=41,
        deadlock_detected=True,
        deadlock_cycle=["P0", "P1"],
        termination_detected=True,
        conservation_ok=True,
        seconds=12.3,
        bank_totals={"tokens": 3000},
        graph_dot="out/philosophers-deadlock.dot",
        graph_png=None,
        archives={"bank": "out/archive/bank"},
        shop_deadlock_detected=True,
        shop_deadlock_calls=[
            {"service": "orders", "method": "/shop.Orders/Place", "call": "client:1"},
            {"service": "payments", "method": "/shop.Payments/Charge", "call": "orders:1"},
        ],
        shop_stopped=True,
        out_dir="out",
        data_dir=None,
        systems={"job": {"first_seen_seconds": {"termination": 4.25}}},
    )
    text = _text(demo_summary(report))
    assert "deadlock among the philosophers: cycle P0 -> P1 -> P0" in text
    assert "wait-for graph: out/philosophers-deadlock.dot (install Graphviz for a PNG)" in text
    place, charge = "orders /shop.Orders/Place#client:1", "payments /shop.Payments/Charge#orders:1"
    assert f"deadlock among the shop's gRPC services (RPC mode): {place} -> {charge} -> {place}" in text
    assert "the job terminated: detected 4.2 s into the demo" in text
    assert "bank totals: tokens = 3000 (conserved in every snapshot)" in text
    assert "41 snapshots completed in 12.3 s" in text
    assert "every finished snapshot archived as Parquet in out/archive/<system>" in text
