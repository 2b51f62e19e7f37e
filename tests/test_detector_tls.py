"""The detector under TLS and mutual TLS, attacked the way an outsider or a wrong certificate would.

Real handshakes on 127.0.0.1 with throwaway certificates (the ``pki`` fixture, tests/certs.py): one
CA, and certificates issued from it for agents P and Q (``stablewatch://process/P``, ``.../Q``), a
reader and an operator (``stablewatch://role/reader``, ``.../operator``) and one naming nothing; the
``foreign`` fixture is another CA the detector does not trust. Each attack checks what stopped it (status code and the
refusal metric), and that the detector still serves afterwards.
"""

from __future__ import annotations

import asyncio
import http.client
import socket
import ssl
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from certs import credentials, tls_config
from control_streams import register
from mtls_detector import mtls_detector

from polling import async_poll, poll
from stablewatch.agents import Agent
from stablewatch.agents.certificates import channel_credentials
from stablewatch.agents.peer_identity import process_uri
from stablewatch.cli.client import DetectorClient, DetectorError
from stablewatch.detector.service.auth import METHOD_PERMISSIONS
from stablewatch.detector.service.limits import Limits
from stablewatch.testing.detector import Running
from stablewatch.v1 import (
    AgentMessage,
    LocalSnapshotPart,
    LocalState,
    control_pb2,
    control_pb2_grpc,
    query_pb2,
    query_pb2_grpc,
)
from stablewatch.v1.query_pb2 import SNAPSHOT_OUTCOME_COMPLETED

pytestmark = pytest.mark.timeout(90)

TIMEOUT = 10.0
REFUSED = "stablewatch_refused_total"


@pytest.fixture(scope="module")
def mtls(tmp_path_factory: pytest.TempPathFactory, pki: dict[str, Path]) -> Iterator[Running]:
    with mtls_detector(tmp_path_factory.mktemp("mtls"), pki) as running:
        yield running


def client(running: Running, pki: dict[str, Path], name: str | None) -> DetectorClient:
    return DetectorClient(running.detector.address, timeout=TIMEOUT, credentials=credentials(pki, name))


def query_code(running: Running, creds: grpc.ChannelCredentials | None, method: str) -> grpc.StatusCode:
    """The status of one ``Query`` call (``ListMembers`` or ``TriggerSnapshot``) with these credentials."""
    address = running.detector.address
    with grpc.insecure_channel(address) if creds is None else grpc.secure_channel(address, creds) as channel:
        query = query_pb2_grpc.QueryStub(channel)
        call = {
            "ListMembers": lambda: query.ListMembers(query_pb2.ListMembersRequest(), timeout=TIMEOUT),
            "TriggerSnapshot": lambda: query.TriggerSnapshot(query_pb2.TriggerSnapshotRequest(), timeout=TIMEOUT),
        }[method]
        try:
            call()
        except grpc.RpcError as error:
            return error.code()
        return grpc.StatusCode.OK


# -- the happy path ---------------------------------------------------------------------------------------


def test_agents_attach_over_mutual_tls_and_a_snapshot_completes(mtls: Running, pki: dict[str, Path]) -> None:
    """P and Q attach with their own certificates, exchange a message, and an operator's snapshot completes."""

    async def scenario() -> None:
        peers: dict[str, str] = {}
        got: list[bytes] = []
        agents = [
            Agent(
                pid,
                detector=mtls.detector.address,
                peers=peers,
                tls=tls_config(pki, f"agent_{pid}"),
                handler=lambda src, message: got.append(message.payload),
            )
            for pid in ("P", "Q")
        ]
        for agent in agents:
            await agent.start()
            peers[agent.process_id] = agent.address
        try:
            await async_poll(lambda: set(mtls.detector.coordinator.members) == {"P", "Q"}, "P and Q to attach")
            await agents[0].send("Q", b"over mutual TLS")
            await async_poll(lambda: got == [b"over mutual TLS"], "the message")
            with client(mtls, pki, "operator") as operator:
                results = await asyncio.to_thread(operator.trigger_snapshot, TIMEOUT)
            assert results.snapshot.outcome == SNAPSHOT_OUTCOME_COMPLETED, results.snapshot.abort_reason
            assert results.snapshot.processes == 2
        finally:
            for agent in agents:
                await agent.stop()
        await async_poll(lambda: not mtls.detector.coordinator.members, "P and Q to detach")

    asyncio.run(asyncio.wait_for(scenario(), 60))


# -- attacks on the control stream ------------------------------------------------------------------------


def test_spoofed_process_id_is_refused_and_counted(mtls: Running, pki: dict[str, Path]) -> None:
    """P's certificate registering as Q: PERMISSION_DENIED naming the URI it lacks; Q never attaches."""
    before = mtls.metric(REFUSED, reason="identity_mismatch")
    code, details = register(mtls.detector.address, credentials(pki, "agent_P"), "Q")
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "'Q' is not in the client certificate, which names 'P'" in details
    assert process_uri("Q") in details
    assert mtls.metric(REFUSED, reason="identity_mismatch") == before + 1
    assert "Q" not in mtls.detector.coordinator.members
    # P's own id is accepted on the same certificate.
    assert register(mtls.detector.address, credentials(pki, "agent_P"), "P") == (
        grpc.StatusCode.OK,
        "registered",
    )


