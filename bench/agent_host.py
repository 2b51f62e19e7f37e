"""Hosts several agents in one OS process, for the benchmarks: JSON commands in, JSON events out.

    python bench/agent_host.py --agents a0,a1,a2 --detector HOST:PORT

It prints ``{"event": "ready", "addresses": {...}}`` and then takes one command per stdin line:

* ``{"cmd": "peers", "peers": {"a5": "127.0.0.1:4001", ...}, "links": {"a0": ["a1", "a5"], ...}}``
* ``{"cmd": "traffic", "rate": 200}``: every agent sends 64-byte messages to random neighbours,
  ``rate`` a second each, until ``{"cmd": "quiet"}``;
* ``{"cmd": "wait", "agent": "a3", "on": "a4"}`` / ``{"cmd": "unwait", "agent": "a3"}``: add or
  remove a wait; replies ``{"event": "waited", "t": <time.monotonic()>}`` right after the change;
* ``{"cmd": "ring", "order": ["a0", ...], "hold": 0.001}``: a mutex token goes round the ring
  ``order`` (across processes); an agent waits on its predecessor until the token reaches it,
  holds it for ``hold`` seconds, passes it on and waits again; the first agent starts with it;
* ``{"cmd": "waits"}``: replies ``{"event": "waits", "waits": {"a3": ["a2"], ...}, "passes": 17,
  "t": <time.monotonic()>}``, each agent's current waits (what a naive detector polls), how many
  times this host's agents have passed the ring's token on so far, and when the reply was made;
* ``{"cmd": "exit"}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

from child import emit

from stablewatch.agents import Agent, AppMessage, ChannelSettings

PAYLOAD = b"x" * 64


class Host:
    def __init__(self, ids: list[str], detector: str | None, seed: int) -> None:
        self.peers: dict[str, str] = {}
        settings = ChannelSettings(backoff_initial=0.01, backoff_max=0.2)
        options: dict[str, object] = {"channel_settings": settings, "heartbeat_interval": 0.5}
        self.agents = {pid: Agent(pid, peers=self.peers, detector=detector, **options) for pid in ids}
        self.links: dict[str, list[str]] = {}
        self.random = random.Random(seed)
        self.tasks: set[asyncio.Task[None]] = set()
        self.traffic: asyncio.Task[None] | None = None
        self.wait_tokens: dict[str, int] = {}
        self.current_waits: dict[str, list[str]] = {}
        self.ring_next: dict[str, str] = {}
        self.ring_ready = asyncio.Event()  # the token may arrive before this host hears of the ring
        self.ring_hold = 0.0
        self.passes = 0  # token passes made by this host's agents
        for pid, agent in self.agents.items():
            agent.on_message(self._handler(pid))

    def _handler(self, pid: str):
        async def handle(src: str, message: AppMessage) -> None:
            if message.payload == b"token":
                self._unwait(pid)
                task = asyncio.ensure_future(self._pass_token(pid))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

        return handle

    async def _pass_token(self, pid: str) -> None:
        await self.ring_ready.wait()
        await asyncio.sleep(self.ring_hold)
        successor = self.ring_next[pid]
        predecessor = next(p for p, n in self.ring_next.items() if n == pid)
        # Passing the token and waiting for it again is one step: no snapshot falls between.
        await self.agents[pid].send(successor, b"token")
        self._wait(pid, predecessor)
        self.passes += 1

    def _wait(self, pid: str, on: str) -> None:
        self._unwait(pid)
        self.wait_tokens[pid] = self.agents[pid].state.add_wait([on])
        self.current_waits[pid] = [on]

    def _unwait(self, pid: str) -> None:
        token = self.wait_tokens.pop(pid, None)
        if token is not None:
            self.agents[pid].state.remove_wait(token)
        self.current_waits.pop(pid, None)

    async def _send_traffic(self, rate: float) -> None:
        senders = [pid for pid in self.agents if self.links.get(pid)]
        if not senders or rate <= 0:
            return
        period = 1 / (rate * len(senders))
        next_at = time.monotonic()
        while True:
            pid = self.random.choice(senders)
            await self.agents[pid].send(self.random.choice(self.links[pid]), PAYLOAD)
            next_at += period
            delay = next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)

    async def run(self) -> None:
        for agent in self.agents.values():
            await agent.start()
        emit(event="ready", addresses={pid: agent.address for pid, agent in self.agents.items()})
        reader = asyncio.StreamReader(limit=1 << 24)  # a peers line for 1 024 agents is long
        loop = asyncio.get_running_loop()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            command = json.loads(line)
            cmd = command["cmd"]
            if cmd == "peers":
                self.peers.update(command["peers"])
                self.links = {pid: links for pid, links in command.get("links", {}).items() if pid in self.agents}
                emit(event="peers")
            elif cmd == "traffic":
                self.traffic = asyncio.ensure_future(self._send_traffic(command["rate"]))
                emit(event="traffic")
            elif cmd == "quiet":
                if self.traffic is not None:
                    self.traffic.cancel()
                emit(event="quiet")
            elif cmd == "wait":
                self._wait(command["agent"], command["on"])
                emit(event="waited", t=time.monotonic())
            elif cmd == "unwait":
                self._unwait(command["agent"])
                emit(event="waited", t=time.monotonic())
            elif cmd == "ring":
                order = command["order"]
                self.ring_next = {pid: order[(i + 1) % len(order)] for i, pid in enumerate(order)}
                self.ring_hold = command["hold"]
                self.ring_ready.set()
                for i, pid in enumerate(order):
                    if pid in self.agents and i > 0:
                        self._wait(pid, order[i - 1])
                if order[0] in self.agents:
                    task = asyncio.ensure_future(self._pass_token(order[0]))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
                emit(event="ring")
            elif cmd == "waits":
                emit(event="waits", waits=self.current_waits, passes=self.passes, t=time.monotonic())
            elif cmd == "exit":
                break
        for task in [*self.tasks, *([self.traffic] if self.traffic else [])]:
            task.cancel()
        for agent in self.agents.values():
            await agent.stop()
        emit(event="stopped")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", required=True, help="comma-separated agent ids")
    parser.add_argument("--detector")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(Host(args.agents.split(","), args.detector, args.seed).run())


if __name__ == "__main__":
    main()
