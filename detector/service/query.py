"""The query API (``stablewatch.v1.Query``): a thin gRPC servicer over the detector.

It only translates: results and wait-for graphs are read as the detector stored them, never
recomputed. The detector is any object with the small :class:`QueryBackend` interface.

Errors carry standard status codes with a message: NOT_FOUND for an unknown snapshot,
INVALID_ARGUMENT for a bad request (a page size, a page token or a list over the detector's
limits among them), FAILED_PRECONDITION when no agent is attached, a snapshot has no state to
show (aborted) or nothing to break (ResolveDeadlock: no deadlock proven, or being broken
already), and RESOURCE_EXHAUSTED over a limit of the detector (the trigger rate, running
triggers, watchers in all and per client). Every string a client sends is bounded and checked
before it is used, and a refusal quotes at most a short prefix of it. Who may call what is
decided before a call gets here (:mod:`~.auth`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any, NoReturn, Protocol

import grpc

from stablewatch.detector.service.auth import peer_identity
from stablewatch.detector.service.coordinator import NoAgents
from stablewatch.detector.service.limits import LimitExceeded, Limits
from stablewatch.detector.service.resolver import NothingToResolve
from stablewatch.detector.service.store import Store
from stablewatch.v1 import GlobalSnapshot, WaitForGraph, query_pb2, query_pb2_grpc
from stablewatch.v1.bounds import MAX_ID_BYTES, process_id_problem, quoted_prefix
from stablewatch.v1.query_pb2 import SnapshotResults, WatchEvent

__all__ = ["MAX_PAGE_TOKEN_LENGTH", "QueryBackend", "QueryService", "outcome_name", "parse_page_token"]

DEFAULT_PAGE_SIZE = 50
MAX_TRIGGER_TIMEOUT_MS = 10 * 60 * 1000
#: A page token is a snapshot id in ASCII decimal digits: at most this many (the digits of the
#: largest int64, which bounds every id), never more than that value.
MAX_PAGE_TOKEN_LENGTH = 19
_MAX_SNAPSHOT_ID = 2**63 - 1


async def _fail(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("unreachable")  # context.abort raises


class QueryBackend(Protocol):
    """What the query API needs from the detector."""

    @property
    def store(self) -> Store: ...

    def latest(self) -> SnapshotResults | None: ...

    async def trigger(self, deadline: float | None, expected: Iterable[str]) -> SnapshotResults:
        """May raise NoAgents, or LimitExceeded."""
        ...

    def members(self) -> query_pb2.ListMembersResponse: ...

    def watch(self, identity: str) -> AsyncIterator[WatchEvent]:
        """Watch as `identity` (:func:`~.auth.peer_identity`); may raise LimitExceeded."""
        ...

    def refused(self, reason: str, detail: str) -> None:
        """Count a refused call (reason: one of limits.REFUSAL_REASONS)."""

    def resolve(self, snapshot_id: int, requested_by: str) -> list[query_pb2.Resolution]:
        """Break the deadlocks of a completed snapshot; may raise KeyError, or NothingToResolve."""
        ...


class QueryService(query_pb2_grpc.QueryServicer):
    """Translates Query RPCs into calls on the detector."""

    def __init__(self, detector: QueryBackend, limits: Limits | None = None) -> None:
        self._detector = detector
        self._limits = limits or Limits()

    async def GetLatestResults(self, request, context) -> SnapshotResults:
        latest = self._detector.latest()
        if latest is None:
            await _fail(context, grpc.StatusCode.NOT_FOUND, "no snapshot has completed yet")
        return latest

    async def GetSnapshotResults(self, request, context) -> SnapshotResults:
        snapshot_id = await self._snapshot_id(request, context)
        results = self._detector.store.results(snapshot_id)
        if results is None:
            await _fail(context, grpc.StatusCode.NOT_FOUND, f"snapshot {snapshot_id} is not known")
        return results

    async def ListSnapshots(self, request, context) -> query_pb2.ListSnapshotsResponse:
        page_size, before = await self._page(request, context)
        page = self._detector.store.list(page_size + 1, before)
        response = query_pb2.ListSnapshotsResponse(snapshots=page[:page_size])
        if len(page) > page_size:
            response.next_page_token = str(page[page_size - 1].snapshot_id)
        return response

    async def GetSnapshot(self, request, context) -> GlobalSnapshot:
        snapshot_id = await self._snapshot_id(request, context)
        snapshot = self._detector.store.snapshot(snapshot_id)
        if snapshot is None:
            await self._missing(snapshot_id, context)
        return snapshot

    async def GetWaitForGraph(self, request, context) -> WaitForGraph:
        snapshot_id = await self._snapshot_id(request, context)
        graph = self._detector.store.wait_for_graph(snapshot_id)
        if graph is None:
            await self._missing(snapshot_id, context)
        return graph

    async def TriggerSnapshot(self, request, context) -> SnapshotResults:
        if request.timeout_ms > MAX_TRIGGER_TIMEOUT_MS:
            await self._bad_request(context, f"timeout_ms must be at most {MAX_TRIGGER_TIMEOUT_MS}")
        if len(request.expected_members) > self._limits.max_agents:
            count, limit = len(request.expected_members), self._limits.max_agents
            await self._bad_request(context, f"expected_members names {count} processes, above the limit of {limit}")
        for index, name in enumerate(request.expected_members):
            # The same rules as a Register's process id: any other name could never attach.
            if process_id_problem(name) is not None:
                await self._bad_request(
                    context,
                    f"expected_members[{index}] must be a process id of 1 to {MAX_ID_BYTES} bytes without control "
                    f"characters, not {quoted_prefix(name)}",
                )
        try:
            return await self._detector.trigger(request.timeout_ms / 1000 or None, request.expected_members)
        except NoAgents as error:
            await _fail(context, grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except LimitExceeded as error:
            await _fail(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))

    async def ListMembers(self, request, context) -> query_pb2.ListMembersResponse:
        return self._detector.members()

    async def Watch(self, request, context) -> AsyncIterator[WatchEvent]:
        try:
            events = self._detector.watch(peer_identity(context))
        except LimitExceeded as error:
            await _fail(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        async for event in events:
            if request.changes_only:
                if event.HasField("resolution"):
                    yield event  # a break is news whatever the predicates do
                    continue
                if not event.changes:
                    continue
                event = WatchEvent(changes=event.changes, snapshot_id=event.snapshot_id)
            yield event

    async def ResolveDeadlock(self, request, context) -> query_pb2.ResolveResponse:
        snapshot_id = await self._snapshot_id(request, context)
        if self._detector.store.summary(snapshot_id) is None:
            await _fail(context, grpc.StatusCode.NOT_FOUND, f"snapshot {snapshot_id} is not known")
        try:
            resolutions = self._detector.resolve(snapshot_id, peer_identity(context))
        except KeyError:
            await self._missing(snapshot_id, context)
        except NothingToResolve as error:
            await _fail(context, grpc.StatusCode.FAILED_PRECONDITION, str(error))
        return query_pb2.ResolveResponse(resolutions=resolutions)

    async def ListResolutions(self, request, context) -> query_pb2.ListResolutionsResponse:
        page_size, before = await self._page(request, context)
        page = self._detector.store.resolutions(page_size + 1, before)
        response = query_pb2.ListResolutionsResponse(resolutions=page[:page_size])
        if len(page) > page_size:
            response.next_page_token = str(page[page_size - 1].resolution_id)
        return response

    async def _page(self, request: Any, context: grpc.aio.ServicerContext) -> tuple[int, int | None]:
        """A list request's page size (a default for 0) and the id its page token starts below."""
        limit = self._limits.max_page_size
        if request.page_size > limit:
            await self._bad_request(context, f"page_size must be at most {limit}, not {request.page_size}")
        before = None
        if request.page_token:
            try:
                before = parse_page_token(request.page_token)
            except ValueError as error:
                await self._bad_request(context, str(error))
        return request.page_size or min(DEFAULT_PAGE_SIZE, limit), before

    async def _bad_request(self, context: grpc.aio.ServicerContext, message: str) -> NoReturn:
        """A request over one of the detector's bounds: counted, and INVALID_ARGUMENT."""
        self._detector.refused("bad_request", message)
        await _fail(context, grpc.StatusCode.INVALID_ARGUMENT, message)

    @staticmethod
    async def _snapshot_id(request: query_pb2.GetSnapshotRequest, context: grpc.aio.ServicerContext) -> int:
        if request.snapshot_id == 0:
            await _fail(context, grpc.StatusCode.INVALID_ARGUMENT, "snapshot_id is required (ids start at 1)")
        return request.snapshot_id

    async def _missing(self, snapshot_id: int, context: grpc.aio.ServicerContext) -> NoReturn:
        summary = self._detector.store.summary(snapshot_id)
        if summary is None:
            await _fail(context, grpc.StatusCode.NOT_FOUND, f"snapshot {snapshot_id} is not known")
        reason = f": {summary.abort_reason}" if summary.abort_reason else ""
        message = f"snapshot {snapshot_id} is {outcome_name(summary.outcome)}{reason}"
        await _fail(context, grpc.StatusCode.FAILED_PRECONDITION, message)


def parse_page_token(token: str) -> int:
    """The snapshot id a page token names: ASCII digits, at most :data:`MAX_PAGE_TOKEN_LENGTH`,
    within int64. Raises ValueError saying so otherwise, quoting at most a short prefix of it."""
    # Length first: int() of a long string costs time, and str.isdigit() takes "²" and other digits.
    if len(token) > MAX_PAGE_TOKEN_LENGTH or not (token.isascii() and token.isdigit()) or int(token) > _MAX_SNAPSHOT_ID:
        raise ValueError(
            f"page_token must be the next_page_token of an earlier page (ASCII digits, at most "
            f"{MAX_PAGE_TOKEN_LENGTH}, within int64), not {quoted_prefix(token, 32)}"
        )
    return int(token)


def outcome_name(outcome: int) -> str:
    """A snapshot outcome as a word: running, completed, aborted."""
    return query_pb2.SnapshotOutcome.Name(outcome).removeprefix("SNAPSHOT_OUTCOME_").lower()
