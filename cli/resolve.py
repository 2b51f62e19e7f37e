"""``stablewatch resolve``: break the deadlocks a snapshot proves, by hand (DESIGN.md, "Breaking a
proven deadlock").

The detector picks one wait per deadlock, as ``--resolve`` would (its policy, else youngest), and
sends the break to the victim's agent; the agent's report comes later (``stablewatch resolutions``,
``stablewatch watch``): an agent whose detectors break unasked by another policy than the one that
chose the victim refuses it (``policies_disagree``), since one of them may have broken another wait
of that deadlock already. Under mutual TLS it needs the operator role.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

from stablewatch.cli import arguments
from stablewatch.cli.client import DetectorClient
from stablewatch.cli.exits import EXIT_ERROR
from stablewatch.cli.query import connection_options, run_query, timeout_option
from stablewatch.cli.render import resolution_dict, resolve_report
from stablewatch.detector.service.resolutions import outcome_word

__all__ = ["add_parser", "run"]


def add_parser(commands: argparse._SubParsersAction) -> None:
    resolve = commands.add_parser(
        "resolve",
        parents=[connection_options(), timeout_option()],
        help="break the deadlocks a snapshot proves: one wait each (operator role)",
        description="Break each deadlock that completed snapshot SNAPSHOT_ID proves: the detector picks "
        "one wait of it (by its --resolve policy, else the youngest) and its agent ends that wait, whose "
        "caller gets ABORTED or DeadlockVictim. Nothing is broken for a snapshot whose deadlock is false "
        "or unknown, or whose deadlocks are being broken already. Where another detector breaks deadlocks "
        "unasked by another --resolve policy, the agent refuses the break (policies_disagree in `stablewatch "
        "resolutions`, naming that detector): it may have broken another wait of the deadlock already. "
        "Under mutual TLS it needs "
        "stablewatch://role/operator. Exit status 0 when a break was sent, 1 when the detector refused "
        "(nothing to break, an unknown snapshot, no permission) or reached no victim.",
    )
    resolve.add_argument(
        "snapshot_id",
        type=arguments.positive_int,
        metavar="SNAPSHOT_ID",
        help="a completed snapshot whose deadlock is true (`stablewatch status` shows the latest)",
    )


def run(args: argparse.Namespace, console: Console) -> int:
    return run_query(_resolve, args, console)


def _resolve(client: DetectorClient, args: argparse.Namespace, console: Console) -> int:
    resolutions = client.resolve(args.snapshot_id)
    if args.json:
        report = {
            "detector": client.address,
            "snapshot_id": args.snapshot_id,
            "resolutions": [resolution_dict(resolution) for resolution in resolutions],
        }
        print(json.dumps(report), flush=True)
    else:
        console.print(resolve_report(args.snapshot_id, resolutions))
    # A break whose victim's process was not attached never went out: a failure when none did.
    unsent = [resolution for resolution in resolutions if outcome_word(resolution) == "not_attached"]
    if len(unsent) == len(resolutions):
        victims = ", ".join(sorted({resolution.process_id for resolution in unsent}))
        print(f"stablewatch: no break was sent: the victims' processes are not attached ({victims})", file=sys.stderr)
        return EXIT_ERROR
    return 0
