"""A scripted detector on a loopback port and a service's recording callbacks, for tests of the
agent's control client (:class:`~stablewatch.agents.control.ControlClient`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from stablewatch.agents.control import ControlClient
from stablewatch.v1 import AgentMessage, DetectorMessage
from stablewatch.v1.control_pb2 import BreakReport, BreakWait, Refused, Registered, StartSnapshot
from stablewatch.v1.control_pb2_grpc import ControlServicer, add_ControlServicer_to_server

__all__ = ["Agent", "FakeDetector", "serve", "session", "start"]


class FakeDetector(ControlServicer):
    """Records every stream's messages and sends what the test tells it to on the latest stream
    (or on the latest stream of one process, :meth:`send_to`)."""

    def __init__(
        self, refuse: int = 0, heartbeat_interval_ms: int = 0, epoch: int = 0, answer: asyncio.Event | None = None
    ) -> None:
        self.refuse = refuse
        self.answer = answer  # when given, Registered is sent only once it is set
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.epoch = epoch
        self.registrations: list[AgentMessage] = []
        self.received: list[AgentMessage] = []  # everything after Register, over all streams
        self._outbox: asyncio.Queue[DetectorMessage] | None = None
        self._outboxes: dict[str, asyncio.Queue[DetectorMessage]] = {}  # each process's latest stream

    async def Attach(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        self.registrations.append(first)
        if self.refuse > 0:
            self.refuse -= 1
            await context.write(DetectorMessage(refused=Refused(reason="attached elsewhere")))
            return
        outbox: asyncio.Queue[DetectorMessage] = asyncio.Queue()
        self._outbox = outbox
        self._outboxes[first.register.process_id] = outbox
        if self.answer is not None:
            await self.answer.wait()
        registered = Registered(
            detector_id="fake", heartbeat_interval_ms=self.heartbeat_interval_ms, detector_epoch=self.epoch
        )
        await context.write(DetectorMessage(registered=registered))

        async def write() -> None:
            while True:
                await context.write(await outbox.get())

        writer = asyncio.create_task(write())
        try:
            while (message := await context.read()) is not grpc.aio.EOF:
                self.received.append(message)
        finally:
            writer.cancel()

    def send(self, message: DetectorMessage) -> None:
        """Send ``message`` on the latest accepted stream."""
        assert self._outbox is not None, "no agent attached"
        self._outbox.put_nowait(message)

    def send_to(self, process_id: str, message: DetectorMessage) -> None:
        """Send ``message`` on the latest accepted stream of ``process_id``."""
        assert process_id in self._outboxes, f"{process_id} never attached"
        self._outboxes[process_id].put_nowait(message)

    def attached(self, process_id: str) -> bool:
        """Whether ``process_id`` has had a stream accepted (and answered with Registered)."""
        return process_id in self._outboxes

    def break_wait(
        self, process_id: str, instance: int, *, break_id: int, snapshot_id: int = 1, task: str = ""
    ) -> None:
        """Send ``process_id`` a ``BreakWait`` for its wait ``instance`` (the cycle "A -> B -> A")."""
        order = BreakWait(
            break_id=break_id,
            snapshot_id=snapshot_id,
            instance=instance,
            task=task,
            deadlock="A -> B -> A",
            knows_failed=True,  # as today's detectors
        )
        self.send_to(process_id, DetectorMessage(break_wait=order))

    def report(self, break_id: int) -> BreakReport | None:
        """The ``BreakReport`` answering break ``break_id``, once it has come (None before)."""
        return next((r for r in self.of_kind("break_report") if r.break_id == break_id), None)

    def of_kind(self, kind: str) -> list[Any]:
        """The received messages of one kind ("part", "heartbeat", ...), unwrapped, in order."""
        return [getattr(m, kind) for m in self.received if m.WhichOneof("kind") == kind]


async def serve(detector: FakeDetector, port: int = 0) -> tuple[grpc.aio.Server, int]:
    """Start ``detector`` on 127.0.0.1 (``port`` 0: one the OS picks); return the server and its port."""
    server = grpc.aio.server()
    add_ControlServicer_to_server(detector, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound


class Agent:
    """What the service would do with the callbacks: remember what was started and finished."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.finished: list[int] = []
        self.events: list[tuple[str, str]] = []
        self.lifetimes: list[float | None] = []
        self.calls: list[tuple[str, int]] = []  # starts, finishes and epochs, in the order they ran

    async def on_start(self, snapshot_id: int, lifetime: float | None) -> None:
        self.started.append(snapshot_id)
        self.lifetimes.append(lifetime)
        self.calls.append(("start", snapshot_id))

    def on_finish(self, snapshot_id: int) -> None:
        self.finished.append(snapshot_id)
        self.calls.append(("finish", snapshot_id))

    def on_epoch(self, epoch: int) -> None:
        self.calls.append(("epoch", epoch))

    def on_event(self, kind: str, detail: str) -> None:
        self.events.append((kind, detail))

    def client(self, port: int, **kwargs: Any) -> ControlClient:
        options: dict[str, Any] = {"backoff_initial": 0.01, "backoff_max": 0.1, "heartbeat_interval": 60.0}
        options.update(kwargs)
        return ControlClient(
            "p1",
            "127.0.0.1:7001",
            f"127.0.0.1:{port}",
            on_start=options.pop("on_start", self.on_start),
            on_finish=self.on_finish,
            on_epoch=self.on_epoch,
            on_event=self.on_event,
            **options,
        )


def start(k: int) -> DetectorMessage:
    """The detector's StartSnapshot ``k``."""
    return DetectorMessage(start=StartSnapshot(snapshot_id=k))


@contextlib.asynccontextmanager
async def session(detector: FakeDetector, agent: Agent, **options: Any) -> AsyncIterator[ControlClient]:
    """``agent``'s control client (``options`` as :meth:`Agent.client` takes them), started against
    ``detector`` served on a free port; the client and then the server stopped at the end."""
    server, port = await serve(detector)
    client = agent.client(port, **options)
    await client.start()
    try:
        yield client
    finally:
        await client.stop()
        await server.stop(None)
