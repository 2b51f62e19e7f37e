"""Who may do what on the detector: identities and roles from client certificates.

With mutual TLS (the detector is given a client CA), every connection shows a certificate signed
by that CA, and the certificate's URI subject alternative names say what its holder may do:

* ``stablewatch://process/<id>`` — attach as agent ``<id>`` on the control stream (the id is
  percent-encoded; :func:`stablewatch.agents.peer_identity.process_uri`). Parts are then accepted only for
  that process, on its own stream. A certificate that names no process cannot open a control
  stream at all: it is refused before the stream takes one of the detector's slots.
* ``stablewatch://role/reader`` — read: latest results, snapshots, wait-for graphs, members, the
  watch stream, the breaks of deadlocks (``ListResolutions``), and server reflection.
* ``stablewatch://role/operator`` — read, trigger snapshots (``TriggerSnapshot``) and break a
  proven deadlock by hand (``ResolveDeadlock``).

A certificate may carry several of them. The health check is open to any connection that
completes the handshake (probes need it). Every other method needs a permission from
:data:`METHOD_PERMISSIONS`; a method missing from it is refused (fail closed).

Without a client CA there is no identity: the detector serves everyone who can connect and logs a
warning at start when that is not loopback only (SECURITY.md). Refusals carry the standard codes,
UNAUTHENTICATED (no certificate where one is required) and PERMISSION_DENIED (a certificate
without the role or identity), with a message that names what was missing.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import grpc

from stablewatch.agents.peer_identity import PROCESS_URI_PREFIX, peer_process_ids, peer_uris, process_uri
from stablewatch.v1.bounds import quoted_prefix

__all__ = [
    "METHOD_PERMISSIONS",
    "ROLES",
    "ROLE_URI_PREFIX",
    "AuthInterceptor",
    "Authorizer",
    "Denied",
    "Permission",
    "peer_identity",
    "role_uri",
]

ROLE_URI_PREFIX = "stablewatch://role/"


class Permission(enum.Enum):
    """What a call needs."""

    OPEN = "open"  # any connection (the health check)
    AGENT = "agent"  # a process identity; checked by the coordinator against the Register
    READ = "read"
    TRIGGER = "trigger"
    RESOLVE = "resolve"  # break a proven deadlock by hand


#: Each role's permissions.
ROLES: dict[str, frozenset[Permission]] = {
    "reader": frozenset({Permission.READ}),
    "operator": frozenset({Permission.READ, Permission.TRIGGER, Permission.RESOLVE}),
}

_QUERY = "/stablewatch.v1.Query/"
#: The permission every method of the detector needs; any other method is refused.
METHOD_PERMISSIONS: dict[str, Permission] = {
    "/stablewatch.v1.Control/Attach": Permission.AGENT,
    _QUERY + "GetLatestResults": Permission.READ,
    _QUERY + "GetSnapshotResults": Permission.READ,
    _QUERY + "ListSnapshots": Permission.READ,
    _QUERY + "GetSnapshot": Permission.READ,
    _QUERY + "GetWaitForGraph": Permission.READ,
    _QUERY + "ListMembers": Permission.READ,
    _QUERY + "Watch": Permission.READ,
    _QUERY + "TriggerSnapshot": Permission.TRIGGER,
    _QUERY + "ResolveDeadlock": Permission.RESOLVE,
    _QUERY + "ListResolutions": Permission.READ,
    "/grpc.health.v1.Health/Check": Permission.OPEN,
    "/grpc.health.v1.Health/Watch": Permission.OPEN,
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": Permission.READ,
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": Permission.READ,
}


def role_uri(role: str) -> str:
    """The URI SAN that grants ``role``: ``stablewatch://role/<role>``."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; the roles are {', '.join(ROLES)}")
    return ROLE_URI_PREFIX + role


def peer_identity(context: grpc.aio.ServicerContext) -> str:
    """Who is calling, for limits per client: the client certificate (its subject and sorted
    subject alternative names) under mutual TLS, else the peer's address without its port.

    Certificates with the same subject and names are one identity (a renewed certificate stays
    the same client); without one, each host is one identity, whatever port it calls from.
    """
    auth = context.auth_context()
    if auth.get("x509_pem_cert"):
        subject = b"".join(auth.get("x509_subject", ())).decode(errors="replace")
        names = sorted(name.decode(errors="replace") for name in auth.get("x509_subject_alternative_name", ()))
        return f"certificate {subject} [{', '.join(names)}]"
    kind, _, address = context.peer().partition(":")
    if kind in ("ipv4", "ipv6"):
        address = unquote(address.rsplit(":", 1)[0])  # ipv4:127.0.0.1:54321, ipv6:%5B::1%5D:54321
    return f"address {address or context.peer()}"