@pytest.mark.parametrize("name", ["nobody", "operator"])
def test_certificate_without_a_process_cannot_attach(mtls: Running, pki: dict[str, Path], name: str) -> None:
    """Refused before the stream takes a slot or its Register is read, and counted."""
    denied, mismatched = (mtls.metric(REFUSED, reason=reason) for reason in ("permission_denied", "identity_mismatch"))
    code, details = register(mtls.detector.address, credentials(pki, name), "P")
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "no process" in details
    assert mtls.metric(REFUSED, reason="permission_denied") == denied + 1
    assert mtls.metric(REFUSED, reason="identity_mismatch") == mismatched  # its Register was never read


def test_part_naming_another_process_is_rejected(mtls: Running, pki: dict[str, Path]) -> None:
    """P attaches honestly, then sends Q's part for a running snapshot of P and Q: rejected as spoofed.

    Parts are taken only for the process whose stream they come on; Q's own part (from Q's
    stream) is what completes the snapshot, and the forged one changes nothing.
    """
    loop = mtls.loop

    async def scenario() -> None:
        streams = {}
        for pid in ("P", "Q"):
            channel = grpc.aio.secure_channel(mtls.detector.address, credentials(pki, f"agent_{pid}"))
            call = control_pb2_grpc.ControlStub(channel).Attach()
            await call.write(AgentMessage(register=control_pb2.Register(process_id=pid, address="x:1")))
            assert (await asyncio.wait_for(call.read(), TIMEOUT)).WhichOneof("kind") == "registered"
            streams[pid] = (channel, call)
        try:
            future = asyncio.run_coroutine_threadsafe(mtls.detector.take_snapshot(TIMEOUT), loop)
            snapshot_id = 0
            while not snapshot_id:  # the StartSnapshot each member receives
                message = await asyncio.wait_for(streams["P"][1].read(), TIMEOUT)
                snapshot_id = message.start.snapshot_id if message.WhichOneof("kind") == "start" else 0
            before = mtls.metric("stablewatch_rejected_parts_total", reason="spoofed")
            forged = LocalSnapshotPart(snapshot_id=snapshot_id, process_id="Q", state=LocalState(active=True))
            await streams["P"][1].write(AgentMessage(part=forged))
            await async_poll(
                lambda: mtls.metric("stablewatch_rejected_parts_total", reason="spoofed") == before + 1, "the rejection"
            )
            for pid in ("P", "Q"):
                part = LocalSnapshotPart(snapshot_id=snapshot_id, process_id=pid, state=LocalState(active=False))
                await streams[pid][1].write(AgentMessage(part=part))
            results = await asyncio.wrap_future(future)
            assert results.snapshot.outcome == SNAPSHOT_OUTCOME_COMPLETED
            snapshot = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_stored(mtls, snapshot_id), loop))
            assert {p.process_id: p.state.active for p in snapshot.processes} == {"P": False, "Q": False}
        finally:
            for channel, call in streams.values():
                call.cancel()
                await channel.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
    poll(lambda: not mtls.detector.coordinator.members, "P and Q to detach")


async def _stored(running: Running, snapshot_id: int):  # type: ignore[no-untyped-def]
    return running.detector.store.snapshot(snapshot_id)


# -- attacks on the transport -----------------------------------------------------------------------------


def test_plaintext_client_is_refused_by_a_tls_detector(mtls: Running) -> None:
    assert query_code(mtls, None, "ListMembers") == grpc.StatusCode.UNAVAILABLE
    code, _ = register(mtls.detector.address, None, "P")
    assert code == grpc.StatusCode.UNAVAILABLE
    with DetectorClient(mtls.detector.address, timeout=TIMEOUT) as plaintext, pytest.raises(DetectorError) as caught:
        plaintext.members()
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE


def test_client_without_a_certificate_is_refused_by_mutual_tls(mtls: Running, pki: dict[str, Path]) -> None:
    assert query_code(mtls, credentials(pki, None), "ListMembers") == grpc.StatusCode.UNAVAILABLE
    code, _ = register(mtls.detector.address, credentials(pki, None), "P")
    assert code == grpc.StatusCode.UNAVAILABLE


def test_certificates_of_another_ca_are_refused_both_ways(
    mtls: Running, pki: dict[str, Path], foreign: dict[str, Path]
) -> None:
    """A client certificate from a foreign CA fails the handshake; so does a client that trusts only that CA."""
    wrong_client = channel_credentials(pki["ca_cert"], foreign["client_cert"], foreign["client_key"])
    wrong_trust = channel_credentials(foreign["ca_cert"], pki["operator_cert"], pki["operator_key"])
    for creds in (wrong_client, wrong_trust):
        assert query_code(mtls, creds, "ListMembers") == grpc.StatusCode.UNAVAILABLE
        assert register(mtls.detector.address, creds, "P")[0] == grpc.StatusCode.UNAVAILABLE
    with (
        DetectorClient(mtls.detector.address, timeout=TIMEOUT, credentials=wrong_client) as foreign_client,
        pytest.raises(DetectorError, match="over TLS"),
    ):
        foreign_client.members()
    assert not mtls.detector.coordinator.members


