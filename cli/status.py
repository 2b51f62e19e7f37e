"""``stablewatch status``: the attached agents, the latest predicate values and the latest break of a deadlock."""

from __future__ import annotations

import argparse
import json

import grpc
from rich.console import Console
from rich.markup import escape
from rich.text import Text

from stablewatch.cli.client import DetectorClient, DetectorError
from stablewatch.cli.query import connection_options, run_query, timeout_option
from stablewatch.cli.render import members_table, proto_dict, resolution_dict, resolution_line, results_report
from stablewatch.v1.query_pb2 import Resolution, SnapshotResults

__all__ = ["add_parser", "run"]


def add_parser(commands: argparse._SubParsersAction) -> None:
    commands.add_parser(
        "status",
        parents=[connection_options(), timeout_option()],
        help="attached agents, the latest predicate values and the latest break of a deadlock",
    )


def run(args: argparse.Namespace, console: Console) -> int:
    return run_query(_status, args, console)


def _status(client: DetectorClient, args: argparse.Namespace, console: Console) -> int:
    membership = client.membership()
    members = list(membership.members)
    latest = _latest_or_none(client)
    latest_break = _latest_break(client)
    if args.json:
        report = {
            "detector": client.address,
            "members": [proto_dict(member) for member in members],
            "expected_missing": list(membership.expected_missing),
            "expected_count": membership.expected_count,
            "latest": None if latest is None else proto_dict(latest),
            "latest_resolution": None if latest_break is None else resolution_dict(latest_break),
        }
        print(json.dumps(report), flush=True)
    else:
        console.print(members_table(members) if members else "[dim]no agent is attached[/]")
        if membership.expected_missing:
            missing = ", ".join(membership.expected_missing)
            console.print(
                f"[yellow]expected but not attached: {escape(missing)}[/] (whole-system predicates are unknown)"
            )
        if membership.expected_count and len(members) < membership.expected_count:
            console.print(f"[yellow]{len(members)} of {membership.expected_count} expected processes are attached[/]")
        console.print(results_report(latest) if latest else "[dim]no snapshot has completed yet[/]")
        if latest_break is not None:
            console.print(Text("latest ") + resolution_line(latest_break))
    return 0


def _latest_break(client: DetectorClient) -> Resolution | None:
    """The newest break of a deadlock, if any (None too from a detector older than breaking)."""
    try:
        page = client.list_resolutions(page_size=1)
    except DetectorError as error:
        if error.code == grpc.StatusCode.UNIMPLEMENTED:
            return None
        raise
    return page.resolutions[0] if page.resolutions else None


def _latest_or_none(client: DetectorClient) -> SnapshotResults | None:
    try:
        return client.latest_results()
    except DetectorError as error:
        if error.code == grpc.StatusCode.NOT_FOUND:
            return None
        raise
