"""Fault and bad-input figures: what stablewatch does when connections break, agents die, the
detector restarts or one of two detectors dies, and peers send garbage.

Five phases, each against real code:

* ``resets`` — three token-bank agents (stablewatch.testing.token_node, each its own OS process) move tokens
  through TCP proxies that break every connection over and over, while a detector (in this
  process) takes snapshots. Every message carries a per-channel sequence number: at the end each
  receiver reports gaps (``lost``) and repeats (``duplicated``); the tokens must add up too.
* ``kills`` — an agent is killed (SIGKILL) while a snapshot runs: that snapshot must abort within
  its deadline, and once the agent is back the next snapshot must complete.
* ``detector_restarts`` — the detector is stopped and started again on the same port while the
  agents run: its history stays, snapshot ids only grow, and the next snapshot completes. The
  last restart is on an empty data directory: ids still only grow, and the agents follow.
* ``failovers`` — two detectors side by side (``stablewatch detector --replica 0`` and ``1``, each
  its own OS process, ``--resolve youngest``, snapshots every 0.2 s, hints on) over three token
  nodes attached to both and moving tokens all along. Each round kills one detector (SIGKILL,
  replica 1 and 0 in turn), forms a deadlock while it is down (two fresh
  stablewatch.testing.deadlock_node processes attached to both; an asyncio, a threaded and a
  flow-control deadlock in turn), checks that the other detector proves it and breaks it, brings
  the killed one back on its port and data directory, checks that every agent is attached to both
  again (each detector's members, each agent's ``stablewatch_agent_detector_connected``) and that
  the returned one breaks nothing, then forms one more deadlock with both up. A deadlock is
  **broken twice** (``double_breaks``) when the detectors' breaks of it were reported BROKEN more
  than once (two waits, or one wait by both), or its agents counted more than one break
  (``stablewatch_agent_breaks_total``), or more than one waiter got ``DeadlockVictim``. A second
  break of the same wait, answered ALREADY_BROKEN or GONE, is the exactly-once rule at work
  (``repeat_breaks``). The tokens must add up at the end.
* ``fuzzed`` — seeded random and mutated channel frames, snapshot parts and control messages,
  fed to the frame decoder and the protocol core, the assembler, and the coordinator's control
  stream handling. Each must be accepted or rejected with a reason; anything else is a crash.

It prints a table and, as its last line, one JSON object with ``resets``, ``lost``,
``duplicated``, ``kills``, ``kills_recovered``, ``detector_restarts``, ``detector_failovers``,
``deadlocks_during_failover``, ``detected_during_failover``, ``double_breaks``, ``fuzzed`` and
``crashes`` (and more), ``targets`` and ``target_met``. Targets: lost, duplicated and crashes 0;
every kill recovered; every restart's history kept and next snapshot completed;
``detected_during_failover == deadlocks_during_failover``; ``double_breaks == 0``; the tokens
conserved; at least as many resets and fuzzed inputs as asked.

    python bench/faults.py [--resets 1000] [--kills 3] [--restarts 3] [--failovers 3] [--fuzz 100000] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

from google.protobuf.message import DecodeError
from report import json_line

from stablewatch.agents.core import RemoteProtocolError, SnapshotCore
from stablewatch.agents.frames import FrameError, decode
from stablewatch.detector.assembly import Assembler, PartRejected
from stablewatch.detector.service.coordinator import Coordinator, Member
from stablewatch.detector.service.detector import DetectorConfig
from stablewatch.detector.service.query import outcome_name
from stablewatch.detector.service.resolutions import outcome_word
from stablewatch.testing.deadlock_node import DeadlockProcess, introduce
from stablewatch.testing.detector import Running
from stablewatch.testing.detector_process import DetectorProcess
from stablewatch.testing.tcp_proxy import TcpProxy
from stablewatch.testing.token_nodes import Node, connect_all, wait_quiet
from stablewatch.v1 import (
    AgentMessage,
    ChannelFrame,
    EntryExtras,
    InboundChannelState,
    LocalSnapshotPart,
    LocalState,
    MarkerEntry,
    OutboundCount,
    RecordedMessage,
)
from stablewatch.v1.control_pb2 import (
    BREAK_OUTCOME_ALREADY_BROKEN,
    BREAK_OUTCOME_BROKEN,
    BREAK_OUTCOME_GONE,
    Heartbeat,
    Pong,
    Register,
    SnapshotFailure,
)
from stablewatch.v1.query_pb2 import Resolution

TOKENS = 1000
T = TypeVar("T")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- detector ---------------------------------------------------------------------------------------


def start_detector(data_dir: Path, listen: str = "127.0.0.1:0", deadline: float = 3.0) -> Running:
    config = DetectorConfig(
        data_dir=data_dir,
        listen=listen,
        metrics_port=None,
        interval=None,
        deadline=deadline,
        heartbeat_interval=0.2,
        heartbeat_timeout=2.0,
    )
    return Running(config)


def snapshot(running: Running, deadline: float = 3.0) -> Any:
    return running.call(running.detector.take_snapshot(deadline=deadline), timeout=deadline + 30)


def poll(condition: Callable[[], T], what: str, timeout: float = 60) -> T:
    """``condition()`` once it is truthy; TimeoutError naming ``what`` after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.01)
    return value


