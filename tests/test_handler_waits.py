"""The agent records whether its message handler is in a run that waits (``handler_waits``).

A send blocked on a full window is released by its receiver's handler taking what is queued. The
detector took a receiver's handler to be waiting whenever the receiver recorded a wait of task
``""`` (the handler's own waits are of that task), but a background task that declares a wait
without ``task=`` records one too. With the handler idle, a send to that process counted as blocked
and a deadlock was made up, which the handler's next run ended. The agent now records what it
knows: whether the handler was inside a run, and whether that run waits (its send blocked, or a
wait it declared, of any task). An older agent records nothing, and the old rule stands for it.

The recordings come from a real :class:`Agent` (its delivery task, recording lock, blocked sends
and wait registry); its channel to Q never connects (see ``test_channels_review``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from snapshot_gen import rows_of
from test_channels_review import UNREACHABLE, full_window, hold

from stablewatch.agents import Agent, AppMessage
from stablewatch.detector.evaluation import choose_victims, evaluate, verdict
from stablewatch.detector.evaluation.columnar import evaluate_rows
from stablewatch.v1 import (
    ChannelSnapshot,
    GlobalSnapshot,
    LocalSnapshotPart,
    LocalState,
    ProcessSnapshot,
    RecordedMessage,
    Wait,
    WaitNode,
)

pytestmark = pytest.mark.timeout(30)

Handler = Callable[[Agent], Awaitable[None]]


async def background_wait(agent: Agent, entered: asyncio.Event) -> None:
    """A task of P's other than its handler that waits on R, declared without ``task=``."""
    with agent.state.waiting("R"):
        entered.set()
        await asyncio.Event().wait()


def recorded(
    handler_run: Handler | None, *, held: bool = True, background: bool = False, earlier: Handler | None = None
) -> LocalState:
    """P's state as its real agent records it while P's handler runs `handler_run` (None: the
    handler stays idle), after a run of `earlier` if given. P's window to Q is full, and Q holds it
    when `held` (else the send is about to go on); with `background`, a task of P's declares a wait
    on R first."""

    async def scenario() -> LocalState:
        agent = Agent("P", peers={"Q": UNREACHABLE}, hint_after=None)
        agent._lock = asyncio.Lock()  # what start() makes, without any network
        channel = full_window(b"m")
        if held:
            hold(channel)
        agent._outbound["Q"] = channel
        agent._carry_out(agent._core.open_outbound("Q"))
        agent.state.set_active(False)
        parts: list[LocalSnapshotPart] = []
        agent.on_part(parts.append)
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task[None]] = []
        if background:
            entered = asyncio.Event()
            tasks.append(loop.create_task(background_wait(agent, entered), name="refresher"))
            await entered.wait()
        in_run = asyncio.Event()

        async def handler(src: str, message: AppMessage) -> None:
            if message.payload == b"earlier":
                assert earlier is not None
                await earlier(agent)
                return
            assert handler_run is not None
            in_run.set()
            await handler_run(agent)

        agent.on_message(handler)
        agent._delivery = loop.create_task(agent._deliver_forever(), name="delivery-P")
        tasks.append(agent._delivery)
        if earlier is not None:  # the delivery task takes the runs in order: this one ends first
            agent._inbox.put("R", [AppMessage(b"earlier")], 1, 7)
        if handler_run is not None:
            agent._inbox.put("R", [AppMessage(b"go")], 2, 2)
            await in_run.wait()
        await agent.start_snapshot(1)  # takes the recording lock: between runs, or in a blocked send
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        [state] = [part.state for part in parts if part.HasField("state")]
        return state

    return asyncio.run(scenario())


async def sends(agent: Agent) -> None:
    await agent.send("Q", b"x")


async def declares_then_sends(agent: Agent) -> None:
    with agent.state.waiting("R"):
        await agent.send("Q", b"x")


async def declares_for_a_task_then_sends(agent: Agent) -> None:
    with agent.state.waiting("R", task="lookup"):
        await agent.send("Q", b"x")


def test_an_idle_handler_does_not_wait_though_a_background_task_declares_a_wait_of_the_process() -> None:
    state = recorded(None, background=True)
    assert [w.task for w in state.waits] == [""] and state.HasField("handler_waits")
    assert not state.handler_waits


def test_a_handler_blocked_on_a_held_window_waits() -> None:
    state = recorded(sends)
    assert [(w.task, w.flow_control) for w in state.waits] == [("", True)]
    assert state.handler_waits


