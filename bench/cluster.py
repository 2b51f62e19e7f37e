"""A detector in this process and agents in a few host processes (bench/agent_host.py), for benchmarks."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from stablewatch.detector.service.detector import Detector, DetectorConfig
from stablewatch.detector.service.limits import Limits

HOST_SCRIPT = Path(__file__).with_name("agent_host.py")


def ring_links(ids: list[str]) -> dict[str, list[str]]:
    """Each agent sends to the next one round the ring."""
    return {pid: [ids[(i + 1) % len(ids)]] for i, pid in enumerate(ids)}


def random_links(ids: list[str], degree: int, seed: int) -> dict[str, list[str]]:
    """Each agent sends to ``degree`` distinct random others."""
    rng = random.Random(seed)
    return {pid: rng.sample([other for other in ids if other != pid], degree) for pid in ids}


class Host:
    """One agent_host.py process."""

    def __init__(self, process: asyncio.subprocess.Process, ids: list[str]) -> None:
        self.process = process
        self.ids = ids

    async def send(self, cmd: str, **fields: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps({"cmd": cmd, **fields}) + "\n").encode())
        await self.process.stdin.drain()

    async def expect(self, event: str, timeout: float = 60) -> dict[str, Any]:
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            line = await asyncio.wait_for(self.process.stdout.readline(), max(0.01, deadline - time.monotonic()))
            if not line:
                raise RuntimeError(f"agent host exited with {await self.process.wait()}")
            message = json.loads(line)
            if message["event"] == event:
                return message

    async def ask(self, cmd: str, event: str, **fields: Any) -> dict[str, Any]:
        await self.send(cmd, **fields)
        return await self.expect(event)


class Cluster:
    """``agents`` agents spread over ``processes`` host processes, attached to an in-process detector."""

    def __init__(
        self,
        agents: int,
        processes: int,
        *,
        interval: float | None = None,
        deadline: float = 5.0,
        max_concurrent: int = 4,
        seed: int | None = None,
        heartbeat_timeout: float = 5.0,
        limits: Limits | None = None,
        one_by_one: bool = False,
    ) -> None:
        """``one_by_one`` starts each host process only once the previous one is ready (large clusters)."""
        self.ids = [f"a{i}" for i in range(agents)]
        self.processes = processes
        self.folder = tempfile.TemporaryDirectory(prefix="stablewatch-bench-")
        config = DetectorConfig(
            data_dir=Path(self.folder.name),
            listen="127.0.0.1:0",
            metrics_port=0,
            interval=interval,
            deadline=deadline,
            max_concurrent=max_concurrent,
            max_snapshots=100_000,
            seed=seed,
            heartbeat_timeout=heartbeat_timeout,
            limits=limits or Limits(),
        )
        self.one_by_one = one_by_one
        self.addresses: dict[str, str] = {}  # of the agents of the hosts that reported ready
        self.detector = Detector(config)
        self.hosts: list[Host] = []
        self.host_of: dict[str, Host] = {}

    @classmethod
    def scheduled(cls, args: argparse.Namespace) -> Cluster:
        """``--agents`` over ``--processes``, the detector taking snapshots every ``--interval``
        seconds (``--deadline``, at most ``--max-concurrent`` at once, ``--seed``)."""
        options = {"deadline": args.deadline, "max_concurrent": args.max_concurrent, "seed": args.seed}
        return cls(args.agents, args.processes, interval=args.interval, **options)

    async def __aenter__(self) -> Cluster:
        try:
            await self._start()
        except BaseException:
            await self.__aexit__(None, None, None)  # no host process left behind
            raise
        return self

    async def _start(self) -> None:
        await self.detector.start()
        groups = [self.ids[i :: self.processes] for i in range(self.processes)]
        for n, group in enumerate(groups):
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                str(HOST_SCRIPT),
                "--agents",
                ",".join(group),
                "--detector",
                self.detector.address,
                "--seed",
                str(n),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            host = Host(process, group)
            self.hosts.append(host)
            for pid in group:
                self.host_of[pid] = host
            if self.one_by_one:
                self.addresses.update((await host.expect("ready", 120))["addresses"])

    async def connect(self, links: dict[str, list[str]], timeout: float = 60) -> None:
        """Exchange addresses, set each agent's neighbours, and wait until all have attached.

        ``timeout`` bounds each host's start and then the attaching of every agent (seconds).
        """
        addresses = self.addresses
        if not self.one_by_one:
            for host in self.hosts:
                addresses.update((await host.expect("ready", timeout))["addresses"])
        for host in self.hosts:
            own = {pid: links[pid] for pid in host.ids if pid in links}
            await host.ask("peers", "peers", peers=addresses, links=own)
        deadline = time.monotonic() + timeout
        while len(self.detector.coordinator.members) < len(self.ids):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.detector.coordinator.members)} of {len(self.ids)} agents attached")
            await asyncio.sleep(0.02)

    async def all_hosts(self, cmd: str, event: str, **fields: Any) -> list[dict[str, Any]]:
        return [await host.ask(cmd, event, **fields) for host in self.hosts]

    async def __aexit__(self, *exc_info: object) -> None:
        async def finish(host: Host) -> None:
            try:
                await asyncio.wait_for(host.process.wait(), 20)
            except TimeoutError:
                host.process.kill()
                await host.process.wait()

        # Tell every host to exit first, then wait for them together: each takes a few seconds.
        running = [host for host in self.hosts if host.process.returncode is None]
        for host in running:
            try:
                await host.send("exit")
            except OSError:
                host.process.kill()
        await asyncio.gather(*(finish(host) for host in running))
        await self.detector.stop()
        self.folder.cleanup()
