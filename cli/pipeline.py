"""``stablewatch pipeline evaluate|history|follow``: handed whole to :mod:`stablewatch.pipeline.cli`.

The pipeline keeps its own parser, because ``pipeline/jobs.py`` runs the same one under
``spark-submit``; it is imported only for this command, since PySpark is an optional extra.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["NAME", "add_parser", "delegate"]

NAME = "pipeline"


def add_parser(commands: argparse._SubParsersAction) -> None:
    # Listed for --help only: main() hands `pipeline ...` to the pipeline's own parser.
    commands.add_parser(NAME, help="analyse the snapshot archive with Spark: evaluate, history, follow")


def delegate(argv: Sequence[str]) -> int:
    """Run ``stablewatch pipeline`` with the arguments after ``pipeline``; returns the exit status."""
    from stablewatch.pipeline.cli import main

    return main(argv)
