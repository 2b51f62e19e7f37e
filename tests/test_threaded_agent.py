"""ThreadedAgent: the agent for synchronous services, driven from plain threads."""

from __future__ import annotations

import threading

import pytest
from detector_stub import StubDetector

from polling import poll
from stablewatch.agents import AppMessage, ThreadedAgent


def test_threads_send_tokens_and_snapshots_conserve_them() -> None:
    detector = StubDetector()
    received: list[tuple[str, bytes]] = []
    b = ThreadedAgent("B", detector=detector.address, handler=lambda src, m: received.append((src, m.payload)))
    a = None
    try:
        b.start()
        a = ThreadedAgent("A", peers={"B": b.address}, detector=detector.address)
        a.start()
        a.state.set_counter("tokens", 100)
        detector.wait_members({"A", "B"})

        def worker(n: int) -> None:
            for i in range(50):
                a.send("B", b"%d-%d" % (n, i), counters={"tokens": 1})

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(2)]
        for thread in threads:
            thread.start()
        snapshots = [detector.snapshot() for _ in range(3)]
        for thread in threads:
            thread.join(30)
        poll(lambda: len(received) == 100, "all 100 messages")
        for snapshot in snapshots:
            held = sum(p.state.counters["tokens"] for p in snapshot.processes)
            in_flight = sum(m.counters["tokens"] for c in snapshot.channels for m in c.messages)
            assert held + in_flight == 100
        assert a.state.counter("tokens") == 0
        assert b.state.counter("tokens") == 100
        for n in range(2):  # each thread's messages arrive in the order that thread sent them
            assert [p for _, p in received if p.startswith(b"%d-" % n)] == [b"%d-%d" % (n, i) for i in range(50)]
    finally:
        if a is not None:
            a.stop()
        b.stop()
        detector.stop()


def test_calling_back_into_the_agent_from_its_handler_is_refused() -> None:
    errors: list[Exception] = []
    b = ThreadedAgent("B")

    def handler(src: str, message: AppMessage) -> None:
        try:
            b.send("A", b"echo")
        except RuntimeError as error:
            errors.append(error)

    b.on_message(handler)
    b.start()
    a = ThreadedAgent("A", peers={"B": b.address})
    try:
        a.start()
        a.send("B", b"ping")
        poll(lambda: errors, "the handler's error")
        assert "from its own handler" in str(errors[0])
    finally:
        a.stop()
        b.stop()


def test_stop_is_idempotent_and_start_errors_surface() -> None:
    agent = ThreadedAgent("A", listen="256.0.0.1:1")  # not an address
    with pytest.raises(Exception, match=r"A cannot listen|256\.0\.0\.1"):
        agent.start()
    agent.stop()
    agent.stop()


def test_service_threads_read_whether_the_detector_has_accepted_it() -> None:
    """``detector_connected`` and ``detectors`` read as the Agent's do, from a service thread (they
    hop onto the agent's loop) and before the agent starts (no loop runs then)."""
    detector = StubDetector()
    agent = ThreadedAgent("A", detector=detector.address)
    try:
        assert agent.detector_connected is False
        assert agent.detectors == ()
        agent.start()
        detector.wait_members({"A"})
        poll(lambda: agent.detector_connected, "A's detector_connected")
        (status,) = agent.detectors
        assert status.address == detector.address
        assert status.connected is True
    finally:
        agent.stop()
        detector.stop()
