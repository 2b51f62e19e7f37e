"""The web view: the pure builder on hand-made cuts, the live holder, and the page, its data and its
event stream served by a real detector (plaintext, its own port, mutual TLS)."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from command_line import DetectorProcess, stablewatch
from mtls_detector import mtls_detector

from conftest import free_port
from polling import poll
from stablewatch.agents import Agent
from stablewatch.detector.evaluation import evaluate
from stablewatch.detector.service.auth import Authorizer
from stablewatch.detector.service.detector import DetectorConfig
from stablewatch.detector.service.web_http import WebApp
from stablewatch.detector.service.web_view import (
    MAX_DRAWN_NODES,
    LiveView,
    ViewInputs,
    build_view,
    finished_of,
    latest_of,
)
from stablewatch.testing.detector import Running
from stablewatch.v1 import WAIT_MODEL_OR, GlobalSnapshot
from stablewatch.v1.query_pb2 import (
    SNAPSHOT_OUTCOME_ABORTED,
    SNAPSHOT_OUTCOME_COMPLETED,
    Resolution,
    SnapshotSummary,
)

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 20.0
T0 = 1_700_000_000_000_000  # microseconds
SVG = "{http://www.w3.org/2000/svg}"


# -- hand-made cuts -----------------------------------------------------------------------------------------


def proc(pid: str, *targets: str, model: int = 0, task: str = "", active: bool = False) -> dict[str, Any]:
    """A process that waits (with `model`) on `targets`, or on nothing."""
    waits = [{"task": task, "model": model, "targets": [{"process": t} for t in targets]}] if targets else []
    return {"process_id": pid, "state": {"active": active, "waits": waits}}


def summary(
    snapshot_id: int, outcome: int = SNAPSHOT_OUTCOME_COMPLETED, ms: int = 3, reason: str = ""
) -> SnapshotSummary:
    result = SnapshotSummary(snapshot_id=snapshot_id, outcome=outcome, abort_reason=reason)
    result.started_at.FromMicroseconds(T0 + snapshot_id * 1_000_000)
    result.finished_at.FromMicroseconds(T0 + snapshot_id * 1_000_000 + ms * 1000)
    return result


def view_of(snapshot: GlobalSnapshot) -> dict[str, Any]:
    evaluation = evaluate(snapshot)
    done = summary(snapshot.snapshot_id)
    latest = latest_of(done, snapshot, evaluation)
    return build_view(ViewInputs(latest=latest, timeline=(finished_of(done, evaluation.results),)), 1)


def drawn(svg: str) -> tuple[dict[str, set[str]], dict[tuple[str, str], set[str]], dict[tuple[str, str], ET.Element]]:
    """The SVG's nodes (name -> classes), edges ((waiter, target) -> classes) and channels."""
    root = ET.fromstring(svg)  # well-formed XML, or this fails
    nodes, edges, channels = {}, {}, {}
    for g in root.iter(f"{SVG}g"):
        classes = set(g.get("class", "").split())
        if "node" in classes:
            nodes[g.get("data-node")] = classes
        elif "edge" in classes:
            edges[(g.get("data-waiter"), g.get("data-target"))] = classes
        elif "channel" in classes:
            channels[(g.get("data-src"), g.get("data-dst"))] = g
    return nodes, edges, channels


def predicates(view: dict[str, Any]) -> dict[str, str]:
    return {p["name"]: p["value"] for p in view["predicates"]}


def test_an_and_cycle_is_highlighted_node_by_node_and_edge_by_edge() -> None:
    ring = ["P0", "P1", "P2"]
    cut = GlobalSnapshot(
        snapshot_id=7,
        processes=[*(proc(p, ring[(i + 1) % 3]) for i, p in enumerate(ring)), proc("X", "P0"), proc("idle")],
    )
    view = view_of(cut)
    assert predicates(view)["deadlock"] == "true"
    assert view["graph"]["cycle"] == ring
    nodes, edges, _ = drawn(view["graph"]["svg"])
    for name in ring:
        assert {"node", "process", "and", "deadlocked", "cycle"} <= nodes[name]
    assert "deadlocked" in nodes["X"] and "cycle" not in nodes["X"]  # waits on the cycle: stuck, not on it
    assert {"idle"} <= nodes["idle"] and "deadlocked" not in nodes["idle"]
    for waiter, target in [("P0", "P1"), ("P1", "P2"), ("P2", "P0")]:
        assert {"edge", "and", "deadlocked", "cycle"} <= edges[(waiter, target)]
    assert "cycle" not in edges[("X", "P0")]
    assert {n["id"] for n in view["graph"]["nodes"] if n["cycle"]} == set(ring)


