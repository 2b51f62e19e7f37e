"""The agent's control client reports a detector's refusal with the detector's code, every time.

The detector refuses some control streams before it reads them (over mutual TLS, a certificate
that names no process: PERMISSION_DENIED; an identity that already holds its unregistered
streams: RESOURCE_EXHAUSTED). The client's Register is then often still being written, and
grpc.aio turns such a write into INTERNAL ("Internal error from Core"); the client must still
report ``refused`` with the detector's code, never ``unreachable``, or a misconfigured agent says
the detector is down. On 127.0.0.1 the race shows in about a fifth of quick attempts, so a few
hundred of them (well under a second) catch it. The client must also stop at once while it
attempts, even as a refusal arrives.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import grpc
from certs import credentials

from conftest import limited_detector
from polling import async_poll, run
from stablewatch.agents.control import ControlClient
from stablewatch.detector.service.limits import Limits
from stablewatch.testing.detector import Running
from stablewatch.v1.control_pb2_grpc import ControlStub

ATTEMPTS = 300  # before the fix, 55 and 63 of 300 were reported as unreachable (INTERNAL)


async def _never_started(snapshot_id: int, lifetime: float | None) -> None:
    raise AssertionError(f"a refused agent was asked to start snapshot {snapshot_id}")


async def reports(running: Running, process_id: str, creds: grpc.ChannelCredentials) -> list[tuple[str, str]]:
    """The events of ``process_id``'s control client attaching with ``creds`` over and over (backoff
    of a millisecond), once it has made ``ATTEMPTS`` attempts and stopped."""
    events: list[tuple[str, str]] = []
    client = ControlClient(
        process_id,
        "127.0.0.1:7001",
        running.detector.address,
        on_start=_never_started,
        on_finish=lambda snapshot_id: None,
        credentials=creds,
        backoff_initial=0.001,
        backoff_max=0.001,
        on_event=lambda kind, detail: events.append((kind, detail)),
    )
    await client.start()
    try:
        await async_poll(lambda: len(events) >= ATTEMPTS, f"{ATTEMPTS} attempts")
    finally:
        started_at = time.monotonic()
        await client.stop()  # a stop it missed would wait for run's timeout, which stop then absorbs
        took = time.monotonic() - started_at
    assert took < 5.0, f"stopping took {took:.1f} s: the client went on attempting"
    return events


def assert_all_refused(events: list[tuple[str, str]], code: grpc.StatusCode) -> None:
    kinds = Counter(f"{kind} {detail.partition(':')[0]}" for kind, detail in events)
    assert kinds == {f"refused {code.name}": len(events)}, kinds


def test_a_certificate_naming_no_process_is_always_reported_as_refused(tmp_path: Path, pki: dict[str, Path]) -> None:
    running = limited_detector(tmp_path / "data", pki)
    try:
        events = run(reports(running, "P", credentials(pki, "nobody")))
    finally:
        running.stop()
    assert_all_refused(events, grpc.StatusCode.PERMISSION_DENIED)
    assert "names no process" in events[0][1]


def test_too_many_unregistered_streams_are_always_reported_as_refused(tmp_path: Path, pki: dict[str, Path]) -> None:
    """Q holds its one unregistered stream (open, never registering); each attempt of Q's control
    client is refused with RESOURCE_EXHAUSTED before it is read."""
    limits = Limits(max_unregistered_per_identity=1, register_timeout=60.0)
    running = limited_detector(tmp_path / "data", pki, limits)

    async def scenario() -> list[tuple[str, str]]:
        creds = credentials(pki, "agent_Q")
        async with grpc.aio.secure_channel(running.detector.address, creds) as channel:
            held = ControlStub(channel).Attach()
            await async_poll(lambda: running.detector.coordinator.unregistered_streams == 1, "Q's held stream")
            try:
                return await reports(running, "Q", creds)
            finally:
                held.cancel()

    try:
        events = run(scenario())
    finally:
        running.stop()
    assert_all_refused(events, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert "have not registered" in events[0][1]
