"""``stablewatch graph``: a snapshot's wait-for graph as DOT, or drawn by Graphviz as PNG or SVG."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.text import Text

from stablewatch.cli import arguments
from stablewatch.cli.client import DetectorClient
from stablewatch.cli.query import CommandError, connection_options, run_query, timeout_option
from stablewatch.cli.render import proto_dict
from stablewatch.detector.evaluation import wait_for_dot

__all__ = ["add_parser", "run"]


def add_parser(commands: argparse._SubParsersAction) -> None:
    graph = commands.add_parser(
        "graph", parents=[connection_options(), timeout_option()], help="a snapshot's wait-for graph (DOT, PNG, SVG)"
    )
    graph.add_argument("--snapshot", type=arguments.positive_int, metavar="ID",
                       help="snapshot id (default: the latest)")  # fmt: skip
    graph.add_argument("--format", choices=("dot", "png", "svg"), default="dot",
                       help="DOT text, or an image drawn by Graphviz (%(default)s)")  # fmt: skip
    graph.add_argument("--out", type=Path, metavar="FILE", help="write to FILE instead of stdout")


def run(args: argparse.Namespace, console: Console) -> int:
    return run_query(_graph, args, console)


def _graph(client: DetectorClient, args: argparse.Namespace, console: Console) -> int:
    if args.format != "dot" and shutil.which("dot") is None:
        raise CommandError(
            f"--format {args.format} needs Graphviz's `dot` command: install graphviz "
            "(e.g. `apt install graphviz`, `brew install graphviz`) or use --format dot"
        )
    if args.format != "dot" and args.out is None and (args.json or sys.stdout.isatty()):
        raise CommandError(f"--format {args.format} needs --out FILE here (or redirect stdout to a file)")
    snapshot_id = args.snapshot or client.latest_results().snapshot.snapshot_id
    graph = client.wait_for_graph(snapshot_id)
    dot = wait_for_dot(graph)
    data = dot.encode() if args.format == "dot" else _graphviz(dot, args.format)
    if args.out is not None:
        try:
            args.out.write_bytes(data)
        except OSError as error:
            raise CommandError(f"cannot write {args.out}: {error.strerror or error}") from None
    if args.json:
        written = None if args.out is None else str(args.out)
        report = {"snapshot_id": snapshot_id, "out": written, "dot": dot, "graph": proto_dict(graph)}
        print(json.dumps(report), flush=True)
    elif args.out is None:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        console.print(Text(f"wrote the wait-for graph of snapshot {snapshot_id} to {args.out}"), highlight=False)
    return 0


def _graphviz(dot: str, image_format: str) -> bytes:
    try:
        drawn = subprocess.run(["dot", f"-T{image_format}"], input=dot.encode(), capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise CommandError(f"Graphviz's `dot` failed: {error}") from None
    if drawn.returncode != 0:
        raise CommandError(f"Graphviz's `dot` failed: {drawn.stderr.decode(errors='replace').strip()}")
    return drawn.stdout
