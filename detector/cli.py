"""The ``stablewatch`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path

from google.protobuf.json_format import MessageToDict
from rich.console import Console

from stablewatch.detector.cos418 import (
    TOKENS,
    TraceError,
    compare_snaps,
    expected_snap_files,
    format_snap,
    parse_delays,
    parse_events,
    parse_snap,
    parse_topology,
    snap_from_snapshot,
)
from stablewatch.detector.predicates import Evaluator
from stablewatch.detector.render import snapshot_report
from stablewatch.detector.simulator import Simulation, random_delays, tape_delays

__all__ = ["main"]

EXIT_MISMATCH = 1
EXIT_BAD_INPUT = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stablewatch", description="Detect stable properties with snapshots.")
    commands = parser.add_subparsers(dest="command", required=True)

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

    demo = commands.add_parser("demo", help="simulate the bundled token-bank trace and show the results")
    demo.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stablewatch`` console script."""
    args = _parser().parse_args(argv)
    console = Console()
    try:
        if args.command == "simulate":
            delays = (
                tape_delays(parse_delays(args.delays), str(args.delays)) if args.delays else random_delays(args.seed)
            )
            return _simulate(args.topology, args.events, delays, args.out, args.expected, args.json, console)
        if args.command == "demo":
            traces = resources.files("stablewatch.detector") / "traces"
            with resources.as_file(traces) as folder:
                return _simulate(
                    folder / "bank.top",
                    folder / "bank.events",
                    random_delays(0),
                    None,
                    None,
                    args.json,
                    console,
                )
    except TraceError as error:
        print(f"stablewatch: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def _simulate(
    topology_path: Path,
    events_path: Path,
    delays: Iterator[int],
    out: Path | None,
    expected: Path | None,
    as_json: bool,
    console: Console,
) -> int:
    topology = parse_topology(topology_path)
    events = parse_events(events_path, topology)
    expected_snaps = [parse_snap(path) for path in expected_snap_files(expected)] if expected else None
    snapshots = Simulation(topology, delays, events_source=str(events_path)).run(events)

    evaluator = Evaluator(expected_totals={TOKENS: sum(topology.balances.values())})
    entries = [(snapshot, evaluator.evaluate(snapshot)) for snapshot in snapshots]
    snaps = [snap_from_snapshot(snapshot) for snapshot in snapshots]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        for snap in snaps:
            (out / f"{snap.snapshot_id}.snap").write_text(format_snap(snap))
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
            "matches_expected": None if expected_snaps is None else not differences,
            "differences": differences,
        }
        print(json.dumps(report))
    else:
        console.print(snapshot_report(entries, title=f"{len(snapshots)} snapshots of {events_path.name}"))
        if out is not None:
            console.print(f"wrote {len(snaps)} .snap files to {out}")
        if expected_snaps is not None:
            for difference in differences:
                console.print(f"[red]differs[/]: {difference}")
            if not differences:
                console.print(f"[green]all {len(expected_snaps)} expected snapshots match[/]")
    return EXIT_MISMATCH if differences else 0


if __name__ == "__main__":
    sys.exit(main())
