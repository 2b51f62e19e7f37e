"""The web view over HTTP: a WSGI app serving the page, its data, and a stream of its changes.

Routes (GET or HEAD; anything else is 405):

* ``/`` — the page (``web_static/index.html``), which loads ``/static/view.css`` and
  ``/static/view.js`` and follows ``/events``;
* ``/api/view`` — the view as JSON (:func:`~.web_view.build_view`);
* ``/events`` — server-sent events: event ``view`` with the view's JSON at once and after every
  change (a burst of changes while one is being sent gives one event, of the newest), a comment
  every :data:`KEEPALIVE` seconds so that proxies and browsers keep the stream open, and the end of
  the stream when the detector stops. At most :data:`MAX_STREAMS` are open at once (each holds a
  thread of the server); more get 503;
* ``/static/<name>`` — the files shipped in ``web_static`` (nothing is fetched from elsewhere).

It is served by :mod:`.metrics_http`, at ``/`` beside ``/metrics`` or on a port of its own, with
the same TLS. Who may look is decided as for the query API (:mod:`.auth`): under mutual TLS a
client shows a certificate in the handshake, and the web view answers only a certificate with the
role ``stablewatch://role/reader`` or ``operator`` (permission READ); any other gets 403 with a
message naming the role it lacks (and the refusal is counted, as the gRPC ones are). Without client
certificates everyone who can connect may look, as everyone may query. ``/metrics`` beside it is
not affected: any certificate of the CA may scrape, as before.

Every response forbids framing and sniffing, and the page's content security policy allows only
its own files: the graph's SVG comes inside the JSON, with every name escaped on the server.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from importlib import resources
from wsgiref.types import StartResponse, WSGIEnvironment

from stablewatch.detector.service.auth import Authorizer, Denied, Permission
from stablewatch.detector.service.metrics_http import PEER_URIS
from stablewatch.detector.service.web_view import LiveView

__all__ = ["KEEPALIVE", "MAX_STREAMS", "WebApp"]

#: Seconds between keep-alive comments on an idle event stream.
KEEPALIVE = 15.0
#: Event streams open at once.
MAX_STREAMS = 32

_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}
_HEADERS = [
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
    (
        "Content-Security-Policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
]
_STATUS = {
    200: "200 OK",
    401: "401 Unauthorized",
    403: "403 Forbidden",
    404: "404 Not Found",
    405: "405 Method Not Allowed",
    503: "503 Service Unavailable",
}


def _static_files() -> dict[str, tuple[bytes, str]]:
    """The shipped files by name, with their content type."""
    folder = resources.files("stablewatch.detector.service").joinpath("web_static")
    files = {}
    for entry in folder.iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if entry.is_file() and suffix in _TYPES:
            files[entry.name] = (entry.read_bytes(), _TYPES[suffix])
    return files


class WebApp:
    """The WSGI app of the web view (see the module doc).

    `view` is what the detector publishes; `authorizer` its own (mutual TLS or not);
    `on_refused(reason, detail)` counts and logs a refusal.
    """

    def __init__(
        self,
        view: LiveView,
        authorizer: Authorizer,
        on_refused: Callable[[str, str], None] | None = None,
        *,
        keepalive: float = KEEPALIVE,
        max_streams: int = MAX_STREAMS,
    ) -> None:
        self._view = view
        self._authorizer = authorizer
        self._on_refused = on_refused
        self._keepalive = keepalive
        self._max_streams = max_streams
        self._streams = 0
        self._lock = threading.Lock()
        self._files = _static_files()

    @property
    def streams(self) -> int:
        """Event streams open now."""
        with self._lock:
            return self._streams

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        path = environ.get("PATH_INFO") or "/"
        head = method == "HEAD"
        try:
            # The handshake verified the certificate against the client CA (metrics_http).
            self._authorizer.check_uris(environ.get(PEER_URIS), Permission.READ, "the web view")
        except Denied as denied:
            if self._on_refused is not None:
                self._on_refused(denied.reason, f"{environ.get('REMOTE_ADDR', '?')} (web view): {denied}")
            status = 401 if denied.reason == "unauthenticated" else 403
            return _text(start_response, status, f"{denied}\n", head)
        if method not in ("GET", "HEAD"):
            return _text(start_response, 405, f"{method} is not served here; use GET\n", head, [("Allow", "GET, HEAD")])
        if path in ("/", "/index.html"):
            body, kind = self._files["index.html"]
            return _respond(start_response, 200, kind, body, head, [("Cache-Control", "no-cache")])
        if path == "/api/view":
            _, body = self._view.json()
            return _respond(start_response, 200, "application/json", body, head, [("Cache-Control", "no-store")])
        if path == "/events":
            return self._events(start_response, head)
        name = path.removeprefix("/static/")
        if path.startswith("/static/") and name in self._files:  # names only: no path is ever opened
            body, kind = self._files[name]
            return _respond(start_response, 200, kind, body, head, [("Cache-Control", "no-cache")])
        return _text(start_response, 404, "not found: the web view is at /\n", head)

    def _events(self, start_response: StartResponse, head: bool) -> Iterable[bytes]:
        with self._lock:
            if self._streams >= self._max_streams:
                return _text(start_response, 503, f"{self._streams} event streams are open, the most served\n", head)
            if not head:
                self._streams += 1
        headers = [("Content-Type", "text/event-stream"), ("Cache-Control", "no-store"), ("X-Accel-Buffering", "no")]
        start_response(_STATUS[200], [*headers, *_HEADERS])
        return [] if head else _Stream(self._stream(), self._ended)

    def _stream(self) -> Generator[bytes, None, None]:
        """The events, until the view closes (the detector stops)."""
        yield b"retry: 2000\n\n"
        seen = -1
        while True:
            version = self._view.wait_for_change(seen, self._keepalive)
            if version is None:
                return  # the stream ends and the server closes the connection
            if version == seen:
                yield b": keep-alive\n\n"
                continue
            seen, body = self._view.json()
            yield b"id: %d\nevent: view\ndata: %s\n\n" % (seen, body)

    def _ended(self) -> None:
        with self._lock:
            self._streams -= 1


class _Stream:
    """An event stream as a WSGI response: the server calls ``close()`` once it is done with it,
    whether it ended, the client went away, or it never started (a generator's ``finally`` would
    not run then), and the stream's slot frees exactly once."""

    def __init__(self, events: Generator[bytes, None, None], ended: Callable[[], None]) -> None:
        self._events = events
        self._ended: Callable[[], None] | None = ended

    def __iter__(self) -> Iterator[bytes]:
        return self._events

    def close(self) -> None:
        self._events.close()
        ended, self._ended = self._ended, None
        if ended is not None:
            ended()


def _respond(
    start_response: StartResponse,
    status: int,
    kind: str,
    body: bytes,
    head: bool,
    extra: Iterable[tuple[str, str]] = (),
) -> list[bytes]:
    headers = [("Content-Type", kind), ("Content-Length", str(len(body))), *extra, *_HEADERS]
    start_response(_STATUS[status], headers)
    return [] if head else [body]


def _text(
    start_response: StartResponse, status: int, message: str, head: bool, extra: Iterable[tuple[str, str]] = ()
) -> list[bytes]:
    return _respond(start_response, status, "text/plain; charset=utf-8", message.encode(), head, extra)
