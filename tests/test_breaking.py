"""Breaking waits without a network: instance ids, the long-wait hints, the dispatch of a
``BreakWait``, and what the application waits (``LocalStateKeeper``) and the blocked sends
(``BlockedSends``) do when one of theirs is broken, on threads and in asyncio tasks.

The same over real gRPC, from a detector's control stream, is in test_breaking_embedded.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
from collections.abc import AsyncIterator, Iterable

import pytest

from polling import async_poll, run
from stablewatch.agents import DeadlockVictim, LocalStateKeeper, WaitHandle, breaking
from stablewatch.agents.blocked import BlockedSends
from stablewatch.agents.breaking import BreakDispatcher, Broken, HintWatch, OpenWait
from stablewatch.v1.control_pb2 import (
    BREAK_OUTCOME_ALREADY_BROKEN,
    BREAK_OUTCOME_BROKEN,
    BREAK_OUTCOME_GONE,
    BreakWait,
    WaitHint,
)

JOIN_TIMEOUT = 30.0


def order(instance: int, break_id: int = 1, snapshot_id: int = 7) -> BreakWait:
    return BreakWait(break_id=break_id, snapshot_id=snapshot_id, instance=instance, deadlock="A -> B -> A")


# -- instances ------------------------------------------------------------------------------------


def test_instances_are_unique_across_threads() -> None:
    threads, each = 8, 5000
    found: list[list[int]] = [[] for _ in range(threads)]
    start = threading.Barrier(threads, timeout=JOIN_TIMEOUT)

    def take(i: int) -> None:
        start.wait()
        found[i].extend(breaking.new_instance() for _ in range(each))

    workers = [threading.Thread(target=take, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(JOIN_TIMEOUT)
    assert not any(worker.is_alive() for worker in workers)
    everything = [instance for ids in found for instance in ids]
    assert len(set(everything)) == threads * each and min(everything) > 0
    for ids in found:  # increasing within a thread
        assert ids == sorted(ids)


def test_the_victims_error_names_the_deadlock_and_the_snapshot() -> None:
    victim = DeadlockVictim.of(order(42, snapshot_id=9))
    assert (victim.instance, victim.snapshot_id) == (42, 9)
    assert "snapshot 9" in str(victim) and "A -> B -> A" in str(victim) and "retry" in str(victim)
    assert "a wait cycle" in breaking.victim_message(BreakWait(instance=1))


# -- the hint watch -------------------------------------------------------------------------------


def test_a_wait_is_hinted_once_when_it_has_lasted_the_threshold() -> None:
    watch = HintWatch(0.020)
    waits = [OpenWait(1, "worker", 1_000_000), OpenWait(2, "", 1_015_000)]
    assert watch.due(waits, 1_019_999) == []
    assert watch.due(waits, 1_020_000) == [WaitHint(instance=1, task="worker", waited_ms=20)]
    assert watch.due(waits, 1_030_000) == []  # 1 hinted already, 2 not yet due
    assert watch.due(waits, 1_040_500) == [WaitHint(instance=2, task="", waited_ms=25)]
    assert watch.due(waits, 9_000_000) == []


def test_the_hint_watch_forgets_waits_that_ended() -> None:
    watch = HintWatch(0.001)
    for instance in range(1, 1001):
        (hint,) = watch.due([OpenWait(instance, "t", 0)], 2_000)
        assert hint.instance == instance
    assert len(watch._hinted) == 1  # only the one still open


def test_the_hint_threshold_must_be_positive() -> None:
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="positive"):
            HintWatch(bad)


def test_hint_forever_sends_each_long_wait_once_and_survives_a_failing_send(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = LocalStateKeeper()
    dispatcher = BreakDispatcher([state])
    sent: list[WaitHint] = []
    failures = [RuntimeError("the stream is down")]

    def send(hint: WaitHint) -> bool:
        if failures:
            raise failures.pop()
        sent.append(hint)
        return True

    async def scenario() -> None:
        loop = asyncio.create_task(breaking.hint_forever(dispatcher, HintWatch(0.004), send))
        try:
            lost = state.add_wait("B")  # its hint fails: a hint is best effort
            await async_poll(lambda: not failures, "the failing send")
            first = state.add_wait("C", task="t")
            await async_poll(lambda: sent, "the hint of the second wait")
            second = state.add_wait("D")
            await async_poll(lambda: len(sent) == 2, "the hint of the third wait")
            # The loop has run many times with the first two open: each was hinted once at most.
            assert [(h.instance, h.task) for h in sent] == [(first, "t"), (second, "")]
            assert all(h.waited_ms >= 4 for h in sent)
            for token in (lost, first, second):
                state.remove_wait(token)
        finally:
            loop.cancel()
            with pytest.raises(asyncio.CancelledError):
                await loop

    with caplog.at_level(logging.ERROR):
        run(scenario())
    assert "could not look for long waits" in caplog.text


def test_a_hint_dropped_while_the_detector_is_unreachable_is_sent_again() -> None:
    state = LocalStateKeeper()
    dispatcher = BreakDispatcher([state])
    tries: list[int] = []
    delivered: list[WaitHint] = []

    def send(hint: WaitHint) -> bool:
        tries.append(hint.instance)
        if len(tries) < 3:
            return False  # no stream to the detector yet: dropped
        delivered.append(hint)
        return True

    async def scenario() -> None:
        loop = asyncio.create_task(breaking.hint_forever(dispatcher, HintWatch(0.004), send))
        try:
            token = state.add_wait("B")
            await async_poll(lambda: delivered, "the hint delivered at last")
            await async_poll(lambda: len(tries) >= 3, "three tries")
            assert tries[:3] == [token] * 3 and [h.instance for h in delivered] == [token]
            state.remove_wait(token)
        finally:
            loop.cancel()
            with pytest.raises(asyncio.CancelledError):
                await loop

    run(scenario())


class CountingSource:
    """A LocalStateKeeper's waits, counting how often the hint loop looks at them."""

    def __init__(self) -> None:
        self.state = LocalStateKeeper()
        self.looked = 0

    @property
    def doorbell(self) -> breaking.Doorbell:
        return self.state.doorbell

    @doorbell.setter
    def doorbell(self, doorbell: breaking.Doorbell) -> None:
        self.state.doorbell = doorbell

    def break_wait(self, order: BreakWait) -> Broken | None:
        return self.state.break_wait(order)

    def open_waits(self) -> list[OpenWait]:
        self.looked += 1
        return self.state.open_waits()

    def idle(self) -> bool:
        return self.state.idle()


