"""One of two services that deadlock on purpose, run as its own OS process, to be broken by a detector.

    python -P -m stablewatch.testing.deadlock_node --id A --peer B --kind asyncio --detector HOST:PORT

Each process prints one JSON line per event on stdout and takes commands on stdin, one JSON
object a line: ``{"cmd": "peers", "peers": {"B": "127.0.0.1:1234"}}``, ``{"cmd": "hold"}``,
``{"cmd": "go"}``, ``{"cmd": "metrics", "samples": {"key": ["sample_name", {"label": "value"}]}}``
and ``{"cmd": "exit"}``. Events: ``ready`` (with its address), ``holding``, ``victim`` (the
``DeadlockVictim`` it got, with its message and instance), ``done`` (its work completed),
``metrics`` (the samples' ``values`` in its agent's registry, None for a sample it has not got) and
``stopped``. ``hold`` makes a lock kind's service take its own lock before ``go``: once both hold
theirs, ``go`` deadlocks them for sure (without it, a service that starts late may lend its lock
before taking it, and the other completes without a deadlock).
:class:`DeadlockProcess` runs one from another process (a test, a benchmark) and reads its events.

The kinds of wait (``--kind``), one per way an embedded agent's wait can be broken:

* ``asyncio`` and ``threaded``: each service holds its own lock and asks its peer for the other
  one (an application wait, ``agent.state.waiting(peer)``), so both wait forever: an AND cycle.
  The victim's wait raises :class:`~stablewatch.agents.DeadlockVictim` (asyncio: where its task
  awaits; threaded: through the wait's handle, as a thread cannot be interrupted). It gives its
  lock to its peer, which completes (``done``), returns it and frees its own; the victim then
  asks again and completes too.
* ``flow``: the services pass balls back and forth from their message handlers over channels with
  windows and receive queues of two, so both handlers block in ``send`` with the other's queue
  full: a flow-control deadlock. The victim's ``send`` raises ``DeadlockVictim`` (that ball is
  kept, not sent) and from then on it keeps every ball it gets (this kind has no ``done``: a later
  snapshot without the deadlock tells it is over).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
from typing import Any

from stablewatch.agents import Agent, AppMessage, ChannelSettings, DeadlockVictim, ThreadedAgent
from stablewatch.agents.metrics import BREAK_KINDS
from stablewatch.testing.json_process import JsonProcess

REQUEST = b"request"  # "give me your lock"; wakes no one
GRANT = b"grant"  # the receiver may use the sender's lock
RETURN = b"return"  # the receiver's lock, given back
BALLS = 6  # per service, in the flow kind


def emit(**event: object) -> None:
    """Print one event as a JSON line on stdout, flushed (the parent reads it at once)."""
    print(json.dumps(event), flush=True)


class Locks:
    """Who holds which of the two locks; guarded by ``mutex`` (a service thread and the handlers share it)."""

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.mine_home = True  # my lock is here (not lent to the peer)
        self.holding = False  # I hold my lock for my own work
        self.asked = False  # the peer asked for my lock
        self.granted = False  # the peer's lock is mine to use

    def put_down(self) -> bool:
        """Stop holding my lock; whether to lend it to the peer now (it asked)."""
        with self.mutex:
            self.holding = False
            lend = self.asked and self.mine_home
            if lend:
                self.mine_home, self.asked = False, False
            return lend


class DeadlockNode:
    """The service; see the module docstring."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.me, self.peer, self.kind = args.id, args.peer, args.kind
        self.peers: dict[str, str] = {}
        options: dict[str, Any] = {"peers": self.peers, "detector": args.detector, "heartbeat_interval": 0.2}
        if self.kind == "flow":
            options["channel_settings"] = ChannelSettings(window_entries=2, inbox_entries=2, read_ahead_entries=64)
        self.threaded = ThreadedAgent(self.me, **options) if self.kind == "threaded" else None
        self.agent = self.threaded.agent if self.threaded is not None else Agent(self.me, **options)
        self.agent.on_message(self.on_message)
        self.locks = Locks()
        self.wake = asyncio.Event()  # the locks changed (asyncio kind: set on the agent's loop)
        self.changed = threading.Event()  # the same, for the threaded kind's service thread
        self.victim = False

    # -- messages (on the agent's loop) -----------------------------------------------------------

    async def on_message(self, src: str, message: AppMessage) -> None:
        if self.kind == "flow":
            await self._ball(message.payload)
            return
        locks, lend = self.locks, False
        with locks.mutex:
            if message.payload == REQUEST:
                lend = locks.mine_home and not locks.holding
                if lend:
                    locks.mine_home = False
                else:
                    locks.asked = True
            elif message.payload == GRANT:
                locks.granted = True
            elif message.payload == RETURN:
                locks.mine_home = True
        if lend:
            await self.agent.send(self.peer, GRANT)
        self.wake.set()
        self.changed.set()

    async def _ball(self, payload: bytes) -> None:
        if self.victim:
            return  # once broken, keep every ball: the play winds down
        try:
            await self.agent.send(self.peer, payload, counters={"balls": 1})
        except DeadlockVictim as victim:
            self.victim = True
            emit(event="victim", kind="flow", message=str(victim), instance=victim.instance)

    # -- the work, asyncio ------------------------------------------------------------------------

    async def work_asyncio(self) -> None:
        """Take my lock, ask for the peer's, work with both; if broken, give mine away and ask again."""
        locks = self.locks
        while True:
            while not locks.mine_home:
                with self.agent.state.waiting(self.peer, task="my lock back"):
                    await self._changed()
            with locks.mutex:
                locks.holding = True
            await self.agent.send(self.peer, REQUEST, wakes=False)
            try:
                with self.agent.state.waiting(self.peer):
                    while not locks.granted:
                        await self._changed()
            except DeadlockVictim as victim:
                self.victim = True
                emit(event="victim", kind="asyncio", message=str(victim), instance=victim.instance)
                if locks.put_down():
                    await self.agent.send(self.peer, GRANT)
                continue
            with locks.mutex:
                locks.granted = False
            await self.agent.send(self.peer, RETURN)
            if locks.put_down():
                await self.agent.send(self.peer, GRANT)
            emit(event="done")
            return

    async def _changed(self) -> None:
        self.wake.clear()
        await self.wake.wait()

    # -- the work, on a service thread ------------------------------------------------------------

    def work_threaded(self) -> None:
        """The same on a service thread: it learns of a break through its wait's handle."""
        agent, locks = self.threaded, self.locks
        assert agent is not None
        while True:
            while not self._thread_sees(lambda: locks.mine_home):
                with agent.state.waiting(self.peer, task="my lock back"):
                    self.changed.wait(30)
            with locks.mutex:
                locks.holding = True
            agent.send(self.peer, REQUEST, wakes=False)
            try:
                with agent.state.waiting(self.peer) as wait:
                    wait.on_break(lambda victim: self.changed.set())
                    while not self._thread_sees(lambda: locks.granted):
                        wait.check()  # raises DeadlockVictim once the wait is broken
                        self.changed.wait(30)
            except DeadlockVictim as victim:
                self.victim = True
                emit(event="victim", kind="threaded", message=str(victim), instance=victim.instance)
                if locks.put_down():
                    agent.send(self.peer, GRANT)
                continue
            with locks.mutex:
                locks.granted = False
            agent.send(self.peer, RETURN)
            if locks.put_down():
                agent.send(self.peer, GRANT)
            emit(event="done")
            return

    def _thread_sees(self, condition: Any) -> bool:
        """Clear the change flag, then look: a change after the look sets it again."""
        self.changed.clear()
        with self.locks.mutex:
            return bool(condition())

    # -- the work, flow control -------------------------------------------------------------------

    async def serve_balls(self) -> None:
        self.agent.state.set_counter("balls", BALLS)
        for k in range(BALLS):
            await self.agent.send(self.peer, b"%s%d" % (self.me.encode(), k), counters={"balls": 1})

    # -- the process ------------------------------------------------------------------------------

    async def run(self) -> None:
        if self.threaded is not None:
            await asyncio.to_thread(self.threaded.start)
        else:
            await self.agent.start()
        emit(event="ready", address=self.agent.address)
        reader = asyncio.StreamReader()
        await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        work: asyncio.Future[Any] | None = None
        while line := await reader.readline():
            command = json.loads(line)
            if command["cmd"] == "peers":
                self.peers.update(command["peers"])
                emit(event="peers")
            elif command["cmd"] == "hold":
                with self.locks.mutex:
                    self.locks.holding = True  # a request for my lock now waits until my work puts it down
                emit(event="holding")
            elif command["cmd"] == "go":
                if self.kind == "threaded":
                    work = asyncio.ensure_future(asyncio.to_thread(self.work_threaded))
                else:
                    work = asyncio.ensure_future(self.work_asyncio() if self.kind == "asyncio" else self.serve_balls())
            elif command["cmd"] == "metrics":
                registry = self.agent.metrics.registry
                values = {key: registry.get_sample_value(*sample) for key, sample in command["samples"].items()}
                emit(event="metrics", values=values)
            elif command["cmd"] == "exit":
                break
        if work is not None and self.kind != "threaded":
            work.cancel()
        if self.threaded is not None:
            await asyncio.to_thread(self.threaded.stop)
        else:
            await self.agent.stop()
        emit(event="stopped")


