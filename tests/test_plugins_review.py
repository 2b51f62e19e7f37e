"""User predicates, as a review found them wanting: any BaseException they raise, names that shadow a
built-in's or each other's, and the shipped example predicate on an open cut."""

import asyncio
import math
import textwrap
from pathlib import Path

import pytest
from google.protobuf.struct_pb2 import Struct

from stablewatch.cli.exits import EXIT_ERROR
from stablewatch.cli.main import main
from stablewatch.detector.evaluation import evaluate, verdict
from stablewatch.detector.evaluation.plugins import (
    GROUP,
    PluginError,
    UserPredicate,
    built_in_name,
    check_names,
    entry_point_predicates,
    load_predicate,
)
from stablewatch.detector.service.detector import Detector, DetectorConfig
from stablewatch.examples.job import all_tasks_done
from stablewatch.v1 import (
    Evaluation,
    GlobalSnapshot,
    LocalState,
    ProcessSnapshot,
    Wait,
    WaitNode,
)

# A closed cut whose built-ins are all decided: A and B wait on each other (a deadlock), C holds
# 5 tokens (termination false; conservation true, its baseline taken here).
SNAPSHOT = GlobalSnapshot(
    snapshot_id=4,
    expected_members=["A", "B", "C"],
    processes=[
        ProcessSnapshot(process_id="A", state=LocalState(waits=[Wait(targets=[WaitNode(process="B")])])),
        ProcessSnapshot(process_id="B", state=LocalState(waits=[Wait(targets=[WaitNode(process="A")])])),
        ProcessSnapshot(process_id="C", state=LocalState(active=True, counters={"tokens": 5})),
    ],
)
BUILT_INS = ["deadlock", "termination", "conservation(tokens)"]


class PluginBug(BaseException):
    """A BaseException a plugin might raise that is neither an interrupt nor an exit."""


# Predicates loaded by import path from this very module; the first is named like a built-in.
def deadlock(snapshot: GlobalSnapshot) -> bool:
    return False


def fine(snapshot: GlobalSnapshot) -> bool:
    return True


def _built_ins(evaluation: Evaluation) -> list[tuple[str, str]]:
    return [(r.name, verdict(r)) for r in evaluation.results[:-1]]


# -- 1. a BaseException from a predicate is its failure, not the evaluation's ---------------------


@pytest.mark.parametrize(
    ("error", "text"),
    [
        (asyncio.CancelledError(), "CancelledError: "),
        (GeneratorExit(), "GeneratorExit: "),
        (PluginBug("oops"), "PluginBug: oops"),
    ],
)
def test_base_exception_becomes_an_error_result_beside_the_built_ins(error: BaseException, text: str) -> None:
    def check(snapshot: GlobalSnapshot) -> bool:
        raise error

    evaluation = evaluate(SNAPSHOT, plugins=[UserPredicate("check", check)])
    assert _built_ins(evaluation) == [("deadlock", "true"), ("termination", "false"), ("conservation(tokens)", "true")]
    failed = evaluation.results[-1]
    assert (failed.name, verdict(failed), failed.error) == ("check", "unknown", text)
    assert failed.summary == f"user predicate failed: {text}"


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
def test_interrupt_and_exit_still_propagate(error: type[BaseException]) -> None:
    def check(snapshot: GlobalSnapshot) -> bool:
        raise error

    with pytest.raises(error):
        evaluate(SNAPSHOT, plugins=[UserPredicate("check", check)])


def test_cancelled_error_in_a_predicate_does_not_cancel_the_evaluating_task() -> None:
    """The detector evaluates inside its snapshot task: that task must finish with the evaluation."""

    def check(snapshot: GlobalSnapshot) -> bool:
        raise asyncio.CancelledError

    async def take() -> Evaluation:
        return evaluate(SNAPSHOT, plugins=[UserPredicate("check", check)])

    async def main() -> tuple[bool, Evaluation]:
        task = asyncio.ensure_future(take())
        await asyncio.wait([task])
        return task.cancelled(), task.result()

    cancelled, evaluation = asyncio.run(main())
    assert not cancelled
    assert [r.name for r in evaluation.results] == [*BUILT_INS, "check"]


# -- 2. names: never a built-in's, never two alike ----------------------------------------------


