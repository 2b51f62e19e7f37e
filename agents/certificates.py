"""gRPC TLS credentials from PEM files, for the agents' channels and control stream and for the detector.

An agent is both a server (peers open their channel streams to it) and a client (it dials its
peers and the detector), so one :class:`TlsConfig` (this process's certificate and key, and the CA
it trusts) gives credentials for both sides. With a CA the server requires client certificates
(mutual TLS) unless ``mutual=False``, so only processes holding a certificate from that CA can
feed its channels. The detector and the CLI build theirs from the same functions.

Files are read when credentials are built, so a rotated certificate is picked up by the next
server or channel. A missing, unreadable or non-PEM file raises an error naming the file. Which
process a verified certificate may speak as is :mod:`stablewatch.agents.peer_identity`'s job.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

__all__ = [
    "TlsConfig",
    "channel_credentials",
    "read_pem",
    "server_credentials",
    "server_name_options",
]

StrPath = str | os.PathLike[str]


def server_credentials(
    cert_file: StrPath, key_file: StrPath, client_ca_file: StrPath | None = None
) -> grpc.ServerCredentials:
    """Server credentials; with `client_ca_file`, clients must present a certificate it signed."""
    pair = (read_pem(key_file, "private key"), read_pem(cert_file, "certificate"))
    if client_ca_file is None:
        return grpc.ssl_server_credentials([pair])
    ca = read_pem(client_ca_file, "client CA certificate")
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=True)


def channel_credentials(
    ca_file: StrPath | None, cert_file: StrPath | None = None, key_file: StrPath | None = None
) -> grpc.ChannelCredentials:
    """Client credentials trusting `ca_file` (None: the system roots), with a client certificate
    for mutual TLS when `cert_file` and `key_file` are given (both or neither)."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("a client certificate needs both cert_file and key_file, or neither")
    return grpc.ssl_channel_credentials(
        root_certificates=None if ca_file is None else read_pem(ca_file, "CA certificate"),
        private_key=None if key_file is None else read_pem(key_file, "private key"),
        certificate_chain=None if cert_file is None else read_pem(cert_file, "certificate"),
    )


def server_name_options(server_name: str | None) -> list[tuple[str, str]]:
    """Channel options that check the server's certificate for `server_name` instead of the
    dialled host (None: no option)."""
    return [] if server_name is None else [("grpc.ssl_target_name_override", server_name)]


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """One process's TLS identity and trust, for both its server and its client side.

    `ca_file` None trusts the system roots as a client and asks no client certificate as a server.
    `server_name` overrides the name checked in the server's certificate (when dialling an address
    the certificate does not name); pass :meth:`channel_options` to the channel for it.
    `detector_name` is the name checked in a detector's certificate instead (the control stream
    only): a name that only detector certificates carry (``stablewatch-detector`` in
    ``deploy/tls/make-certs.sh``), so that an agent's certificate, which may name the host the
    detector is dialled at (localhost, 127.0.0.1), cannot serve as the detector and send orders.
    """

    cert_file: StrPath
    key_file: StrPath
    ca_file: StrPath | None = None
    server_name: str | None = None
    mutual: bool = True  # with a CA: require client certificates signed by it
    detector_name: str | None = None

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials for ``server.add_secure_port``; mutual TLS when a CA is configured and `mutual`."""
        return server_credentials(self.cert_file, self.key_file, self.ca_file if self.mutual else None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials for ``grpc.secure_channel``, presenting this process's certificate."""
        return channel_credentials(self.ca_file, self.cert_file, self.key_file)

    def channel_options(self) -> list[tuple[str, str]]:
        """Channel options that go with :meth:`channel_credentials`."""
        return server_name_options(self.server_name)

    def control_channel_options(self) -> list[tuple[str, str]]:
        """Channel options for the control stream to a detector: its certificate must name
        `detector_name` (else `server_name`, else the dialled host)."""
        return server_name_options(self.detector_name or self.server_name)


def read_pem(path: StrPath, what: str) -> bytes:
    """The bytes of PEM file `path`, or an error that names the file and what it should hold.

    Raises OSError (missing, unreadable) or ValueError (no PEM data); `what` names the content in
    the message, e.g. ``"certificate"``.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise OSError(error.errno, f"cannot read TLS {what} file ({error.strerror})", str(path)) from error
    if b"-----BEGIN " not in data:
        raise ValueError(f"TLS {what} file {str(path)!r} holds no PEM data")
    return data
