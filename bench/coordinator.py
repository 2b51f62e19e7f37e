"""The detector's coordinator alone, served in the benchmark's process, for the benchmarks whose agents
run in child processes: attaching, and snapshots on the detector's own schedule."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc

from stablewatch.detector.service.coordinator import Coordinator, SnapshotAborted
from stablewatch.detector.service.scheduler import Scheduler
from stablewatch.v1 import control_pb2_grpc

__all__ = ["attached", "served_coordinator", "stop_snapshots", "take_snapshots"]


@contextlib.asynccontextmanager
async def served_coordinator(id_space: int = 0) -> AsyncIterator[tuple[Coordinator, str]]:
    """A coordinator (heartbeats every second) on a free loopback port: it and its address.

    ``id_space``: its replica number; a second detector beside the first needs another one.
    """
    coordinator = Coordinator(heartbeat_interval=1.0, id_space=id_space)
    server = grpc.aio.server()
    control_pb2_grpc.add_ControlServicer_to_server(coordinator, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        yield coordinator, address
    finally:
        await server.stop(0)


async def attached(coordinator: Coordinator, members: set[str], timeout: float = 30) -> None:
    """Return once exactly ``members`` are attached; TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while set(coordinator.members) != members:
        if time.monotonic() > deadline:
            raise TimeoutError(f"agents did not attach to the detector: {sorted(coordinator.members)}")
        await asyncio.sleep(0.01)


async def take_snapshots(coordinator: Coordinator, completed: list[float], per_second: float = 10) -> None:
    """Snapshots on the detector's own schedule until cancelled; appends when each one completed.

    The detector's :class:`Scheduler` with its defaults (jitter 0.1, at most 2 at once, deadline
    5 s): what a user gets from ``stablewatch detector --interval 0.1``.
    """

    async def take() -> None:
        with contextlib.suppress(SnapshotAborted):
            await coordinator.snapshot(5.0)
            completed.append(time.monotonic())

    scheduler = Scheduler(take, interval=1 / per_second, seed=1)
    scheduler.start()
    try:
        await asyncio.Event().wait()  # until the case ends and cancels this task
    finally:
        await scheduler.stop()


async def stop_snapshots(snapshots: asyncio.Future[None]) -> None:
    """Cancel a :func:`take_snapshots` task and wait until its schedule has stopped."""
    snapshots.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await snapshots
