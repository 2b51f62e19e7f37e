"""A token bank: branches move tokens to each other at random; the detector checks none are lost.

What it demonstrates: the ``conservation(tokens)`` predicate on consistent snapshots. Each branch
starts with ``--tokens`` tokens and sends random amounts to random branches every 5–20 ms with
``agent.send(dest, payload, counters={"tokens": amount})``: the agent takes the amount out of the
sender's ``tokens`` counter at the send and adds it to the receiver's at delivery, so a snapshot
finds every token either in a branch or on a recorded message, and the total never changes.

With ``--drop-rate P`` a branch loses each delivered transfer with probability P (it debits the
amount again in its handler: the money vanishes). Conservation then fails, and its evidence shows
a negative drift; the branch also reports what it lost in the attribute ``dropped``. Branches are
always active: the bank never terminates.

Run three branches (one terminal each, or in the background) against a detector::

    python -m stablewatch.examples.bank --id A --branches A,B,C --peers-dir /tmp/bank --detector HOST:PORT
    python -m stablewatch.examples.bank --id B --branches A,B,C --peers-dir /tmp/bank --detector HOST:PORT
    python -m stablewatch.examples.bank --id C --branches A,B,C --peers-dir /tmp/bank --detector HOST:PORT

Each branch logs its balance once a second.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from stablewatch.agents import Agent, AppMessage
from stablewatch.examples._common import PeerDirectory, id_list, run_service, service_parser, service_rng

__all__ = ["Branch", "main"]

log = logging.getLogger("stablewatch.examples.bank")

_TRANSFER = b"transfer"


class Branch:
    """One branch: sends random transfers forever and, with ``--drop-rate``, loses some it receives."""

    def __init__(self, agent: Agent, args: argparse.Namespace, peers: PeerDirectory) -> None:
        self.agent = agent
        self.peers = peers
        self.others = [b for b in args.branches if b != args.id]
        self.drop_rate: float = args.drop_rate
        self.rng = service_rng(args, "transfers")
        self.drop_rng = service_rng(args, "drops")  # apart, so drops do not change the transfers' sequence
        self.sent = self.received = self.dropped = 0
        agent.state.set_counter("tokens", args.tokens)
        agent.state.set_attribute("dropped", 0)
        agent.on_message(self.on_message)

    def on_message(self, src: str, message: AppMessage) -> None:
        """A transfer arrived; the agent has already credited it. With ``--drop-rate`` it may vanish."""
        self.received += 1
        amount = (message.counters or {}).get("tokens", 0)
        if amount and self.drop_rng.random() < self.drop_rate:
            # Same step as the credit (no await in between): no snapshot sees the money arrive.
            self.agent.state.add("tokens", -amount)
            self.dropped += amount
            self.agent.state.set_attribute("dropped", self.dropped)
            log.debug("dropped %d tokens from %s", amount, src)

    async def run(self) -> None:
        await self.peers.wait_for_peers(self.others)
        reporter = asyncio.ensure_future(self._report())
        try:
            while True:
                await asyncio.sleep(self.rng.uniform(0.005, 0.020))
                balance = self.agent.state.counter("tokens")
                if balance <= 0:
                    continue
                dest = self.rng.choice(self.others)
                amount = self.rng.randint(1, balance)
                await self.agent.send(dest, _TRANSFER, counters={"tokens": amount})
                self.sent += 1
        finally:
            reporter.cancel()

    async def _report(self) -> None:
        """Log the balance and traffic once a second."""
        while True:
            await asyncio.sleep(1.0)
            log.info(
                "balance %d, sent %d, received %d, dropped %d tokens",
                self.agent.state.counter("tokens"),
                self.sent,
                self.received,
                self.dropped,
            )


def _probability(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a probability is between 0 and 1, not {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = service_parser("bank", "A token bank branch: random transfers, watched for lost tokens.")
    parser.add_argument("--branches", type=id_list, required=True, help="every branch id, comma-separated")
    parser.add_argument("--tokens", type=int, default=1000, help="tokens each branch starts with (default 1000)")
    parser.add_argument(
        "--drop-rate", type=_probability, default=0.0, help="probability of losing a received transfer (default 0)"
    )
    args = parser.parse_args(argv)
    if args.id not in args.branches:
        parser.error(f"--id {args.id} is not one of --branches")
    if args.tokens < 0:
        parser.error("--tokens must not be negative")
    return run_service(args, Branch)


if __name__ == "__main__":
    sys.exit(main())