def test_built_in_names_are_the_ones_evaluate_gives() -> None:
    """The reserved names follow the built-ins: every result evaluate() gives without plugins is one."""
    names = [r.name for r in evaluate(SNAPSHOT).results]
    assert names == BUILT_INS
    assert [built_in_name(name) for name in names] == ["deadlock", "termination", "conservation(<counter>)"]
    assert [built_in_name(name) for name in ["deadlocks", "my_termination", "conservation", "check"]] == [None] * 4


@pytest.mark.parametrize(
    ("spec", "name", "shadowed"),
    [
        (f"{__name__}:deadlock", None, "deadlock"),  # the attribute's name
        (f"{__name__}:fine", "termination", "termination"),
        (f"{__name__}:fine", "conservation(tokens)", "conservation(<counter>)"),
        ("sw_no_such_module:conservation(x)", None, "conservation(<counter>)"),  # refused before importing
    ],
)
def test_load_predicate_refuses_a_built_in_name(spec: str, name: str | None, shadowed: str) -> None:
    with pytest.raises(PluginError) as refused:
        load_predicate(spec, name=name)
    given = name or spec.partition(":")[2]
    assert str(refused.value) == (
        f"user predicate {given!r} (from {spec}) is named like the built-in predicate {shadowed}, "
        "whose results it would be mistaken for: give it another name"
    )


def test_a_programmatic_predicate_is_refused_a_built_in_name() -> None:
    with pytest.raises(PluginError, match=rf"'deadlock' \(from {__name__}:fine\) is named like the built-in"):
        UserPredicate("deadlock", fine)


def _install(tmp_path: Path, dist: str, entries: dict[str, str]) -> None:
    """Install distribution `dist` with entry points `entries` (name: value) in this group, on sys.path."""
    info = tmp_path / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entries.items())
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n{lines}")


