"""The local state keeper: counters, attributes, waits (one per instance), the atomic snapshot, and
thread safety. Breaking a wait is in test_breaking.py."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest
from google.protobuf.json_format import MessageToDict

from stablewatch.agents import breaking
from stablewatch.agents.state import LocalStateKeeper
from stablewatch.v1 import WAIT_MODEL_AND, WAIT_MODEL_OR, LocalState, WaitNode

JOIN_TIMEOUT = 60.0


def _waits(state: LocalState) -> list[tuple[str, int, list[tuple[str, str]]]]:
    return [(w.task, w.model, [(t.process, t.task) for t in w.targets]) for w in state.waits]


# -- activity -------------------------------------------------------------------------------------


def test_new_keeper_is_active_and_empty() -> None:
    state = LocalStateKeeper()
    assert state.active
    assert state.snapshot() == LocalState(active=True)
    assert not LocalStateKeeper(active=False).snapshot().active


def test_active_property_and_setter() -> None:
    state = LocalStateKeeper()
    state.active = False
    assert not state.active and not state.snapshot().active
    state.set_active(True)
    assert state.active
    with pytest.raises(TypeError, match="bool"):
        state.set_active(1)  # type: ignore[arg-type]


# -- counters -------------------------------------------------------------------------------------


def test_counters() -> None:
    state = LocalStateKeeper()
    assert state.counter("tokens") == 0
    assert state.add("tokens", 5) == 5
    assert state.add("tokens", -7) == -2
    state.set_counter("credits", 3)
    copy = state.counters()
    assert copy == {"tokens": -2, "credits": 3}
    copy["tokens"] = 100
    assert state.counter("tokens") == -2
    assert dict(state.snapshot().counters) == {"tokens": -2, "credits": 3}


@pytest.mark.parametrize("bad", [1.0, "1", True, None])
def test_counter_values_must_be_int(bad: object) -> None:
    state = LocalStateKeeper()
    with pytest.raises(TypeError, match=r"'tokens'.*must be an int"):
        state.add("tokens", bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"'tokens'.*must be an int"):
        state.set_counter("tokens", bad)  # type: ignore[arg-type]
    assert state.counters() == {}


def test_counter_names_and_range() -> None:
    state = LocalStateKeeper()
    with pytest.raises(ValueError, match="empty"):
        state.add("", 1)
    with pytest.raises(TypeError, match="name"):
        state.add(3, 1)  # type: ignore[arg-type]
    state.set_counter("big", 2**63 - 1)
    with pytest.raises(ValueError, match=r"'big'.*int64"):
        state.add("big", 1)
    assert state.counter("big") == 2**63 - 1
    with pytest.raises(ValueError, match="int64"):
        state.set_counter("small", -(2**63) - 1)


def test_apply_transfer_debits_and_credits() -> None:
    state = LocalStateKeeper()
    state.set_counter("tokens", 10)
    state.apply_transfer({"tokens": 3, "credits": 2}, -1)
    assert state.counters() == {"tokens": 7, "credits": -2}  # going negative is allowed
    state.apply_transfer({"credits": 2}, +1)
    assert state.counters() == {"tokens": 7, "credits": 0}


def test_apply_transfer_is_all_or_nothing() -> None:
    state = LocalStateKeeper()
    state.set_counter("big", 2**63 - 1)
    with pytest.raises(ValueError, match="'big'"):
        state.apply_transfer({"a": 1, "big": 1}, +1)
    with pytest.raises(TypeError, match="'b'"):
        state.apply_transfer({"a": 1, "b": 0.5}, +1)  # type: ignore[dict-item]
    assert state.counters() == {"big": 2**63 - 1}
    for sign in (0, 2, True):
        with pytest.raises(ValueError, match="sign"):
            state.apply_transfer({"a": 1}, sign)


# -- attributes -----------------------------------------------------------------------------------


def test_attributes_are_copied_and_reach_the_struct() -> None:
    state = LocalStateKeeper()
    value = {"queue": [1, 2.5, "x", None, True], "leader": {"id": "P1"}}
    state.set_attribute("info", value)
    state.set_attribute("phase", "commit")
    value["queue"].append("later")  # type: ignore[attr-defined]
    attributes = state.attributes()
    assert attributes == {"info": {"queue": [1, 2.5, "x", None, True], "leader": {"id": "P1"}}, "phase": "commit"}
    attributes["info"]["leader"]["id"] = "mutated"  # type: ignore[index]
    snap = state.snapshot()
    assert MessageToDict(snap.attributes) == {
        "info": {"queue": [1.0, 2.5, "x", None, True], "leader": {"id": "P1"}},
        "phase": "commit",
    }
    assert state.attributes()["info"]["leader"]["id"] == "P1"  # type: ignore[index]


def test_attributes_must_be_json_like() -> None:
    state = LocalStateKeeper()
    with pytest.raises(TypeError, match=r"info\.peers\[1\].*set"):
        state.set_attribute("info", {"peers": ["a", {"b"}]})
    with pytest.raises(TypeError, match="key 1"):
        state.set_attribute("info", {1: "x"})
    with pytest.raises(ValueError, match="finite"):
        state.set_attribute("ratio", float("nan"))
    with pytest.raises(TypeError, match="key"):
        state.set_attribute(None, 1)  # type: ignore[arg-type]
    assert state.attributes() == {}


# -- waits ----------------------------------------------------------------------------------------


def test_waiting_accepts_every_target_form() -> None:
    state = LocalStateKeeper()
    with state.waiting(["B", ("C", "worker"), WaitNode(process="D", task="")], model="or", task="main"):
        assert _waits(state.snapshot()) == [("main", WAIT_MODEL_OR, [("B", ""), ("C", "worker"), ("D", "")])]
    with state.waiting("B"), state.waiting(WaitNode(process="C", task="t")):
        assert _waits(state.snapshot()) == [("", WAIT_MODEL_AND, [("B", "")]), ("", WAIT_MODEL_AND, [("C", "t")])]
    assert _waits(state.snapshot()) == []


def test_each_wait_is_reported_on_its_own_with_its_instance_and_start() -> None:
    """Waits of one task are not merged here (the detector merges them): one Wait per instance,
    in the order they began, each with its instance id and the time it began."""
    state = LocalStateKeeper()
    before = breaking.now_us()
    first = state.add_wait(["B", "C"], model="or", task="t")
    second = state.add_wait(["C", "D"], model="or", task="t")  # same task: both kept
    other = state.add_wait("E", task="u")
    third = state.add_wait("F", model="and", task="t")
    after = breaking.now_us()
    snap = state.snapshot()
    assert _waits(snap) == [
        ("t", WAIT_MODEL_OR, [("B", ""), ("C", "")]),
        ("t", WAIT_MODEL_OR, [("C", ""), ("D", "")]),
        ("u", WAIT_MODEL_AND, [("E", "")]),
        ("t", WAIT_MODEL_AND, [("F", "")]),
    ]
    assert [w.instance for w in snap.waits] == [first, second, other, third]
    assert len({first, second, other, third}) == 4 and 0 not in (first, second, other, third)
    starts = [w.began_at_us for w in snap.waits]
    assert starts == sorted(starts) and before <= starts[0] and starts[-1] <= after
    assert [(w.instance, w.task, w.began_at_us) for w in state.open_waits()] == [
        (w.instance, w.task, w.began_at_us) for w in snap.waits
    ]
    state.remove_wait(first)
    state.remove_wait(third)
    assert [w.instance for w in state.snapshot().waits] == [second, other]
    state.remove_wait(second)
    state.remove_wait(other)
    assert _waits(state.snapshot()) == [] and state.open_waits() == []
    with pytest.raises(ValueError, match="token"):
        state.remove_wait(first)
    with pytest.raises(ValueError, match="token"):
        state.handle(first)


def test_an_instance_is_never_reused() -> None:
    """Not after its wait ends, not by another keeper: the ids are the process's."""
    seen: set[int] = set()
    for keeper in (LocalStateKeeper(), LocalStateKeeper()):
        for _ in range(100):
            with keeper.waiting("B") as wait:
                assert wait.instance not in seen
                seen.add(wait.instance)
            token = keeper.add_wait("C")
            assert token not in seen and keeper.handle(token).instance == token
            seen.add(token)
            keeper.remove_wait(token)


