"""``stablewatch simulate``: play a COS 418 trace through the protocol core (no services needed),
write its snapshots as .snap files, and compare them with the expected ones."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from google.protobuf.json_format import MessageToDict
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from stablewatch.agents.core import DEFAULT_MAX_RECORDINGS
from stablewatch.cli import arguments
from stablewatch.cli.exits import EXIT_ABORTED, EXIT_BAD_INPUT, EXIT_MISMATCH
from stablewatch.cli.render import snapshot_report
from stablewatch.detector.evaluation import evaluate, new_baselines
from stablewatch.detector.evaluation.text import plural
from stablewatch.detector.sim.cos418 import (
    TOKENS,
    TraceError,
    compare_snaps,
    format_snap,
    parse_delays,
    parse_events,
    parse_expected,
    parse_topology,
    snap_from_snapshot,
)
from stablewatch.detector.sim.simulator import Simulation, random_delays, tape_delays

__all__ = ["add_parser", "run"]


def add_parser(commands: argparse._SubParsersAction) -> None:
    simulate = commands.add_parser(
        "simulate", help="run a COS 418 trace through the protocol core and write .snap files"
    )
    simulate.add_argument("--topology", type=Path, required=True, help=".top file")
    simulate.add_argument("--events", type=Path, required=True, help=".events file")
    delays = simulate.add_mutually_exclusive_group()
    delays.add_argument("--delays", type=Path, help="delay tape, one integer a line (reproduces COS 418 runs)")
    delays.add_argument("--seed", type=int, default=0, help="seed for random delays 0-4 (default 0)")
    simulate.add_argument("--out", type=Path, required=True, help="folder for <snapshot id>.snap files")
    simulate.add_argument("--expected", type=Path, help="folder or path prefix of expected .snap files")
    simulate.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    simulate.add_argument("--max-recordings", type=arguments.positive_int, metavar="N",
        help=f"refuse a snapshot at a process already recording N, as agents do ({DEFAULT_MAX_RECORDINGS}; "
        "default: no bound)")  # fmt: skip
    simulate.add_argument("--max-recorded-bytes", type=arguments.positive_int, metavar="N",
        help="fail a snapshot whose recording at a process passes N bytes (16 a token message), as agents do "
        "(default: no bound)")  # fmt: skip


def run(args: argparse.Namespace, console: Console) -> int:
    """Replay a trace, write and print its snapshots; a failed snapshot is printed with its reason and
    exits 3, a difference from the expected snapshots exits 1, a bad trace file exits 2."""
    try:
        return _simulate(args, console)
    except TraceError as error:
        print(f"stablewatch: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _simulate(args: argparse.Namespace, console: Console) -> int:
    topology_path, events_path, out, expected, as_json = args.topology, args.events, args.out, args.expected, args.json
    delays = tape_delays(parse_delays(args.delays), str(args.delays)) if args.delays else random_delays(args.seed)
    topology = parse_topology(topology_path)
    events = parse_events(events_path, topology)
    expected_snaps = parse_expected(expected) if expected else None
    simulation = Simulation(
        topology,
        delays,
        events_source=str(events_path),
        max_recordings=args.max_recordings,
        max_recorded_bytes=args.max_recorded_bytes,
    )
    snapshots = simulation.run(events)

    totals = {TOKENS: sum(topology.balances.values())}
    entries = []
    for snapshot in snapshots:
        evaluation = evaluate(snapshot, totals)
        totals.update(new_baselines(evaluation))
        entries.append((snapshot, list(evaluation.results)))
    snaps = [snap_from_snapshot(snapshot) for snapshot in snapshots]
    if out is not None:
        try:
            out.mkdir(parents=True, exist_ok=True)
            for snap in snaps:
                (out / f"{snap.snapshot_id}.snap").write_text(format_snap(snap))
        except FileExistsError:
            raise TraceError(out, 0, "--out must be a folder, and this is an existing file") from None
        except OSError as error:
            raise TraceError(out, 0, f"cannot write the .snap files: {error.strerror or error}") from None
    differences = compare_snaps(snaps, expected_snaps) if expected_snaps is not None else []

    if as_json:
        report = {
            "snapshots": [
                {
                    "snapshot_id": snapshot.snapshot_id,
                    "snap": format_snap(snap),
                    "results": [MessageToDict(result) for result in results],
                }
                for (snapshot, results), snap in zip(entries, snaps, strict=True)
            ],
            "started": simulation.started,
            "failed": [{"snapshot_id": aborted.snapshot_id, "reason": aborted.reason} for aborted in simulation.failed],
            "matches_expected": None if expected_snaps is None else not differences,
            "differences": differences,
        }
        print(json.dumps(report))
    else:
        title = Text(f"{plural(len(snapshots), 'snapshot')} of {events_path.name}")
        console.print(snapshot_report(entries, title=title))
        if out is not None:
            console.print(f"wrote {plural(len(snaps), '.snap file')} to {escape(str(out))}")
        for aborted in simulation.failed:
            console.print(f"[red]failed[/]: snapshot {aborted.snapshot_id}: {escape(aborted.reason)}", soft_wrap=True)
        if simulation.failed:
            console.print(f"[red]{len(simulation.failed)} of {plural(simulation.started, 'snapshot')} failed[/]")
        if expected_snaps is not None:
            for difference in differences:
                console.print(f"[red]differs[/]: {escape(difference)}")
            if not differences:
                matched = plural(len(expected_snaps), "expected snapshot")
                console.print(f"[green]{'the' if len(expected_snaps) == 1 else 'all'} {matched} match[/]")
    if simulation.failed:
        return EXIT_ABORTED
    return EXIT_MISMATCH if differences else 0