@pytest.fixture
def plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "sw_review_checks.py").write_text(
        textwrap.dedent(
            """
            def always(snapshot):
                return True

            def never(snapshot):
                return False
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_entry_point_named_like_a_built_in_is_refused(plugin_module: Path) -> None:
    _install(plugin_module, "sw-review-a", {"deadlock": "sw_review_checks:never", "ok": "sw_review_checks:always"})
    with pytest.raises(PluginError) as refused:
        entry_point_predicates()
    assert str(refused.value) == (
        f"user predicate 'deadlock' (from entry point deadlock = sw_review_checks:never in group {GROUP} of "
        "sw-review-a) is named like the built-in predicate deadlock, whose results it would be mistaken for: "
        "give it another name"
    )


def test_two_entry_points_of_one_name_are_refused(plugin_module: Path) -> None:
    _install(plugin_module, "sw-review-a", {"pair": "sw_review_checks:always"})
    _install(plugin_module, "sw-review-b", {"pair": "sw_review_checks:never"})
    with pytest.raises(PluginError) as refused:
        entry_point_predicates()
    message = str(refused.value)
    assert message.startswith("two user predicates are named 'pair' (from entry point pair = sw_review_checks:")
    assert "of sw-review-a" in message and "of sw-review-b" in message
    assert message.endswith("): give one another name")


def test_the_detector_refuses_two_predicates_of_one_name(tmp_path: Path) -> None:
    first = load_predicate(f"{__name__}:fine", name="check")
    second = UserPredicate("check", deadlock)
    with pytest.raises(PluginError) as refused:
        Detector(DetectorConfig(data_dir=tmp_path / "data"), plugins=[first, second])
    assert str(refused.value) == (
        f"two user predicates are named 'check' (from {__name__}:fine and from {__name__}:deadlock): "
        "give one another name"
    )
    with pytest.raises(PluginError, match="two user predicates are named 'check'"):
        check_names([first, first])  # one predicate twice: two results of one name all the same


def test_the_detector_refuses_a_predicate_renamed_as_a_built_in(tmp_path: Path) -> None:
    """A frozen predicate can still be renamed by force; the detector checks the names it is given."""
    renamed = UserPredicate("check", fine)
    object.__setattr__(renamed, "name", "termination")
    with pytest.raises(PluginError) as refused:
        Detector(DetectorConfig(data_dir=tmp_path / "data"), plugins=[renamed])
    assert str(refused.value).startswith(
        f"user predicate 'termination' (from {__name__}:fine) is named like the built-in predicate termination"
    )


def test_the_detector_takes_predicates_of_distinct_names(tmp_path: Path) -> None:
    plugins = [load_predicate(f"{__name__}:fine"), UserPredicate("other", deadlock)]
    Detector(DetectorConfig(data_dir=tmp_path / "data"), plugins=plugins)


# -- 3. the shipped example predicate is unknown on an open cut ----------------------------------


def _workers(reported: dict[str, tuple[int, int]], expected: list[str]) -> GlobalSnapshot:
    """A cut of the job's workers `reported` (id: (created, done)), when the detector expected `expected`."""
    processes = []
    for worker, (created, done) in reported.items():
        attributes = Struct()
        attributes.update({"created": created, "done": done, "queued": 0})
        processes.append(ProcessSnapshot(process_id=worker, state=LocalState(attributes=attributes)))
    return GlobalSnapshot(snapshot_id=1, expected_members=expected, processes=processes)


def test_all_tasks_done_is_unknown_on_an_open_cut() -> None:
    """W2 was expected and did not report: its tasks, created and not done, are not in the sums."""
    result = load_predicate("stablewatch.examples.job:all_tasks_done")(_workers({"W1": (3, 3)}, ["W1", "W2"]))
    assert verdict(result) == "unknown" and not result.error
    assert result.summary == "unknown: 3 of 3 tasks done, but 1 process missing from the cut (W2)"


@pytest.mark.parametrize(("done", "holds"), [(4, True), (3, False)])
def test_all_tasks_done_decides_on_a_closed_cut(done: int, holds: bool) -> None:
    snapshot = _workers({"W1": (3, 3), "W2": (1, done - 3)}, ["W1", "W2"])
    result = UserPredicate("all_tasks_done", all_tasks_done)(snapshot)
    assert (verdict(result), result.summary) == ("true" if holds else "false", f"{done} of 4 tasks done")
    assert dict(result.details) == {"created": 4, "done": done}


def test_the_detector_command_says_why_it_cannot_start_with_two_predicates_of_one_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = f"{__name__}:fine"
    argv = ["detector", "--data-dir", str(tmp_path / "data"), "--predicate", spec, "--predicate", spec]
    assert main(argv) == EXIT_ERROR  # a message, not a traceback
    assert "stablewatch: the detector cannot start: two user predicates are named 'fine'" in capsys.readouterr().err


def test_a_whole_system_answer_is_unknown_on_an_open_cut_and_kept_on_a_closed_one() -> None:
    def everyone_idle(snapshot: GlobalSnapshot) -> dict[str, object]:
        return {"holds": True, "summary": "all idle", "whole_system": True}

    predicate = UserPredicate("everyone_idle", everyone_idle)
    open_cut = predicate(_workers({"W1": (0, 0)}, ["W1", "W2"]))
    assert verdict(open_cut) == "unknown" and list(open_cut.missing_processes) == ["W2"]
    assert open_cut.summary == "unknown: all idle, but 1 process missing from the cut (W2)"
    assert verdict(predicate(_workers({"W1": (0, 0)}, ["W1"]))) == "true"
    wrong = UserPredicate("wrong", lambda snapshot: {"holds": True, "whole_system": "yes"})(_workers({}, []))
    assert verdict(wrong) == "unknown" and wrong.error.startswith("TypeError: 'whole_system' must be a bool")


def test_a_detail_without_json_is_the_predicates_error() -> None:
    # From a review (read only) of the persistence: a user predicate's NaN in its details was taken
    # as it was; the archive then set every such snapshot aside (its deadlock proofs with it), and
    # the pipeline failed on it. It is the predicate's error now, in the detector and the pipeline.
    for value in (math.nan, math.inf, [1.0, {"deep": -math.inf}]):
        result = UserPredicate("ratio", lambda snapshot, v=value: {"holds": True, "details": {"ratio": v}})(
            _workers({}, [])
        )
        assert verdict(result) == "unknown" and result.error.startswith("ValueError: 'details' holds")
        assert "under 'ratio': numbers must be finite" in result.error