# -- phase 1: stream resets ------------------------------------------------------------------------


def reset_phase(target: int, seed: int, work: Path) -> dict[str, int]:
    """Break every channel connection until `target` connections were cut; count what got lost."""
    if target <= 0:  # skipped
        return {
            "resets": 0,
            "lost": 0,
            "duplicated": 0,
            "messages": 0,
            "snapshots_completed": 0,
            "tokens_conserved": None,
        }
    detector = start_detector(work / "resets")
    nodes = [Node(pid, "--tokens", str(TOKENS), "--detector", detector.detector.address) for pid in "ABC"]
    proxies = {node.process_id: TcpProxy(node.address) for node in nodes}
    resets = snapshots = 0
    try:
        connect_all(nodes, {pid: proxy.address for pid, proxy in proxies.items()})
        poll(lambda: len(detector.detector.coordinator.members) == 3, "three agents attached")
        rng = random.Random(seed)
        rounds = 0
        while resets < target:
            rounds += 1
            for node in nodes:
                node.command("transfer", count=rng.randint(50, 200), seed=rng.randrange(1 << 30))
            # Cut only connections that finished their handshake: gRPC backs off for a second
            # after a connection that failed before it, and the point is many resets, quickly.
            poll(lambda: all(p.all_established or not p.connections for p in proxies.values()), "streams up", 30)
            resets += sum(proxy.break_all() for proxy in proxies.values())
            if rounds % 10 == 0:
                snapshots += outcome_name(snapshot(detector).snapshot.outcome) == "completed"
        for node in nodes:
            node.expect("transferred", timeout=120)
        stats = wait_quiet(nodes, timeout=180)
        result = snapshot(detector)
        conservation = {r.name: r for r in result.results}.get("conservation(tokens)")
    finally:
        for node in nodes:
            node.stop()
        for proxy in proxies.values():
            proxy.stop()
        detector.stop()
    lost = duplicated = 0
    for node_stats in stats:
        for error in node_stats["errors"]:
            got, expected = (int(x) for x in error.split("got ")[1].split(", expected "))
            duplicated += got < expected
            lost += got > expected
    sent = {(n.process_id, d): c for n, s in zip(nodes, stats, strict=True) for d, c in s["sent"].items()}
    received = {(s_, n.process_id): c for n, s in zip(nodes, stats, strict=True) for s_, c in s["received"].items()}
    lost += sum(max(0, c - received.get(channel, 0)) for channel, c in sent.items())
    tokens_kept = sum(s["tokens"] for s in stats) == 3 * TOKENS
    return {
        "resets": resets,
        "lost": lost,
        "duplicated": duplicated,
        "messages": sum(sent.values()),
        "snapshots_completed": snapshots,
        "tokens_conserved": int(tokens_kept and conservation is not None and conservation.holds),
    }


# -- phase 2: agents killed mid-snapshot -----------------------------------------------------------


def kill_phase(kills: int, work: Path, deadline: float = 3.0) -> dict[str, Any]:
    """Kill an agent while a snapshot waits for it; the snapshot must abort in time, the next complete."""
    detector = start_detector(work / "kills", deadline=deadline)
    args = ("--tokens", str(TOKENS), "--detector", detector.detector.address)
    nodes = {pid: Node(pid, *args) for pid in "ABC"}
    recovered = 0
    abort_seconds: list[float] = []
    failures: list[str] = []
    try:
        connect_all(list(nodes.values()))
        for round_ in range(kills):
            poll(lambda: len(detector.detector.coordinator.members) == 3, "three agents attached")
            nodes["A"].command("transfer", count=20, seed=round_)
            nodes["A"].expect("transferred")
            # Freeze C before the snapshot starts: it cannot answer the marker, so the snapshot
            # is certainly still waiting on C when C dies (a live C can finish in milliseconds).
            nodes["C"].process.send_signal(signal.SIGSTOP)
            pending = asyncio.run_coroutine_threadsafe(
                detector.detector.take_snapshot(deadline=deadline), detector.loop
            )
            poll(lambda p=pending: detector.detector.coordinator.running or p.done(), "the snapshot running")
            killed_at = time.monotonic()
            nodes["C"].kill()
            aborted = pending.result(deadline + 30)
            abort_seconds.append(time.monotonic() - killed_at)
            if outcome_name(aborted.snapshot.outcome) != "aborted":
                failures.append(f"round {round_}: the snapshot {outcome_name(aborted.snapshot.outcome)} without C")
                continue
            nodes["C"] = Node("C", *args)
            connect_all(list(nodes.values()))
            poll(lambda: len(detector.detector.coordinator.members) == 3, "C back")
            # A snapshot running while a sender first reaches the new C fails (its counts restart
            # with C): let every channel to C carry a message first, as a live system soon would.
            for pid in "AB":
                nodes[pid].command("transfer", count=10, seed=round_)
            wait_quiet(list(nodes.values()))
            following = snapshot(detector, deadline=10)
            if outcome_name(following.snapshot.outcome) == "completed":
                recovered += 1
            else:
                failures.append(following.snapshot.abort_reason)
    finally:
        for node in nodes.values():
            node.stop()
        detector.stop()
    within = sum(seconds <= deadline + 1.0 for seconds in abort_seconds)
    return {
        "kills": kills,
        "kills_recovered": recovered,
        "aborted_within_deadline": within,
        "abort_seconds": [round(s, 3) for s in abort_seconds],
        "recovery_failures": failures,
    }