@contextlib.asynccontextmanager
async def hinting(dispatcher: BreakDispatcher, sent: list[WaitHint], after: float = 0.004) -> AsyncIterator[None]:
    """The hint loop (threshold ``after``) over ``dispatcher``'s waits meanwhile, its hints appended to ``sent``."""

    def send(hint: WaitHint) -> bool:
        sent.append(hint)
        return True

    loop = asyncio.create_task(breaking.hint_forever(dispatcher, HintWatch(after), send))
    try:
        yield
    finally:
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop


def test_the_hint_loop_sleeps_while_nothing_waits_and_a_new_wait_wakes_it() -> None:
    source = CountingSource()
    dispatcher = BreakDispatcher([source])
    bell = dispatcher.doorbell
    assert source.state.doorbell is bell  # the dispatcher hands its doorbell to its sources
    sent: list[WaitHint] = []

    async def scenario() -> None:
        async with hinting(dispatcher, sent):
            await async_poll(lambda: bell.asleep, "the loop asleep with nothing registered")
            looked = source.looked
            # Fifty of its periods (2 ms): asleep, it does not look once.
            await asyncio.sleep(0.1)
            assert source.looked == looked and bell.asleep
            token = source.state.add_wait("B", task="t")  # rings: the loop wakes
            assert not bell.asleep
            await async_poll(lambda: sent, "the hint of the new wait")
            assert [(h.instance, h.task) for h in sent] == [(token, "t")] and source.looked > looked
            # While a wait is registered it keeps looking (the wait is hinted once).
            looked = source.looked
            await async_poll(lambda: source.looked > looked + 3, "more looks while a wait is open")
            assert not bell.asleep and len(sent) == 1
            source.state.remove_wait(token)
            await async_poll(lambda: bell.asleep, "the loop asleep again once the wait ended")
        assert not bell.asleep  # a stopped loop leaves the bell quiet: a ring calls nothing
        source.state.add_wait("C")

    run(scenario())


