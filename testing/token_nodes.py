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

import sys
import time
from typing import Any

from stablewatch.testing.json_process import JsonProcess

__all__ = ["Node", "connect_all", "wait_quiet"]

# Run as ``python -P -m``: the installed module, whatever the working directory holds (-P keeps it off sys.path).
NODE_MODULE = "stablewatch.testing.token_node"


class Node(JsonProcess):
    """One token_node process: JSON commands in on stdin, JSON events out on stdout.

    ``args`` are the process's command-line options after ``--id`` (see the token_node module).
    Starting returns once the node is ready; its channels' address is then ``address``.
    """

    def __init__(self, process_id: str, *args: str) -> None:
        super().__init__(process_id, [sys.executable, "-P", "-m", NODE_MODULE, "--id", process_id, *args])

    def stats(self) -> dict[str, Any]:
        """The node's counts: messages ``sent`` and ``received`` per peer, ``tokens``, ``errors``, ..."""
        self.command("stats")
        return self.expect("stats")

    def wait_seen(self, event: str, count: int = 1, timeout: float = 30) -> None:
        """Wait until the node has printed ``count`` events of this kind in all (even skipped ones)."""
        deadline = time.monotonic() + timeout
        while self.count(event) < count:
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise TimeoutError(f"{self.process_id}: {self.count(event)} {event!r} events, expected {count}")
            time.sleep(0.01)

    def stop(self, timeout: float = 10) -> int:
        """End the process politely (the ``exit`` command: the agent stops), killing it if it lingers."""
        return super().stop(timeout)


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