# -- phase 3: detector restarts --------------------------------------------------------------------


def restart_phase(restarts: int, work: Path) -> dict[str, Any]:
    """Restart the detector on the same port and data while agents run; history and ids must hold."""
    data = work / "restarts"
    detector = start_detector(data)
    address = detector.detector.address

    def attached() -> bool:
        return len(detector.detector.coordinator.members) == 3

    def history() -> list[int]:
        return detector.on_loop(lambda: [s.snapshot_id for s in detector.detector.store.list(1000)])

    nodes = [Node(pid, "--tokens", str(TOKENS), "--detector", address) for pid in "ABC"]
    ids: list[int] = []
    kept = completed_after = 0
    try:
        connect_all(nodes)
        for round_ in range(restarts):
            poll(attached, "three agents attached")
            for node in nodes:
                node.command("transfer", count=100, seed=round_)
            ids += [snapshot(detector).snapshot.snapshot_id for _ in range(3)]
            before = history()
            detector.stop()
            if round_ == restarts - 1 and restarts > 1:
                # The last restart is on an empty data directory (a lost volume): no history to
                # keep, but ids must still never repeat and the agents must follow the new epoch.
                data = work / "restarts-fresh"
                detector = start_detector(data, listen=address)
                kept += not history()
            else:
                detector = start_detector(data, listen=address)
                kept += set(before) <= set(history())
            poll(attached, "agents back after the restart")
            result = snapshot(detector)
            completed_after += outcome_name(result.snapshot.outcome) == "completed"
            ids.append(result.snapshot.snapshot_id)
    finally:
        for node in nodes:
            node.stop()
        detector.stop()
    return {
        "detector_restarts": restarts,
        "history_kept": kept,
        "completed_after_restart": completed_after,
        "ids_increasing": int(all(a < b for a, b in itertools.pairwise(ids))),
    }


# -- phase 4: detector failovers -------------------------------------------------------------------

# The kinds of deadlock formed in turn (stablewatch.testing.deadlock_node): an application wait in
# an asyncio task, one on a service thread, and sends blocked by flow control.
DEADLOCK_KINDS = ("asyncio", "threaded", "flow")
FAILOVER_INTERVAL = 0.2  # seconds between each detector's scheduled snapshots


class Replica(DetectorProcess):
    """``stablewatch detector`` as an OS process: one replica of two, breaking deadlocks (``--resolve
    youngest``) on a short schedule, with the agents' hints on; killed with SIGKILL and started
    again on its port and data directory. Queried over its gRPC query API, as an operator would."""

    def __init__(self, data_dir: Path, replica: int, listen: str = "127.0.0.1:0") -> None:
        options = ["--metrics-port", "none", "--replica", str(replica), "--resolve", "youngest"]
        options += ["--interval", str(FAILOVER_INTERVAL), "--heartbeat-timeout", "2"]
        super().__init__(data_dir, *options, listen=listen)
        self.replica = replica


def later_snapshot_without_deadlock(detector: Replica, timeout: float = 30) -> None:
    """Wait for a snapshot of ``detector`` started after now whose deadlock predicate is false."""
    now_us = time.time_ns() // 1000

    def quiet() -> bool:
        results = detector.latest()
        if results is None or results.snapshot.started_at.ToMicroseconds() <= now_us:
            return False
        deadlock = {result.name: result for result in results.results}.get("deadlock")
        return deadlock is not None and not deadlock.holds and not deadlock.unknown

    poll(quiet, f"a snapshot of replica {detector.replica} without a deadlock", timeout)