def test_waiting_removes_exactly_its_wait_on_exception() -> None:
    state = LocalStateKeeper()
    outer = state.add_wait("B", task="t")
    with pytest.raises(RuntimeError, match="boom"), state.waiting("C", task="t") as inner:
        assert [w.instance for w in state.snapshot().waits] == [outer, inner.instance]
        raise RuntimeError("boom")
    assert _waits(state.snapshot()) == [("t", WAIT_MODEL_AND, [("B", "")])]
    state.remove_wait(outer)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"targets": "B", "model": "AND"}, ValueError, "'and' or 'or'"),
        ({"targets": "B", "model": "xor"}, ValueError, "model"),
        ({"targets": ""}, ValueError, "names no process"),
        ({"targets": [("", "task")]}, ValueError, "names no process"),
        ({"targets": []}, ValueError, "at least one target"),
        ({"targets": [3]}, TypeError, "wait target"),
        ({"targets": [("B", "t", "x")]}, TypeError, "wait target"),
        ({"targets": [("B", 1)]}, TypeError, "str"),
        ({"targets": "B", "task": None}, TypeError, "task"),
    ],
)
def test_wait_errors(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    state = LocalStateKeeper()
    with pytest.raises(error, match=match):
        state.add_wait(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(error, match=match), state.waiting(**kwargs):  # type: ignore[arg-type]
        pass
    assert _waits(state.snapshot()) == []


def test_snapshot_is_a_copy() -> None:
    state = LocalStateKeeper()
    state.add("tokens", 1)
    token = state.add_wait("B")
    snap = state.snapshot()
    state.add("tokens", 1)
    state.remove_wait(token)
    state.set_attribute("late", 1)
    assert snap.counters["tokens"] == 1 and len(snap.waits) == 1 and not snap.attributes.fields


# -- threads --------------------------------------------------------------------------------------


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Switch threads every few microseconds, so the reader lands inside the workers' updates."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


@pytest.mark.usefixtures("fast_switching")
def test_concurrent_updates_give_consistent_snapshots() -> None:
    """Workers change paired counters, nested waits and paired attributes, each in one call; a
    reader's snapshots must never show half of a call, and the totals must add up at the end."""
    state = LocalStateKeeper()
    workers, rounds = 6, 300
    start = threading.Barrier(workers + 1, timeout=JOIN_TIMEOUT)
    done = threading.Event()
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            start.wait()
            for k in range(rounds):
                with state.waiting([f"P{i}", (f"P{i}", "x")], task=f"t{i}"):
                    state.apply_transfer({f"x{i}": 1, f"y{i}": 1}, +1)
                    with state.waiting(f"Q{i}", model="or", task=f"t{i}"):
                        state.add("hits", 1)
                        state.set_attribute(f"pair{i}", {"a": k, "b": k})
                    state.apply_transfer({f"x{i}": 1, f"y{i}": 1}, -1)
                state.add("hits", 1)
        except BaseException as error:
            errors.append(error)

    snapshots: list[LocalState] = []

    def read() -> None:
        try:
            start.wait()
            while not done.is_set():
                snapshots.append(state.snapshot())
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
    reader = threading.Thread(target=read)
    for thread in [*threads, reader]:
        thread.start()
    for thread in threads:
        thread.join(JOIN_TIMEOUT)
    done.set()
    reader.join(JOIN_TIMEOUT)
    assert not any(t.is_alive() for t in [*threads, reader])
    assert not errors, errors
    snapshots.append(state.snapshot())

    hits = 0
    for snap in snapshots:
        for i in range(workers):
            assert snap.counters.get(f"x{i}", 0) == snap.counters.get(f"y{i}", 0) in (0, 1)
            if f"pair{i}" in snap.attributes.fields:
                pair = snap.attributes.fields[f"pair{i}"].struct_value.fields
                assert pair["a"].number_value == pair["b"].number_value
        by_task: dict[str, list[tuple[int, list[tuple[str, str]]]]] = {}
        for task, model, targets in _waits(snap):
            by_task.setdefault(task, []).append((model, targets))
        for task, waits in by_task.items():
            i = task.removeprefix("t")
            outer = (WAIT_MODEL_AND, [(f"P{i}", ""), (f"P{i}", "x")])
            assert waits in ([outer], [outer, (WAIT_MODEL_OR, [(f"Q{i}", "")])])
        assert snap.counters.get("hits", 0) >= hits
        hits = snap.counters.get("hits", 0)
    final = snapshots[-1]
    assert final.counters["hits"] == 2 * workers * rounds
    assert not final.waits
    assert len(snapshots) > 1
