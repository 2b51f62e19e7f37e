"""``stablewatch watch``: follow predicate values live, as a table or one JSON object per event.

Breaks of deadlocks come on the same stream (when sent, and when their agent answers), with or
without ``--changes-only``: listed under the table, and as events of their own in JSON.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.live import Live

from stablewatch.cli import arguments
from stablewatch.cli.client import DetectorClient
from stablewatch.cli.query import CommandError, connection_options, run_query, timeout_option
from stablewatch.cli.render import WatchView, proto_dict, resolution_dict
from stablewatch.detector.service.query import outcome_name
from stablewatch.v1.query_pb2 import WatchEvent

__all__ = ["add_parser", "run"]


def add_parser(commands: argparse._SubParsersAction) -> None:
    watch = commands.add_parser(
        "watch",
        parents=[connection_options(), timeout_option()],
        help="follow predicate values live, and the breaks of deadlocks",
    )
    watch.add_argument("--changes-only", action="store_true",
                       help="only snapshots that change a predicate's value (and breaks of deadlocks)")  # fmt: skip
    watch.add_argument("--count", type=arguments.positive_int, metavar="N", help="stop after N events")


def run(args: argparse.Namespace, console: Console) -> int:
    return run_query(_watch, args, console)  # Ctrl-C ends it with exit status 0


def _watch(client: DetectorClient, args: argparse.Namespace, console: Console) -> int:
    client.members()  # fails within --timeout when the detector is not there; the stream has no deadline
    view = WatchView()
    events = client.watch(args.changes_only)
    # A live table redraws itself on a terminal; piped or written to a file (a log, `timeout`,
    # systemd), it would show only the last table, at exit, so the table is printed after each event.
    live = None if args.json or not console.is_terminal else Live(view.render(), console=console, auto_refresh=False)
    try:
        if live is not None:
            live.start(refresh=True)
        for seen, event in enumerate(events, 1):
            if args.json:
                print(json.dumps(_watch_json(event)), flush=True)
            else:
                view.update(event)
                if live is not None:
                    live.update(view.render(), refresh=True)
                else:
                    console.print(view.render())
                    console.file.flush()
            if seen == args.count:
                return 0
    finally:
        events.close()
        if live is not None:
            live.stop()
    raise CommandError(f"the detector at {client.address} ended the stream (it is shutting down)")


def _watch_json(event: WatchEvent) -> dict[str, Any]:
    """One event as JSON: ``outcome`` is the snapshot's (completed, aborted) when the event has
    results; a break of a deadlock (``resolution``) has its outcome as a word (resolution_dict)."""
    outcome = outcome_name(event.results.snapshot.outcome) if event.HasField("results") else None
    report = {"outcome": outcome, **proto_dict(event)}
    if event.HasField("resolution"):
        report["resolution"] = resolution_dict(event.resolution)
    return report