class Load:
    """Token transfers among the token nodes, batch after batch on a thread, until :meth:`stop`.

    A node's events come in one queue, so the thread holds ``locks`` while it waits for a batch:
    anyone else asking the nodes something takes the node's lock first.
    """

    def __init__(self, nodes: list[Node], seed: int, batch: int = 200) -> None:
        self.nodes = nodes
        self.locks = {node.process_id: threading.Lock() for node in nodes}
        self.messages = 0
        self._rng = random.Random(seed)
        self._batch = batch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with contextlib.ExitStack() as held:
                    for lock in self.locks.values():
                        held.enter_context(lock)
                    for node in self.nodes:
                        node.command("transfer", count=self._batch, seed=self._rng.randrange(1 << 30))
                    for node in self.nodes:
                        node.expect("transferred", timeout=120)
                self.messages += self._batch * len(self.nodes)
        except BaseException as error:  # reported by stop(): the phase's figures would be wrong
            self.error = error

    def connected(self, address: str) -> bool:
        """Whether every node's agent has its control stream to the detector at ``address`` up."""
        sample = {"up": ("stablewatch_agent_detector_connected", {"detector": address})}
        for node in self.nodes:
            with self.locks[node.process_id]:
                if node.metrics(sample)["up"] != 1:
                    return False
        return True

    def stop(self, check: bool = True) -> None:
        """End the transfers after the batch under way; with ``check``, raise if they failed."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(180)
        if check and self.error is not None:
            raise RuntimeError(f"the token transfers failed: {self.error!r}") from self.error


class Deadlock:
    """Two deadlock nodes (their own OS processes) attached to both detectors, deadlocked on purpose."""

    def __init__(self, ids: tuple[str, str], kind: str, addresses: list[str], watchers: list[DetectorProcess]) -> None:
        self.ids, self.kind = ids, kind
        detector = ",".join(addresses)
        self.nodes: list[DeadlockProcess] = []
        try:
            for mine, peer in (ids, ids[::-1]):
                self.nodes.append(DeadlockProcess(mine, peer, kind, detector))
            introduce(self.nodes)
            poll(lambda: all(set(ids) <= watcher.members() for watcher in watchers), "the pair attached", 30)
            for node in self.nodes:  # each takes its own lock first, so neither lends it: a deadlock for sure
                node.command("hold")
                node.expect("holding")
        except BaseException:
            self.stop()
            raise
        self.went = time.monotonic()
        for node in self.nodes:
            node.command("go")

    def broken(self, watchers: list[DetectorProcess], timeout: float = 30) -> float | None:
        """Seconds from ``go`` to the first victim, once the deadlock is over (both services done, or
        with flow control a later snapshot of each watcher without a deadlock); None if it is not."""
        try:
            poll(self.victims, "a victim", timeout)
            seconds = time.monotonic() - self.went
            if self.kind != "flow":
                for node in self.nodes:
                    node.expect("done", timeout=timeout)
            for watcher in watchers:
                later_snapshot_without_deadlock(watcher, timeout)
        except TimeoutError as error:
            log(f"  {self.kind} deadlock {'/'.join(self.ids)}: {error}")
            return None
        return seconds

    def victims(self) -> int:
        return sum(len(node.victims()) for node in self.nodes)

    def agent_breaks(self) -> int:
        """Waits the pair's agents broke (their ``stablewatch_agent_breaks_total``)."""
        return sum(node.breaks() for node in self.nodes)

    def resolutions(self, detector: DetectorProcess) -> list[Resolution]:
        """The breaks ``detector`` sent to this pair, once none waits for its report."""

        def settled() -> tuple[list[Resolution]] | None:
            mine = [r for r in detector.resolutions() if r.process_id in self.ids]
            return None if any(outcome_word(r) == "pending" for r in mine) else (mine,)

        return poll(settled, "the pair's breaks reported", 30)[0]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class Failovers:
    """The failover phase's detectors, load and tallies (see the module docstring)."""

    def __init__(self, seed: int, work: Path) -> None:
        self.data = [work / f"failover-d{replica}" for replica in (0, 1)]
        self.load: Load | None = None
        self.detectors: list[Replica] = []
        self.nodes: list[Node] = []
        self.pairs: list[Deadlock] = []
        try:
            self.detectors = [Replica(self.data[replica], replica) for replica in (0, 1)]
            self.addresses = [detector.address for detector in self.detectors]
            self.nodes = [Node(pid, "--tokens", str(TOKENS), "--detector", ",".join(self.addresses)) for pid in "ABC"]
        except BaseException:
            self.stop()
            raise
        self.load = Load(self.nodes, seed)
        self.figures: dict[str, Any] = dict.fromkeys(FAILOVER_COUNTS, 0)
        self.break_seconds: list[float] = []
        self.reattach_seconds: list[float] = []
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.failures: list[str] = []

    def start(self) -> None:
        connect_all(self.nodes)
        for detector in self.detectors:
            poll(lambda d=detector: {"A", "B", "C"} <= d.members(), f"the agents on replica {detector.replica}")
        self.load.start()

    def round(self, number: int) -> None:
        """Kill one detector, deadlock two services while it is down, bring it back, deadlock two more."""
        figures = self.figures
        down = 1 - number % 2  # replica 1 goes first, then 0, and so on
        up, address = self.detectors[1 - down], self.addresses[down]
        log(f"  failover {number + 1}: killing replica {down} ...")
        self.detectors[down].kill()
        figures["detector_failovers"] += 1
        poll(lambda: not self.load.connected(address), "the agents saw the detector go", 30)
        # A deadlock that forms while it is down: the other alone must prove it and break it.
        kind = DEADLOCK_KINDS[number % len(DEADLOCK_KINDS)]
        pair = self.deadlock((f"P{number}", f"Q{number}"), kind, [up])
        figures["deadlocks_during_failover"] += 1
        seconds = pair.broken([up])
        from_up = pair.resolutions(up)
        figures["detected_during_failover"] += bool(from_up)  # a break is sent only for a proven deadlock
        # Back on its port and data: the agents return, and it must not break that deadlock again.
        back_at = time.monotonic()
        self.detectors[down] = Replica(self.data[down], down, listen=address)
        everyone = {"A", "B", "C", *pair.ids}
        try:
            poll(lambda: all(everyone <= d.members() for d in self.detectors), "everyone attached to both", 30)
            poll(lambda: self.load.connected(address), "the agents' streams to it up", 30)
            self.reattach_seconds.append(time.monotonic() - back_at)
            figures["reattached"] += 1
            for _ in range(2):  # its first snapshots with the pair: no deadlock, nothing to break
                later_snapshot_without_deadlock(self.detectors[down])
        except TimeoutError as error:
            self.failures.append(f"round {number}: replica {down} back: {error}")
        figures["breaks_after_return"] += len(pair.resolutions(self.detectors[down]))
        if self.broken_once(pair, seconds) and any(r.outcome == BREAK_OUTCOME_BROKEN for r in from_up):
            figures["broken_during_failover"] += 1
        else:
            self.failures.append(f"round {number}: the {kind} deadlock during the failover was not broken once")
        pair.stop()
        # The same with both up: both usually prove it, and the agent breaks one wait once.
        both = self.deadlock((f"R{number}", f"S{number}"), kind, self.detectors)
        figures["deadlocks_with_both_up"] += 1
        if self.broken_once(both, both.broken(self.detectors)):
            figures["broken_with_both_up"] += 1
        else:
            self.failures.append(f"round {number}: the {kind} deadlock with both up was not broken once")
        both.stop()

    def deadlock(self, ids: tuple[str, str], kind: str, watchers: list[DetectorProcess]) -> Deadlock:
        pair = Deadlock(ids, kind, self.addresses, watchers)
        self.pairs.append(pair)
        return pair

    def broken_once(self, pair: Deadlock, seconds: float | None) -> bool:
        """Tally both detectors' breaks of ``pair``; whether it ended, broken exactly once."""
        found = [r for detector in self.detectors for r in pair.resolutions(detector)]
        self.outcomes.update(outcome_word(r) for r in found)
        self.figures["repeat_breaks"] += sum(
            r.outcome in (BREAK_OUTCOME_ALREADY_BROKEN, BREAK_OUTCOME_GONE) for r in found
        )
        broken = sum(r.outcome == BREAK_OUTCOME_BROKEN for r in found)
        if broken > 1 or pair.agent_breaks() > 1 or pair.victims() > 1:
            self.figures["double_breaks"] += 1
            sent = [(r.process_id, r.instance, outcome_word(r)) for r in found]
            self.failures.append(f"{'/'.join(pair.ids)} broken more than once: {sent}, {pair.victims()} victims")
            return False
        if seconds is None or broken != 1:
            return False
        self.break_seconds.append(seconds)
        return True

    def finish(self) -> dict[str, Any]:
        """Stop the load; the phase's figures once every token has arrived."""
        self.load.stop()
        stats = wait_quiet(self.nodes, timeout=120)
        errors = [error for node_stats in stats for error in node_stats["errors"]]
        seconds, reattach = self.break_seconds, self.reattach_seconds
        return self.figures | {
            "failover_break_p50_ms": round(statistics.median(seconds) * 1000, 1) if seconds else None,
            "failover_break_max_ms": round(max(seconds) * 1000, 1) if seconds else None,
            "failover_reattach_max_s": round(max(reattach), 2) if reattach else None,
            "failover_break_outcomes": dict(sorted(self.outcomes.items())),
            "failover_messages": self.load.messages,
            "failover_tokens_conserved": int(not errors and sum(s["tokens"] for s in stats) == 3 * TOKENS),
            "failover_failures": self.failures,
        }

    def stop(self) -> None:
        if self.load is not None:
            self.load.stop(check=False)
        for pair in self.pairs:
            pair.stop()
        for node in self.nodes:
            node.stop()
        for detector in self.detectors:
            detector.stop()


