"""Shared fixtures: the COS 418 traces, throwaway certificates, an in-test detector, a local Spark,
two RPC-mode agents; and helpers: a free port, a detector with limits."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from certs import issue, make_certs
from detector_stub import StubDetector
from rpc_harness import new_agent
from settable_clock import Clock

from stablewatch.agents.peer_identity import process_uri
from stablewatch.agents.rpc.agent import RpcAgent
from stablewatch.detector.service.auth import role_uri
from stablewatch.detector.service.detector import DetectorConfig
from stablewatch.detector.service.limits import Limits
from stablewatch.detector.service.store import Store
from stablewatch.testing.detector import Running

ROOT = Path(__file__).resolve().parent.parent
CONFORMANCE = ROOT.parent / "shared" / "conformance" / "cos418"
DELAY_TAPE = CONFORMANCE / "go-rand-intn5-seed8053172852482175524.txt"


def free_port() -> int:
    """A loopback port nobody listens on (the operating system's pick), for a server that starts later."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def cos418() -> Path:
    """The conformance folder; tests that need it skip with a message where it is absent."""
    if not DELAY_TAPE.is_file():
        pytest.skip(f"COS 418 conformance traces not found at {CONFORMANCE}")
    return CONFORMANCE


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A throwaway CA with server, client and node certificates (see certs.make_certs)."""
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="session")
def pki(certs: dict[str, Path]) -> dict[str, Path]:
    """``certs`` plus certificates from the same CA for processes P and Q, a reader, an operator
    and one naming nothing (keys ``agent_P_cert``, ``reader_key``, ``nobody_cert``, ...)."""
    paths = dict(certs)
    for name, uris in {
        "agent_P": [process_uri("P")],
        "agent_Q": [process_uri("Q")],
        "reader": [role_uri("reader")],
        "operator": [role_uri("operator")],
        "nobody": [],
    }.items():
        paths |= issue(certs, name, uris=uris)
    return paths


@pytest.fixture(scope="session")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Certificates from another CA, which the servers and agents under test do not trust."""
    return make_certs(tmp_path_factory.mktemp("foreign"))


@pytest.fixture
def detector() -> Iterator[StubDetector]:
    """A StubDetector (the real coordinator on its own thread), stopped after the test."""
    stub = StubDetector()
    yield stub
    stub.stop()


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local Spark session (local[2]) for all the pipeline's tests, stopped at the end."""
    from spark_session import local_spark  # PySpark is imported only by the tests that need it

    with local_spark() as session:
        yield session


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    """A real detector on its own thread (127.0.0.1, no metrics port, no scheduler), stopped after the test."""
    config = DetectorConfig(data_dir=tmp_path / "data", listen="127.0.0.1:0", metrics_port=None, interval=None)
    service = Running(config)
    yield service
    service.stop()


@pytest.fixture
def rpc_agents() -> Iterator[tuple[RpcAgent, RpcAgent]]:
    """RPC-mode agents without a detector: the server's, S, and the client's, C."""
    server, client = new_agent("S"), new_agent("C")
    yield server, client
    client.stop()
    server.stop()


def limited_detector(
    data_dir: Path, pki: dict[str, Path] | None = None, limits: Limits | None = None, **config: Any
) -> Running:
    """A detector with these ``limits`` (no metrics port, no scheduler) on 127.0.0.1, unless
    ``config`` (other DetectorConfig fields) says otherwise: mutual TLS with the certificates of
    ``pki`` (the fixture's), else plaintext."""
    if pki is not None:
        tls = {"tls_cert": pki["server_cert"], "tls_key": pki["server_key"], "tls_client_ca": pki["ca_cert"]}
        config = tls | config
    options: dict[str, Any] = {"listen": "127.0.0.1:0", "metrics_port": None, "interval": None} | config
    return Running(DetectorConfig(data_dir=data_dir, limits=limits or Limits(), **options))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """A detector's store in a fresh folder, closed after the test."""
    with Store(tmp_path / "data") as store:
        yield store


@pytest.fixture
def clock() -> Clock:
    """A settable wall clock, at ``settable_clock.T0``."""
    return Clock()
