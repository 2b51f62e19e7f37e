"""Every surface that lists the outcomes of a break knows ``policies_disagree``, and agrees with the code.

An agent attached to detectors whose ``--resolve`` policies differ refuses their automatic breaks
(``BREAK_OUTCOME_POLICIES_DISAGREE``; tests/test_two_detectors_policies.py tests the rule). The
outcome words come from the code (``DetectorMetrics``' and the archive's ``RESOLUTION_OUTCOMES``,
the ``BreakOutcome`` enum), so an outcome added there and forgotten here fails: the CLI styles
every answer an agent can give and its help names every word; the README's lists, the dashboard's
panel and the alert rules cover every word (an outcome that leaves the deadlock in place alerts).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from test_cli_resolve import resolution

from stablewatch.cli.main import main
from stablewatch.cli.render import resolution_dict, resolution_line, resolutions_table
from stablewatch.detector.archive.schema import RESOLUTION_OUTCOMES as ARCHIVED_OUTCOMES
from stablewatch.detector.service.metrics import RESOLUTION_OUTCOMES
from stablewatch.v1.control_pb2 import BREAK_OUTCOME_POLICIES_DISAGREE, BREAK_OUTCOME_UNSPECIFIED, BreakOutcome

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "stablewatch-dashboard.json"
REFUSAL = (
    "automatic break of wait 7 refused: the detectors break deadlocks by different policies "
    "(oldest at d1:50051, youngest at d0:50051)"
)
# Outcomes after which nothing is left to do: the wait was broken, or needed no break.
QUIET = {"gone", "already_broken"}


def outcome_style(line: Any, word: str) -> str:
    """The style of ``word`` in a rendered break line (empty when unstyled)."""
    start = line.plain.index(f": {word}") + 2
    styles = [str(span.style) for span in line.spans if span.start == start and span.end == start + len(word)]
    return styles[0] if styles else ""


# -- the CLI -------------------------------------------------------------------------------------------------


def test_a_refused_break_reads_policies_disagree_in_red() -> None:
    """Nothing was broken and the deadlock stays until the policies agree: red, like unanswered."""
    refused = resolution(outcome=BREAK_OUTCOME_POLICIES_DISAGREE, reported_after_ms=2, detail=REFUSAL)
    assert resolution_dict(refused)["outcome"] == "policies_disagree"
    line = resolution_line(refused)
    assert line.plain == (
        f"break #4 of wait 7 of b/y (youngest, snapshot #12): policies_disagree after 2.0 ms: {REFUSAL}"
    )
    assert outcome_style(line, "policies_disagree") == "red"
    console = Console(record=True, width=400, color_system=None)
    console.print(resolutions_table([refused]))
    assert "policies_disagree" in console.export_text()


@pytest.mark.parametrize("value", [v for v in BreakOutcome.values() if v != BREAK_OUTCOME_UNSPECIFIED])
def test_every_answer_of_an_agent_is_styled(value: int) -> None:
    shown = resolution(outcome=value, reported_after_ms=1)
    word = resolution_dict(shown)["outcome"]
    assert word in RESOLUTION_OUTCOMES and word in ARCHIVED_OUTCOMES
    assert outcome_style(resolution_line(shown), word), f"{word} has no style in the CLI"


def test_the_resolutions_help_names_every_outcome(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["resolutions", "--help"])
    assert exited.value.code == 0
    shown = capsys.readouterr().out
    for word in (*RESOLUTION_OUTCOMES, "pending"):
        assert re.search(rf"\b{word}\b", shown), word
    assert "--resolve" in shown  # why an agent answers policies_disagree


# -- the README and the dashboard ----------------------------------------------------------------------------


def _words(text: str) -> list[str]:
    return [word.strip() for word in " ".join(text.split()).split(",")]


def test_the_readme_lists_every_outcome() -> None:
    readme = README.read_text()
    counted = re.findall(r"`stablewatch_deadlocks_resolved_total\{outcome\}`\s+\(([^)]*)\)", readme)
    assert counted, "the README lists no outcome of stablewatch_deadlocks_resolved_total"
    for found in counted:
        assert _words(found) == list(RESOLUTION_OUTCOMES)
    (row,) = [line for line in readme.splitlines() if line.startswith("| `resolutions` |")]
    archived = re.search(r"outcome \(([^)]*)\)", row)
    assert archived is not None, row
    # pending is a break archived before its outcome was known: the row's text says no more of it.
    assert _words(archived.group(1)) == [word for word in ARCHIVED_OUTCOMES if word != "pending"]


def test_the_dashboard_explains_every_outcome() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    (breaks,) = [panel for panel in panels if panel.get("title") == "Breaks by outcome"]
    for word in RESOLUTION_OUTCOMES:
        assert re.search(rf"\b{word} \(", breaks["description"]), word


# -- the alert rules -----------------------------------------------------------------------------------------


def _alerted() -> dict[str, dict[str, Any]]:
    """Per outcome word, the alert rule whose expression counts its breaks."""
    yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read deploy/ (it belongs in the dev extra)")
    rules = [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    alerted: dict[str, dict[str, Any]] = {}
    for rule in rules:
        for matcher in re.findall(r'stablewatch_deadlocks_resolved_total\{outcome=~?"([^"]*)"\}', rule.get("expr", "")):
            for word in matcher.split("|"):
                assert word not in alerted, f"{word} is counted by two alerts"
                alerted[word] = rule
    return alerted


def test_every_outcome_alerts_or_is_quiet() -> None:
    """An outcome that leaves the deadlock in place (or says nothing of it) warns; one after which
    nothing is left to do does not alert. A new outcome must be put on one side or the other."""
    alerted = _alerted()
    assert set(alerted) | QUIET == set(RESOLUTION_OUTCOMES)
    assert not set(alerted) & QUIET
    for word in ("policies_disagree", "unanswered", "not_attached"):
        assert alerted[word]["labels"]["severity"] == "warning", word


def test_the_policies_alert_is_one_per_system_and_says_what_to_do() -> None:
    rule = _alerted()["policies_disagree"]
    assert rule["alert"] == "StablewatchResolvePoliciesDisagree"
    # Each detector's refused break counts: the sum over the replicas, one alert for both.
    assert rule["expr"].startswith("sum without (instance, replica) (floor(increase(")
    assert rule["for"] == "0s"
    description = " ".join(rule["annotations"]["description"].split())
    for needle in ("the same --resolve", "stablewatch resolutions", "stablewatch resolve"):
        assert needle in description, needle
