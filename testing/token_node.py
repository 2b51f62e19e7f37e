"""A token-bank service embedding the agent, run as its own OS process (by :class:`.token_nodes.Node`).

    python -m stablewatch.testing.token_node --id A --tokens 100 [--detector HOST:PORT] [--tls-dir DIR]

It prints one JSON line per event on stdout and takes one JSON command per line on stdin:
``{"cmd": "peers", "peers": {"B": "127.0.0.1:1234"}}``, ``{"cmd": "transfer", "count": 500,
"seed": 1}`` (random transfers to random peers; replies when all are sent), ``{"cmd": "stats"}``,
``{"cmd": "restart_server"}``, ``{"cmd": "slow", "seconds": 0.01}`` (each delivery then awaits
that long), ``{"cmd": "metrics", "samples": {"key": ["sample_name", {"label": "value"}]}}``
(replies with each sample's value from the agent's registry, or null) and ``{"cmd": "exit"}``.
Every payload carries a per-channel sequence number, so the receiver checks that nothing is lost,
duplicated or reordered.

Transfer commands run one after another. ``--window`` and ``--max-frame-entries`` set the
channels' window and frame size (in entries); ``--inbox`` the receive queue's bound (in messages:
the agent acknowledges only while fewer wait for the handler). ``--listen HOST:PORT`` chooses where the agent
listens (default 127.0.0.1:0, a free port), so a restarted process can come back on the same
address. With ``--resume`` the first message from each source sets the sequence number expected
next (a restarted receiver joins its channels mid-stream); the checks apply from there on, and
stats report those first numbers as ``first``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

from stablewatch.agents import Agent, AppMessage, ChannelSettings, TlsConfig


def emit(**event: object) -> None:
    """Print one event as a JSON line on stdout, flushed (the parent reads it at once)."""
    print(json.dumps(event), flush=True)


class TokenNode:
    """The service: an agent that sends tokens (its ``tokens`` counter) to its peers in numbered
    messages, checks the numbers of those it receives, and runs the commands from stdin.

    With ``--tls-dir``, the folder holds ``node.pem`` and ``node.key`` (one certificate for both
    sides of every channel, naming localhost) and ``ca.pem``.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        tls = None
        if args.tls_dir:
            folder = Path(args.tls_dir)
            tls = TlsConfig(folder / "node.pem", folder / "node.key", folder / "ca.pem", server_name="localhost")
        settings = ChannelSettings(
            window_entries=args.window,
            max_frame_entries=args.max_frame_entries,
            inbox_entries=args.inbox,
            backoff_initial=0.01,
            backoff_max=0.2,
        )
        self.peers: dict[str, str] = {}
        self.agent = Agent(
            args.id,
            listen=args.listen,
            peers=self.peers,
            detector=args.detector,
            tls=tls,
            channel_settings=settings,
            heartbeat_interval=0.2,
        )
        self.agent.state.set_counter("tokens", args.tokens)
        self.agent.state.set_active(False)
        self.agent.on_message(self.on_message)
        self.next_seq: dict[str, int] = {}  # per destination
        self.received: dict[str, int] = {}  # per source
        self.errors: list[str] = []
        self.delay = 0.0
        self.resume = args.resume
        self.first: dict[str, int] = {}  # per source: the first sequence number received
        # Transfers run one at a time: two interleaved ones would number messages out of send order.
        self.transfer_lock = asyncio.Lock()

    async def on_message(self, src: str, message: AppMessage) -> None:
        seq = int(message.payload.split(b":")[1])
        if src not in self.first:
            self.first[src] = seq
            if self.resume:
                self.received[src] = seq
        expected = self.received.get(src, 0)
        if seq != expected:
            self.errors.append(f"from {src}: got {seq}, expected {expected}")
        self.received[src] = max(expected, seq + 1)
        if self.delay:
            await asyncio.sleep(self.delay)

    async def transfer(self, count: int, seed: int) -> None:
        rng = random.Random(seed)
        peers = sorted(self.peers)
        for _ in range(count):
            dest = rng.choice(peers)
            balance = self.agent.state.counter("tokens")
            amount = rng.randint(0, min(balance, 5))
            seq = self.next_seq.get(dest, 0)
            self.next_seq[dest] = seq + 1
            await self.agent.send(dest, b"%s:%d" % (self.agent.process_id.encode(), seq), counters={"tokens": amount})

    def stats(self) -> dict[str, object]:
        return {
            "sent": self.next_seq,
            "received": self.received,
            "errors": self.errors[:10],
            "tokens": self.agent.state.counter("tokens"),
            "unacknowledged": {dest: ch.unacknowledged for dest, ch in self.agent._outbound.items()},
            "last_error": {dest: ch.last_error for dest, ch in self.agent._outbound.items()},
            "first": self.first,
        }

    def metrics(self, samples: dict[str, list]) -> dict[str, float | None]:
        registry = self.agent.metrics.registry
        return {key: registry.get_sample_value(name, labels or {}) for key, (name, labels) in samples.items()}

    async def run(self) -> None:
        await self.agent.start()
        emit(event="ready", address=self.agent.address)
        reader = asyncio.StreamReader()
        await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        tasks: set[asyncio.Task[None]] = set()
        while line := await reader.readline():
            command = json.loads(line)
            cmd = command["cmd"]
            if cmd == "peers":
                self.peers.update(command["peers"])
                emit(event="peers")
            elif cmd == "transfer":

                async def transfer(count: int = command["count"], seed: int = command["seed"]) -> None:
                    async with self.transfer_lock:
                        await self.transfer(count, seed)
                    emit(event="transferred")

                task = asyncio.ensure_future(transfer())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            elif cmd == "stats":
                emit(event="stats", **self.stats())
            elif cmd == "restart_server":
                await self.agent.restart_server()
                emit(event="restarted", address=self.agent.address)
            elif cmd == "metrics":
                emit(event="metrics", values=self.metrics(command["samples"]))
            elif cmd == "slow":
                self.delay = command["seconds"]
                emit(event="slow")
            elif cmd == "exit":
                break
        for task in tasks:
            task.cancel()
        await self.agent.stop()
        emit(event="stopped")


def main() -> None:
    """Parse the command line and run the node until the ``exit`` command or the end of stdin."""
    parser = argparse.ArgumentParser(prog="python -m stablewatch.testing.token_node")
    parser.add_argument("--id", required=True)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--detector")
    parser.add_argument("--tls-dir")
    parser.add_argument("--window", type=int, default=20_000)
    parser.add_argument("--max-frame-entries", type=int, default=512)
    parser.add_argument("--inbox", type=int, default=4096)
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--resume", action="store_true")
    asyncio.run(TokenNode(parser.parse_args()).run())


if __name__ == "__main__":
    main()