def test_an_or_knot_is_flagged_and_or_edges_are_told_apart() -> None:
    cut = GlobalSnapshot(
        snapshot_id=8,
        processes=[
            proc("A", "B", "C", model=WAIT_MODEL_OR),
            proc("B", "A", model=WAIT_MODEL_OR),
            proc("C", "A", model=WAIT_MODEL_OR),
        ],
    )
    view = view_of(cut)
    assert predicates(view)["deadlock"] == "true"
    assert sorted(view["graph"]["knot"]) == ["A", "B", "C"]
    nodes, edges, _ = drawn(view["graph"]["svg"])
    assert all({"or", "knot", "deadlocked"} <= nodes[n] for n in "ABC")
    assert {"edge", "or", "knot"} <= edges[("A", "C")]
    # An OR waiter with one free target is not deadlocked: nothing red.
    free = view_of(
        GlobalSnapshot(snapshot_id=9, processes=[proc("A", "B", "C", model=WAIT_MODEL_OR), proc("B"), proc("C", "A")])
    )
    nodes, edges, _ = drawn(free["graph"]["svg"])
    assert predicates(free)["deadlock"] == "false"
    assert "deadlocked" not in nodes["A"] and "or" in edges[("A", "B")]


def test_channels_with_messages_in_flight_are_flagged_and_the_waits_they_satisfy_set_apart() -> None:
    cut = GlobalSnapshot(
        snapshot_id=10,
        processes=[proc("P", "Q"), proc("Q", active=True), proc("R")],
        channels=[
            # Q -> P holds a message that wakes P: P's wait on Q does not count.
            {"src": "Q", "dst": "P", "sent_before_marker": 1, "messages": [{"payload": b"x"}]},
            # R -> Q holds two heartbeats: in flight, but they wake no one.
            {"src": "R", "dst": "Q", "sent_before_marker": 2, "messages": [{"no_wake": True}, {"no_wake": True}]},
        ],
    )
    view = view_of(cut)
    assert predicates(view)["deadlock"] == "false"
    assert view["graph"]["channels"] == [
        {"src": "Q", "dst": "P", "messages": 1, "waking": 1},
        {"src": "R", "dst": "Q", "messages": 2, "waking": 0},
    ]
    _, edges, channels = drawn(view["graph"]["svg"])
    assert {"discounted"} <= edges[("P", "Q")] and "deadlocked" not in edges[("P", "Q")]
    assert channels[("Q", "P")].get("data-messages") == "1" and channels[("Q", "P")].get("data-waking") == "1"
    assert {"channel", "in-flight"} <= set(channels[("R", "Q")].get("class", "").split())


def test_an_open_cut_makes_whole_system_predicates_unknown_with_their_summary() -> None:
    cut = GlobalSnapshot(snapshot_id=11, processes=[proc("A")], expected_members=["A", "B"])
    view = view_of(cut)
    termination = next(p for p in view["predicates"] if p["name"] == "termination")
    assert termination["value"] == "unknown"
    assert termination["missing"] == ["B"] and "B" in termination["summary"]
    assert view["snapshot"]["closed"] is False
    assert view["timeline"][0]["values"]["termination"] == "unknown"
    members = build_view(ViewInputs(expected=("A", "B"), expected_count=3, latest=latest_of(
        summary(11), cut, evaluate(cut))))["members"]  # fmt: skip
    assert members["missing"] == ["A", "B"] and members["missing_count"] == 3 and members["cut_missing"] == ["B"]


def test_tasks_and_rpc_calls_are_nodes_of_their_own_kind() -> None:
    cut = GlobalSnapshot(
        snapshot_id=12,
        processes=[
            {"process_id": "A", "state": {"waits": [{"task": "worker", "targets": [{"process": "B"}]}]}},
            {"process_id": "B", "state": {"waits": [{"task": "/shop.Orders/Place#3", "targets": [{"process": "A"}]}]}},
        ],
    )
    kinds = {n["id"]: n["kind"] for n in view_of(cut)["graph"]["nodes"]}
    assert kinds["A/worker"] == "task" and kinds["B /shop.Orders/Place#3"] == "call" and kinds["B"] == "process"


