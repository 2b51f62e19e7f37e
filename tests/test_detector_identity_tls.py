"""Mutual TLS: an agent can require its detector's certificate to name a name only detectors carry.

An agent checks that the detector's certificate comes from the CA and names the host it dials. An
agent's certificate may name that host too (``deploy/tls/make-certs.sh`` gives every agent
localhost and 127.0.0.1), so whoever holds any agent's key and listens where agents dial could take
their control streams, read their snapshot parts and send ``BreakWait``. ``TlsConfig.detector_name``
makes the control stream check another name (``stablewatch-detector``), which agents' certificates
do not carry; peers' channels keep checking the host they dial.
"""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import replace
from pathlib import Path

import pytest
from certs import issue, make_certs, tls_config
from cryptography import x509
from mtls_detector import mtls_detector

from polling import async_poll
from stablewatch.agents import Agent
from stablewatch.agents.certificates import TlsConfig
from stablewatch.agents.peer_identity import process_uri
from stablewatch.testing.detector import Running

pytestmark = pytest.mark.timeout(90)

DETECTOR_NAME = "stablewatch-detector"


def _attaches(running: Running, tls: TlsConfig, seconds: float) -> bool:
    """Whether an agent with ``tls`` attaches to ``running``'s detector within ``seconds``."""

    async def scenario() -> bool:
        agent = Agent("A", detector=running.detector.address, tls=tls)
        await agent.start()
        try:
            await async_poll(lambda: agent.detector_connected, "A attached", seconds)
        except TimeoutError:
            pass  # not attached: told below
        finally:
            connected = agent.detector_connected
            await agent.stop()
        return connected

    return asyncio.run(asyncio.wait_for(scenario(), seconds + 30))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    paths = make_certs(tmp_path_factory.mktemp("pki"))
    loopback = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    paths |= issue(paths, "impostor", uris=[process_uri("X")])  # an agent's: process X, loopback names
    paths |= issue(paths, "detector", names=[x509.DNSName(DETECTOR_NAME), *loopback])
    return paths


def test_with_a_detector_name_an_agents_certificate_cannot_serve_as_the_detector(
    tmp_path: Path, pki: dict[str, Path]
) -> None:
    tls = replace(tls_config(pki, "server"), detector_name=DETECTOR_NAME)
    with mtls_detector(tmp_path / "impostor", pki, cert="impostor") as impostor:
        assert not _attaches(impostor, tls, 5), "attached to a detector whose certificate names only process X"
    with mtls_detector(tmp_path / "detector", pki, cert="detector") as detector:
        assert _attaches(detector, tls, 30), "did not attach to the detector whose certificate names it"


def test_without_it_the_dialled_host_is_all_that_is_checked(tmp_path: Path, pki: dict[str, Path]) -> None:
    """The limit the option exists for (stated in SECURITY.md): without it the impostor is taken."""
    with mtls_detector(tmp_path / "impostor", pki, cert="impostor") as impostor:
        assert _attaches(impostor, tls_config(pki, "server"), 30)
