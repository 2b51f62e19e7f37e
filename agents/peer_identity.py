"""Which processes a peer may speak as: the process ids its verified client certificate names.

A certificate names the processes its holder may speak as with URI subject alternative names of
the form ``stablewatch://process/<id>`` (the id percent-encoded, see :func:`process_uri`); a
certificate may name several (a host that runs several processes). When a peer shows a verified
client certificate (mutual TLS), :func:`peer_process_ids` gives those ids, and both the detector
(on ``Register``) and an agent (on a channel's hello, through :func:`check_channel_peer`) refuse a
process id the certificate does not name. Without client certificates there is no identity to
check: anyone who can connect may claim any id, so run mutual TLS wherever the network is not
trusted (SECURITY.md). The credentials themselves come from :mod:`stablewatch.agents.certificates`.
"""

from __future__ import annotations

from urllib.parse import quote, unquote

import grpc

from stablewatch.agents.frames import FrameError
from stablewatch.v1 import ChannelHello

__all__ = ["PROCESS_URI_PREFIX", "check_channel_peer", "peer_process_ids", "peer_uris", "process_uri"]

#: A URI SAN starting with this names a process: ``stablewatch://process/<percent-encoded id>``.
PROCESS_URI_PREFIX = "stablewatch://process/"


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