class Denied(Exception):
    """A call or registration is refused: ``code`` for the client, ``reason`` for the metric."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason  # one of limits.REFUSAL_REASONS


class Authorizer:
    """Decides calls from the peer's certificate; ``required``: the detector runs mutual TLS.

    Without ``required`` a peer without a certificate may do anything (there is no identity to
    check); a peer with one is still held to what it names.
    """

    def __init__(self, *, required: bool) -> None:
        self.required = required

    def check(self, context: grpc.aio.ServicerContext, permission: Permission, method: str) -> None:
        """Raise :class:`Denied` unless the peer of this call has ``permission``."""
        if permission in (Permission.OPEN, Permission.AGENT):
            return
        self.check_uris(peer_uris(context), permission, method)

    def check_uris(self, uris: tuple[str, ...] | None, permission: Permission, method: str) -> None:
        """Raise :class:`Denied` unless a peer whose verified certificate has these URI SANs (None: no
        certificate) has ``permission``: the rule of :meth:`check`, for the web view's HTTPS too."""
        if permission in (Permission.OPEN, Permission.AGENT):
            return
        if uris is None:
            if self.required:
                raise Denied(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated", f"{method} needs a client certificate")
            return
        roles = [uri.removeprefix(ROLE_URI_PREFIX) for uri in uris if uri.startswith(ROLE_URI_PREFIX)]
        if any(permission in ROLES.get(role, ()) for role in roles):
            return
        needs = " or ".join(role_uri(role) for role, granted in ROLES.items() if permission in granted)
        shown = quoted_prefix(", ".join(roles), 128) if roles else "none"
        raise Denied(
            grpc.StatusCode.PERMISSION_DENIED,
            "permission_denied",
            f"{method} needs a client certificate with the URI SAN {needs} (its roles: {shown})",
        )

    def check_agent(self, context: grpc.aio.ServicerContext) -> None:
        """Raise :class:`Denied` unless the peer may attach as some process: under mutual TLS, its
        certificate must name one. Checked before a control stream takes a slot or is read."""
        allowed = peer_process_ids(context)
        if allowed is None:
            if self.required:
                raise Denied(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated", "an agent needs a client certificate")
            return
        if not allowed:
            raise Denied(
                grpc.StatusCode.PERMISSION_DENIED,
                "permission_denied",
                f"an agent's client certificate must carry a URI SAN {PROCESS_URI_PREFIX}<id>; this one names "
                "no process",
            )

    def check_process(self, context: grpc.aio.ServicerContext, process_id: str) -> None:
        """Raise :class:`Denied` unless the peer may register as ``process_id``."""
        allowed = peer_process_ids(context)
        if allowed is None:
            if self.required:
                raise Denied(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated", "an agent needs a client certificate")
            return
        if process_id not in allowed:
            # Every quote is a prefix: the refusal's size does not grow with the id or the certificate.
            named = quoted_prefix(", ".join(sorted(allowed)), 128) if allowed else "no process"
            raise Denied(
                grpc.StatusCode.PERMISSION_DENIED,
                "identity_mismatch",
                f"process id {quoted_prefix(process_id)} is not in the client certificate, which names {named}; "
                f"an agent's certificate must carry the URI SAN {quoted_prefix(process_uri(process_id), 128)}",
            )


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks every call's permission (:data:`METHOD_PERMISSIONS`) before its handler runs.

    The peer's certificate is only known inside the call, so the handler is wrapped: the check runs
    first and a refusal aborts the call with its code. ``on_refused(reason, detail)`` counts them.
    """

    def __init__(self, authorizer: Authorizer, on_refused: Callable[[str, str], None]) -> None:
        self._authorizer = authorizer
        self._on_refused = on_refused

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        permission = METHOD_PERMISSIONS.get(method)
        if handler is None or permission in (Permission.OPEN, Permission.AGENT):
            return handler

        async def check(context: grpc.aio.ServicerContext) -> None:
            if permission is None:
                message = f"{method} is not served to anyone"
                self._on_refused("permission_denied", message)
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)
            try:
                self._authorizer.check(context, permission, method)
            except Denied as denied:
                self._on_refused(denied.reason, f"{context.peer()}: {denied}")
                await context.abort(denied.code, str(denied))

        return _guarded(handler, check)


def _guarded(
    handler: grpc.RpcMethodHandler, check: Callable[[grpc.aio.ServicerContext], Awaitable[None]]
) -> grpc.RpcMethodHandler:
    """``handler`` with ``check(context)`` awaited before its behaviour (sync or async) runs."""
    codec = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}

    async def single(behaviour: Callable[..., Any], request: Any, context: grpc.aio.ServicerContext) -> Any:
        await check(context)
        result = behaviour(request, context)
        return await result if inspect.isawaitable(result) else result

    async def stream(
        behaviour: Callable[..., Any], request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        await check(context)
        result = behaviour(request, context)
        if hasattr(result, "__aiter__"):
            async for response in result:
                yield response
        else:
            for response in result:
                yield response

    # grpc.aio tells async handlers by their function type: these must be coroutine functions and
    # async generator functions, not lambdas returning them.
    if handler.unary_unary:

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await single(handler.unary_unary, request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **codec)
    if handler.stream_unary:

        async def stream_unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            return await single(handler.stream_unary, requests, context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, **codec)
    behaviour = handler.unary_stream or handler.stream_stream

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for response in stream(behaviour, request, context):
            yield response

    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **codec)
    return grpc.stream_stream_rpc_method_handler(streaming, **codec)