def test_the_hint_loop_looks_when_a_wait_is_due_not_every_half_threshold() -> None:
    source = CountingSource()
    dispatcher = BreakDispatcher([source])
    sent: list[WaitHint] = []

    async def scenario() -> None:
        async with hinting(dispatcher, sent, after=0.2):
            await async_poll(lambda: dispatcher.doorbell.asleep, "the loop asleep")
            looked = source.looked
            token = source.state.add_wait("B")
            # Before the wait is due (200 ms) the loop does not look: it slept until then.
            await asyncio.sleep(0.15)
            assert source.looked == looked and not sent
            await async_poll(lambda: sent, "the hint when the wait is due")
            assert [h.instance for h in sent] == [token] and sent[0].waited_ms >= 200
            assert source.looked - looked <= 2  # when due (and once more if the timer woke a hair early)
        watch = HintWatch(0.02)
        assert watch.due([OpenWait(1, "", 1_000_000), OpenWait(2, "", 1_005_000)], 1_010_000) == []
        assert watch.next_due_us == 1_020_000  # the earlier wait's
        assert watch.due([OpenWait(1, "", 1_000_000)], 1_020_000) and watch.next_due_us is None

    run(scenario())


def test_a_wait_registered_from_another_thread_wakes_the_sleeping_loop() -> None:
    state = LocalStateKeeper()
    dispatcher = BreakDispatcher([state])
    sent: list[WaitHint] = []

    async def scenario() -> None:
        async with hinting(dispatcher, sent):
            await async_poll(lambda: dispatcher.doorbell.asleep, "the loop asleep")
            tokens: list[int] = []
            thread = threading.Thread(target=lambda: tokens.append(state.add_wait("B", task="other-thread")))
            thread.start()
            thread.join(JOIN_TIMEOUT)
            await async_poll(lambda: sent, "the hint of the other thread's wait")
            assert [h.instance for h in sent] == tokens

    run(scenario())


# -- the dispatcher -------------------------------------------------------------------------------


class Source:
    """A wait source holding some instances; breaks each once."""

    def __init__(self, instances: Iterable[int]) -> None:
        self.waiting = set(instances)
        self.broken: set[int] = set()

    def break_wait(self, order: BreakWait) -> Broken | None:
        if order.instance not in self.waiting:
            return None
        if order.instance in self.broken:
            return Broken(BREAK_OUTCOME_ALREADY_BROKEN, "before")
        self.broken.add(order.instance)
        return Broken(BREAK_OUTCOME_BROKEN, f"broke {order.instance}")

    def open_waits(self) -> list[OpenWait]:
        return [OpenWait(i, "", 0) for i in sorted(self.waiting)]

    def idle(self) -> bool:
        return not self.waiting


def test_the_dispatcher_asks_each_source_and_reports_what_it_did() -> None:
    first, second = Source([1, 2]), Source([3])
    dispatcher = BreakDispatcher([first])
    dispatcher.add(second)
    report = dispatcher.handle(order(3, break_id=11))
    assert (report.break_id, report.instance, report.outcome, report.detail) == (11, 3, BREAK_OUTCOME_BROKEN, "broke 3")
    assert dispatcher.handle(order(3, break_id=12)).outcome == BREAK_OUTCOME_ALREADY_BROKEN
    unknown = dispatcher.handle(order(99, break_id=13))
    assert (unknown.break_id, unknown.instance, unknown.outcome) == (13, 99, BREAK_OUTCOME_GONE)
    assert "not waiting here" in unknown.detail
    assert first.broken == set() and second.broken == {3}
    assert [w.instance for w in dispatcher.open_waits()] == [1, 2, 3]


# -- application waits on threads -----------------------------------------------------------------


