"""The wait-for graph as drawn, and the web page's times, found by review.

* The DOT writer named a node by its label, ``P/task``, which a process id holding "/" (allowed)
  also produces: two nodes became one and ``stablewatch graph`` drew a cycle that does not exist.
  Nodes are now ``n0``, ``n1``, ... with the label as ``label``; the web view's JSON names each
  edge's ends by process and task too, not by label alone.
* The page's ``clock()`` gave the time of day only, so a week-old latest snapshot read like one of
  today: a time not of today now comes with its date.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import networkx as nx
import pytest

from stablewatch.detector.evaluation import evaluate, wait_for_dot
from stablewatch.detector.service.web_view import ViewInputs, build_view, finished_of, latest_of
from stablewatch.v1 import GlobalSnapshot, WaitForGraph
from stablewatch.v1.bounds import process_id_problem
from stablewatch.v1.query_pb2 import SNAPSHOT_OUTCOME_COMPLETED, SnapshotSummary

VIEW_JS = Path(__file__).resolve().parents[1] / "detector" / "service" / "web_static" / "view.js"


def _look_alikes() -> GlobalSnapshot:
    """Task b of process a waits on c; c waits on the process named "a/b", which waits on nothing.
    (Process a itself waits on its task: an OR waiter, idle as soon as one of its tasks is.)"""
    s = GlobalSnapshot(snapshot_id=9)
    a = s.processes.add(process_id="a")
    a.state.waits.add(task="b").targets.add(process="c")
    c = s.processes.add(process_id="c")
    c.state.waits.add().targets.add(process="a/b")
    s.processes.add(process_id="a/b")
    return s


def _dot_parts(dot: str) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """The DOT text's nodes (id -> label) and edges (id pairs), read from the writer's own lines."""
    nodes = {m[1]: json.loads(m[2]) for m in re.finditer(r'^  (n\d+) \[label=("(?:[^"\\]|\\.)*")', dot, re.M)}
    edges = re.findall(r"^  (n\d+) -> (n\d+)", dot, re.M)
    return nodes, edges


def test_look_alike_nodes_stay_distinct_in_dot() -> None:
    assert process_id_problem("a/b") is None
    evaluation = evaluate(_look_alikes(), {}, [])
    (found,) = [r for r in evaluation.results if r.name == "deadlock"]
    assert not found.holds and not found.unknown  # no deadlock: a/b is free
    dot = wait_for_dot(evaluation.wait_for)
    nodes, edges = _dot_parts(dot)
    # (process, task) in sorted order: ("a", ""), ("a", "b"), ("a/b", ""), ("c", "")
    assert nodes == {"n0": "a", "n1": "a/b", "n2": "a/b", "n3": "c"}, dot
    assert sorted(edges) == [("n0", "n1"), ("n1", "n3"), ("n3", "n2")], dot
    assert nx.is_directed_acyclic_graph(nx.DiGraph(edges))
    assert wait_for_dot(evaluation.wait_for) == dot  # deterministic


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's `dot` is not installed")
def test_graphviz_draws_no_cycle_among_look_alikes() -> None:
    dot = wait_for_dot(evaluate(_look_alikes(), {}, []).wait_for)
    plain = subprocess.run(["dot", "-Tplain"], input=dot.encode(), capture_output=True, check=True).stdout.decode()
    edges = [tuple(line.split()[1:3]) for line in plain.splitlines() if line.startswith("edge ")]
    assert len(edges) == 3
    graph = nx.DiGraph(edges)
    assert nx.is_directed_acyclic_graph(graph), f"DOT draws a cycle: {list(nx.simple_cycles(graph))}"


def test_dot_ids_do_not_depend_on_the_message_order() -> None:
    graph = evaluate(_look_alikes(), {}, []).wait_for
    shuffled = WaitForGraph()
    shuffled.CopyFrom(graph)
    del shuffled.nodes[:]
    shuffled.nodes.extend(reversed(graph.nodes))
    assert wait_for_dot(shuffled) == wait_for_dot(graph)


def test_the_web_view_names_each_edge_end_by_process_and_task() -> None:
    s = _look_alikes()
    evaluation = evaluate(s)
    done = SnapshotSummary(snapshot_id=9, outcome=SNAPSHOT_OUTCOME_COMPLETED)
    view = build_view(
        ViewInputs(latest=latest_of(done, s, evaluation), timeline=(finished_of(done, evaluation.results),))
    )
    edges = {
        ((e["waiter_process"], e["waiter_task"]), (e["target_process"], e["target_task"]))
        for e in view["graph"]["edges"]
    }
    assert edges == {(("a", ""), ("a", "b")), (("a", "b"), ("c", "")), (("c", ""), ("a/b", ""))}
    for edge in view["graph"]["edges"]:  # the labels stay, for the page and its readers
        assert {"waiter", "target"} <= edge.keys()
    assert sorted((n["process"], n["task"]) for n in view["graph"]["nodes"]) == [
        ("a", ""),
        ("a", "b"),
        ("a/b", ""),
        ("c", ""),
    ]


# -- the page's times --------------------------------------------------------------------------------------


def _clock(now: str, *isos: str | None, tz: str = "UTC") -> list[dict[str, str]]:
    """view.js's clock() of each of `isos` in node, at `now`, in time zone `tz`; with the date's and
    the time's own local texts, to compare with."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: cannot run the page's clock()")
    (clock,) = re.findall(r"^  function clock\(iso\) \{$.*?^  \}$", VIEW_JS.read_text(), re.M | re.S)
    script = f"""
const RealDate = Date;
const NOW = RealDate.parse({json.dumps(now)});
globalThis.Date = class extends RealDate {{
  constructor(...args) {{ super(...(args.length ? args : [NOW])); }}
  static now() {{ return NOW; }}
}};
{clock}
const out = {json.dumps(list(isos))}.map((iso) => ({{
  shown: clock(iso),
  date: iso ? new RealDate(iso).toLocaleDateString() : "",
  time: iso ? new RealDate(iso).toLocaleTimeString() : "",
}}));
console.log(JSON.stringify(out));
"""
    out = subprocess.run([node, "-e", script], capture_output=True, check=True, text=True, env={"TZ": tz})
    return json.loads(out.stdout)


def test_a_time_of_today_is_a_time_of_day() -> None:
    (today,) = _clock("2026-11-27T12:00:00.000Z", "2026-11-27T10:00:00.000Z")
    assert today["shown"] == today["time"]


def test_a_week_old_snapshot_does_not_read_as_one_of_today() -> None:
    week_ago, today = _clock("2026-11-27T12:00:00.000Z", "2026-11-20T10:00:00.000Z", "2026-11-27T10:00:00.000Z")
    assert week_ago["shown"] != today["shown"]
    assert week_ago["shown"] == f"{week_ago['date']} {week_ago['time']}"
    assert week_ago["date"] != today["date"]


def test_today_is_the_local_day() -> None:
    iso = "2026-11-26T23:30:00.000Z"  # the 26th in UTC, the 27th in Tokyo (UTC+9)
    (utc,) = _clock("2026-11-27T01:00:00.000Z", iso, tz="UTC")
    (tokyo,) = _clock("2026-11-27T01:00:00.000Z", iso, tz="Asia/Tokyo")
    assert utc["shown"] == f"{utc['date']} {utc['time']}"  # yesterday, in UTC
    assert tokyo["shown"] == tokyo["time"]  # today, in Tokyo


def test_no_time_is_a_dash() -> None:
    assert [c["shown"] for c in _clock("2026-11-27T12:00:00.000Z", None, "")] == ["–", "–"]
