"""An in-process detector under mutual TLS, with the throwaway certificates of the ``pki`` fixture
(tests/certs.py): what the TLS, web view and browser tests attack or read."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from stablewatch.detector.service.detector import DetectorConfig
from stablewatch.testing.detector import Running


@contextlib.contextmanager
def mtls_detector(
    data_dir: Path, pki: dict[str, Path], *, cert: str = "server", **settings: object
) -> Iterator[Running]:
    """A detector with mutual TLS on 127.0.0.1 (gRPC, and /metrics over HTTPS on a free port), its
    certificate ``cert`` of ``pki``, trusting clients of ``pki``'s CA; ``settings`` for the rest.
    Stopped when the block ends."""
    config = DetectorConfig(
        data_dir=data_dir,
        listen="127.0.0.1:0",
        metrics_port=0,
        interval=None,
        tls_cert=pki[f"{cert}_cert"],
        tls_key=pki[f"{cert}_key"],
        tls_client_ca=pki["ca_cert"],
        **settings,  # type: ignore[arg-type]
    )
    running = Running(config)
    try:
        yield running
    finally:
        running.stop()