def test_a_threads_wait_learns_of_its_break_through_its_handle() -> None:
    state = LocalStateKeeper()
    dispatcher = BreakDispatcher([state])
    entered = threading.Event()
    calls: list[tuple[str, DeadlockVictim]] = []
    outcome: list[object] = []
    handles: list[WaitHandle] = []

    def waiter() -> None:
        with state.waiting(["B", "C"], task="worker") as wait:
            handles.append(wait)
            wait.on_break(lambda victim: calls.append((threading.current_thread().name, victim)))
            entered.set()
            if wait.broken.wait(JOIN_TIMEOUT):
                try:
                    wait.check()
                except DeadlockVictim as victim:
                    outcome.append(victim)

    thread = threading.Thread(target=waiter, name="waiter")
    thread.start()
    assert entered.wait(JOIN_TIMEOUT)
    (wait,) = handles
    assert wait.victim is None and not wait.broken.is_set()
    wait.check()  # not broken: nothing happens
    report = dispatcher.handle(order(wait.instance, break_id=5))
    thread.join(JOIN_TIMEOUT)
    assert not thread.is_alive()
    assert report.outcome == BREAK_OUTCOME_BROKEN and "worker" in report.detail and "B and C" in report.detail
    (victim,) = outcome
    assert wait.victim is victim and victim.instance == wait.instance and victim.snapshot_id == 7
    assert calls == [("MainThread", victim)]  # once, on the breaking thread
    # The wait has ended: a second break finds nothing, and the callback is not called again.
    assert dispatcher.handle(order(wait.instance, break_id=6)).outcome == BREAK_OUTCOME_GONE
    assert len(calls) == 1 and state.snapshot().waits == []


def test_breaking_twice_says_already_broken_and_changes_nothing() -> None:
    state = LocalStateKeeper()
    other = state.add_wait("Z", task="other")
    calls: list[DeadlockVictim] = []
    with state.waiting("B", task="t") as wait:
        wait.on_break(calls.append)
        first = state.break_wait(order(wait.instance))
        assert first is not None and first.outcome == BREAK_OUTCOME_BROKEN
        again = state.break_wait(order(wait.instance, break_id=2))
        assert again is not None and again.outcome == BREAK_OUTCOME_ALREADY_BROKEN
        assert "before" in again.detail
        late: list[DeadlockVictim] = []
        wait.on_break(late.append)  # already broken: called at once
        assert calls == late == [wait.victim] and wait.broken.is_set()
        # A broken wait is no longer reported, though its waiter has not left it yet: it holds no
        # deadlock any more, and a cut showing it would make a detector break another wait.
        assert [w.instance for w in state.snapshot().waits] == [other]
        with pytest.raises(DeadlockVictim):
            wait.check()
    assert state.break_wait(order(wait.instance)) is None  # ended: not ours any more
    assert state.break_wait(order(10**12)) is None  # never ours
    assert not state.handle(other).broken.is_set()
    assert [w.instance for w in state.snapshot().waits] == [other]


def test_a_failing_callback_is_logged_and_the_others_still_run(caplog: pytest.LogCaptureFixture) -> None:
    state = LocalStateKeeper()
    calls: list[str] = []

    def fail(victim: DeadlockVictim) -> None:
        raise RuntimeError("callback bug")

    token = state.add_wait("B")
    wait = state.handle(token)
    wait.on_break(fail)
    wait.on_break(lambda victim: calls.append("second"))
    with caplog.at_level(logging.ERROR):
        broken = state.break_wait(order(token))
    assert broken is not None and broken.outcome == BREAK_OUTCOME_BROKEN
    assert calls == ["second"] and "on_break callback" in caplog.text
    state.remove_wait(token)


