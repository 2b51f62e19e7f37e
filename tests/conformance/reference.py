"""An independent reference replay of a COS 418 trace, for checking the simulator against.

It follows the discrete-time rules of ``shared/conformance/cos418/README.md`` word for word, with
plain dicts and lists: no :class:`~stablewatch.agents.core.SnapshotCore`, no assembler, no parser
of the project (it reads the three formats itself). A snapshot is complete, as the COS 418 harness
says, when every process has recorded and a marker has arrived on every inbound link of each.

``python tests/conformance/generate.py`` writes the expected ``.snap`` files of the project's own
cases with it; ``tests/test_conformance.py`` checks it against the COS 418 course's own files.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

# Ticks after every snapshot is complete, as the COS 418 harness does.
SETTLE_TICKS = 6


@dataclass
class Snap:
    """One snapshot: balances as recorded, and per destination the tokens recorded in flight."""

    snapshot_id: int
    balances: dict[str, int] = field(default_factory=dict)
    messages: list[tuple[str, str, int]] = field(default_factory=list)  # (src, dst, tokens), as they arrived
    open_links: dict[str, set[str]] = field(default_factory=dict)  # per recorded process: links still recording

    def text(self) -> str:
        """The ``.snap`` format: the id, ``ID tokens`` in id order, then messages by destination."""
        lines = [str(self.snapshot_id)] + [f"{p} {self.balances[p]}" for p in sorted(self.balances)]
        by_destination = sorted(self.messages, key=lambda message: message[1])  # stable: arrival order kept
        return "\n".join(lines + [f"{src} {dst} token({n})" for src, dst, n in by_destination]) + "\n"


@dataclass
class Replay:
    """What a replay produced: the snapshots by id, and the most that were ever running at once."""

    snaps: dict[int, Snap]
    most_running: int


def _words(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines() if line.split() and line[0] != "#"]


def replay(top: Path, events: Path, delays: Path) -> Replay:
    """Replay ``events`` on the topology ``top`` with the delay tape ``delays``."""
    lines = _words(top)
    count = int(lines[0][0])
    balance = {pid: int(tokens) for pid, tokens in lines[1 : 1 + count]}
    outbound: dict[str, list[str]] = {pid: [] for pid in balance}
    for src, dst in lines[1 + count :]:
        if src != dst and dst not in outbound[src]:
            outbound[src].append(dst)
    for dsts in outbound.values():
        dsts.sort()  # plain string order, as the harness sorts its map keys
    inbound = {pid: {src for src in balance if pid in outbound[src]} for pid in balance}
    links: dict[tuple[str, str], deque[tuple[int, str, int]]] = {
        (src, dst): deque() for src in balance for dst in outbound[src]
    }  # (due, "token" or "marker", tokens or snapshot id)
    tape: Iterator[int] = (int(words[0]) for words in _words(delays))
    snaps: dict[int, Snap] = {}
    now = 0
    most_running = 0

    def running() -> list[Snap]:
        return [snap for snap in snaps.values() if len(snap.balances) < count or any(snap.open_links.values())]

    def record(pid: str, snapshot_id: int, first_marker_from: str | None) -> None:
        snap = snaps.setdefault(snapshot_id, Snap(snapshot_id))
        snap.balances[pid] = balance[pid]
        snap.open_links[pid] = inbound[pid] - {first_marker_from}
        for dst in outbound[pid]:
            links[pid, dst].append((now + 1 + next(tape), "marker", snapshot_id))

    def tick() -> None:
        nonlocal now
        now += 1
        for src in sorted(balance):
            for dst in outbound[src]:
                queue = links[src, dst]
                if queue and queue[0][0] <= now:
                    _, kind, value = queue.popleft()
                    if kind == "token":
                        balance[dst] += value
                        for snap in snaps.values():
                            if src in snap.open_links.get(dst, ()):
                                snap.messages.append((src, dst, value))
                    elif dst in snaps[value].balances:
                        snaps[value].open_links[dst].discard(src)
                    else:
                        record(dst, value, src)
                    break

    for words in _words(events):
        if words[0] == "send":
            src, dst, tokens = words[1], words[2], int(words[3])
            if balance[src] < tokens:
                raise ValueError(f"{events}: {src} sends {tokens} tokens but has {balance[src]}")
            balance[src] -= tokens
            links[src, dst].append((now + 1 + next(tape), "token", tokens))
        elif words[0] == "snapshot":
            record(words[1], len(snaps), None)
        else:
            for _ in range(int(words[1]) if len(words) > 1 else 1):
                tick()
        most_running = max(most_running, len(running()))
    while running():
        if not any(links.values()):
            raise ValueError(f"{events}: snapshots {[snap.snapshot_id for snap in running()]} cannot complete")
        tick()
    for _ in range(SETTLE_TICKS):
        tick()
    return Replay(snaps, most_running)
