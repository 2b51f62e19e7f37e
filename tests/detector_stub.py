"""The detector's coordinator on its own event-loop thread, so synchronous tests can drive it."""

from __future__ import annotations

import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc

from stablewatch.agents.loop_thread import LoopThread
from stablewatch.detector.assembly import PartRejected
from stablewatch.detector.service.coordinator import Coordinator, SnapshotAborted
from stablewatch.v1 import GlobalSnapshot, control_pb2_grpc

__all__ = ["SnapshotAborted", "StubDetector"]

T = TypeVar("T")


class StubDetector:
    """A control server on 127.0.0.1 that runs one-hop snapshots on demand."""

    def __init__(self, heartbeat_interval: float = 0.2) -> None:
        self._loop_thread = LoopThread("stub-detector")
        self._loop_thread.start()
        self.rejections: list[PartRejected] = []
        self.coordinator = Coordinator(heartbeat_interval=heartbeat_interval, on_rejected=self.rejections.append)
        self.port = self._call(self._serve())

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def members(self) -> list[str]:
        return sorted(self.coordinator.members)

    def wait_members(self, expected: set[str], timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while set(self.coordinator.members) != expected:
            if time.monotonic() > deadline:
                raise TimeoutError(f"members {self.members()}, expected {sorted(expected)}")
            time.sleep(0.01)

    def snapshot(self, timeout: float = 20) -> GlobalSnapshot:
        """A snapshot of every attached agent; raises SnapshotAborted when it cannot complete."""
        return self._call(self.coordinator.snapshot(timeout), timeout + 5)

    def ping_all(self, timeout: float = 10) -> float:
        return self._call(self.coordinator.ping_all(timeout), timeout + 5)

    def stop(self) -> None:
        try:
            self._call(self._server.stop(grace=0))
        finally:
            self._loop_thread.stop(10)

    async def _serve(self) -> int:
        self._server = grpc.aio.server()
        control_pb2_grpc.add_ControlServicer_to_server(self.coordinator, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        return port

    def _call(self, coroutine: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return self._loop_thread.run(coroutine, timeout)