# The phase's counts (its JSON keys), 0 when it does not run.
FAILOVER_COUNTS = (
    "detector_failovers",
    "deadlocks_during_failover",
    "detected_during_failover",
    "broken_during_failover",
    "deadlocks_with_both_up",
    "broken_with_both_up",
    "double_breaks",
    "repeat_breaks",
    "breaks_after_return",
    "reattached",
)


def failover_phase(failovers: int, seed: int, work: Path) -> dict[str, Any]:
    """Two resolving detectors (replicas 0 and 1) over agents under load; each round kills one,
    forms a deadlock while it is down, brings it back, then forms one with both up."""
    if failovers <= 0:
        return dict.fromkeys(FAILOVER_COUNTS, 0) | {
            "failover_break_p50_ms": None,
            "failover_break_max_ms": None,
            "failover_reattach_max_s": None,
            "failover_break_outcomes": {},
            "failover_messages": 0,
            "failover_tokens_conserved": None,
            "failover_failures": [],
        }
    phase = Failovers(seed, work)
    try:
        phase.start()
        for number in range(failovers):
            phase.round(number)
        return phase.finish()
    finally:
        phase.stop()


# -- phase 5: fuzzing ------------------------------------------------------------------------------


class Tally:
    """Outcomes of fuzzed inputs: accepted, rejected by reason, or crashed (with the first few tracebacks)."""

    def __init__(self) -> None:
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.crashes: list[str] = []

    def run(self, what: str, action: Callable[[], object]) -> None:
        try:
            action()
        except (FrameError, PartRejected) as rejected:
            self.outcomes[f"{what}: rejected {rejected.reason}"] += 1
        except RemoteProtocolError:
            self.outcomes[f"{what}: rejected protocol"] += 1
        except DecodeError:
            self.outcomes[f"{what}: rejected undecodable"] += 1
        except Exception:
            self.outcomes[f"{what}: CRASH"] += 1
            if len(self.crashes) < 5:
                self.crashes.append(traceback.format_exc())
        else:
            self.outcomes[f"{what}: accepted"] += 1

    @property
    def total(self) -> int:
        return sum(self.outcomes.values())

    @property
    def crashed(self) -> int:
        return sum(n for key, n in self.outcomes.items() if key.endswith("CRASH"))


