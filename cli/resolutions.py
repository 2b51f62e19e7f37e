"""``stablewatch resolutions``: the breaks of deadlocks the detector has sent, newest first, and
what became of each."""

from __future__ import annotations

import argparse
import json

from rich.console import Console

from stablewatch.cli import arguments
from stablewatch.cli.client import DetectorClient
from stablewatch.cli.query import connection_options, run_query, timeout_option
from stablewatch.cli.render import resolution_dict, resolutions_table
from stablewatch.detector.evaluation.text import plural

__all__ = ["DEFAULT_LIMIT", "add_parser", "run"]

DEFAULT_LIMIT = 20


def add_parser(commands: argparse._SubParsersAction) -> None:
    resolutions = commands.add_parser(
        "resolutions",
        parents=[connection_options(), timeout_option()],
        help="the breaks of deadlocks, newest first, and their outcomes",
        description="List the breaks of deadlocks the detector sent (--resolve, or `stablewatch resolve`), "
        "newest first: the victim wait, the deadlock, who asked, and the outcome the victim's agent "
        "reported (broken, gone: the wait had ended, already_broken, policies_disagree: the agent refused "
        "an automatic break because its detectors' --resolve policies differ, failed: breaking it raised at the "
        "agent, which logged why), or unanswered, not_attached, "
        "and pending while the report may still come.",
    )
    resolutions.add_argument("--limit", type=arguments.positive_int, default=DEFAULT_LIMIT, metavar="N",
                             help="show the newest N (%(default)s)")  # fmt: skip


def run(args: argparse.Namespace, console: Console) -> int:
    return run_query(_resolutions, args, console)


def _resolutions(client: DetectorClient, args: argparse.Namespace, console: Console) -> int:
    resolutions = client.resolutions(args.limit)
    if args.json:
        report = {"detector": client.address, "resolutions": [resolution_dict(r) for r in resolutions]}
        print(json.dumps(report), flush=True)
    elif not resolutions:
        console.print("[dim]no deadlock has been broken[/]")
    else:
        title = f"{plural(len(resolutions), 'break')} of deadlocks, newest first"
        console.print(resolutions_table(resolutions, title=title))
    return 0