def test_a_handler_whose_send_is_about_to_go_on_waits_only_on_what_it_declared() -> None:
    going_on = recorded(sends, held=False, background=True)
    assert going_on.active and [w.task for w in going_on.waits] == [""]  # the background task's
    assert not going_on.handler_waits  # its run ends after the send: it will take what is queued
    declared = recorded(declares_then_sends, held=False)
    assert declared.active and [w.task for w in declared.waits] == [""]
    assert declared.handler_waits  # after the send it still waits on R, its run not over
    for_a_task = recorded(declares_for_a_task_then_sends, held=False)
    assert [w.task for w in for_a_task.waits] == ["lookup"] and for_a_task.handler_waits


async def awaits_a_reply_from_r(agent: Agent) -> None:
    """A run that leaves a wait of the process open for later runs: P now waits on R's reply."""
    agent.state.add_wait("R")


def test_a_wait_an_earlier_run_left_open_is_the_processs_not_the_running_handlers() -> None:
    # From a review (read only) of the first version, which took any open wait the delivery task
    # had declared for the handler's, from earlier runs too: this run's send is about to go on, and
    # then the handler takes what is queued, as it does between runs.
    state = recorded(sends, held=False, earlier=awaits_a_reply_from_r)
    assert state.active and [w.task for w in state.waits] == [""] and not state.handler_waits


def deadlock_verdicts(snapshot: GlobalSnapshot) -> tuple[str, str]:
    """The deadlock verdict of the row evaluation and of the columnar one."""
    return verdict(evaluate(snapshot).results[0]), verdict(evaluate_rows(rows_of(snapshot))[0])


def test_a_background_wait_makes_no_deadlock_through_a_send_to_an_idle_handler() -> None:
    # Q's handler is blocked sending to P, whose queue (full of Q's heartbeats) holds Q's window;
    # a task of P's waits on Q, declared without task=. P's handler is idle: it takes the
    # heartbeats, P acknowledges, Q's send goes on. No deadlock at this cut, but the rule for an
    # older agent's recording (a wait of task "" is the handler's) made one up.
    p = recorded(None, background=True)
    p.waits[0].targets[0].process = "Q"  # the same recording, its wait on Q rather than on R
    q = LocalState(
        waits=[Wait(task="", targets=[WaitNode(process="P")], flow_control=True, instance=2, began_at_us=2)],
        handler_waits=True,
    )
    into_p = ChannelSnapshot(src="Q", dst="P", sent_before_marker=2)
    into_p.messages.extend(RecordedMessage(payload=b"hb", no_wake=True) for _ in range(2))
    snapshot = GlobalSnapshot(
        snapshot_id=4,
        processes=[ProcessSnapshot(process_id="P", state=p), ProcessSnapshot(process_id="Q", state=q)],
        channels=[into_p],
        expected_members=["P", "Q"],
    )
    evaluation = evaluate(snapshot)
    assert deadlock_verdicts(snapshot) == ("false", "false")
    assert choose_victims(snapshot, evaluation.wait_for, "youngest") == []
    # An older agent's recording says nothing of its handler: its wait of task "" counts as the
    # handler's, as before, and the cycle stands.
    older = GlobalSnapshot()
    older.CopyFrom(snapshot)
    for process in older.processes:
        process.state.ClearField("handler_waits")
    assert deadlock_verdicts(older) == ("true", "true")
    # P's handler itself declared the wait, in a waiting() block, and sends in it (the send about
    # to go on): the agent cannot see past the send, and reports the wait the block declares, as
    # the application said it: the cycle stands as declared.
    busy = recorded(declares_then_sends, held=False)
    busy.waits[0].targets[0].process = "Q"
    snapshot.processes[0].state.CopyFrom(busy)
    assert deadlock_verdicts(snapshot) == ("true", "true")


def test_a_run_whose_await_was_cancelled_under_it_does_not_end_the_delivery() -> None:
    # A suspicion of a review (read only), checked here: a handler that raised CancelledError (a future it awaited was
    # cancelled) ended the delivery task. No message was handed over again, and the process
    # recorded an idle handler (handler_waits false) though nothing would ever take its queue.
    async def scenario() -> tuple[list[bytes], bool]:
        agent = Agent("P", peers={}, hint_after=None)
        agent._lock = asyncio.Lock()
        handled: list[bytes] = []
        second = asyncio.Event()

        async def handler(src: str, message: AppMessage) -> None:
            handled.append(message.payload)
            if message.payload == b"first":
                gone = asyncio.get_running_loop().create_future()
                gone.cancel()
                await gone  # raises CancelledError in this run only
            second.set()

        agent.on_message(handler)
        delivery = agent._delivery = asyncio.get_running_loop().create_task(agent._deliver_forever())
        agent._inbox.put("R", [AppMessage(b"first"), AppMessage(b"second")], 1, 11)
        await asyncio.wait_for(second.wait(), 10)
        alive = not delivery.done()
        delivery.cancel()
        await asyncio.gather(delivery, return_exceptions=True)
        return handled, alive

    assert asyncio.run(scenario()) == ([b"first", b"second"], True)