def mutate(data: bytes, rng: random.Random) -> bytes:
    """Flip, drop, insert or truncate a few bytes."""
    buffer = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        if not buffer or choice < 0.25:
            buffer.insert(rng.randint(0, len(buffer)), rng.randrange(256))
        elif choice < 0.5:
            buffer[rng.randrange(len(buffer))] ^= 1 << rng.randrange(8)
        elif choice < 0.75:
            del buffer[rng.randrange(len(buffer))]
        else:
            del buffer[rng.randint(0, len(buffer)) :]
    return bytes(buffer)


def random_frame(rng: random.Random) -> ChannelFrame:
    count = rng.randint(0, 12)
    payloads = [b"" if rng.random() < 0.2 else rng.randbytes(rng.randint(0, 16)) for _ in range(count)]
    frame = ChannelFrame(first_seq=rng.randint(0, 50), payloads=payloads)
    for _ in range(rng.randint(0, 3)):
        frame.markers.append(MarkerEntry(position=rng.randint(0, count + 1), snapshot_id=rng.randint(0, 5)))
    for _ in range(rng.randint(0, 3)):
        extras = EntryExtras(position=rng.randint(0, count + 1), no_wake=rng.random() < 0.5)
        if rng.random() < 0.5:
            extras.counters["tokens"] = rng.randint(-5, 5)
        frame.extras.append(extras)
    return frame


def fuzz_frames(n: int, rng: random.Random, tally: Tally) -> None:
    """Frames decoded and their entries fed to a receiving protocol core, as the inbound stream does."""
    core = SnapshotCore("me")
    for i in range(n):
        frame = random_frame(rng)
        data = frame.SerializeToString()
        if i % 2:
            data = mutate(data, rng)

        def receive(data: bytes = data) -> None:
            entries = decode(ChannelFrame.FromString(data))
            for entry in entries:
                actions = core.receive("peer", entry)
                for action in actions:
                    if type(action).__name__ == "RecordState":
                        core.record_state(action.snapshot_id, LocalState())
            for snapshot_id in core.active_snapshots:
                if rng.random() < 0.5:
                    core.finish_snapshot(snapshot_id)

        tally.run("frame", receive)


