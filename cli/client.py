"""A thin synchronous client of the detector's query API, for the CLI and for scripts.

Every unary call has a deadline (``timeout`` seconds, 5 by default), so an unreachable or hung
detector is reported within it rather than waited on forever. gRPC failures become
:class:`DetectorError`, whose message says what went wrong in words a user can act on.

With ``credentials`` (:func:`stablewatch.agents.certificates.channel_credentials`) the client speaks TLS,
showing a client certificate when they hold one; a detector with mutual TLS then decides what the
certificate's role allows (SECURITY.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stablewatch.v1 import GlobalSnapshot, WaitForGraph, query_pb2, query_pb2_grpc
from stablewatch.v1.query_pb2 import Resolution, SnapshotResults, WatchEvent

__all__ = ["DEFAULT_ADDRESS", "DEFAULT_TIMEOUT", "DetectorClient", "DetectorError"]

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_TIMEOUT = 5.0
# How much longer than the snapshot's own deadline TriggerSnapshot may take to answer.
_TRIGGER_SLACK = 5.0
# With no deadline given, the detector uses its own; the client then waits up to the API's maximum.
_TRIGGER_MAX = 600.0
# Pages of ListResolutions, at most: the detector's default page size (query.DEFAULT_PAGE_SIZE),
# which its bounds admit.
_PAGE_SIZE = 50

Request = TypeVar("Request")
Response = TypeVar("Response")


class DetectorError(Exception):
    """A query failed; ``code`` is the gRPC status code (None when unknown)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class DetectorClient:
    """Calls ``stablewatch.v1.Query`` on the detector at ``address`` (host:port)."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.address = address
        self.timeout = timeout
        self._tls = credentials is not None
        if credentials is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            self._channel = grpc.secure_channel(address, credentials, options=options)
        self._stub = query_pb2_grpc.QueryStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> DetectorClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- calls -----------------------------------------------------------------------------------

    def latest_results(self) -> SnapshotResults:
        """Results of the newest complete snapshot (NOT_FOUND before the first one)."""
        return self._call(self._stub.GetLatestResults, query_pb2.GetLatestResultsRequest())

    def snapshot_results(self, snapshot_id: int) -> SnapshotResults:
        return self._call(self._stub.GetSnapshotResults, query_pb2.GetSnapshotRequest(snapshot_id=snapshot_id))

    def list_snapshots(self, page_size: int = 0, page_token: str = "") -> query_pb2.ListSnapshotsResponse:
        request = query_pb2.ListSnapshotsRequest(page_size=page_size, page_token=page_token)
        return self._call(self._stub.ListSnapshots, request)

    def snapshot(self, snapshot_id: int) -> GlobalSnapshot:
        return self._call(self._stub.GetSnapshot, query_pb2.GetSnapshotRequest(snapshot_id=snapshot_id))

    def wait_for_graph(self, snapshot_id: int) -> WaitForGraph:
        return self._call(self._stub.GetWaitForGraph, query_pb2.GetSnapshotRequest(snapshot_id=snapshot_id))

    def health(self) -> str:
        """The detector's overall ``grpc.health.v1`` status: SERVING, NOT_SERVING, ..."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        response = self._call(stub.Check, health_pb2.HealthCheckRequest())
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def members(self) -> list[query_pb2.Member]:
        """The attached agents."""
        return list(self.membership().members)

    def membership(self) -> query_pb2.ListMembersResponse:
        """The attached agents, and the expected processes (``--members``) that are not attached."""
        return self._call(self._stub.ListMembers, query_pb2.ListMembersRequest())

    def trigger_snapshot(self, deadline: float | None = None, expected_members: Sequence[str] = ()) -> SnapshotResults:
        """Take a snapshot now and return its results, completed or aborted.

        ``deadline`` (seconds) is the snapshot's own; None leaves the detector's configured one.
        ``expected_members`` must be in the cut for whole-system predicates to be decided. The
        call itself may take that long plus a few seconds.
        """
        request = query_pb2.TriggerSnapshotRequest(
            timeout_ms=0 if deadline is None else max(1, round(deadline * 1000)), expected_members=expected_members
        )
        wait = (_TRIGGER_MAX if deadline is None else deadline) + _TRIGGER_SLACK
        return self._call(self._stub.TriggerSnapshot, request, wait)

    def resolve(self, snapshot_id: int) -> list[Resolution]:
        """Break the deadlocks that completed snapshot ``snapshot_id`` proves, one wait each (operator
        role under mutual TLS): the breaks sent. FAILED_PRECONDITION when there is nothing to break."""
        response = self._call(self._stub.ResolveDeadlock, query_pb2.ResolveRequest(snapshot_id=snapshot_id))
        return list(response.resolutions)

    def list_resolutions(self, page_size: int = 0, page_token: str = "") -> query_pb2.ListResolutionsResponse:
        """One page of the breaks of deadlocks, newest first."""
        request = query_pb2.ListResolutionsRequest(page_size=page_size, page_token=page_token)
        return self._call(self._stub.ListResolutions, request)

    def resolutions(self, limit: int) -> list[Resolution]:
        """The newest ``limit`` breaks of deadlocks (fewer if there are not so many), newest first."""
        found: list[Resolution] = []
        token = ""
        while len(found) < limit:
            page = self.list_resolutions(min(limit - len(found), _PAGE_SIZE), token)
            found += page.resolutions
            token = page.next_page_token
            if not token:
                break
        return found[:limit]

    def watch(self, changes_only: bool = False) -> Iterator[WatchEvent]:
        """Every new result as the detector publishes it, until it ends the stream.

        The stream has no deadline; closing the iterator (or an exception such as
        KeyboardInterrupt while it waits) cancels it.
        """
        call = self._stub.Watch(query_pb2.WatchRequest(changes_only=changes_only))
        try:
            yield from call
        except grpc.RpcError as error:
            raise self._error(error) from None
        finally:
            call.cancel()

    # -- errors ----------------------------------------------------------------------------------

    def _call(self, method: Callable[..., Response], request: Request, timeout: float | None = None) -> Response:
        timeout = self.timeout if timeout is None else timeout
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as error:
            raise self._error(error, timeout) from None

    def _error(self, error: grpc.RpcError, timeout: float | None = None) -> DetectorError:
        code = error.code() if isinstance(error, grpc.Call) else None
        details = (error.details() if isinstance(error, grpc.Call) else None) or str(error)
        if code == grpc.StatusCode.UNAVAILABLE and self._tls:
            message = (
                f"cannot reach the detector at {self.address} over TLS ({details}); is `stablewatch detector` "
                "running there, does --tls-ca hold the CA of its certificate, and, with mutual TLS, is "
                "--tls-cert signed by the CA it trusts?"
            )
        elif code == grpc.StatusCode.UNAVAILABLE:
            message = (
                f"cannot reach the detector at {self.address} ({details}); is `stablewatch detector` running? "
                "(one that runs with TLS needs --tls-ca, and --tls-cert and --tls-key with mutual TLS)"
            )
        elif code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            message = f"the detector at {self.address} refused: {details}"
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
            message = f"the detector at {self.address} did not answer within {timeout:g} s"
        elif code == grpc.StatusCode.UNIMPLEMENTED:
            message = f"{self.address} does not serve the stablewatch query API ({details})"
        else:
            message = details
        return DetectorError(message, code)
