"""TLS credentials from files: a real grpc.aio echo server and client on 127.0.0.1 over TLS and mTLS."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest

from stablewatch.agents.certificates import TlsConfig, channel_credentials, server_credentials

TIMEOUT = 10.0  # seconds, for every RPC and server stop
METHOD = "/stablewatch.test.Echo/Echo"


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


def _call(
    server_creds: grpc.ServerCredentials,
    client_creds: grpc.ChannelCredentials,
    options: Sequence[tuple[str, str]] = (),
) -> bytes:
    """Start an echo server with `server_creds`, make one call with `client_creds`, stop the server."""

    async def run() -> bytes:
        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler(
            "stablewatch.test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(_echo)}
        )
        server.add_generic_rpc_handlers((handler,))
        port = server.add_secure_port("127.0.0.1:0", server_creds)
        await server.start()
        try:
            async with grpc.aio.secure_channel(f"127.0.0.1:{port}", client_creds, options=options) as channel:
                echo = channel.unary_unary(METHOD)
                return await echo(b"ping", timeout=TIMEOUT)
        finally:
            await server.stop(None)

    return asyncio.run(asyncio.wait_for(run(), 3 * TIMEOUT))


def test_tls_server_verified_by_ip(certs: dict[str, Path]) -> None:
    server = server_credentials(certs["server_cert"], certs["server_key"])
    assert _call(server, channel_credentials(certs["ca_cert"])) == b"ping"


def test_tls_with_server_name_override(certs: dict[str, Path]) -> None:
    config = TlsConfig(certs["client_cert"], certs["client_key"], certs["ca_cert"], server_name="localhost")
    server = server_credentials(certs["server_cert"], certs["server_key"])
    assert config.channel_options() == [("grpc.ssl_target_name_override", "localhost")]
    assert _call(server, config.channel_credentials(), config.channel_options()) == b"ping"


def test_client_refuses_server_from_another_ca(certs: dict[str, Path], foreign: dict[str, Path]) -> None:
    server = server_credentials(foreign["server_cert"], foreign["server_key"])
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        _call(server, channel_credentials(certs["ca_cert"]))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_accepts_client_certificate(certs: dict[str, Path]) -> None:
    server = TlsConfig(certs["server_cert"], certs["server_key"], certs["ca_cert"])
    client = TlsConfig(certs["client_cert"], certs["client_key"], certs["ca_cert"])
    assert _call(server.server_credentials(), client.channel_credentials()) == b"ping"


def test_mutual_tls_refuses_client_without_certificate(certs: dict[str, Path]) -> None:
    server = server_credentials(certs["server_cert"], certs["server_key"], certs["ca_cert"])
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        _call(server, channel_credentials(certs["ca_cert"]))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_refuses_client_from_another_ca(certs: dict[str, Path], foreign: dict[str, Path]) -> None:
    server = server_credentials(certs["server_cert"], certs["server_key"], certs["ca_cert"])
    client = channel_credentials(certs["ca_cert"], foreign["client_cert"], foreign["client_key"])
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        _call(server, client)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_missing_file_is_named(certs: dict[str, Path], tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(FileNotFoundError, match=r"nope\.pem") as caught:
        server_credentials(certs["server_cert"], certs["server_key"], missing)
    assert "client CA certificate" in str(caught.value)
    with pytest.raises(FileNotFoundError, match=r"nope\.pem"):
        TlsConfig(missing, certs["client_key"]).channel_credentials()


def test_file_without_pem_is_named(certs: dict[str, Path], tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"not a key")
    with pytest.raises(ValueError, match=r"private key file .*garbage\.key.* no PEM"):
        server_credentials(certs["server_cert"], garbage)


def test_client_certificate_needs_its_key(certs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="both cert_file and key_file"):
        channel_credentials(certs["ca_cert"], cert_file=certs["client_cert"])


def test_config_without_ca_uses_system_roots_and_no_client_auth(certs: dict[str, Path]) -> None:
    config = TlsConfig(certs["server_cert"], certs["server_key"])
    assert isinstance(config.server_credentials(), grpc.ServerCredentials)
    assert isinstance(config.channel_credentials(), grpc.ChannelCredentials)
    assert config.channel_options() == []
