"""Snapshot ids of detectors side by side: the id spaces (stablewatch.v1.ids) and the coordinator's use of them."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polling import run
from stablewatch.detector.service.coordinator import Coordinator, SnapshotAborted
from stablewatch.v1 import AgentMessage, DetectorMessage, control_pb2, control_pb2_grpc
from stablewatch.v1.ids import ID_SPACES, LOCAL_ID_BASE, id_space, next_id, space_problem

# Detector ids are uint64 below the local ones; clocks in microseconds stay far below that.
IDS = st.integers(min_value=0, max_value=LOCAL_ID_BASE // 2)
SPACES = st.integers(min_value=0, max_value=ID_SPACES - 1)


# -- next_id --------------------------------------------------------------------------------------


@settings(max_examples=500, deadline=None, derandomize=True)
@given(last=IDS, now=IDS, space=SPACES)
def test_next_id_is_the_smallest_id_of_its_space_above_last_and_near_the_clock(last: int, now: int, space: int) -> None:
    new = next_id(last, now, space)
    assert id_space(new) == space
    assert new > last
    floor = now - now % ID_SPACES
    assert new >= floor  # never behind the clock (rounded down to the spaces' period)
    if last < now:
        assert new - now < ID_SPACES  # within 127 µs of the clock when last is behind it
    if last < floor:
        assert new < floor + ID_SPACES  # the clock's own period (not so when last is within it)
    # The smallest such id: one period less is either not above last or behind the clock.
    assert new - ID_SPACES <= last or new - ID_SPACES < floor


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    nows=st.lists(IDS, min_size=1, max_size=30),
    spaces=st.lists(SPACES, min_size=2, max_size=4, unique=True),
)
def test_replicas_given_the_same_clock_never_collide_and_each_increases(nows: list[int], spaces: list[int]) -> None:
    handed: dict[int, list[int]] = {space: [] for space in spaces}
    for space in spaces:
        last = 0
        for now in nows:
            last = next_id(last, now, space)
            handed[space].append(last)
    for space, ids in handed.items():
        assert ids == sorted(set(ids)), f"space {space} did not increase"
    every = [i for ids in handed.values() for i in ids]
    assert len(every) == len(set(every))


def test_replica_0_hands_out_the_multiples_of_128_and_ids_stay_positive() -> None:
    assert next_id(0, 0, 0) == ID_SPACES  # never 0: 0 is no snapshot id on the wire
    assert next_id(0, 0, 1) == 1
    assert next_id(ID_SPACES, 0, 0) == 2 * ID_SPACES
    assert next_id(5, 1000, 3) == 1000 - 1000 % ID_SPACES + 3
    assert next_id(10_000, 1000, 3) == 10_000 + (3 - 10_001) % ID_SPACES + 1  # last is ahead of the clock


def test_space_problem_names_what_is_wrong() -> None:
    for space in (0, 1, ID_SPACES - 1):
        assert space_problem(space) is None
    assert "out of range" in (space_problem(ID_SPACES) or "")
    assert "out of range" in (space_problem(-1) or "")
    assert "integer" in (space_problem(True) or "")  # type: ignore[arg-type]
    assert "integer" in (space_problem("1") or "")  # type: ignore[arg-type]


# -- the coordinator ------------------------------------------------------------------------------


def test_a_coordinator_allocates_in_its_space_and_refuses_ids_outside_it() -> None:
    coordinator = Coordinator(id_space=5)
    with pytest.raises(ValueError, match="id space 5"):
        coordinator.begin_snapshot(ID_SPACES * 3)  # space 0: another detector's
    with pytest.raises(ValueError, match="id space 5"):
        coordinator.begin_snapshot(ID_SPACES * 3 + 6)
    # Its own ids: the refused ones did not move the sequence. No agent is attached, so each aborts.
    with pytest.raises(SnapshotAborted) as first:
        coordinator.begin_snapshot()
    assert first.value.snapshot_id == 5
    with pytest.raises(SnapshotAborted) as given_id:
        coordinator.begin_snapshot(ID_SPACES * 3 + 5)
    assert given_id.value.snapshot_id == ID_SPACES * 3 + 5
    with pytest.raises(SnapshotAborted) as after:
        coordinator.begin_snapshot()
    assert after.value.snapshot_id == ID_SPACES * 4 + 5
    with pytest.raises(ValueError, match="not above the last one"):
        coordinator.begin_snapshot(ID_SPACES * 2 + 5)


@pytest.mark.parametrize("space", [-1, ID_SPACES, True])
def test_a_coordinator_refuses_a_space_that_is_no_replica(space: int) -> None:
    with pytest.raises(ValueError, match="replica"):
        Coordinator(id_space=space)


def test_registered_tells_the_agent_its_detectors_id_space() -> None:
    async def body() -> control_pb2.Registered:
        server = grpc.aio.server()
        control_pb2_grpc.add_ControlServicer_to_server(Coordinator(id_space=7, heartbeat_interval=0.5), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = control_pb2_grpc.ControlStub(channel).Attach()
                await call.write(AgentMessage(register=control_pb2.Register(process_id="p1", address="x:1")))
                reply: DetectorMessage = await asyncio.wait_for(call.read(), 10)
                call.cancel()
                return reply.registered
        finally:
            await server.stop(grace=0)

    registered = run(body())
    assert (registered.id_space, registered.heartbeat_interval_ms) == (7, 500)