def test_every_name_is_escaped_in_the_svg() -> None:
    evil = '<script>alert("x")</script>&'
    view = view_of(GlobalSnapshot(snapshot_id=13, processes=[proc(evil, "Q"), proc("Q", evil)]))
    svg = view["graph"]["svg"]
    assert "<script" not in svg
    nodes, _, _ = drawn(svg)
    assert {"deadlocked"} <= nodes[evil]  # the attribute holds the name exactly, once unescaped


def test_a_big_graph_is_drawn_deadlocked_nodes_first_and_the_rest_counted() -> None:
    chain = [proc(f"W{i:03}", f"W{i + 1:03}") for i in range(300)]  # a long chain to a free end
    cut = GlobalSnapshot(snapshot_id=14, processes=[*chain, proc("W300"), proc("D0", "D1"), proc("D1", "D0")])
    graph = view_of(cut)["graph"]
    assert graph["total_nodes"] == 303 and len(graph["nodes"]) == MAX_DRAWN_NODES
    assert {"D0", "D1"} <= {n["id"] for n in graph["nodes"]}
    ET.fromstring(graph["svg"])


def test_no_snapshot_yet_is_a_view_too() -> None:
    view = build_view(ViewInputs(detector="127.0.0.1:50051"))
    assert view["snapshot"] is None and view["predicates"] == [] and view["timeline"] == []
    ET.fromstring(view["graph"]["svg"])


# -- the live holder ----------------------------------------------------------------------------------------


def completed(snapshot_id: int, *processes: dict[str, Any]) -> tuple[SnapshotSummary, GlobalSnapshot, Any]:
    cut = GlobalSnapshot(snapshot_id=snapshot_id, processes=list(processes))
    return summary(snapshot_id), cut, evaluate(cut)


def test_the_live_view_keeps_the_timeline_the_changes_and_the_breaks() -> None:
    live = LiveView("here:1", ("A", "B"))
    live.finished(*completed(1, proc("A"), proc("B")))
    live.finished(summary(2, SNAPSHOT_OUTCOME_ABORTED, ms=5000, reason="deadline passed"))
    live.finished(*completed(4, proc("A", "B"), proc("B", "A")))
    live.finished(*completed(3, proc("A"), proc("B")))  # slow and older: timeline only
    _, body = live.json()
    view = json.loads(body)
    assert view["snapshot"]["id"] == 4 and predicates(view)["deadlock"] == "true"
    assert [(e["id"], e["outcome"]) for e in view["timeline"]] == [
        (1, "completed"),
        (2, "aborted"),
        (3, "completed"),
        (4, "completed"),
    ]
    assert view["timeline"][1]["reason"] == "deadline passed" and view["timeline"][1]["duration_ms"] == 5000
    deadlock = [(c["snapshot_id"], c["from"], c["to"]) for c in view["changes"] if c["predicate"] == "deadlock"]
    assert deadlock == [(4, "false", "true"), (1, None, "false")]  # newest first

    resolution = Resolution(resolution_id=1, snapshot_id=4, process_id="A", policy="youngest", deadlock="A -> B -> A")
    resolution.sent_at.FromMicroseconds(T0)
    live.add_resolution(resolution)
    resolution.detail = "changed by the detector afterwards"  # the view holds its own copy
    version = live.version
    assert live.wait_for_change(version, 0.01) == version  # nothing new: the same version back
    resolution.reported_at.FromMicroseconds(T0 + 1000)
    live.add_resolution(resolution)  # answered: replaces the first
    assert live.wait_for_change(version, TIMEOUT) == version + 1
    breaks = json.loads(live.json()[1])["breaks"]
    assert [(b["id"], b["outcome"], b["waiter"]) for b in breaks] == [(1, "unanswered", "A")]
    live.close()
    assert live.wait_for_change(live.version, TIMEOUT) is None


def test_event_streams_send_the_view_then_keep_alives_and_end_when_the_view_closes() -> None:
    live = LiveView("here:1")
    app = WebApp(live, Authorizer(required=False), keepalive=0.05, max_streams=1)
    statuses: list[str] = []

    def get(path: str) -> Any:
        return app({"REQUEST_METHOD": "GET", "PATH_INFO": path}, lambda status, headers: statuses.append(status))

    stream = get("/events")
    chunks = iter(stream)
    assert next(chunks) == b"retry: 2000\n\n"
    assert next(chunks).startswith(b"id: 0\nevent: view\ndata: {")
    assert next(chunks) == b": keep-alive\n\n"
    assert b"".join(get("/events")).startswith(b"1 event streams are open") and statuses[-1].startswith("503")
    live.set_members(())
    assert next(chunks).startswith(b"id: 1\nevent: view\n")
    live.close()
    assert list(chunks) == []
    stream.close()
    assert app.streams == 0


