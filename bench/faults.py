"""Fault and bad-input figures: what stablewatch does when connections break, agents die, the
detector restarts, and peers send garbage.

Four phases, each against real code:

* ``resets`` — three token-bank agents (stablewatch.testing.token_node, each its own OS process) move tokens
  through TCP proxies that break every connection over and over, while a detector (in this
  process) takes snapshots. Every message carries a per-channel sequence number: at the end each
  receiver reports gaps (``lost``) and repeats (``duplicated``); the tokens must add up too.
* ``kills`` — an agent is killed (SIGKILL) while a snapshot runs: that snapshot must abort within
  its deadline, and once the agent is back the next snapshot must complete.
* ``detector_restarts`` — the detector is stopped and started again on the same port while the
  agents run: its history stays, snapshot ids only grow, and the next snapshot completes. The
  last restart is on an empty data directory: ids still only grow, and the agents follow.
* ``fuzzed`` — seeded random and mutated channel frames, snapshot parts and control messages,
  fed to the frame decoder and the protocol core, the assembler, and the coordinator's control
  stream handling. Each must be accepted or rejected with a reason; anything else is a crash.

It prints a table and, as its last line, one JSON object with ``resets``, ``lost``,
``duplicated``, ``kills``, ``kills_recovered``, ``detector_restarts``, ``fuzzed`` and
``crashes`` (targets: lost, duplicated and crashes 0; every kill recovered).

    python bench/faults.py [--resets 1000] [--kills 3] [--restarts 3] [--fuzz 100000] [--seed 1]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import random
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError
from report import json_line

from stablewatch.agents.core import RemoteProtocolError, SnapshotCore
from stablewatch.agents.frames import FrameError, decode
from stablewatch.detector.assembly import Assembler, PartRejected
from stablewatch.detector.service.coordinator import Coordinator, Member
from stablewatch.detector.service.detector import DetectorConfig
from stablewatch.detector.service.query import outcome_name
from stablewatch.testing.detector import Running
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
from stablewatch.v1.control_pb2 import Heartbeat, Pong, Register, SnapshotFailure

TOKENS = 1000


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


def poll(condition: Callable[[], object], what: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.01)


# -- phase 1: stream resets ------------------------------------------------------------------------


def reset_phase(target: int, seed: int, work: Path) -> dict[str, int]:
    """Break every channel connection until `target` connections were cut; count what got lost."""
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


# -- phase 4: fuzzing ------------------------------------------------------------------------------


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resets", type=int, default=1000, help="connections to break (1000)")
    parser.add_argument("--kills", type=int, default=3, help="agents to kill mid-snapshot (3)")
    parser.add_argument("--restarts", type=int, default=3, help="detector restarts (3)")
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
        log(f"fuzzing {args.fuzz} inputs ...")
        fuzzed, tally = fuzz_phase(args.fuzz, args.seed)
        results.update(fuzzed)
        results["seconds"] = round(time.monotonic() - started, 1)
    print(f"{'measure':<34}{'value':>12}  target")
    rows = [
        ("connections reset", results["resets"], ">= 1000"),
        ("messages moved meanwhile", results["messages"], ""),
        ("messages lost", results["lost"], "0"),
        ("messages duplicated", results["duplicated"], "0"),
        ("tokens conserved (1 = yes)", results["tokens_conserved"], "1"),
        ("agents killed mid-snapshot", results["kills"], ""),
        ("  snapshot aborted within deadline", results["aborted_within_deadline"], "all"),
        ("  next snapshot completed", results["kills_recovered"], "all"),
        ("detector restarts", results["detector_restarts"], ""),
        ("  history kept", results["history_kept"], "all"),
        ("  next snapshot completed", results["completed_after_restart"], "all"),
        ("  snapshot ids always grew (1 = yes)", results["ids_increasing"], "1"),
        ("fuzzed inputs", results["fuzzed"], ">= 100000"),
        ("crashes", results["crashes"], "0"),
    ]
    for name, value, target in rows:
        print(f"{name:<34}{value:>12}  {target}")
    print("fuzzed outcomes:")
    for outcome, count in sorted(tally.outcomes.items()):
        print(f"  {outcome:<40}{count:>10}")
    for crash in tally.crashes:
        print(crash, file=sys.stderr)
    json_line(results)


if __name__ == "__main__":
    main()
