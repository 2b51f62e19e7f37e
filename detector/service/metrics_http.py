"""The detector's HTTP: /metrics (prometheus-client's WSGI app) and the web view, on threaded servers,
optionally HTTPS with client certificates.

Why not ``prometheus_client.start_http_server(certfile=...)``: it wraps the listening socket, so
every TLS handshake runs in the one thread that accepts connections, and a single client that
connects and never completes its handshake stops every scrape after it. Here the accepting
thread only accepts; each connection's handshake runs in that connection's own thread, with a
timeout, so a stalled or failed handshake costs its own thread for :data:`HANDSHAKE_TIMEOUT`
seconds at most and nothing else. The same timeout bounds how long any client may take to send
its request, with or without TLS.

The verified client certificate's URI SANs reach the app in the WSGI environ under
:data:`PEER_URIS` (None without a certificate): the web view decides its readers from them
(:mod:`.web_http`); /metrics does not look at them (any certificate of the CA may scrape).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler, WSGIServer, make_server
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from prometheus_client import CollectorRegistry, make_wsgi_app

__all__ = ["HANDSHAKE_TIMEOUT", "PEER_URIS", "certificate_uris", "serve_http", "serve_metrics"]

#: Seconds a client has to complete its TLS handshake, and then again to send its request.
HANDSHAKE_TIMEOUT = 10.0
#: The WSGI environ key of the client certificate's URI SANs: a tuple, or None without a certificate.
PEER_URIS = "stablewatch.peer_uris"

_log = logging.getLogger(__name__)


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


def certificate_uris(certificate: dict[str, Any] | None) -> tuple[str, ...] | None:
    """The URI SANs of a certificate as ``ssl.SSLSocket.getpeercert()`` gives it; None for no
    certificate (``getpeercert()`` is empty or None when the handshake asked for none)."""
    if not certificate:
        return None
    return tuple(value for kind, value in certificate.get("subjectAltName", ()) if kind == "URI")


class _Response(ServerHandler):
    def handle_error(self) -> None:
        """A client that goes away or stalls mid-response (an event stream's, typically) is no
        error of the server's: not worth a traceback on stderr."""
        error = sys.exc_info()[1]
        if isinstance(error, OSError):  # ssl.SSLError and TimeoutError among them
            _log.debug("HTTP client gone: %s", error)
            return
        super().handle_error()


class _Handler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Requests are not logged."""

    def get_environ(self) -> dict[str, Any]:
        environ = super().get_environ()
        if isinstance(self.request, ssl.SSLSocket):
            environ["HTTPS"] = "on"
            environ[PEER_URIS] = certificate_uris(self.request.getpeercert())
        return environ

    def handle(self) -> None:
        """``WSGIRequestHandler.handle``, with :class:`_Response` and the server's threads said."""
        self.raw_requestline = self.rfile.readline(65537)
        if len(self.raw_requestline) > 65536:
            self.requestline = self.request_version = self.command = ""
            self.send_error(414)
            return
        if not self.parse_request():  # an error was sent
            return
        response = _Response(self.rfile, self.wfile, self.get_stderr(), self.get_environ(), multithread=True)
        response.request_handler = self  # type: ignore[attr-defined]  # wsgiref logs through it
        response.run(self.server.get_app())  # type: ignore[attr-defined]


def serve_http(
    app: WSGIApplication,
    port: int,
    address: str,
    *,
    cert_file: Path | None = None,
    key_file: Path | None = None,
    client_ca_file: Path | None = None,
    name: str = "metrics-http",
) -> WSGIServer:
    """Serve `app` at ``http(s)://address:port/`` on a daemon thread named `name`; returns the server.

    With ``cert_file`` and ``key_file`` it is HTTPS; with ``client_ca_file`` too, clients must show
    a certificate that CA signed. Stop it with ``shutdown()`` and ``server_close()``.
    """
    family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = type("HttpServer", (_Server,), {"address_family": family})
    server = make_server(address, port, app, server_class, handler_class=_Handler)
    if cert_file is not None and key_file is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert_file, key_file)
        if client_ca_file is not None:
            context.load_verify_locations(client_ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
        server.tls = context  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return server


def serve_metrics(
    registry: CollectorRegistry,
    port: int,
    address: str,
    *,
    cert_file: Path | None = None,
    key_file: Path | None = None,
    client_ca_file: Path | None = None,
    beside: WSGIApplication | None = None,
) -> WSGIServer:
    """Serve ``registry`` at ``http(s)://address:port/metrics`` on a daemon thread; returns the server.

    With `beside` (the web view), every other path goes to that app; without it, prometheus-client
    answers every path. TLS as :func:`serve_http`.
    """
    metrics = make_wsgi_app(registry)
    app = metrics if beside is None else _beside(metrics, beside)
    return serve_http(app, port, address, cert_file=cert_file, key_file=key_file, client_ca_file=client_ca_file)


def _beside(metrics: WSGIApplication, other: WSGIApplication) -> WSGIApplication:
    """``/metrics`` to `metrics`, exactly as without `other`; every other path to `other`."""

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        return (metrics if environ.get("PATH_INFO") == "/metrics" else other)(environ, start_response)

    return app
