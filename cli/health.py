"""``stablewatch health``: the detector's grpc.health.v1 check, for probes."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.text import Text

from stablewatch.cli.client import DetectorClient
from stablewatch.cli.exits import EXIT_ERROR
from stablewatch.cli.query import connection_options, run_query, timeout_option

__all__ = ["add_parser", "run"]


def add_parser(commands: argparse._SubParsersAction) -> None:
    commands.add_parser(
        "health",
        parents=[connection_options(), timeout_option()],
        help="the detector's health check: exit 0 when it is serving (for probes)",
        description="Ask the detector's grpc.health.v1 check. Exit status 0 when it is SERVING, 1 otherwise.",
    )


def run(args: argparse.Namespace, console: Console) -> int:
    return run_query(_health, args, console)


def _health(client: DetectorClient, args: argparse.Namespace, console: Console) -> int:
    status = client.health()
    if args.json:
        print(json.dumps({"detector": client.address, "status": status}), flush=True)
    else:
        console.print(Text(f"{client.address}: {status}"), highlight=False)
    return 0 if status == "SERVING" else EXIT_ERROR