# -- the query API's permissions --------------------------------------------------------------------------


def test_reader_reads_but_cannot_trigger(mtls: Running, pki: dict[str, Path]) -> None:
    before = mtls.metric(REFUSED, reason="permission_denied")
    reader = credentials(pki, "reader")
    assert query_code(mtls, reader, "ListMembers") == grpc.StatusCode.OK
    assert query_code(mtls, reader, "TriggerSnapshot") == grpc.StatusCode.PERMISSION_DENIED
    with client(mtls, pki, "reader") as cli, pytest.raises(DetectorError, match="role/operator") as caught:
        cli.trigger_snapshot(1)
    assert caught.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert mtls.metric(REFUSED, reason="permission_denied") == before + 2
    # The operator may; with no agent attached the call gets past the permission and fails on that.
    assert query_code(mtls, credentials(pki, "operator"), "TriggerSnapshot") == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize("name", ["agent_P", "nobody"])
def test_certificate_without_a_role_cannot_query(mtls: Running, pki: dict[str, Path], name: str) -> None:
    assert query_code(mtls, credentials(pki, name), "ListMembers") == grpc.StatusCode.PERMISSION_DENIED
    assert query_code(mtls, credentials(pki, name), "TriggerSnapshot") == grpc.StatusCode.PERMISSION_DENIED


def test_health_is_open_to_any_certificate_of_the_ca(mtls: Running, pki: dict[str, Path]) -> None:
    with client(mtls, pki, "nobody") as cli:
        assert cli.health() == "SERVING"


def test_every_query_method_has_a_permission() -> None:
    """The interceptor refuses methods missing from the table: a new method must be given one."""
    for module, service in ((query_pb2, "Query"), (control_pb2, "Control")):
        for method in module.DESCRIPTOR.services_by_name[service].methods:
            assert f"/{method.full_name.rsplit('.', 1)[0]}/{method.name}" in METHOD_PERMISSIONS, method.full_name


def test_trigger_rate_limit_holds(tmp_path: Path, pki: dict[str, Path]) -> None:
    """Two triggers per hour: the third call is RESOURCE_EXHAUSTED, says when to retry, and is counted."""
    with mtls_detector(tmp_path, pki, limits=Limits(trigger_rate=(2, 3600))) as running:
        operator = credentials(pki, "operator")
        for _ in range(2):  # no agent attached: each gets past the limit and fails on that
            assert query_code(running, operator, "TriggerSnapshot") == grpc.StatusCode.FAILED_PRECONDITION
        with client(running, pki, "operator") as cli, pytest.raises(DetectorError, match="2 per 3600 s") as caught:
            cli.trigger_snapshot(1)
        assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert running.metric(REFUSED, reason="rate_limited") == 1
        assert query_code(running, credentials(pki, "reader"), "ListMembers") == grpc.StatusCode.OK  # reads go on


# -- /metrics over HTTPS ----------------------------------------------------------------------------------


def test_metrics_are_served_over_https_to_a_certificate_of_the_ca(mtls: Running, pki: dict[str, Path]) -> None:
    url = mtls.detector.metrics_url
    assert url is not None and url.startswith("https://127.0.0.1:")

    def fetch(context: ssl.SSLContext | None, target: str = url) -> str:
        with urllib.request.urlopen(target, timeout=TIMEOUT, context=context) as response:
            return response.read().decode()

    trusting = ssl.create_default_context(cafile=pki["ca_cert"])
    with pytest.raises((OSError, http.client.HTTPException)):
        fetch(trusting)  # no client certificate
    with pytest.raises((OSError, http.client.HTTPException)):
        fetch(None, url.replace("https://", "http://"))  # plaintext
    trusting.load_cert_chain(pki["nobody_cert"], pki["nobody_key"])
    assert "stablewatch_refused_total" in fetch(trusting)


def test_a_client_that_stalls_its_handshake_does_not_stop_scrapes(mtls: Running, pki: dict[str, Path]) -> None:
    """Connections that never start TLS hold only their own threads (until their timeout)."""
    url = mtls.detector.metrics_url
    assert url is not None
    host, port = url.removeprefix("https://").split("/")[0].rsplit(":", 1)
    context = ssl.create_default_context(cafile=pki["ca_cert"])
    context.load_cert_chain(pki["nobody_cert"], pki["nobody_key"])
    stalled = [socket.create_connection((host, int(port)), timeout=TIMEOUT) for _ in range(3)]
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT, context=context) as response:
            assert response.status == 200
    finally:
        for connection in stalled:
            connection.close()
