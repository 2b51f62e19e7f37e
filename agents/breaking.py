"""What every kind of wait shares for breaking proven deadlocks: instance ids, the victim's error,
the once-per-wait dispatch of a ``BreakWait`` and the long-wait hints.

DESIGN.md, "Breaking a proven deadlock": every wait an agent reports carries an instance id that is
never reused in the process (nor after it restarts) and the time it began. A detector that proves
a deadlock names one wait by its instance; the agent breaks it at most once, only while it still
waits, and answers with a ``BreakReport``. Each kind of wait (an application wait, a blocked send,
an RPC call) lives in its own module and offers itself here as a :class:`WaitSource`.

With several detectors side by side, exactly once rests on all of them choosing the same victim of
a deadlock, which only the same policy does: :class:`PolicyAgreement` is the rule by which an
agent refuses automatic breaks while its detectors' policies disagree.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, NoReturn, Protocol

from stablewatch.v1.control_pb2 import (
    BREAK_OUTCOME_BROKEN,
    BREAK_OUTCOME_FAILED,
    BREAK_OUTCOME_GONE,
    BREAK_OUTCOME_POLICIES_DISAGREE,
    BreakReport,
    BreakWait,
    WaitHint,
)

__all__ = [
    "DEFAULT_HINT_AFTER",
    "OFF",
    "OPERATOR",
    "BreakDispatcher",
    "Broken",
    "DeadlockVictim",
    "Doorbell",
    "HintWatch",
    "OpenWait",
    "PolicyAgreement",
    "WaitSource",
    "failed_report",
    "hint_forever",
    "instance_counter",
    "new_instance",
    "now_us",
    "victim_message",
]

_log = logging.getLogger(__name__)

#: How long a wait lasts before the agent hints the detector that a deadlock may have formed.
DEFAULT_HINT_AFTER = 0.020
_LEAST_DELAY = 0.0005  # the hint loop's shortest sleep (s): a wait due in less is looked at then


def instance_counter(clock_ns: Callable[[], int] = time.time_ns) -> Callable[[], int]:
    """A source of wait instance ids for one run of a process, counting up from the run's start time in µs.

    A detector remembers the waits it broke or named by (process, instance), across the process's
    restarts: a run that counted from 1 again would hand a new wait the id of one broken before,
    and the detector would skip the wait its policy names (or two detectors break two waits). Each
    run starts above every id of the runs before it unless one of them began more than one wait
    per µs on average (a wait costs microseconds of CPU) or the wall clock went back between them.
    Microseconds, not nanoseconds: the ids stay below 2**53 (until 2255), as snapshot ids do, so
    that JSON readers (the web view) show them exactly; 0, "unknown", is never handed out.
    """
    return functools.partial(next, itertools.count(max(1, clock_ns() // 1000)))


# One counter for the whole process, shared by every agent and kind of wait: an instance is never
# reused in the process, nor by its earlier runs. ``next`` on an itertools.count is atomic under the GIL.
new_instance: Callable[[], int] = instance_counter()
"""A wait instance id never handed out before in this process or its earlier runs (``next`` on a
counter: one C call, atomic under the GIL, with no Python frame: every RPC-mode call takes one)."""


def now_us() -> int:
    """The wall clock in microseconds since the Unix epoch, as ``Wait.began_at_us`` holds it."""
    return time.time_ns() // 1000


def victim_message(order: BreakWait) -> str:
    """What the waiter is told: which deadlock, proven by which snapshot, and that it may retry."""
    cycle = order.deadlock or "a wait cycle"
    return (
        f"stablewatch broke this wait to end a deadlock proven by snapshot {order.snapshot_id}: {cycle} "
        "(retry after a back-off)"
    )


class DeadlockVictim(Exception):
    """Raised in a waiter whose wait stablewatch broke to end a proven deadlock.

    Safe to retry after a back-off: the wait did not complete (a blocked send's message was not sent).
    """

    def __init__(self, message: str, *, snapshot_id: int = 0, instance: int = 0) -> None:
        super().__init__(message)
        self.snapshot_id = snapshot_id
        self.instance = instance

    @classmethod
    def of(cls, order: BreakWait) -> DeadlockVictim:
        """The error for the waiter of the wait ``order`` breaks."""
        return cls(victim_message(order), snapshot_id=order.snapshot_id, instance=order.instance)


class OpenWait(NamedTuple):
    """A wait now in progress, as the hint watch sees it."""

    instance: int
    task: str
    began_at_us: int


class Broken(NamedTuple):
    """What a source did with a break it recognised."""

    outcome: int  # BREAK_OUTCOME_BROKEN or BREAK_OUTCOME_ALREADY_BROKEN
    detail: str


class WaitSource(Protocol):
    """One kind of wait an agent reports (application waits, blocked sends, RPC calls).

    Its ``doorbell`` is set by the :class:`BreakDispatcher` it is given to; it rings it after it
    registers a wait.
    """

    doorbell: Doorbell

    def break_wait(self, order: BreakWait) -> Broken | None:
        """Break the wait ``order.instance`` if it is one of ours and still waiting; None if not ours (or ended).

        Thread-safe; returns at once (the waiter gets its error on its own thread or task).
        """

    def open_waits(self) -> Iterable[OpenWait]:
        """The waits now in progress (for the hints); cheap, and safe from the agent's event loop."""

    def idle(self) -> bool:
        """True when no wait is registered at all, not even one that cannot be hinted yet.

        The hint loop sleeps while every source is idle, until a source's ``doorbell`` rings.
        """


class Doorbell:
    """Wakes the hint loop, asleep while no wait is registered, when a source registers one.

    A quiet process pays no timer: the loop sleeps until rung. :meth:`ring` is called after each
    registration, from any thread; it reads one attribute unless the loop sleeps. The loop sets
    ``asleep`` *before* it asks the sources whether they are idle, so a wait registered after that
    question (under the source's lock) is always followed by a ring that finds it asleep.
    """

    __slots__ = ("_wake", "asleep")

    def __init__(self) -> None:
        self.asleep = False
        self._wake: Callable[[], None] | None = None

    def attach(self, wake: Callable[[], None] | None) -> None:
        """Call ``wake`` (thread-safe; None: nobody listens) when a ring finds the loop asleep."""
        self._wake = wake

    def ring(self) -> None:
        """A wait was registered: wake the loop if it sleeps."""
        if self.asleep:
            self.asleep = False
            wake = self._wake
            if wake is not None:
                wake()


def failed_report(order: BreakWait, detail: str) -> BreakReport:
    """The answer to ``order`` when breaking its wait raised: ``BREAK_OUTCOME_FAILED``, or for a
    detector that does not know that outcome (``knows_failed`` unset) ``POLICIES_DISAGREE``, which it
    also takes as "nothing known broken": either way it names no other wait of the deadlock."""
    outcome = BREAK_OUTCOME_FAILED if order.knows_failed else BREAK_OUTCOME_POLICIES_DISAGREE
    return BreakReport(break_id=order.break_id, instance=order.instance, outcome=outcome, detail=detail[:1024])


class BreakDispatcher:
    """Routes a ``BreakWait`` to the source that holds the wait and builds the ``BreakReport``.

    Its :attr:`doorbell` is given to every source, which rings it when it registers a wait.
    ``on_broken`` is called with each order that broke a wait, before its report is returned (so
    before the detector can hear of the break): the RPC-mode agent stops serving older recordings.
    A source (or ``on_broken``) that raises is answered ``BREAK_OUTCOME_FAILED`` with its error, never
    "gone": the wait may have been marked broken (left out of later cuts) or may still hold the
    deadlock, and a detector told "gone" would break another wait of it.
    """

    def __init__(self, sources: Sequence[WaitSource], on_broken: Callable[[BreakWait], None] | None = None) -> None:
        self.doorbell = Doorbell()
        self._sources: tuple[WaitSource, ...] = ()
        self._on_broken = on_broken
        for source in sources:
            self.add(source)

    def add(self, source: WaitSource) -> None:
        """One more kind of wait (for instance a server's worker pool made after the agent)."""
        source.doorbell = self.doorbell
        self._sources += (source,)

    def handle(self, order: BreakWait) -> BreakReport:
        """Break ``order``'s wait at most once; a wait that is no longer anywhere is reported gone,
        one whose breaking raised is reported failed (with the error, logged here)."""
        try:
            done = self._break(order)
        except Exception as error:
            _log.exception("breaking wait %d (break %d) failed", order.instance, order.break_id)
            return failed_report(order, f"breaking wait {order.instance} raised {type(error).__name__}: {error}")
        if done is not None:
            return BreakReport(
                break_id=order.break_id, instance=order.instance, outcome=done.outcome, detail=done.detail
            )
        return BreakReport(
            break_id=order.break_id,
            instance=order.instance,
            outcome=BREAK_OUTCOME_GONE,
            detail=f"wait {order.instance} is not waiting here (it ended, or never began): nothing done",
        )

    def _break(self, order: BreakWait) -> Broken | None:
        """What the source holding ``order``'s wait did with it (None: no source holds it); raises
        what a source or ``on_broken`` raised."""
        for source in self._sources:
            done = source.break_wait(order)
            if done is not None:
                if done.outcome == BREAK_OUTCOME_BROKEN and self._on_broken is not None:
                    self._on_broken(order)
                return done
        return None

    def open_waits(self) -> Iterable[OpenWait]:
        """Every source's waits now in progress."""
        for source in self._sources:
            yield from source.open_waits()

    def idle(self) -> bool:
        """True when no source has a wait registered."""
        return all(source.idle() for source in self._sources)


#: ``BreakWait.policy`` of an operator's order: one explicit order, carried out whatever the policies.
OPERATOR = "operator"
#: ``Registered.resolve_policy`` of a detector that breaks no deadlock unasked.
OFF = "off"


class PolicyAgreement:
    """Whether the detectors an agent attaches to choose the same victims; pure bookkeeping.

    DESIGN.md, "Several detectors side by side": breaking stays exactly once because every
    detector picks the same victim of a deadlock and an agent breaks a wait at most once. Detectors
    with different policies (``--resolve youngest`` on one, ``oldest`` on another) pick different
    waits of the same deadlock, and each of those breaks would land. So each detector states its
    policy when it registers the agent (``Registered.resolve_policy``), :meth:`stated` keeps the
    latest each one stated (also while its stream is down: it comes back with it, and its cuts may
    still be answered), and while two of them differ :meth:`refusal` refuses every automatic
    break, from any of them (``BREAK_OUTCOME_POLICIES_DISAGREE``). An operator's order
    (``BreakWait.policy == "operator"``) is one explicit order and goes through, unless the
    detectors agree on an automatic policy other than the one that chose its victim
    (``BreakWait.chosen_by``: an operator at a detector without ``--resolve`` gets the youngest
    wait): one of them may already have broken another wait of that deadlock, on a cut taken after
    the operator's snapshot began, and this would be a second victim. It is refused then, with the
    same outcome, naming the detectors to ask instead (their choice is their own break's).

    Compared are the automatic policies only: a detector that breaks nothing unasked (``off``)
    agrees with every other, and one that states nothing (older than the field) cannot be
    compared, so it is left out (as before the rule). An order that states no policy (from such a
    detector) is taken as automatic.

    >>> agreement = PolicyAgreement()
    >>> agreement.stated("d0:1", "youngest"), agreement.stated("d1:1", "youngest")
    (None, None)
    >>> print(agreement.stated("d1:1", "oldest"))  # doctest: +ELLIPSIS
    the detectors break deadlocks by different policies (oldest at d1:1, youngest at d0:1): ...
    >>> agreement.refusal(BreakWait(policy="youngest")) is not None, agreement.refusal(BreakWait(policy="operator"))
    (True, None)
    >>> agreement.stated("d1:1", "off") is not None  # the policies agree again: youngest
    True
    >>> agreement.refusal(BreakWait(policy="operator", chosen_by="youngest")) is None
    True
    >>> refused = agreement.refusal(BreakWait(policy="operator", chosen_by="oldest", instance=7))
    >>> print(refused.detail)  # doctest: +ELLIPSIS
    operator break of wait 7 refused: it was chosen by oldest, but youngest at d0:1 breaks ...
    """

    def __init__(self) -> None:
        self._policies: dict[str, str] = {}  # detector address -> the policy it stated last
        self._told: str | None = None  # the disagreement last returned by stated()

    def stated(self, detector: str, policy: str) -> str | None:
        """The detector at ``detector`` registered this agent, stating ``policy`` ("" if it states none).

        Returns what changed, to log once, when the detectors come to disagree (or disagree
        otherwise, or agree again); None when nothing changed.
        """
        self._policies[detector] = policy
        now = self.disagreement()
        if now == self._told:
            return None
        self._told = now
        return now if now is not None else "the detectors' policies agree again: automatic breaks are carried out"

    def policy(self, detector: str) -> str:
        """What the detector at ``detector`` stated last ("" when nothing, or not registered yet)."""
        return self._policies.get(detector, "")

    def disagreement(self) -> str | None:
        """Why automatic breaks are refused (the policies and who states them), or None while they agree."""
        automatic = {detector: p for detector, p in self._policies.items() if p not in ("", OFF)}
        if len(set(automatic.values())) < 2:
            return None
        who = ", ".join(f"{policy} at {detector}" for detector, policy in sorted(automatic.items(), key=_by_policy))
        return (
            f"the detectors break deadlocks by different policies ({who}): each would break another wait "
            "of the same deadlock, so this agent breaks none unasked; give every detector the same --resolve"
        )

    def refusal(self, order: BreakWait) -> BreakReport | None:
        """The report refusing ``order`` while the policies disagree (automatic orders), or an
        operator's order chosen by another policy than the one the detectors agree on; None: carry it out."""
        operator = order.policy == OPERATOR
        why = self._other_choice(order) if operator else self.disagreement()
        if why is None:
            return None
        return BreakReport(
            break_id=order.break_id,
            instance=order.instance,
            outcome=BREAK_OUTCOME_POLICIES_DISAGREE,
            detail=f"{'operator' if operator else 'automatic'} break of wait {order.instance} refused: {why}",
        )

    def _other_choice(self, order: BreakWait) -> str | None:
        """Why an operator's ``order`` could make a second victim: the detectors agree on breaking
        unasked by a policy other than ``order.chosen_by`` (None when they do not, or it is not said)."""
        automatic = {detector: p for detector, p in self._policies.items() if p not in ("", OFF)}
        policies = set(automatic.values())
        if not order.chosen_by or len(policies) != 1 or order.chosen_by in policies:
            return None
        who = ", ".join(f"{policy} at {detector}" for detector, policy in sorted(automatic.items()))
        return (
            f"it was chosen by {order.chosen_by}, but {who} breaks deadlocks unasked by another policy and may "
            "already have broken another wait of this deadlock (this would be a second victim); see "
            "`stablewatch resolutions` there, or run `stablewatch resolve` against it"
        )


def _by_policy(item: tuple[str, str]) -> tuple[str, str]:
    return item[1], item[0]


class HintWatch:
    """Which waits have lasted past the threshold and were not hinted yet (once per instance).

    Pure bookkeeping: the agent calls :meth:`due` on a timer with the open waits and the time, and
    sends what it returns. Remembers only instances still open, so it stays as small as the waits.
    """

    def __init__(self, after: float = DEFAULT_HINT_AFTER) -> None:
        if not after > 0:
            raise ValueError(f"the hint threshold must be positive, not {after!r}")
        self.after = after
        self._after_us = int(after * 1e6)
        self._hinted: set[int] = set()
        #: When the next of the waits :meth:`due` last saw will be due (µs), None if none will be.
        self.next_due_us: int | None = None

    def due(self, waits: Iterable[OpenWait], now_us: int) -> list[WaitHint]:
        """Hints for the waits that have lasted at least the threshold and were not hinted before."""
        open_now: set[int] = set()
        hints: list[WaitHint] = []
        earliest: int | None = None  # the earliest start among those not due yet
        for wait in waits:
            open_now.add(wait.instance)
            waited = now_us - wait.began_at_us
            if waited < self._after_us:
                if earliest is None or wait.began_at_us < earliest:
                    earliest = wait.began_at_us
            elif wait.instance not in self._hinted:
                self._hinted.add(wait.instance)
                hints.append(WaitHint(instance=wait.instance, task=wait.task, waited_ms=min(waited // 1000, 2**32 - 1)))
        self._hinted &= open_now
        self.next_due_us = None if earliest is None else earliest + self._after_us
        return hints

    def forget(self, instance: int) -> None:
        """Hint ``instance`` again when it is next due (its hint was not delivered)."""
        self._hinted.discard(instance)


async def hint_forever(dispatcher: BreakDispatcher, watch: HintWatch, send: Callable[[WaitHint], bool]) -> NoReturn:
    """Hint the detector of each wait that has lasted past the threshold, once each, when it is due.

    The one hint loop of the embedded and the RPC-mode agents; each wake-up costs tens of
    microseconds of CPU, so it wakes only when needed. It sleeps until the next wait it saw is due;
    while no wait is registered, until the dispatcher's :class:`Doorbell` rings (a quiet process
    pays no timer); while waits are registered that cannot be due (hinted already, or not
    hintable yet), every half threshold. A hint that ``send`` drops (False: no stream to the
    detector) is sent again half a threshold later.
    """
    period = watch.after / 2
    loop = asyncio.get_running_loop()
    rung = asyncio.Event()
    bell = dispatcher.doorbell
    bell.attach(functools.partial(loop.call_soon_threadsafe, rung.set))
    delay = period
    try:
        while True:
            await asyncio.sleep(delay)
            delay = period
            try:
                now = now_us()
                dropped = False
                for hint in watch.due(dispatcher.open_waits(), now):
                    if not send(hint):
                        watch.forget(hint.instance)
                        dropped = True  # sent again in half a threshold
                rung.clear()
                bell.asleep = True  # before the question: see Doorbell
                if not dispatcher.idle():
                    bell.asleep = False
                    if watch.next_due_us is not None and not dropped:
                        delay = min(max((watch.next_due_us - now) / 1e6, _LEAST_DELAY), watch.after)
                    continue
            except Exception:  # a hint is an optimisation: never let it end the loop (or the agent's stop)
                bell.asleep = False
                _log.exception("could not look for long waits to hint")
                continue
            await rung.wait()
            delay = watch.after  # the wait that rang is due then
    finally:
        bell.asleep = False
        bell.attach(None)
