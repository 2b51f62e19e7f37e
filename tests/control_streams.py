"""Hand-driven control streams against a detector, for tests of its side of the protocol: one
registration, or an agent that sends whatever a test wants."""

from __future__ import annotations

import asyncio

import grpc

from stablewatch.testing.detector import Running
from stablewatch.v1 import AgentMessage, DetectorMessage, LocalSnapshotPart, control_pb2, control_pb2_grpc


def register(
    address: str,
    creds: grpc.ChannelCredentials | None,
    process_id: str,
    agent_address: str = "x:1",
    timeout: float = 60,
) -> tuple[grpc.StatusCode, str]:
    """Open a control stream and register; the reply's kind, or the status code and details that ended it.

    The blocking client, because it reports the status the detector sent: when the detector
    refuses a stream before reading it, a grpc.aio client's write races that status and may
    report INTERNAL ("Internal error from Core") instead.
    """
    channel = grpc.insecure_channel(address) if creds is None else grpc.secure_channel(address, creds)
    with channel:
        message = AgentMessage(register=control_pb2.Register(process_id=process_id, address=agent_address))
        replies = control_pb2_grpc.ControlStub(channel).Attach(iter([message]), timeout=timeout)
        try:
            return grpc.StatusCode.OK, next(replies).WhichOneof("kind")
        except grpc.RpcError as error:
            return error.code(), error.details() or ""
        finally:
            replies.cancel()


class RawAgent:
    """A hand-driven control stream: registers as ``process_id`` (following ``known_epoch``) and
    sends whatever a test wants."""

    def __init__(self, running: Running, process_id: str, known_epoch: int = 0) -> None:
        self.running = running
        self.process_id = process_id
        self.received: list[DetectorMessage] = []
        self.outbox: asyncio.Queue[AgentMessage | None] = asyncio.Queue()
        register = control_pb2.Register(process_id=process_id, address="x:1", known_epoch=known_epoch)
        self.task = asyncio.run_coroutine_threadsafe(self._run(register), running.loop)

    async def _run(self, register: control_pb2.Register) -> None:
        async with grpc.aio.insecure_channel(self.running.detector.address) as channel:
            call = control_pb2_grpc.ControlStub(channel).Attach()
            await call.write(AgentMessage(register=register))

            async def read() -> None:
                async for message in call:
                    self.received.append(message)

            reader = asyncio.ensure_future(read())
            while (message := await self.outbox.get()) is not None:
                await call.write(message)
            reader.cancel()
            call.cancel()

    def send_part(self, part: LocalSnapshotPart) -> None:
        self.send(AgentMessage(part=part))

    def send(self, message: AgentMessage) -> None:
        self.running.loop.call_soon_threadsafe(self.outbox.put_nowait, message)

    def starts(self) -> list[int]:
        return [m.start.snapshot_id for m in self.received if m.WhichOneof("kind") == "start"]

    def aborts(self) -> list[int]:
        return [m.abort.snapshot_id for m in self.received if m.WhichOneof("kind") == "abort"]

    def close(self) -> None:
        self.running.loop.call_soon_threadsafe(self.outbox.put_nowait, None)
        self.task.result(10)