def test_breaks_race_with_waits_ending_and_each_wait_is_broken_at_most_once() -> None:
    """Breakers on several threads aim at waits that workers open and close: every wait is broken
    at most once, a break of an ended wait finds nothing, and a callback runs at most once."""
    rng = random.Random(25)
    state = LocalStateKeeper()
    rounds, breakers = 400, 3
    instances: list[int] = []
    broken: list[int] = []
    calls: dict[int, int] = {}
    lock = threading.Lock()
    done = threading.Event()

    def work() -> None:
        for _ in range(rounds):
            with state.waiting("B") as wait:
                wait.on_break(lambda victim, i=wait.instance: calls.__setitem__(i, calls.get(i, 0) + 1))
                with lock:
                    instances.append(wait.instance)
        done.set()

    def breaker(seed: int) -> None:
        rng = random.Random(seed)
        while not done.is_set():
            with lock:
                if not instances:
                    continue
                target = instances[-1 - rng.randrange(min(3, len(instances)))]
            result = state.break_wait(order(target))
            if result is not None and result.outcome == BREAK_OUTCOME_BROKEN:
                with lock:
                    broken.append(target)

    threads = [threading.Thread(target=work)] + [
        threading.Thread(target=breaker, args=(rng.randrange(2**32),)) for _ in range(breakers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_TIMEOUT)
    assert not any(thread.is_alive() for thread in threads)
    assert len(broken) == len(set(broken))
    assert all(calls.get(i, 0) == 1 for i in broken) and set(calls) == set(broken)
    assert state.snapshot().waits == []


# -- application waits in asyncio tasks -----------------------------------------------------------


def test_an_asyncio_waits_task_gets_the_victim_raised_where_it_awaits() -> None:
    state = LocalStateKeeper()

    async def scenario() -> None:
        never = asyncio.Event()
        entered = asyncio.Event()
        handles: list[WaitHandle] = []

        async def waiter() -> int:
            with state.waiting("B", task="worker") as wait:
                handles.append(wait)
                entered.set()
                await never.wait()
            return 0

        task = asyncio.create_task(waiter(), name="worker")
        await entered.wait()
        (wait,) = handles
        broken = state.break_wait(order(wait.instance))  # on the task's loop: cancelled at once
        assert broken is not None and broken.outcome == BREAK_OUTCOME_BROKEN and "'worker'" in broken.detail
        with pytest.raises(DeadlockVictim) as raised:
            await task
        assert raised.value is wait.victim and isinstance(raised.value.__cause__, asyncio.CancelledError)
        assert not task.cancelled() and task.cancelling() == 0
        assert state.snapshot().waits == [] and wait.broken.is_set()

    run(scenario())


def test_a_task_that_handles_the_victim_goes_on_uncancelled() -> None:
    state = LocalStateKeeper()

    async def scenario() -> None:
        entered = asyncio.Event()
        handles: list[WaitHandle] = []

        async def waiter() -> str:
            try:
                with state.waiting("B") as wait:
                    handles.append(wait)
                    entered.set()
                    await asyncio.Event().wait()
            except DeadlockVictim:
                pass
            await asyncio.sleep(0)  # not cancelled any more: awaits go on
            return "retried"

        task = asyncio.create_task(waiter())
        await entered.wait()
        state.break_wait(order(handles[0].instance))
        assert await task == "retried"

    run(scenario())


async def waiting_on_b(state: LocalStateKeeper, handles: list[WaitHandle]) -> asyncio.Task[None]:
    """A task in an application wait on B that never ends by itself, once it waits; its handle is
    appended to `handles`."""

    async def waiter() -> None:
        with state.waiting("B") as wait:
            handles.append(wait)
            await asyncio.Event().wait()

    task = asyncio.create_task(waiter())
    waits = len(handles) + 1
    await async_poll(lambda: len(handles) == waits, "the task's wait")
    return task


def test_an_outer_cancellation_stays_a_cancellation() -> None:
    state = LocalStateKeeper()

    async def scenario() -> None:
        handles: list[WaitHandle] = []
        task = await waiting_on_b(state, handles)
        task.cancel()  # the service stops the task, and the break comes in the same turn
        state.break_wait(order(handles[0].instance))
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()

        plain = await waiting_on_b(state, handles)  # no break at all: an ordinary cancellation
        plain.cancel()
        with pytest.raises(asyncio.CancelledError):
            await plain
        assert handles[1].victim is None and state.snapshot().waits == []

    run(scenario())


def test_a_break_from_another_thread_reaches_the_task_on_its_loop() -> None:
    state = LocalStateKeeper()

    async def scenario() -> None:
        handles: list[WaitHandle] = []
        task = await waiting_on_b(state, handles)
        broken = await asyncio.to_thread(state.break_wait, order(handles[0].instance))
        assert broken is not None and broken.outcome == BREAK_OUTCOME_BROKEN
        with pytest.raises(DeadlockVictim):
            await task
        assert task.cancelling() == 0

    run(scenario())


def test_a_block_that_completes_before_the_break_reaches_it_completes() -> None:
    """A break from another thread while the task's loop is busy: the block ends first, normally;
    the cancellation that was on its way is not delivered, and the handle still says broken."""
    state = LocalStateKeeper()

    async def scenario() -> str:
        with state.waiting("B") as wait:
            breaker = threading.Thread(target=state.break_wait, args=(order(wait.instance),))
            breaker.start()
            breaker.join(JOIN_TIMEOUT)  # blocks the loop: the cancellation waits for it
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # the scheduled cancellation has run by now, and did nothing
        current = asyncio.current_task()
        assert current is not None and current.cancelling() == 0
        assert wait.broken.is_set() and wait.victim is not None
        return "done"

    assert run(scenario()) == "done"


# -- blocked sends --------------------------------------------------------------------------------


class Window:
    """What BlockedSends reads of an outbound channel: a full window its receiver holds."""

    def __init__(self, dst: str) -> None:
        self.dst = dst
        self.held = True
        self.space = asyncio.Event()

    def has_space(self) -> bool:
        return self.space.is_set()

    async def wait_for_space(self) -> None:
        await self.space.wait()


async def blocked_send(blocked: BlockedSends, waiter: str, window: Window, sent: list[str]) -> None:
    """What Agent._wait_for_space and send do: wait for space, then send."""
    with blocked.waiting(waiter, window):  # type: ignore[arg-type]
        while not window.has_space():
            await window.wait_for_space()
    sent.append(waiter)


def test_a_broken_send_raises_and_sends_nothing() -> None:
    blocked = BlockedSends()

    async def scenario() -> None:
        to_b, to_c = Window("B"), Window("C")
        sent: list[str] = []
        first = asyncio.create_task(blocked_send(blocked, "", to_b, sent))
        second = asyncio.create_task(blocked_send(blocked, "serve", to_c, sent))
        await async_poll(lambda: len(blocked) == 2, "two blocked sends")
        waits = blocked.waits()
        assert [(w.task, [t.process for t in w.targets], w.flow_control) for w in waits] == [
            ("", ["B"], True),
            ("serve", ["C"], True),
        ]
        assert len({w.instance for w in waits}) == 2 and all(w.began_at_us > 0 for w in waits)
        assert [(w.instance, w.task) for w in blocked.open_waits()] == [(w.instance, w.task) for w in waits]
        to_c.held = False  # its receiver acknowledged: not a wait to record, nor to hint
        assert [w.task for w in blocked.waits()] == [""] and [w.task for w in blocked.open_waits()] == [""]

        broken = blocked.break_wait(order(waits[0].instance))
        assert broken is not None and broken.outcome == BREAK_OUTCOME_BROKEN and "to B" in broken.detail
        again = blocked.break_wait(order(waits[0].instance, break_id=2))
        assert again is not None and again.outcome == BREAK_OUTCOME_ALREADY_BROKEN
        assert blocked.waits() == []  # broken: on its way to raise, not waiting for B
        to_b.space.set()  # space comes too late: the send was broken
        with pytest.raises(DeadlockVictim):
            await first
        assert first.cancelling() == 0 and sent == []
        assert blocked.break_wait(order(waits[0].instance)) is None  # ended

        to_c.space.set()
        await second
        assert sent == ["serve"] and len(blocked) == 0
        assert blocked.break_wait(order(waits[1].instance)) is None

    run(scenario())


def test_a_send_broken_from_another_thread_does_not_send_even_if_space_came_first() -> None:
    blocked = BlockedSends()

    async def scenario() -> None:
        window = Window("B")
        sent: list[str] = []
        task = asyncio.create_task(blocked_send(blocked, "", window, sent))
        await async_poll(lambda: blocked.waits(), "the blocked send")
        (wait,) = blocked.waits()
        window.space.set()  # the send is about to resume ...
        results: list[Broken | None] = []
        breaker = threading.Thread(target=lambda: results.append(blocked.break_wait(order(wait.instance))))
        breaker.start()
        breaker.join(JOIN_TIMEOUT)  # ... when the break comes (the loop blocked meanwhile)
        (broken,) = results
        assert broken is not None and broken.outcome == BREAK_OUTCOME_BROKEN
        with pytest.raises(DeadlockVictim):
            await task
        assert sent == [] and task.cancelling() == 0

    run(scenario())
