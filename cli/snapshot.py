"""``stablewatch snapshot``: take a snapshot now and show its results."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

from stablewatch.cli import arguments
from stablewatch.cli.client import DetectorClient
from stablewatch.cli.exits import EXIT_ABORTED
from stablewatch.cli.query import connection_options, run_query
from stablewatch.cli.render import proto_dict, results_report
from stablewatch.detector.service.query import outcome_name
from stablewatch.v1.query_pb2 import SNAPSHOT_OUTCOME_COMPLETED

__all__ = ["add_parser", "run"]


def add_parser(commands: argparse._SubParsersAction) -> None:
    snapshot = commands.add_parser(
        "snapshot",
        parents=[connection_options()],
        help="take a snapshot now and show its results",
        description="Take a snapshot now. Exit status 0 if it completed, 3 if it was aborted, 1 on errors.",
    )
    snapshot.add_argument("--timeout", type=arguments.positive, metavar="S",
                          help="abort the snapshot after S seconds (default: the detector's --deadline)")  # fmt: skip


def run(args: argparse.Namespace, console: Console) -> int:
    return run_query(_snapshot, args, console)


def _snapshot(client: DetectorClient, args: argparse.Namespace, console: Console) -> int:
    if args.json:
        results = client.trigger_snapshot(args.timeout)
    else:
        with console.status(f"taking a snapshot of the agents attached to {client.address}…"):
            results = client.trigger_snapshot(args.timeout)
    summary = results.snapshot
    if args.json:
        report = {
            "detector": client.address,
            "snapshot_id": summary.snapshot_id,
            "outcome": outcome_name(summary.outcome),
            "abort_reason": summary.abort_reason,
            "results": proto_dict(results),
        }
        print(json.dumps(report), flush=True)
        if summary.outcome != SNAPSHOT_OUTCOME_COMPLETED:  # for whoever reads the script's stderr
            print(f"stablewatch: snapshot {summary.snapshot_id} aborted: {summary.abort_reason}", file=sys.stderr)
    else:
        console.print(results_report(results))  # the summary line gives an abort's reason
    return 0 if summary.outcome == SNAPSHOT_OUTCOME_COMPLETED else EXIT_ABORTED
