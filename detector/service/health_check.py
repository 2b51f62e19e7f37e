"""The detector's gRPC health service: grpc_health's asyncio servicer, with the one string a client
sends it bounded.

The health check is open to any connection that completes the handshake (probes need it), and a
``Watch`` on a service name no service has stays open, holding its request, for as long as the
client likes: twenty of them naming 8 MB each took 400 MB of the detector. A name longer than any
service's is refused before anything holds it. The asyncio servicer, not the thread-pool one: that
one holds a thread per ``Watch``, and six of them left every health check hanging.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2

from stablewatch.v1.bounds import quoted_prefix, too_long

__all__ = ["MAX_SERVICE_NAME_BYTES", "HealthService"]

#: The longest service name a health check may ask about (UTF-8 bytes); the detector's are short.
MAX_SERVICE_NAME_BYTES = 256


class HealthService(health.aio.HealthServicer):
    """``grpc.health.v1.Health`` for the detector; ``on_refused(reason, detail)`` counts refusals."""

    def __init__(self, on_refused: Callable[[str, str], None]) -> None:
        super().__init__()
        self._on_refused = on_refused

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        await self._check_name(request, context)
        return await super().Check(request, context)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        await self._check_name(request, context)
        await super().Watch(request, context)

    async def _check_name(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        if too_long(request.service, MAX_SERVICE_NAME_BYTES):
            message = f"service must be at most {MAX_SERVICE_NAME_BYTES} bytes, not {quoted_prefix(request.service)}"
            self._on_refused("bad_request", f"{context.peer()}: {message}")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
