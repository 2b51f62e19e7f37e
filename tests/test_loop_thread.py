"""An agent's own loop thread, stopped, leaves nothing pending: no task is destroyed later with an
error in the log ("Task was destroyed but it is pending!"), as gRPC's tasks of just-ended calls were."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
from collections.abc import Callable

import pytest
from rpc_harness import agent

from stablewatch.agents.loop_thread import LoopThread
from stablewatch.agents.threaded import ThreadedAgent
from stablewatch.testing.detector import Running


def destroyed_pending(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What asyncio logged of tasks destroyed while pending, once the collector has freed them."""
    gc.collect()
    return [record.getMessage() for record in caplog.records if "destroyed but it is pending" in record.getMessage()]


def started() -> LoopThread:
    loop_thread = LoopThread("test-loop")
    loop_thread.start()
    return loop_thread


def refusal_from_inside(loop_thread: LoopThread, stop: Callable[[], None]) -> str:
    """What ``stop()`` raises when it is called on ``loop_thread``'s own thread (RuntimeError expected)."""

    async def stop_from_inside() -> str:
        try:
            stop()
        except RuntimeError as refused:
            return str(refused)
        return "not refused"

    return loop_thread.run(stop_from_inside(), 10)


def test_a_task_left_on_the_loop_is_cancelled_and_awaited_as_it_stops(caplog: pytest.LogCaptureFixture) -> None:
    loop_thread = started()

    async def start_forever() -> asyncio.Task[bool]:
        return asyncio.get_running_loop().create_task(asyncio.Event().wait())

    task = loop_thread.run(start_forever(), 10)
    loop_thread.stop(10)
    assert task.cancelled()
    assert not loop_thread.is_alive() and loop_thread.loop.is_closed()
    del task
    assert destroyed_pending(caplog) == []


def test_a_task_that_fails_as_it_is_cancelled_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    loop_thread = started()

    async def fails_when_cancelled() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise ValueError("its clean-up failed") from None

    async def start() -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(fails_when_cancelled())

    caplog.set_level(logging.WARNING)
    task = loop_thread.run(start(), 10)
    loop_thread.stop(10)
    del task
    gc.collect()
    failures = [record for record in caplog.records if "its clean-up failed" in str(record.exc_info)]
    assert [record.name for record in failures] == ["stablewatch.agents.loop_thread"]
    assert not any("never retrieved" in record.getMessage() for record in caplog.records)


def test_a_task_that_will_not_end_is_named_and_the_thread_still_stops(caplog: pytest.LogCaptureFixture) -> None:
    loop_thread = started()

    async def stubborn() -> None:
        while True:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)

    async def start_stubborn() -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(stubborn(), name="stubborn")

    caplog.set_level(logging.WARNING)
    task = loop_thread.run(start_stubborn(), 10)
    loop_thread.stop(0.2)
    assert any("did not end" in record.getMessage() and "stubborn" in record.getMessage() for record in caplog.records)
    assert not loop_thread.is_alive() and loop_thread.loop.is_closed()
    assert not task.done()  # left as it was: the loop is closed under it
    # Put away here, or asyncio would log it destroyed pending in whichever test runs when it is freed.
    task.get_coro().close()
    task._log_destroy_pending = False  # type: ignore[attr-defined]


def test_stopping_from_the_loop_s_own_thread_is_refused_at_once_and_the_loop_goes_on() -> None:
    loop_thread = started()
    assert "from inside it" in refusal_from_inside(loop_thread, lambda: loop_thread.stop(10))
    assert loop_thread.is_alive() and not loop_thread.loop.is_closed()
    loop_thread.stop(10)
    assert not loop_thread.is_alive() and loop_thread.loop.is_closed()


def test_threads_stopping_it_at_once_all_return_and_the_loop_is_closed_once() -> None:
    loop_thread = started()
    errors: list[BaseException] = []

    def stop() -> None:
        try:
            loop_thread.stop(10)
        except BaseException as error:
            errors.append(error)

    stoppers = [threading.Thread(target=stop) for _ in range(4)]
    for stopper in stoppers:
        stopper.start()
    for stopper in stoppers:
        stopper.join(30)
    assert errors == [] and not any(stopper.is_alive() for stopper in stoppers)
    assert not loop_thread.is_alive() and loop_thread.loop.is_closed()


def test_a_loop_thread_never_started_is_closed_by_stop() -> None:
    loop_thread = LoopThread("never-started")
    loop_thread.stop(1)
    assert loop_thread.loop.is_closed()


@pytest.mark.parametrize("attempt", range(3))  # gRPC left a task pending in 2 of 3 such stops before
def test_rpc_agents_stopped_while_snapshots_run_leave_no_task_pending(
    running: Running, caplog: pytest.LogCaptureFixture, attempt: int
) -> None:
    agents = [agent(running, f"P{index}") for index in range(5)]
    snapshots = [running.call(_started_snapshot(running)) for _ in range(10)]
    for each in agents:
        each.stop()
    for taken in snapshots:
        running.call(_ended(taken))
    left = [task for each in agents for task in asyncio.all_tasks(each._loop) if not task.done()]
    assert left == []
    del agents, left, snapshots  # so that the collector frees whatever the agents left, and asyncio logs it
    assert destroyed_pending(caplog) == []


def test_an_rpc_agent_refuses_to_be_stopped_from_its_own_thread(running: Running) -> None:
    attached = agent(running, "P")
    try:
        assert "own thread" in refusal_from_inside(attached._loop_thread, attached.stop)
        assert attached.detector_connected
    finally:
        attached.stop()


async def _started_snapshot(running: Running) -> asyncio.Task[object]:
    return asyncio.get_running_loop().create_task(running.detector.take_snapshot(deadline=5))


async def _ended(task: asyncio.Task[object]) -> None:
    await asyncio.wait([task])


def test_a_threaded_agent_refuses_to_be_stopped_from_its_own_thread() -> None:
    threaded = ThreadedAgent("T")
    threaded.start()
    try:
        assert "own handler" in refusal_from_inside(threaded._loop_thread, threaded.stop)
        assert threaded._loop_thread.is_alive()
    finally:
        threaded.stop()
    assert not threaded._loop_thread.is_alive()
