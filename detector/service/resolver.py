"""When to break a proven deadlock, and which wait: the detector's rules, with no I/O and no clock.

DESIGN.md, "Breaking a proven deadlock". A completed snapshot whose deadlock predicate is **true**
(never unknown, never on a cut that failed a channel's proof: such a snapshot never completes) gets
one victim per deadlocked sink component, chosen by the pure policy of
:func:`~stablewatch.detector.evaluation.victims.choose_victims`. After a break, the same deadlock
(the same sink component) gets no second victim until a snapshot that *started after the agent's
report* still shows it: a snapshot begun earlier may have recorded the victim still waiting. A
deadlock's component can grow after its break went out (a node that one of its AND waiters also
waits on blocks on it, and joins), so a hold covers every component that shares a node with the
one broken: the grown deadlock is the same one, and its first break may end it whole. A hold is
kept for an hour after its report; a snapshot that started before a hold that was dropped (or
before the detector started: holds are not stored) gets no victim, since its deadlock may have
been broken since, and is refused for an operator with "take a new snapshot". A wait
named in a break that went out is never named again (whatever the agent answered), so a deadlock
that outlives its victim moves on to the next candidate; one whose break could not be sent (the
process was not attached) is named again by a later cut, as every other detector names it. A
break whose report never comes is given up after ``report_timeout`` seconds, and counts as
reported then.

A report may still come after that (a slow agent, a congested stream). A break given up is
remembered for ``late_window`` seconds (at most ``max_given_up`` of them, oldest forgotten first),
and a report from its victim's process for its wait within that time is taken as the answer it is
(:meth:`Resolver.reported_late`): a wait broken (or gone, or already broken) is named again by no
later cut, even if a break of it sent again is given up too; and when the deadlock has no newer
break, its hold moves to the late report, so a snapshot begun before it gets no second victim.

A break the agent *refused* because the detectors it attaches to break by different policies
(``BREAK_OUTCOME_POLICIES_DISAGREE``: each would break another wait of the deadlock) broke
nothing. Its wait is not named either: once the policies agree again, every detector names the
same wait, and moving on to the next candidate would make a second victim. The detector's own
policy does not try that deadlock again until ``refusal_pause`` seconds after the refusal (each try
would be refused the same while the configuration stays wrong); an operator's request may break
it at once. An operator's order refused because the detectors agree on another policy than the one
that chose it is taken the same way (another wait of the deadlock may have been broken already).

A break whose breaking *raised* at the agent (``BREAK_OUTCOME_FAILED``: its callback or wait source
failed) is taken as a refusal too, not as "gone": the wait may have been marked broken, so that
later cuts no longer show it, or may still hold the deadlock. Its wait is not named, and the
deadlock gets no other victim: a later cut that still shows it names the same wait again after
``refusal_pause`` (the agent answers ``already_broken`` if the first try did break it); a cut
that no longer shows it names nothing.

The caller (:mod:`.breaking`) passes the time in, sends the orders and stores what happened.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from stablewatch.detector.evaluation import Verdict, result_named
from stablewatch.detector.evaluation.victims import Victim, choose_victims
from stablewatch.v1 import Evaluation, GlobalSnapshot

__all__ = [
    "DEFAULT_LATE_WINDOW",
    "DEFAULT_MAX_GIVEN_UP",
    "DEFAULT_REFUSAL_PAUSE",
    "DEFAULT_REPORT_TIMEOUT",
    "NothingToResolve",
    "Resolver",
    "remember",
]

#: Seconds a break waits for its agent's report before the detector gives up on it.
DEFAULT_REPORT_TIMEOUT = 10.0
#: Seconds after an agent refused a break (the detectors' policies disagree) before this
#: detector's policy names that deadlock again: one refusal a minute per deadlock shows the
#: misconfiguration, and a fixed one is acted on within the minute.
DEFAULT_REFUSAL_PAUSE = 60.0
#: Seconds after giving a break up during which its agent's late report is still taken: a minute,
#: whatever the report timeout (a slow agent or a congested stream is slow for a time of its own).
DEFAULT_LATE_WINDOW = 60.0
#: Breaks given up that are remembered at once for a late report (oldest forgotten first).
DEFAULT_MAX_GIVEN_UP = 10_000
# Waits already named in a break, remembered at most this many (oldest forgotten first). Instances
# are never reused in a process, so forgetting one can only repeat a break that the agent ignores.
_MAX_NAMED = 100_000


def remember(memory: dict[Any, Any], key: Any, value: Any = None, bound: int = _MAX_NAMED) -> None:
    """Keep ``key`` (with ``value``) in ``memory``, an insertion-ordered dict of at most ``bound``
    entries: the oldest is forgotten to make room."""
    memory[key] = value
    if len(memory) > bound:
        del memory[next(iter(memory))]


# A hold outlives its report by this long: no snapshot runs longer (its deadline is far below), so
# none that started before the report can still complete after it.
_HOLD_SECONDS = 3600.0


class NothingToResolve(Exception):
    """A request to break the deadlock of a snapshot that proves none, or whose deadlocks are being broken."""


@dataclass
class _Hold:
    """A deadlock with a break under way: no second victim until a later snapshot shows it again."""

    break_id: int
    reported_at: float | None = None  # when the agent answered (or the detector gave up waiting)
    sent_at: float = 0.0
    refused: bool = False  # the agent refused it: the detectors' policies disagree, nothing was broken


@dataclass(frozen=True)
class _GivenUp:
    """A break given up on, whose report may still come late."""

    key: Hashable  # its deadlock's
    wait: tuple[str, int]  # the process and instance it names
    at: float  # when it was given up


class Resolver:
    """Chooses the waits to break after each snapshot and remembers the breaks under way."""

    def __init__(
        self,
        *,
        report_timeout: float = DEFAULT_REPORT_TIMEOUT,
        refusal_pause: float = DEFAULT_REFUSAL_PAUSE,
        late_window: float = DEFAULT_LATE_WINDOW,
        max_given_up: int = DEFAULT_MAX_GIVEN_UP,
    ) -> None:
        if not report_timeout > 0:
            raise ValueError(f"report_timeout must be positive, not {report_timeout!r}")
        if not refusal_pause >= 0:
            raise ValueError(f"refusal_pause must not be negative, not {refusal_pause!r}")
        if not late_window >= 0:
            raise ValueError(f"late_window must not be negative, not {late_window!r}")
        if max_given_up < 1:
            raise ValueError(f"max_given_up must be at least 1, not {max_given_up!r}")
        self.report_timeout = report_timeout
        self.refusal_pause = refusal_pause
        self.late_window = late_window
        self._max_given_up = max_given_up
        self._holds: dict[Hashable, _Hold] = {}
        # Each break under way: its deadlock's key, and the wait it names.
        self._by_break: dict[int, tuple[Hashable, tuple[str, int]]] = {}
        self._named: dict[tuple[str, int], None] = {}
        # Breaks given up, oldest first, while a late report may still answer them.
        self._given_up: dict[int, _GivenUp] = {}
        # Waits an agent said it acted on (broken, gone, already broken): never named again, even
        # when a break of the same wait sent again is given up (bounded as the named ones).
        self._settled: dict[tuple[str, int], None] = {}
        # Holds are not known for snapshots that started at or before this time (a hold dropped
        # after its hour, or the detector's start): None while every hold is known.
        self._forgotten_until: float | None = None

    def victims(
        self,
        snapshot: GlobalSnapshot,
        evaluation: Evaluation,
        started_at: float,
        policy: str,
        *,
        operator: bool = False,
    ) -> list[Victim]:
        """The waits to break now for ``snapshot`` (which started at ``started_at``), one per deadlock.

        Empty unless its deadlock predicate is true; a deadlock with a break under way, or whose
        break was reported after this snapshot started, is skipped. One whose break an agent
        refused (the detectors' policies disagree) is skipped until ``refusal_pause`` after the
        refusal, unless an ``operator`` asks.
        """
        result = result_named(evaluation, "deadlock")
        if result is None or Verdict.of(result) is not Verdict.TRUE:
            return []
        for key in [k for k, hold in self._holds.items() if _expired(hold, started_at)]:
            self.forget_until(self._holds.pop(key).reported_at)  # type: ignore[arg-type]
        if self.forgotten(started_at):
            return []
        chosen = []
        for victim in choose_victims(snapshot, evaluation.wait_for, policy, exclude=self._named):
            nodes = set(victim.key)
            if any(
                self._holding(hold, started_at, operator)
                for key, hold in self._holds.items()
                if not nodes.isdisjoint(key)
            ):
                continue
            chosen.append(victim)
        return chosen

    def forget_until(self, when: float) -> None:
        """Holds are not known for snapshots that started at or before ``when`` (the detector
        started then, or dropped a hold reported then): they get no victim (see :meth:`forgotten`)."""
        if self._forgotten_until is None or when > self._forgotten_until:
            self._forgotten_until = when

    def forgotten(self, started_at: float) -> bool:
        """Whether a snapshot that started at ``started_at`` is older than the holds this resolver
        knows: a deadlock it shows may have been broken since, and a victim chosen for it could be a
        second one."""
        return self._forgotten_until is not None and started_at <= self._forgotten_until

    def why_none(self, evaluation: Evaluation, started_at: float) -> str:
        """Why :meth:`victims` chose no wait for a snapshot that started at ``started_at`` (for an
        operator's request)."""
        result = result_named(evaluation, "deadlock")
        if result is None:
            return "it has no deadlock result"
        verdict = Verdict.of(result)
        if verdict is not Verdict.TRUE:
            return f"it proves no deadlock (deadlock is {verdict})"
        if self.forgotten(started_at):
            return (
                "it started before the breaks this detector still knows of (it restarted since, or its "
                "record of a break after it has expired), so its deadlocks may have been broken since: "
                "take a new snapshot"
            )
        if any(hold.reported_at is None for hold in self._holds.values()):
            return "its deadlocks are being broken already (a break is waiting for its agent's report)"
        return (
            "every deadlock it shows was broken after it started, or has no wait that can be broken "
            "(waits of agents too old to name them, or named in an earlier break)"
        )

    def sent(self, victim: Victim, break_id: int, now: float) -> None:
        """A break for ``victim`` went out as ``break_id`` at ``now``."""
        self._holds[victim.key] = _Hold(break_id, sent_at=now)
        self._by_break[break_id] = (victim.key, (victim.process, victim.instance))
        remember(self._named, (victim.process, victim.instance))

    def reported(self, break_id: int, now: float, *, refused: bool = False) -> bool:
        """The agent answered ``break_id`` at ``now``; False when no such break is under way.

        ``refused``: nothing is known to be broken (its detectors' policies disagree, or breaking
        raised at the agent). The wait is not
        named (see :meth:`unsent`), and the deadlock waits ``refusal_pause`` for this detector's
        policy to try it again.
        """
        under_way = self._by_break.pop(break_id, None)
        if under_way is None:
            return False
        hold = self._holds.get(under_way[0])
        if hold is not None and hold.break_id == break_id:
            hold.reported_at = now
            hold.refused = refused
        if refused:
            self._named.pop(under_way[1], None)
        else:
            remember(self._settled, under_way[1])
        return True

    def reported_late(self, break_id: int, wait: tuple[str, int], now: float, *, refused: bool = False) -> bool:
        """A report for ``break_id``, given up on before, came at ``now`` naming ``wait`` (its
        process and instance); False (and nothing changes) unless that break was given up less
        than ``late_window`` ago and named that very wait.

        Otherwise it is taken as :meth:`reported` takes a report in time: a wait the agent acted on
        is named again by no cut, and a refusal names nothing and pauses the policy. The deadlock's
        hold moves to ``now`` only if no newer break of it went out since: that newer break holds
        it, and its agent answers it (``ALREADY_BROKEN`` when this one broke the wait).
        """
        self._forget_given_up(now)
        given_up = self._given_up.get(break_id)
        if given_up is None or given_up.wait != wait:
            return False
        del self._given_up[break_id]
        hold = self._holds.get(given_up.key)
        if hold is not None and hold.break_id == break_id:
            hold.reported_at = max(now, hold.reported_at or now)
            hold.refused = refused
        if not refused:
            remember(self._named, wait)
            remember(self._settled, wait)
        return True

    @property
    def given_up(self) -> int:
        """How many breaks given up are remembered for a late report."""
        return len(self._given_up)

    def unsent(self, break_id: int, now: float) -> None:
        """The break ``break_id`` could not go out at ``now`` (its victim's process was not attached).

        It counts as reported then: a snapshot begun earlier is not answered with another break.
        But its wait is not named: no agent acted on it, so a later cut that still shows the
        deadlock names the same wait again, the one any other detector names too (choosing the
        next candidate would make a second victim of one deadlock).
        """
        under_way = self._by_break.pop(break_id, None)
        if under_way is None:
            return
        hold = self._holds.get(under_way[0])
        if hold is not None and hold.break_id == break_id:
            hold.reported_at = now
        if under_way[1] not in self._settled:  # an agent said it acted on that wait: keep it named
            self._named.pop(under_way[1], None)

    def overdue(self, now: float) -> list[int]:
        """Breaks whose report has not come within ``report_timeout``: given up (reported as of ``now``).

        Their waits are not named either: the order may have been lost with its stream, and the wait
        still holds the deadlock. A later cut that shows it names the same wait again, as another
        detector would (the agent breaks a wait at most once: ``ALREADY_BROKEN`` if it had). Each is
        remembered for a late report (:meth:`reported_late`) for ``late_window``; those given up
        longer ago are forgotten now.
        """
        late = [
            break_id
            for break_id, (key, _) in self._by_break.items()
            if now - self._holds[key].sent_at >= self.report_timeout
        ]
        for break_id in late:
            key, wait = self._by_break[break_id]
            self.unsent(break_id, now)  # given up as if it had never gone out (see above)
            remember(self._given_up, break_id, _GivenUp(key, wait, now), self._max_given_up)
        self._forget_given_up(now)
        return late

    def remembers(self, break_id: int) -> bool:
        """Whether ``break_id`` was given up and a late report may still answer it."""
        return break_id in self._given_up

    def _forget_given_up(self, now: float) -> None:
        """Forget the breaks given up more than ``late_window`` before ``now`` (oldest first)."""
        while self._given_up:
            break_id, given_up = next(iter(self._given_up.items()))
            if now - given_up.at <= self.late_window:
                return
            del self._given_up[break_id]

    def _holding(self, hold: _Hold, started_at: float, operator: bool) -> bool:
        """Whether ``hold`` keeps its deadlock from a victim chosen for a snapshot begun at ``started_at``."""
        if hold.reported_at is None:
            return True  # a break under way: one at a time
        if hold.refused:  # nothing was broken: only the policy's next try waits
            return not operator and started_at < hold.reported_at + self.refusal_pause
        return started_at <= hold.reported_at


def _expired(hold: _Hold, started_at: float) -> bool:
    return hold.reported_at is not None and hold.reported_at < started_at - _HOLD_SECONDS
