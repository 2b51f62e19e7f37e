"""Dining philosophers over the network, one process per seat, heading for a certain deadlock.

What it demonstrates: the ``deadlock`` predicate (AND model) with the in-flight rule, with no
false positive while the table works and a certain report once it is stuck.

The table. Seats ``P0 .. Pn-1`` sit in a ring; fork ``i`` lives at seat ``i`` (its left fork) and is
the right fork of seat ``i-1``. Forks travel as messages carrying ``counters={"forks": 1}``, so
``conservation(forks)`` holds throughout. A hungry philosopher

1. takes its left fork if it is at home; if it is lent to its left neighbour, it waits for it to
   come back (a wait on the left neighbour);
2. then sends REQUEST to its right neighbour and waits (AND) on it until the fork arrives (GRANT);
3. eats, sends the right fork back (RETURN), puts its left fork down and lends it to its left
   neighbour if asked meanwhile, and thinks.

A philosopher grants a request at once when its left fork is at home and not taken, and
otherwise when it puts the fork down. Waits are registered and removed in the same step as the
message that causes them (``add_wait`` when the request leaves, ``remove_wait`` in the handler
that receives the fork), so a snapshot shows a wait exactly while the philosopher cannot go on.
REQUEST never releases anyone's wait, so it is sent with ``wakes=False``.

The deadlock. Thinking takes 50–150 ms and eating 10–30 ms, so the table runs normally at first.
(The classic protocol can deadlock by chance at any time, but seldom does at this pace: that takes
all five holding their left fork at once, each waiting for its right neighbour's reply, while a
philosopher spends most of its time thinking, even when a loaded machine delays the replies. It
is likeliest when everyone gets hungry at once, so seat ``i`` sits down ``i`` ×
:data:`SIT_DOWN_STEP` after seat 0.) After ``--deadlock-after`` seconds (default 3; negative: never
forced) a philosopher stops putting its left fork down: once it has taken its left fork it keeps
it and, after each meal, asks again for the right one. Every philosopher soon holds its left fork
and waits on its right neighbour, which never grants: the wait-for graph has the cycle ``P0 -> P1
-> ... -> Pn-1 -> P0`` with no fork in flight along it, and the detector reports it (and it stays
reported: deadlock is stable).

When the table sits down. Watched by a detector (``--detector``), a philosopher sits down to eat
only once it records its first snapshot (or after :data:`FIRST_LOOK` seconds without one), and
counts the ``--deadlock-after`` seconds from then: the detector's first snapshot sees the table
before anyone is hungry and the next ones see it eating, however long the processes took to start
and attach. Without a detector, it sits down once its neighbours are known.

Attributes ``meals`` (meals eaten) and ``greedy`` show progress.

Run five philosophers against a detector::

    for p in P0 P1 P2 P3 P4; do
        python -m stablewatch.examples.philosophers --id $p --seats P0,P1,P2,P3,P4 \\
            --peers-dir /tmp/table --detector HOST:PORT &
    done
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys

from stablewatch.agents import Agent, AppMessage
from stablewatch.examples._common import (
    PeerDirectory,
    id_list,
    run_service,
    send_now,
    service_parser,
    service_rng,
)
from stablewatch.v1 import LocalSnapshotPart

__all__ = ["Philosopher", "main"]

log = logging.getLogger("stablewatch.examples.philosophers")

REQUEST = b"request"  # to the right neighbour: "lend me your left fork"
GRANT = b"grant"  # the receiver's right fork, lent
RETURN = b"return"  # the receiver's left fork, given back
_FORK = {"forks": 1}

THINK = (0.050, 0.150)  # seconds: long beside eating and a reply's delay, so no deadlock by chance
EAT = (0.010, 0.030)
STUCK_AFTER = 1.0  # seconds of waiting before the philosopher says it is stuck
FIRST_LOOK = 10.0  # seconds a watched philosopher waits for its first snapshot before sitting down anyway
SIT_DOWN_STEP = 0.25  # seconds between two seats sitting down: not everyone hungry at once, nor on new channels


class Philosopher:
    """One seat at the table; all state changes happen in synchronous steps (no await inside)."""

    def __init__(self, agent: Agent, args: argparse.Namespace, peers: PeerDirectory) -> None:
        seats: list[str] = args.seats
        me = seats.index(args.id)
        self.agent = agent
        self.peers = peers
        self.seats = seats
        self.left = seats[me - 1]  # shares our left fork; we lend it to them
        self.right = seats[(me + 1) % len(seats)]  # owns our right fork; we borrow it
        self.sits_down_after = me * SIT_DOWN_STEP  # seconds after the table is looked at
        self.rng = service_rng(args, "table")
        self.deadlock_after: float = args.deadlock_after
        self.fork_home = True  # our left fork is here (not lent to the left neighbour)
        self.left_taken = False  # we hold our left fork for ourselves
        self.has_right = False
        self.hungry = False
        self.request_pending = False  # the left neighbour asked for our left fork
        self.greedy = False
        self.meals = 0
        self._wait: int | None = None  # the registered wait's token
        self._ready = asyncio.Event()  # both forks in hand
        self._watched = args.detector is not None  # it sits down at its first snapshot
        self._looked_at = asyncio.Event()  # it recorded a snapshot
        self._clock_from: float | None = None  # when it sat down: the --deadlock-after clock (loop time)
        agent.state.set_counter("forks", 1)
        agent.state.set_attribute("meals", 0)
        agent.state.set_attribute("greedy", False)
        agent.on_message(self.on_message)
        agent.on_part(self._recorded)

    # -- the synchronous steps ----------------------------------------------------------------------

    def _wait_on(self, neighbour: str) -> None:
        assert self._wait is None
        self._wait = self.agent.state.add_wait(neighbour, model="and")

    def _stop_waiting(self) -> None:
        assert self._wait is not None
        self.agent.state.remove_wait(self._wait)
        self._wait = None

    def _lend_left_fork(self) -> None:
        self.fork_home = False
        self.request_pending = False
        send_now(self.agent, self.left, GRANT, counters=_FORK)

    def _ask_for_right_fork(self) -> None:
        # The request cannot release any wait of the right neighbour: it wakes no one.
        send_now(self.agent, self.right, REQUEST, wakes=False)
        self._wait_on(self.right)

    def get_hungry(self) -> None:
        """Take the left fork (or wait for it to come back), then ask for the right one."""
        self.hungry = True
        if self.left_taken:
            self._ask_for_right_fork()
        elif self.fork_home:
            self.left_taken = True
            self._ask_for_right_fork()
        else:
            self._wait_on(self.left)  # lent out: the left neighbour is eating with it

    def finish_eating(self) -> None:
        """Give the right fork back; put the left one down unless greedy (then keep it and get hungry)."""
        self.meals += 1
        self.agent.state.set_attribute("meals", self.meals)
        self.has_right = False
        self.hungry = False
        send_now(self.agent, self.right, RETURN, counters=_FORK)
        if self.greedy:
            self.get_hungry()
            return
        self.left_taken = False
        if self.request_pending:
            self._lend_left_fork()

    def on_message(self, src: str, message: AppMessage) -> None:
        """Handle REQUEST, GRANT or RETURN; waits change here, atomically with the receipt."""
        kind = message.payload
        if kind == REQUEST:  # from the left neighbour, for our left fork
            if self.fork_home and not self.left_taken:
                self._lend_left_fork()
            else:
                self.request_pending = True
        elif kind == GRANT:  # from the right neighbour: our right fork
            self._stop_waiting()
            self.has_right = True
            self._ready.set()
        elif kind == RETURN:  # from the left neighbour: our left fork is back
            self.fork_home = True
            if self.hungry and not self.left_taken:
                self._stop_waiting()
                self.left_taken = True
                self._ask_for_right_fork()
        else:
            log.warning("unknown message %r from %s", kind, src)

    def _recorded(self, part: LocalSnapshotPart) -> None:
        """A snapshot part of ours went to the detector (handed over on the agent's loop)."""
        self._looked_at.set()

    def _greedy_now(self, now: float) -> bool:
        """Whether --deadlock-after seconds have passed on the greedy clock (never when negative)."""
        if self.deadlock_after < 0 or self._clock_from is None:
            return False
        return now >= self._clock_from + self.deadlock_after

    # -- the philosopher's life ---------------------------------------------------------------------

    async def run(self) -> None:
        await self.peers.wait_for_peers(s for s in self.seats if s != self.agent.process_id)
        loop = asyncio.get_running_loop()
        if self._watched:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._looked_at.wait(), FIRST_LOOK)
        self._clock_from = loop.time()
        await asyncio.sleep(self.sits_down_after)
        while True:
            if not self.hungry:
                await asyncio.sleep(self.rng.uniform(*THINK))
                self.get_hungry()
            await self._await_forks()
            await asyncio.sleep(self.rng.uniform(*EAT))
            if not self.greedy and self._greedy_now(loop.time()):
                self.greedy = True
                self.agent.state.set_attribute("greedy", True)
                log.info("greedy from now on: keeping my left fork (after %d meals)", self.meals + 1)
            self.finish_eating()

    async def _await_forks(self) -> None:
        """Wait until both forks are here; say so once if that takes long."""
        said = False
        while not self._ready.is_set():
            try:
                await asyncio.wait_for(self._ready.wait(), STUCK_AFTER)
            except TimeoutError:
                if not said:
                    waiting_on = self.right if self.left_taken else self.left
                    log.info("stuck for %gs: waiting on %s (meals %d)", STUCK_AFTER, waiting_on, self.meals)
                    said = True
        self._ready.clear()
        log.debug("eating (meal %d)", self.meals + 1)


def main(argv: list[str] | None = None) -> int:
    parser = service_parser("philosophers", "A dining philosopher; the table deadlocks after --deadlock-after seconds.")
    parser.add_argument("--seats", type=id_list, required=True, help="every seat id in ring order, comma-separated")
    parser.add_argument(
        "--deadlock-after",
        type=float,
        default=3.0,
        help="seconds after which philosophers keep their left fork, from the first snapshot when "
        "watched by a detector (default 3; negative: never)",
    )
    args = parser.parse_args(argv)
    if args.id not in args.seats:
        parser.error(f"--id {args.id} is not one of --seats")
    return run_service(args, Philosopher)


if __name__ == "__main__":
    sys.exit(main())