def random_part(rng: random.Random, snapshot_id: int, processes: list[str]) -> LocalSnapshotPart:
    process = rng.choice([*processes, "", "stranger"])
    part = LocalSnapshotPart(
        snapshot_id=rng.choice([snapshot_id, snapshot_id - 1, snapshot_id + 7, 0]), process_id=process
    )
    if rng.random() < 0.6:
        part.state.CopyFrom(LocalState(active=rng.random() < 0.5, counters={"tokens": rng.randint(0, 9)}))
    for _ in range(rng.randint(0, 3)):
        part.outbound.append(OutboundCount(dst=rng.choice([*processes, "", "x"]), sent_before_marker=rng.randint(0, 3)))
    for _ in range(rng.randint(0, 3)):
        messages = [RecordedMessage(payload=b"m") for _ in range(rng.randint(0, 2))]
        part.inbound.append(
            InboundChannelState(
                src=rng.choice([*processes, "", "x"]), received_before_recording=rng.randint(0, 3), messages=messages
            )
        )
    return part


def fuzz_parts(n: int, rng: random.Random, tally: Tally) -> None:
    """Random and mutated parts into an assembler collecting snapshots of three processes."""
    processes = ["a", "b", "c"]
    assembler = Assembler()
    snapshot_id = 1
    assembler.begin(snapshot_id, processes)
    for i in range(n):
        part = random_part(rng, snapshot_id, processes)
        data = part.SerializeToString()
        if i % 3 == 0:
            data = mutate(data, rng)
        sender = rng.choice([part.process_id, part.process_id, "a", None])

        def add(data: bytes = data, sender: str | None = sender) -> None:
            assembler.add_part(LocalSnapshotPart.FromString(data), sender=sender)

        tally.run("part", add)
        if snapshot_id not in assembler.running:
            snapshot_id += 1
            assembler.begin(snapshot_id, processes)


async def fuzz_control(n: int, rng: random.Random, tally: Tally) -> None:
    """Random control messages on a registered member's stream, through the coordinator's handling."""
    coordinator = Coordinator(
        on_rejected=lambda rejected: tally.outcomes.update([f"control: rejected {rejected.reason}"])
    )
    now = time.time()
    for pid in ("a", "b"):
        coordinator.members[pid] = Member(pid, "x:1", 1, now, now)
    snapshot_id, _ = coordinator.begin_snapshot(deadline=60)
    messages = []
    for i in range(n):
        kind = rng.randrange(6)
        if kind == 0:
            message = AgentMessage(part=random_part(rng, snapshot_id, ["a", "b"]))
        elif kind == 1:
            message = AgentMessage(heartbeat=Heartbeat(sequence=i))
        elif kind == 2:
            message = AgentMessage(failure=SnapshotFailure(snapshot_id=rng.choice([snapshot_id, 99]), reason="fuzz"))
        elif kind == 3:
            message = AgentMessage(pong=Pong(nonce=rng.randint(0, 9)))
        elif kind == 4:
            message = AgentMessage(register=Register(process_id=rng.choice(["a", "z"])))
        else:
            message = AgentMessage()
        data = message.SerializeToString()
        messages.append(mutate(data, rng) if i % 3 == 0 else data)

    async def stream() -> AsyncIterator[AgentMessage]:
        for data in messages:
            try:
                yield AgentMessage.FromString(data)
            except DecodeError:
                tally.outcomes["control: rejected undecodable"] += 1  # gRPC refuses such bytes before us

    member = coordinator.members["a"]
    before = sum(tally.outcomes.values())
    try:
        await coordinator._read(member, stream())
    except Exception:
        tally.outcomes["control: CRASH"] += 1
        tally.crashes.append(traceback.format_exc())
    handled = n - (sum(tally.outcomes.values()) - before)
    tally.outcomes["control: accepted"] += max(0, handled)
    for running in list(coordinator.running):
        coordinator.abort(running, "fuzzing over", "shutdown")


def fuzz_phase(total: int, seed: int) -> tuple[dict[str, int], Tally]:
    rng = random.Random(seed)
    tally = Tally()
    third = total // 3
    fuzz_frames(third, rng, tally)
    fuzz_parts(third, rng, tally)
    asyncio.run(fuzz_control(total - 2 * third, rng, tally))
    return {"fuzzed": tally.total, "crashes": tally.crashed}, tally


# -- main -------------------------------------------------------------------------------------------


