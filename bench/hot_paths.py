"""Benchmark: the per-message and per-snapshot hot paths of an agent and the detector, in one process.

Each case is timed against the way it was done before (or against the floor it cannot beat), in
interleaved rounds of about ``--seconds`` each, and reported as the median cost per message and
the spread (lowest and highest round):

* ``send``: ``await agent.send(dest, payload)`` for a plain 64-byte message into a wide window,
  against an awaited empty coroutine (the floor of any awaited API) and ``list.append`` (what the
  raw case of ``channel_throughput.py`` does per message);
* ``decode``: the messages of a 512-entry frame, built in C (``frames.decode``) against a list
  comprehension of ``AppMessage(payload)``;
* ``part``: 2 000 messages in flight recorded by the core and turned into a part's
  ``InboundChannelState`` as they arrive, by column (``part_build``), against the former way, one
  ``RecordedMessage`` built in place per message (``part_build_before``), and that part
  serialized (``part_serialize``): what the receiving agent pays per message in flight;
* ``assembly``: the detector turning those 2 000 messages into the global snapshot's
  ``RecordedMessage`` objects (``assembly``), against copying the 2 000 objects an agent sent the
  former way (``assembly_before``): what the detector pays per message in flight.

The last line is one JSON object: per case, ``*_ns`` (median per message) and ``*_spread``.

    python bench/hot_paths.py [--seconds 1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable

from report import interleaved, json_line, medians_and_spreads, spread_row
from rich.console import Console
from rich.table import Table

from stablewatch.agents import Agent, AppMessage, ChannelSettings
from stablewatch.agents.core import RecordState, ReportPart, SnapshotCore
from stablewatch.agents.frames import decode, encode
from stablewatch.detector.assembly import _add_recorded
from stablewatch.v1 import GlobalSnapshot, LocalSnapshotPart, LocalState

PAYLOAD = b"x" * 64
FRAME = encode(0, [PAYLOAD] * 512)
RECORDED = [AppMessage(PAYLOAD) for _ in range(2000)]


def per_item(run: Callable[[], int], seconds: float) -> float:
    """Seconds per item: ``run()`` (which returns how many items it did) repeated for ``seconds``."""
    items, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        items += run()
    return elapsed / items


def build_part() -> LocalSnapshotPart:
    """The receiver's own path: record, then take RECORDED in flight on ``a -> b`` (reported as they come)."""
    core = SnapshotCore("b")
    (record,) = core.start_snapshot(1, now=0.0)
    assert isinstance(record, RecordState)
    core.record_state(1, LocalState())
    (report,) = core.receive_messages("a", RECORDED)
    assert isinstance(report, ReportPart)
    return report.part


PART = build_part()
CHANNEL = PART.inbound[0]


def build_part_before() -> LocalSnapshotPart:
    """The former way: one RecordedMessage built in place in the part per message in flight."""
    part = LocalSnapshotPart(snapshot_id=1, process_id="b")
    add = part.inbound.add(src="a").messages.add
    for index, (payload, counters, no_wake) in enumerate(RECORDED, start=1):
        if counters or no_wake:
            add(payload=payload, counters=counters, no_wake=no_wake, receive_index=index)
        else:
            add(payload=payload, receive_index=index)
    return part


PART_BEFORE = build_part_before()


def sync_cases() -> dict[str, Callable[[], int]]:
    def decode_in_c() -> int:
        return len(decode(FRAME))

    def decode_listcomp() -> int:
        return len([AppMessage(payload) for payload in FRAME.payloads])

    def part_build() -> int:
        return len(build_part().inbound[0].payloads)

    def part_build_before() -> int:
        return len(build_part_before().inbound[0].messages)

    def part_serialize() -> int:
        PART.SerializeToString()
        return len(CHANNEL.payloads)

    def assembly_columns() -> int:
        _add_recorded(GlobalSnapshot().channels.add(src="a", dst="b").messages, CHANNEL)
        return len(CHANNEL.payloads)

    def assembly_messages() -> int:
        GlobalSnapshot().channels.add(src="a", dst="b", messages=PART_BEFORE.inbound[0].messages)
        return len(RECORDED)

    return {
        "decode": decode_in_c,
        "decode_before": decode_listcomp,
        "part_build": part_build,
        "part_build_before": part_build_before,
        "part_serialize": part_serialize,
        "assembly": assembly_columns,
        "assembly_before": assembly_messages,
    }


async def send_cases(seconds: float, rounds: int) -> dict[str, list[float]]:
    """The awaited cases, in interleaved rounds, on an agent whose window never fills."""
    batch = 100_000
    settings = ChannelSettings(window_entries=1 << 30, window_bytes=1 << 40, backoff_initial=3600, backoff_max=3600)
    agent = Agent("a", peers={"b": "127.0.0.1:9"}, channel_settings=settings)
    await agent.start()
    try:
        await agent.send("b", PAYLOAD)  # opens the channel
        channel = agent._outbound["b"]

        async def send() -> None:
            for _ in range(batch):
                await agent.send("b", PAYLOAD)

        async def nothing(dest: str, payload: bytes) -> None:
            return None

        async def await_floor() -> None:
            for _ in range(batch):
                await nothing("b", PAYLOAD)

        async def append_floor() -> None:
            pending: list[bytes] = []
            for _ in range(batch):
                pending.append(PAYLOAD)

        cases = {"send": send, "await_floor": await_floor, "append_floor": append_floor}
        results: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(rounds):
            for name, case in cases.items():
                items, start = 0, time.perf_counter()
                while (elapsed := time.perf_counter() - start) < seconds:
                    await case()
                    items += batch
                    channel._entries.clear()  # keep memory flat: nothing is ever sent
                    channel._sizes.clear()
                    channel._window_bytes = 0
                results[name].append(elapsed / items)
        return results
    finally:
        await agent.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="seconds per case per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    results = asyncio.run(send_cases(args.seconds, args.rounds))
    results |= interleaved(sync_cases(), args.rounds, lambda _, case: per_item(case, args.seconds))
    nanoseconds = {name: [value * 1e9 for value in values] for name, values in results.items()}

    table = Table(title=f"hot paths, ns per message: {args.rounds} interleaved rounds of {args.seconds:g} s per case")
    for column in ("case", "median", "lowest", "highest"):
        table.add_column(column, justify="right" if column != "case" else "left")
    for name, values in nanoseconds.items():
        table.add_row(name, *spread_row(values, ",.0f"))
    Console().print(table)
    json_line({"seconds": args.seconds, "rounds": args.rounds, **medians_and_spreads(nanoseconds, "ns", 1)})


if __name__ == "__main__":
    main()
