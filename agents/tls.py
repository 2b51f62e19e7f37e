"""gRPC TLS credentials from PEM files, for the agent's channels and its control stream.

An agent is both a server (peers open their channel streams to it) and a client (it dials its
peers and the detector), so one :class:`TlsConfig` (this process's certificate and key, and the CA
it trusts) gives credentials for both sides. With a CA the server requires client certificates
(mutual TLS) unless ``mutual=False``, so only processes holding a certificate from that CA can
feed its channels.

Files are read when credentials are built, so a rotated certificate is picked up by the next
server or channel. A missing, unreadable or non-PEM file raises an error naming the file.

**Identity.** A certificate names the processes its holder may speak as with URI subject
alternative names of the form ``stablewatch://process/<id>`` (the id percent-encoded, see
:func:`process_uri`); a certificate may name several (a host that runs several processes). When a
peer shows a verified client certificate (mutual TLS), :func:`peer_process_ids` gives those ids,
and both the detector (on ``Register``) and an agent (on a channel's hello, through
:func:`check_channel_peer`) refuse a process id the certificate does not name. Without client
certificates there is no identity to check: anyone who can connect may claim any id, so run
mutual TLS wherever the network is not trusted (SECURITY.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

import grpc

from stablewatch.agents.frames import FrameError
from stablewatch.v1 import ChannelHello

__all__ = [
    "PROCESS_URI_PREFIX",
    "TlsConfig",
    "channel_credentials",
    "check_channel_peer",
    "peer_process_ids",
    "peer_uris",
    "process_uri",
    "read_pem",
    "server_credentials",
    "server_name_options",
]

StrPath = str | os.PathLike[str]

#: A URI SAN starting with this names a process: ``stablewatch://process/<percent-encoded id>``.
PROCESS_URI_PREFIX = "stablewatch://process/"


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
    """

    cert_file: StrPath
    key_file: StrPath
    ca_file: StrPath | None = None
    server_name: str | None = None
    mutual: bool = True  # with a CA: require client certificates signed by it

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials for ``server.add_secure_port``; mutual TLS when a CA is configured and `mutual`."""
        return server_credentials(self.cert_file, self.key_file, self.ca_file if self.mutual else None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials for ``grpc.secure_channel``, presenting this process's certificate."""
        return channel_credentials(self.ca_file, self.cert_file, self.key_file)

    def channel_options(self) -> list[tuple[str, str]]:
        """Channel options that go with :meth:`channel_credentials`."""
        return server_name_options(self.server_name)


def process_uri(process_id: str) -> str:
    """The URI SAN that names ``process_id`` in a certificate: ``stablewatch://process/<id>``.

    Every character but letters, digits and ``_.-~`` is percent-encoded (``a b`` becomes ``a%20b``).
    """
    return PROCESS_URI_PREFIX + quote(process_id, safe="")


def peer_uris(context: grpc.aio.ServicerContext) -> tuple[str, ...] | None:
    """The URI SANs of the client certificate the peer of this call showed, or None without one.

    Our server credentials either require and verify client certificates (mutual TLS) or do not
    ask for them, so a certificate seen here was verified against the configured client CA.
    """
    auth = context.auth_context()
    if not auth.get("x509_pem_cert"):
        return None  # plaintext, or TLS without client certificates: no identity at all
    return tuple(uri.decode(errors="replace") for uri in auth.get("peer_uri", ()))


def peer_process_ids(context: grpc.aio.ServicerContext) -> frozenset[str] | None:
    """The process ids the peer's certificate names (possibly none), or None without a certificate."""
    uris = peer_uris(context)
    if uris is None:
        return None
    prefix = len(PROCESS_URI_PREFIX)
    return frozenset(unquote(uri[prefix:]) for uri in uris if uri.startswith(PROCESS_URI_PREFIX) and uri[prefix:])


def check_channel_peer(context: grpc.aio.ServicerContext, hello: ChannelHello) -> None:
    """Refuse a channel whose hello names a sender the peer's certificate does not name.

    Raises :class:`FrameError` ``spoofed`` (the peer's fault). Without a client certificate there
    is nothing to check against, and the channel is accepted.
    """
    allowed = peer_process_ids(context)
    if allowed is not None and hello.src not in allowed:
        named = ", ".join(sorted(allowed)) or f"no process (no {PROCESS_URI_PREFIX}<id> URI SAN)"
        raise FrameError("spoofed", f"the peer claims to be {hello.src!r} but its certificate names {named}")


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