def targets(results: dict[str, Any], args: argparse.Namespace) -> dict[str, bool]:
    """Each target of the module docstring, met or not."""
    return {
        "resets_as_asked": results["resets"] >= args.resets,
        "lost_zero": results["lost"] == 0,
        "duplicated_zero": results["duplicated"] == 0,
        "tokens_conserved": results["tokens_conserved"] in (1, None),  # None: the phase was skipped
        "kills_aborted_within_deadline": results["aborted_within_deadline"] == results["kills"],
        "kills_recovered": results["kills_recovered"] == results["kills"],
        "restarts_history_kept": results["history_kept"] == results["detector_restarts"],
        "restarts_completed": results["completed_after_restart"] == results["detector_restarts"],
        "ids_increasing": results["ids_increasing"] == 1,
        "detected_during_failover": results["detected_during_failover"] == results["deadlocks_during_failover"],
        "failover_deadlocks_broken": results["broken_during_failover"] + results["broken_with_both_up"]
        == results["deadlocks_during_failover"] + results["deadlocks_with_both_up"],
        "failovers_reattached": results["reattached"] == results["detector_failovers"],
        "double_breaks_zero": results["double_breaks"] == 0,
        "failover_tokens_conserved": results["failover_tokens_conserved"] in (1, None),
        "fuzzed_as_asked": results["fuzzed"] >= args.fuzz,
        "crashes_zero": results["crashes"] == 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resets", type=int, default=1000, help="connections to break (1000)")
    parser.add_argument("--kills", type=int, default=3, help="agents to kill mid-snapshot (3)")
    parser.add_argument("--restarts", type=int, default=3, help="detector restarts (3)")
    parser.add_argument("--failovers", type=int, default=3, help="one of two detectors killed and brought back (3)")
    parser.add_argument("--fuzz", type=int, default=100_000, help="fuzzed inputs (100000)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="stablewatch-faults-") as folder:
        work = Path(folder)
        started = time.monotonic()
        log(f"breaking connections until {args.resets} were reset ...")
        results.update(reset_phase(args.resets, args.seed, work))
        log(f"killing {args.kills} agents mid-snapshot ...")
        results.update(kill_phase(args.kills, work))
        log(f"restarting the detector {args.restarts} times ...")
        results.update(restart_phase(args.restarts, work))
        log(f"killing one of two detectors {args.failovers} times, deadlocking while it is down ...")
        results.update(failover_phase(args.failovers, args.seed, work))
        log(f"fuzzing {args.fuzz} inputs ...")
        fuzzed, tally = fuzz_phase(args.fuzz, args.seed)
        results.update(fuzzed)
        results["seconds"] = round(time.monotonic() - started, 1)
    met = targets(results, args)
    results["targets"] = met
    results["target_met"] = all(met.values())
    print(f"{'measure':<40}{'value':>12}  {'target':<14}met")
    rows = [
        ("connections reset", "resets", f">= {args.resets}", "resets_as_asked"),
        ("messages moved meanwhile", "messages", "", None),
        ("messages lost", "lost", "0", "lost_zero"),
        ("messages duplicated", "duplicated", "0", "duplicated_zero"),
        ("tokens conserved (1 = yes)", "tokens_conserved", "1", "tokens_conserved"),
        ("agents killed mid-snapshot", "kills", "", None),
        ("  snapshot aborted within deadline", "aborted_within_deadline", "all", "kills_aborted_within_deadline"),
        ("  next snapshot completed", "kills_recovered", "all", "kills_recovered"),
        ("detector restarts", "detector_restarts", "", None),
        ("  history kept", "history_kept", "all", "restarts_history_kept"),
        ("  next snapshot completed", "completed_after_restart", "all", "restarts_completed"),
        ("  snapshot ids always grew (1 = yes)", "ids_increasing", "1", "ids_increasing"),
        ("one of two detectors killed", "detector_failovers", "", None),
        ("  deadlocks formed while it was down", "deadlocks_during_failover", "", None),
        ("  proven by the other", "detected_during_failover", "all", "detected_during_failover"),
        ("  broken once by the other", "broken_during_failover", "all", "failover_deadlocks_broken"),
        ("  agents back on both", "reattached", "all", "failovers_reattached"),
        ("  breaks by the one come back", "breaks_after_return", "", None),
        ("  deadlocks formed with both up", "deadlocks_with_both_up", "", None),
        ("  broken once", "broken_with_both_up", "all", "failover_deadlocks_broken"),
        ("  deadlocks broken more than once", "double_breaks", "0", "double_breaks_zero"),
        ("  repeat breaks (already broken, gone)", "repeat_breaks", "", None),
        ("  go -> victim p50 ms", "failover_break_p50_ms", "", None),
        ("  messages moved meanwhile", "failover_messages", "", None),
        ("  tokens conserved (1 = yes)", "failover_tokens_conserved", "1", "failover_tokens_conserved"),
        ("fuzzed inputs", "fuzzed", f">= {args.fuzz}", "fuzzed_as_asked"),
        ("crashes", "crashes", "0", "crashes_zero"),
    ]
    for name, key, target, verdict in rows:
        mark = "" if verdict is None else ("yes" if met[verdict] else "MISSED")
        print(f"{name:<40}{results[key]!s:>12}  {target:<14}{mark}")
    print("breaks of the failover deadlocks, by outcome:", results["failover_break_outcomes"])
    for failure in results["failover_failures"]:
        print(f"failover: {failure}", file=sys.stderr)
    print("fuzzed outcomes:")
    for outcome, count in sorted(tally.outcomes.items()):
        print(f"  {outcome:<40}{count:>10}")
    for crash in tally.crashes:
        print(crash, file=sys.stderr)
    json_line(results)


if __name__ == "__main__":
    main()
