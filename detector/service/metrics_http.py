"""The /metrics endpoint: prometheus-client's WSGI app on a threaded HTTP server, optionally HTTPS.

Why not ``prometheus_client.start_http_server(certfile=...)``: it wraps the listening socket, so
every TLS handshake runs in the one thread that accepts connections, and a single client that
connects and never completes its handshake stops every scrape after it. Here the accepting
thread only accepts; each connection's handshake runs in that connection's own thread, with a
timeout, so a stalled or failed handshake costs its own thread for :data:`HANDSHAKE_TIMEOUT`
seconds at most and nothing else. The same timeout bounds how long any client may take to send
its request, with or without TLS.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

__all__ = ["HANDSHAKE_TIMEOUT", "serve_metrics"]

#: Seconds a client has to complete its TLS handshake, and then again to send its request.
HANDSHAKE_TIMEOUT = 10.0


class _Server(ThreadingMixIn, WSGIServer):
    """One thread per connection; with ``tls``, the handshake happens in that thread."""

    daemon_threads = True  # a stalled client never holds up shutdown
    tls: ssl.SSLContext | None = None

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(HANDSHAKE_TIMEOUT)
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        try:
            secure = self.tls.wrap_socket(request, server_side=True)
        except (OSError, ssl.SSLError):
            return  # no certificate, a wrong one, plaintext, or too slow: the client's problem
        with contextlib.closing(secure):
            super().finish_request(secure, client_address)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""


def serve_metrics(
    registry: CollectorRegistry,
    port: int,
    address: str,
    *,
    cert_file: Path | None = None,
    key_file: Path | None = None,
    client_ca_file: Path | None = None,
) -> WSGIServer:
    """Serve ``registry`` at ``http(s)://address:port/metrics`` on a daemon thread; returns the server.

    With ``cert_file`` and ``key_file`` it is HTTPS; with ``client_ca_file`` too, clients must show
    a certificate that CA signed. Stop it with ``shutdown()`` and ``server_close()``.
    """
    family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = type("MetricsServer", (_Server,), {"address_family": family})
    server = make_server(address, port, make_wsgi_app(registry), server_class, handler_class=_Quiet)
    if cert_file is not None and key_file is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert_file, key_file)
        if client_ca_file is not None:
            context.load_verify_locations(client_ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
        server.tls = context  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
