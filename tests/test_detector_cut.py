"""The detector end to end on partial cuts: expected members, unknown results, aborts for every stray recording.

Agents here are hand-driven control streams (:class:`control_streams.RawAgent`), so that each
test says exactly which parts the detector gets.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from control_streams import RawAgent

from polling import poll
from stablewatch.cli.client import DetectorClient, DetectorError
from stablewatch.cli.main import main
from stablewatch.detector.evaluation import verdict
from stablewatch.detector.service.detector import DetectorConfig
from stablewatch.detector.service.query import outcome_name
from stablewatch.testing.detector import Running
from stablewatch.v1 import LocalSnapshotPart, LocalState, OutboundCount
from stablewatch.v1.query_pb2 import SnapshotResults

pytestmark = pytest.mark.timeout(60)


def start(tmp_path: Path, **options: object) -> Running:
    config = DetectorConfig(data_dir=tmp_path / "data", listen="127.0.0.1:0", metrics_port=0, interval=None)
    for name, value in options.items():
        setattr(config, name, value)
    return Running(config)


@pytest.fixture
def detector(tmp_path: Path) -> Iterator[Running]:
    running = start(tmp_path, expected_members=("P", "Q", "W"))
    yield running
    running.stop()


def attach(running: Running, *pids: str) -> list[RawAgent]:
    agents = [RawAgent(running, pid) for pid in pids]
    poll(lambda: set(pids) <= set(running.detector.coordinator.members), f"{', '.join(pids)} to attach")
    return agents


def snapshot_with(
    running: Running, agents: list[RawAgent], *, outbound: dict[str, list[str]] | None = None, tokens: int = 5
) -> SnapshotResults:
    """Take a snapshot; each agent answers with a passive state holding `tokens` (and these channels)."""
    before = {agent: len(agent.starts()) for agent in agents}  # before the start can arrive
    pending: concurrent.futures.Future[SnapshotResults] = asyncio.run_coroutine_threadsafe(
        running.detector.take_snapshot(deadline=10), running.loop
    )
    poll(lambda: all(len(a.starts()) > before[a] for a in agents), "StartSnapshot at every agent")
    for agent in agents:
        pid = agent.process_id
        part = LocalSnapshotPart(
            snapshot_id=agent.starts()[-1], process_id=pid, state=LocalState(counters={"t": tokens})
        )
        part.outbound.extend(OutboundCount(dst=dst) for dst in (outbound or {}).get(pid, []))
        agent.send_part(part)
    return pending.result(20)


def verdicts(results: SnapshotResults) -> dict[str, str]:
    return {r.name: verdict(r) for r in results.results}


def test_an_expected_member_that_is_not_attached_makes_whole_system_predicates_unknown(detector: Running) -> None:
    # W is declared (--members P,Q,W) but its control stream is down: it may well be working.
    # Neither P nor Q waits on anything, so no deadlock among them is decided all the same.
    agents = attach(detector, "P", "Q")
    try:
        results = snapshot_with(detector, agents)
        assert outcome_name(results.snapshot.outcome) == "completed"
        assert verdicts(results) == {"deadlock": "false", "termination": "unknown", "conservation(t)": "unknown"}
        termination = results.results[1]
        assert list(termination.missing_processes) == ["W"]
        assert detector.metric("stablewatch_predicate_value", predicate="termination") == 0
        assert detector.metric("stablewatch_predicate_unknown", predicate="termination") == 1
        # No baseline from a partial cut: nothing is stored as the expected total.
        assert detector.on_loop(detector.detector.store.expected_totals) == {}

        agents += attach(detector, "W")
        results = snapshot_with(detector, agents)
        assert verdicts(results) == {"deadlock": "false", "termination": "true", "conservation(t)": "true"}
        assert detector.metric("stablewatch_predicate_unknown", predicate="termination") == 0
        assert detector.on_loop(detector.detector.store.expected_totals) == {"t": 15}  # the closed cut's baseline
    finally:
        for agent in agents:
            agent.close()


def test_a_channel_to_a_process_never_attached_opens_the_cut(tmp_path: Path) -> None:
    running = start(tmp_path)
    agents = attach(running, "P", "Q")
    try:
        results = snapshot_with(running, agents, outbound={"P": ["ghost"]})
        assert outcome_name(results.snapshot.outcome) == "completed"
        assert verdicts(results)["termination"] == "unknown"
        assert list(results.results[1].missing_processes) == ["ghost"]
    finally:
        for agent in agents:
            agent.close()
        running.stop()


def test_trigger_snapshot_honours_expected_members_and_min_members(tmp_path: Path) -> None:
    running = start(tmp_path, min_members=2)
    agents = attach(running, "P")
    try:
        with DetectorClient(running.detector.address) as client:
            with pytest.raises(DetectorError) as refused:
                client.trigger_snapshot(deadline=5)
            assert "min-members" in str(refused.value)
            agents += attach(running, "Q")

            pending = concurrent.futures.ThreadPoolExecutor(1).submit(
                client.trigger_snapshot, deadline=10, expected_members=["P", "Q", "R"]
            )
            poll(lambda: all(a.starts() for a in agents), "StartSnapshot at both")
            for agent in agents:
                state = LocalState(counters={"t": 1})
                agent.send_part(
                    LocalSnapshotPart(snapshot_id=agent.starts()[-1], process_id=agent.process_id, state=state)
                )
            results = pending.result(20)
        assert verdicts(results)["termination"] == "unknown"
        assert list(results.results[1].missing_processes) == ["R"]
    finally:
        for agent in agents:
            agent.close()
        running.stop()


def test_every_rejected_part_ends_its_senders_recording(tmp_path: Path) -> None:
    running = start(tmp_path)
    agents = attach(running, "P")
    try:
        pending = asyncio.run_coroutine_threadsafe(running.detector.take_snapshot(deadline=10), running.loop)
        poll(lambda: agents[0].starts(), "StartSnapshot at P")
        snapshot_id = agents[0].starts()[0]
        # R attached after the snapshot began, heard of it through a marker, and records it: it is
        # no member, so no done or abort would ever reach it. The detector tells it to forget.
        (late,) = attach(running, "R")
        late.send_part(LocalSnapshotPart(snapshot_id=snapshot_id, process_id="R", state=LocalState()))
        poll(lambda: running.metric("stablewatch_rejected_parts_total", reason="not_member") == 1, "the rejection")
        poll(lambda: late.aborts() == [snapshot_id], "an abort sent to R")
        # An id no detector started (a marker from an earlier detector's snapshot): aborted too.
        late.send_part(LocalSnapshotPart(snapshot_id=12345, process_id="R", state=LocalState()))
        poll(lambda: late.aborts() == [snapshot_id, 12345], "an abort of the unknown snapshot")
        agents[0].send_part(LocalSnapshotPart(snapshot_id=snapshot_id, process_id="P", state=LocalState()))
        assert outcome_name(pending.result(20).snapshot.outcome) == "completed"
        assert late.aborts() == [snapshot_id, 12345]  # the member P's snapshot went on untouched
        agents.append(late)
    finally:
        for agent in agents:
            agent.close()
        running.stop()


def test_start_snapshot_carries_the_deadline_and_registration_the_epoch(tmp_path: Path) -> None:
    running = start(tmp_path)
    (agent,) = attach(running, "P")
    try:
        pending = asyncio.run_coroutine_threadsafe(running.detector.take_snapshot(deadline=7.5), running.loop)
        poll(lambda: agent.starts(), "StartSnapshot at P")
        start_message = next(m.start for m in agent.received if m.WhichOneof("kind") == "start")
        assert start_message.deadline_ms == 7500
        registered = next(m.registered for m in agent.received if m.WhichOneof("kind") == "registered")
        assert registered.detector_epoch == running.on_loop(lambda: running.detector.store.epoch) != 0
        agent.send_part(LocalSnapshotPart(snapshot_id=agent.starts()[0], process_id="P", state=LocalState()))
        pending.result(20)
    finally:
        agent.close()
        running.stop()


def test_a_second_detector_on_the_same_data_directory_is_refused(tmp_path: Path) -> None:
    running = start(tmp_path)
    try:
        with pytest.raises(Exception, match="in use by another detector"):
            start(tmp_path)
    finally:
        running.stop()
    start(tmp_path).stop()  # released on stop


def test_unknown_reaches_the_watch_stream_and_the_client(detector: Running) -> None:
    agents = attach(detector, "P", "Q")
    try:
        with DetectorClient(detector.detector.address) as client:
            snapshot_with(detector, agents)
            latest = client.latest_results()
        termination = latest.results[1]
        assert termination.unknown and not termination.holds
        members = client_members(detector)
        assert list(members.expected_missing) == ["W"]
    finally:
        for agent in agents:
            agent.close()


def client_members(running: Running):
    with grpc.insecure_channel(running.detector.address) as channel:
        from stablewatch.v1 import query_pb2, query_pb2_grpc

        return query_pb2_grpc.QueryStub(channel).ListMembers(query_pb2.ListMembersRequest(), timeout=10)


def test_status_names_the_expected_members_that_are_missing(
    detector: Running, capsys: pytest.CaptureFixture[str]
) -> None:
    agents = attach(detector, "P")
    try:
        assert main(["status", "--detector", detector.detector.address, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["expected_missing"] == ["Q", "W"]
        assert main(["status", "--detector", detector.detector.address]) == 0
        assert "expected but not attached: Q, W" in capsys.readouterr().out
    finally:
        for agent in agents:
            agent.close()


@pytest.mark.parametrize(
    ("argument", "parsed"), [("A,B,A", (("A", "B"), 0)), ("5", ((), 5)), (" W1 , W2 ", (("W1", "W2"), 0))]
)
def test_members_option(argument: str, parsed: tuple[tuple[str, ...], int]) -> None:
    from stablewatch.cli.arguments import members as _members

    assert _members(argument) == parsed


@pytest.mark.parametrize("argument", ["", "A,,B", "0", ","])
def test_bad_members_option_exits_2(argument: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["detector", "--members", argument])
    assert exited.value.code == 2
    assert "--members" in capsys.readouterr().err