# -- running one from another process ----------------------------------------------------------------


class DeadlockProcess(JsonProcess):
    """One deadlock node as an OS process: JSON commands in on stdin, JSON events out on stdout.

        a = DeadlockProcess("A", "B", "asyncio", "127.0.0.1:50051,127.0.0.1:50052")
        b = DeadlockProcess("B", "A", "asyncio", "127.0.0.1:50051,127.0.0.1:50052")
        introduce([a, b])          # each learns the other's address
        for node in (a, b):
            node.command("hold")   # each takes its own lock ...
            node.expect("holding")
        for node in (a, b):
            node.command("go")     # ... and asks for the other's: a resolving detector breaks one wait
        a.expect("done")

    Starting returns once the node is ready. ``events`` holds every event the node has printed so
    far, in order, and ``expect`` waits for the next of a kind; :meth:`log` is the end of its stderr.
    """

    def __init__(self, process_id: str, peer: str, kind: str, detector: str) -> None:
        command = [sys.executable, "-P", "-m", "stablewatch.testing.deadlock_node"]
        command += ["--id", process_id, "--peer", peer, "--kind", kind, "--detector", detector]
        super().__init__(process_id, command)

    def breaks(self) -> int:
        """Waits its agent broke (``stablewatch_agent_breaks_total``, every kind)."""
        samples = {kind: ("stablewatch_agent_breaks_total", {"kind": kind}) for kind in BREAK_KINDS}
        return int(sum(value or 0 for value in self.metrics(samples).values()))

    def victims(self) -> list[dict[str, Any]]:
        """The ``victim`` events printed so far."""
        return [event for event in self.events if event["event"] == "victim"]


def introduce(nodes: list[DeadlockProcess]) -> None:
    """Tell each node every node's address, and wait until each has taken them."""
    peers = {node.process_id: node.address for node in nodes}
    for node in nodes:
        node.command("peers", peers=peers)
        node.expect("peers")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m stablewatch.testing.deadlock_node")
    parser.add_argument("--id", required=True)
    parser.add_argument("--peer", required=True)
    parser.add_argument("--kind", choices=("asyncio", "threaded", "flow"), required=True)
    parser.add_argument("--detector", required=True, help="the detector's address, or several separated by commas")
    asyncio.run(DeadlockNode(parser.parse_args()).run())


if __name__ == "__main__":
    main()