# -- served by a real detector ------------------------------------------------------------------------------


def fetch(url: str, context: ssl.SSLContext | None = None) -> tuple[int, str, str]:
    """Status, content type and body of a GET (an HTTP error's too)."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT, context=context) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read().decode()


class Events:
    """An ``/events`` stream read event by event (each read times out)."""

    def __init__(self, url: str, context: ssl.SSLContext | None = None) -> None:
        self.response = urllib.request.urlopen(url + "events", timeout=TIMEOUT, context=context)
        assert self.response.headers["Content-Type"] == "text/event-stream"

    def next(self) -> dict[str, Any] | None:
        """The next view (its JSON), or None once the stream ends."""
        fields: dict[str, str] = {}
        while True:
            line = self.response.readline()
            if not line:
                return None
            line = line.decode().rstrip("\n")
            if not line:
                if fields.get("event") == "view":
                    return json.loads(fields["data"])
                fields = {}
                continue
            if not line.startswith(":"):
                name, _, value = line.partition(": ")
                fields[name] = value

    def close(self) -> None:
        self.response.close()


@pytest.fixture
def ring(tmp_path: Path) -> Iterator[Running]:
    """A detector on plaintext loopback (the web view beside /metrics) with agents A -> B -> C -> A
    deadlocked, and no snapshot until a test triggers one."""
    config = DetectorConfig(
        data_dir=tmp_path / "data",
        listen="127.0.0.1:0",
        metrics_port=0,
        interval=None,
        expected_members=("A", "B", "C"),
        hints=False,  # snapshots only when a test triggers one
    )
    running = Running(config)
    agents = [Agent(name, detector=running.detector.address, heartbeat_interval=0.2) for name in "ABC"]
    try:
        for agent in agents:
            running.call(agent.start())
        poll(lambda: len(running.detector.coordinator.members) == 3, "three members")
        for agent, target in zip(agents, "BCA", strict=True):
            agent.state.add_wait([target])
        yield running
    finally:
        for agent in agents:
            running.call(agent.stop())
        running.stop()


def test_the_page_its_assets_and_its_data_are_served_beside_metrics(ring: Running) -> None:
    detector = ring.detector
    url = detector.web_url
    assert url is not None and detector.metrics_url is not None
    assert url == detector.metrics_url.removesuffix("metrics")
    snapshot_id = ring.call(detector.trigger()).snapshot.snapshot_id

    status, kind, page = fetch(url)
    assert (status, kind) == (200, "text/html; charset=utf-8")
    assert 'id="snapshot-id"' in page and 'src="static/view.js"' in page
    assert fetch(url + "static/view.js")[:2] == (200, "text/javascript; charset=utf-8")
    assert fetch(url + "static/view.css")[:2] == (200, "text/css; charset=utf-8")
    assert fetch(url + "static/../web_view.py")[0] == 404
    assert "stablewatch_snapshots_total" in fetch(detector.metrics_url)[2]  # /metrics as before

    status, kind, body = fetch(url + "api/view")
    view = json.loads(body)
    assert (status, kind) == (200, "application/json")
    assert view["snapshot"]["id"] == snapshot_id and predicates(view)["deadlock"] == "true"
    assert sorted(view["graph"]["cycle"]) == ["A", "B", "C"]
    assert [m["process_id"] for m in view["members"]["attached"]] == ["A", "B", "C"]
    nodes, _, _ = drawn(view["graph"]["svg"])
    assert all({"deadlocked", "cycle"} <= nodes[name] for name in "ABC")
    assert view["timeline"][-1]["id"] == snapshot_id and view["timeline"][-1]["duration_ms"] is not None

    request = urllib.request.Request(url + "api/view", method="POST", data=b"")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=TIMEOUT)
    assert refused.value.code == 405


def test_the_event_stream_delivers_each_new_snapshot(ring: Running) -> None:
    detector = ring.detector
    first = ring.call(detector.trigger()).snapshot.snapshot_id
    assert detector.web_url is not None
    events = Events(detector.web_url)
    try:
        view = events.next()
        assert view is not None and view["snapshot"]["id"] == first
        second = ring.call(detector.trigger()).snapshot.snapshot_id
        assert second != first
        while (view := events.next()) is not None and view["snapshot"]["id"] != second:
            pass  # a membership change may come between
        assert view is not None and view["version"] > 0 and predicates(view)["deadlock"] == "true"
    finally:
        events.close()


def test_the_event_stream_ends_cleanly_when_the_detector_stops(tmp_path: Path) -> None:
    running = Running(DetectorConfig(data_dir=tmp_path / "data", listen="127.0.0.1:0", metrics_port=0, interval=None))
    try:
        assert running.detector.web_url is not None
        events = Events(running.detector.web_url)
        assert events.next() is not None  # the present view, at once
    finally:
        running.stop()
    assert events.next() is None  # the end of the stream, not a timeout
    events.close()


def test_the_web_view_on_its_own_port(tmp_path: Path) -> None:
    config = DetectorConfig(data_dir=tmp_path / "data", listen="127.0.0.1:0", metrics_port=0, web_port=0, interval=None)
    running = Running(config)
    try:
        web, metrics = running.detector.web_url, running.detector.metrics_url
        assert web is not None and metrics is not None and web.rsplit(":", 1)[1] != metrics.rsplit(":", 1)[1]
        assert fetch(web)[0] == 200
        assert fetch(web + "metrics")[0] == 404  # /metrics stays on its own port
        assert "stablewatch_snapshots_total" in fetch(metrics.removesuffix("metrics"))[2]  # prometheus answers any path
    finally:
        running.stop()


def test_the_detector_command_reports_and_logs_the_web_view(tmp_path: Path) -> None:
    process = DetectorProcess(tmp_path / "data", "--web-port", "0", "--interval", "off")
    try:
        ready = json.loads(process.stdout.seen[0])
        assert ready["web"].startswith("http://127.0.0.1:") and ready["web"] != ready["metrics"].removesuffix("metrics")
        assert fetch(ready["web"] + "api/view")[0] == 200
        poll(lambda: any("web view on " + ready["web"] in line for line in process.stderr.seen), "the log line")
    finally:
        assert process.stop() == 0
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        result = stablewatch(
            "detector", "--listen", "127.0.0.1:0", "--metrics-port", "0", "--web-port", str(port),
            "--data-dir", str(tmp_path / "other"), "--interval", "off",
        )  # fmt: skip
    assert result.returncode == 1
    assert f"the detector cannot start: the web view on 127.0.0.1:{port}: Address already in use" in result.stderr


# -- mutual TLS: readers only ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mtls(tmp_path_factory: pytest.TempPathFactory, pki: dict[str, Path]) -> Iterator[Running]:
    with mtls_detector(tmp_path_factory.mktemp("web-mtls"), pki) as running:
        yield running


def tls(pki: dict[str, Path], name: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=pki["ca_cert"])
    if name is not None:
        context.load_cert_chain(pki[f"{name}_cert"], pki[f"{name}_key"])
    return context


@pytest.mark.parametrize("name", ["reader", "operator"])
def test_a_reader_may_look_under_mutual_tls(mtls: Running, pki: dict[str, Path], name: str) -> None:
    url = mtls.detector.web_url
    assert url is not None and url.startswith("https://127.0.0.1:")
    assert fetch(url, tls(pki, name))[0] == 200
    assert json.loads(fetch(url + "api/view", tls(pki, name))[2])["snapshot"] is None
    events = Events(url, tls(pki, name))
    try:
        assert events.next() is not None
    finally:
        events.close()


@pytest.mark.parametrize("name", ["agent_P", "nobody"])
def test_a_certificate_without_a_role_gets_403_and_metrics_as_before(
    mtls: Running, pki: dict[str, Path], name: str
) -> None:
    url, metrics = mtls.detector.web_url, mtls.detector.metrics_url
    assert url is not None and metrics is not None
    refused = mtls.metric("stablewatch_refused_total", reason="permission_denied")
    for path in ("", "api/view", "events", "static/view.js"):
        status, _, body = fetch(url + path, tls(pki, name))
        assert status == 403, path
        assert "the web view needs a client certificate with the URI SAN stablewatch://role/reader" in body
    assert mtls.metric("stablewatch_refused_total", reason="permission_denied") == refused + 4
    assert "stablewatch_refused_total" in fetch(metrics, tls(pki, name))[2]  # any certificate of the CA scrapes


def test_a_client_without_a_certificate_cannot_connect(mtls: Running, pki: dict[str, Path]) -> None:
    url = mtls.detector.web_url
    assert url is not None
    with pytest.raises((OSError, http.client.HTTPException)):
        fetch(url, tls(pki, None))
    with pytest.raises((OSError, http.client.HTTPException)):
        fetch(url.replace("https://", "http://"))
