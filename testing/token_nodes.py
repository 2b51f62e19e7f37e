"""Run token-bank services (:mod:`stablewatch.testing.token_node`) as OS processes and talk to them.

    nodes = [Node(pid, "--tokens", "100", "--detector", detector_address) for pid in "ABC"]
    connect_all(nodes)                                  # every node learns every other's address
    nodes[0].command("transfer", count=500, seed=1)     # random transfers to random peers
    nodes[0].expect("transferred")
    stats = wait_quiet(nodes)                           # once every message sent has been received

Waiting (``expect`` and what is built on it) polls with a deadline, then raises TimeoutError naming
the node and what it waited for.
"""

from __future__ import annotations

import collections
import json
import queue
import subprocess
import sys
import threading
import time
from typing import Any

__all__ = ["Node", "connect_all", "wait_quiet"]

# Run as ``python -P -m``: the installed module, whatever the working directory holds (-P keeps it off sys.path).
NODE_MODULE = "stablewatch.testing.token_node"


class Node:
    """One token_node process: JSON commands in on stdin, JSON events out on stdout.

    ``args`` are the process's command-line options after ``--id`` (see the token_node module).
    Starting returns once the node is ready; its channels' address is then ``address``.
    """

    def __init__(self, process_id: str, *args: str) -> None:
        self.process_id = process_id
        self.process = subprocess.Popen(
            [sys.executable, "-P", "-m", NODE_MODULE, "--id", process_id, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        # How many events of each kind the node has printed, including those ``expect`` skipped.
        self.seen: collections.Counter[str] = collections.Counter()
        threading.Thread(target=self._read, daemon=True).start()
        self.address = self.expect("ready", timeout=60)["address"]

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            self.seen[message["event"]] += 1
            self._events.put(message)

    def command(self, cmd: str, **fields: object) -> None:
        """Send one command (``{"cmd": cmd, **fields}``); its reply is an event to ``expect``."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"cmd": cmd, **fields}) + "\n")
        self.process.stdin.flush()

    def expect(self, event: str, timeout: float = 30) -> dict[str, Any]:
        """The next event of this kind (others before it are skipped); fails after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (self.process.poll() is not None and self._events.empty()):
                raise TimeoutError(f"{self.process_id}: no {event!r} event (exit code {self.process.poll()})")
            try:
                message = self._events.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if message["event"] == event:
                return message

    def stats(self) -> dict[str, Any]:
        """The node's counts: messages ``sent`` and ``received`` per peer, ``tokens``, ``errors``, ..."""
        self.command("stats")
        return self.expect("stats")

    def metrics(self, samples: dict[str, tuple[str, dict[str, str]]]) -> dict[str, float | None]:
        """The values of these samples (``{key: (sample name, labels)}``) in the node's agent metrics."""
        self.command("metrics", samples={key: [name, labels] for key, (name, labels) in samples.items()})
        return self.expect("metrics")["values"]

    def wait_seen(self, event: str, count: int = 1, timeout: float = 30) -> None:
        """Wait until the node has printed ``count`` events of this kind in all (even skipped ones)."""
        deadline = time.monotonic() + timeout
        while self.seen[event] < count:
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise TimeoutError(f"{self.process_id}: {self.seen[event]} {event!r} events, expected {count}")
            time.sleep(0.01)

    def kill(self) -> None:
        """End the process at once (SIGKILL): no goodbye to its peers or the detector."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)

    def stop(self) -> None:
        """End the process politely (the ``exit`` command: the agent stops), killing it if it lingers."""
        if self.process.poll() is None:
            try:
                self.command("exit")
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(timeout=10)


def connect_all(nodes: list[Node], addresses: dict[str, str] | None = None) -> None:
    """Tell every node every other node's address (or the given ones, e.g. through proxies)."""
    addresses = addresses or {node.process_id: node.address for node in nodes}
    for node in nodes:
        node.command("peers", peers={pid: addr for pid, addr in addresses.items() if pid != node.process_id})
        node.expect("peers")


def wait_quiet(nodes: list[Node], timeout: float = 60) -> list[dict[str, Any]]:
    """Poll until every message sent has been received; returns the final stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = [node.stats() for node in nodes]
        sent = {(node.process_id, dst): n for node, s in zip(nodes, stats, strict=True) for dst, n in s["sent"].items()}
        received = {
            (src, node.process_id): n for node, s in zip(nodes, stats, strict=True) for src, n in s["received"].items()
        }
        if all(received.get(channel, 0) >= n for channel, n in sent.items()):
            return stats
        if time.monotonic() > deadline:
            raise TimeoutError(f"still in flight: sent {sent}, received {received}")
        time.sleep(0.05)
