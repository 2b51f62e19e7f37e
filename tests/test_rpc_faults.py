"""RPC mode under faults, for real: stale requests and responses between gRPC services on loopback.

A message is stale when it was sent before the counts between its two processes restarted and
arrives after a newer message of its sender: it is not delivered. The tests hold one call in a TCP
proxy while another call ends ambiguously (DEADLINE_EXCEEDED, so the caller restarts the pair's
counts) and a third carries the new session both ways; then they let the held call through.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
from rpc_harness import Service, agent, call, channel_to, sample, snapshot, stamped

from polling import poll
from stablewatch.agents.rpc.agent import StaleResponse
from stablewatch.detector.service.query import outcome_name
from stablewatch.testing.detector import Running
from stablewatch.testing.tcp_proxy import TcpProxy


def restart_counts(channel: grpc.Channel) -> None:
    """A call that times out before its server answers makes the caller restart the pair's counts; the
    next call carries the new session to the server, and its response the server's back."""
    with pytest.raises(grpc.RpcError) as ended:
        call(channel, "Hang", timeout=0.3)
    assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert call(channel, "Echo", b"new", timeout=10) == b"new"


class Pair:
    """S serves Echo, Slow (until ``release``) and Hang (until the end); C calls it directly and
    through a TCP proxy (``delayed``) that a test can pause."""

    def __init__(self, running: Running) -> None:
        self.s_agent, self.c_agent = agent(running, "S"), agent(running, "C")
        self.handled: list[bytes] = []
        self.slow_started, self.release, self.hang = threading.Event(), threading.Event(), threading.Event()

        def echo(request: bytes, context: object) -> bytes:
            self.handled.append(request)
            return request

        def slow(request: bytes, context: object) -> bytes:
            self.slow_started.set()
            self.release.wait(20)
            return b"done:" + request

        handlers = {"Echo": echo, "Slow": slow, "Hang": lambda request, context: self.hang.wait(20) and b""}
        self.service = Service(handlers, self.s_agent)
        self.proxy = TcpProxy(self.service.address)
        self.direct = channel_to(self.service, self.c_agent, "S")
        self.delayed = grpc.intercept_channel(
            grpc.insecure_channel(self.proxy.address), self.c_agent.client_interceptor("S")
        )
        self.pool = futures.ThreadPoolExecutor(1, thread_name_prefix="held")
        assert call(self.delayed, "Echo", b"warm", timeout=10) == b"warm"  # the proxied connection is up

    def close(self) -> None:
        self.release.set()
        self.hang.set()
        self.proxy.resume()
        self.pool.shutdown(wait=True)
        self.direct.close()
        self.delayed.close()
        self.proxy.stop()
        self.service.stop()
        self.c_agent.stop()
        self.s_agent.stop()


def test_a_stale_request_is_refused_with_aborted_and_the_counts_stay_comparable(running: Running) -> None:
    pair = Pair(running)
    try:
        pair.proxy.pause()
        held = pair.pool.submit(call, pair.delayed, "Echo", b"old", timeout=20)
        poll(lambda: stamped(pair.c_agent, "request") == 2, "the held request stamped (session 0)")
        restart_counts(pair.direct)
        assert sample(pair.c_agent, "peer_resets") == 1
        pair.proxy.resume()
        with pytest.raises(grpc.RpcError) as refused:
            held.result(20)
        assert refused.value.code() == grpc.StatusCode.ABORTED
        details = refused.value.details()
        assert "sent before the counts between C and S restarted" in details, details
        assert "did not run: safe to retry" in details, details
        assert b"old" not in pair.handled
        assert sample(pair.s_agent, "stale_messages", side="server") == 1
        assert sample(pair.s_agent, "bad_stamps", side="server") == 0
        # The refusal carried S's stamp: C took it in as a response, and restarted nothing again.
        assert sample(pair.c_agent, "peer_resets") == 1
        assert stamped(pair.s_agent, "response") == 3  # warm, new and the refusal
        results = snapshot(running)
        assert outcome_name(results.snapshot.outcome) == "completed", results.snapshot.abort_reason
        assert call(pair.direct, "Echo", b"again", timeout=10) == b"again"  # a retry goes through
    finally:
        pair.close()


def test_a_stale_response_fails_its_call_with_aborted_without_restarting_the_counts(running: Running) -> None:
    pair = Pair(running)
    try:
        held = pair.pool.submit(call, pair.delayed, "Slow", b"old", timeout=20)
        poll(pair.slow_started.is_set, "Slow running")
        pair.proxy.pause()
        pair.release.set()
        poll(lambda: stamped(pair.s_agent, "response") == 2, "Slow's response stamped (session 0), held")
        restart_counts(pair.direct)
        assert sample(pair.c_agent, "peer_resets") == 1
        pair.proxy.resume()
        with pytest.raises(grpc.RpcError) as refused:
            held.result(20)
        assert isinstance(refused.value, StaleResponse)
        assert refused.value.code() == grpc.StatusCode.ABORTED
        details = refused.value.details()
        assert "S ran /test.Svc/Slow, but its response was sent before the counts between S and C restarted" in details
        assert sample(pair.c_agent, "stale_messages", side="client") == 1
        assert sample(pair.c_agent, "bad_stamps", side="client") == 0
        assert sample(pair.c_agent, "peer_resets") == 1  # the loss is known: no second restart
        assert not pair.c_agent._outgoing  # the call's wait ended with it
        results = snapshot(running)
        assert outcome_name(results.snapshot.outcome) == "completed", results.snapshot.abort_reason
    finally:
        pair.close()
