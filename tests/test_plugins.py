"""User predicates: loading by import path and entry point, result shapes, failures."""

import textwrap
from pathlib import Path

import pytest

from stablewatch.detector.evaluation.plugins import (
    GROUP,
    PluginError,
    UserPredicate,
    entry_point_predicates,
    load_predicate,
    to_result,
)
from stablewatch.v1 import GlobalSnapshot, LocalState, ProcessSnapshot

SNAPSHOT = GlobalSnapshot(
    snapshot_id=3,
    processes=[
        ProcessSnapshot(process_id="P1", state=LocalState(counters={"queue": 4})),
        ProcessSnapshot(process_id="P2", state=LocalState(counters={"queue": 12})),
    ],
)


# Predicates loaded by import path from this very module.
def queue_bounded(snapshot: GlobalSnapshot) -> tuple[bool, str]:
    longest = max(p.state.counters["queue"] for p in snapshot.processes)
    return longest <= 10, f"longest queue {longest}"


def queue_report(snapshot: GlobalSnapshot) -> dict[str, object]:
    queues = {p.process_id: p.state.counters["queue"] for p in snapshot.processes}
    return {"holds": True, "summary": "queues", "details": {"queues": queues, "total": sum(queues.values())}}


def crashes(snapshot: GlobalSnapshot) -> bool:
    raise ZeroDivisionError("division by zero")


def vandal(snapshot: GlobalSnapshot) -> bool:
    snapshot.processes[0].process_id = "X"
    return True


class Checks:
    @staticmethod
    def has_two(snapshot: GlobalSnapshot) -> bool:
        return len(snapshot.processes) == 2


NOT_CALLABLE = 42


def test_load_by_import_path() -> None:
    predicate = load_predicate(f"{__name__}:queue_bounded")
    assert predicate.name == "queue_bounded"
    result = predicate(SNAPSHOT)
    assert (result.name, result.holds, result.summary, result.error) == (
        "queue_bounded",
        False,
        "longest queue 12",
        "",
    )


def test_load_dotted_attribute_and_custom_name() -> None:
    predicate = load_predicate(f"{__name__}:Checks.has_two", name="pair")
    assert predicate.name == "pair"
    assert predicate(SNAPSHOT).holds


def test_mapping_result_fills_details() -> None:
    result = load_predicate(f"{__name__}:queue_report")(SNAPSHOT)
    assert result.holds
    assert result.summary == "queues"
    assert result.WhichOneof("evidence") == "details"
    assert result.details["total"] == 16
    assert dict(result.details["queues"]) == {"P1": 4, "P2": 12}


def test_load_from_a_module_on_sys_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sw_user_checks.py").write_text("def never(snapshot):\n    return False\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = load_predicate("sw_user_checks:never")(SNAPSHOT)
    assert (result.name, result.holds, result.summary) == ("never", False, "does not hold")


@pytest.mark.parametrize(
    "spec",
    [
        "no_colon",
        ":queue_bounded",
        f"{__name__}:",
        "sw_no_such_module:f",
        f"{__name__}:missing",
        f"{__name__}:NOT_CALLABLE",
    ],
)
def test_bad_import_paths_fail_at_load(spec: str) -> None:
    with pytest.raises(PluginError):
        load_predicate(spec)


def test_exception_becomes_an_error_result() -> None:
    result = load_predicate(f"{__name__}:crashes")(SNAPSHOT)
    assert not result.holds and result.unknown
    assert result.error == "ZeroDivisionError: division by zero"
    assert result.summary == "user predicate failed: ZeroDivisionError: division by zero"


@pytest.mark.parametrize(
    "value",
    [
        1,
        "yes",
        (True, 3),
        (1, "one"),
        {"summary": "no holds"},
        {"holds": True, "extra": 1},
        {"holds": True, "details": [1]},
    ],
)
def test_wrong_shapes_become_error_results(value: object) -> None:
    result = UserPredicate("shape", lambda s: value)(SNAPSHOT)
    assert not result.holds
    assert result.error.startswith("TypeError: ")


@pytest.mark.parametrize("value", [None, (None, "cannot tell"), {"holds": None, "summary": "cannot tell"}])
def test_none_means_unknown(value: object) -> None:
    result = UserPredicate("maybe", lambda s: value)(SNAPSHOT)
    assert result.unknown and not result.holds and not result.error
    assert result.summary in ("unknown", "cannot tell")


def test_details_a_struct_cannot_hold_become_an_error_result() -> None:
    result = UserPredicate("odd", lambda s: {"holds": True, "details": {"when": object()}})(SNAPSHOT)
    assert not result.holds
    assert result.error


def test_to_result_shapes() -> None:
    assert to_result("p", True).summary == "holds"
    assert to_result("p", (True, "fine")).summary == "fine"
    assert to_result("p", {"holds": False}).WhichOneof("evidence") is None


def test_predicate_gets_a_private_copy() -> None:
    snapshot = GlobalSnapshot()
    snapshot.CopyFrom(SNAPSHOT)
    assert UserPredicate("vandal", vandal)(snapshot).holds
    assert snapshot == SNAPSHOT


def test_entry_points(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sw_plugin_pkg.py").write_text(
        textwrap.dedent(
            """
            def always(snapshot):
                return True, "always"

            def fails(snapshot):
                raise ValueError("nope")
            """
        )
    )
    dist = tmp_path / "sw_plugin_pkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sw-plugin-pkg\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[{GROUP}]\n"
        "zeta = sw_plugin_pkg:always\n"
        "alpha = sw_plugin_pkg:fails\n"
        "broken = sw_plugin_pkg:missing\n"
        "[other.group]\n"
        "ignored = sw_plugin_pkg:always\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    predicates = entry_point_predicates()
    assert [p.name for p in predicates] == ["alpha", "broken", "zeta"]
    alpha, broken, zeta = (p(SNAPSHOT) for p in predicates)
    assert (zeta.holds, zeta.summary) == (True, "always")
    assert (alpha.holds, alpha.error) == (False, "ValueError: nope")
    assert not broken.holds
    assert "cannot load 'sw_plugin_pkg:missing'" in broken.error
