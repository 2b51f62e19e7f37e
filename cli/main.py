"""The ``stablewatch`` command line: the top-level parser, and each command handed to its module.

* ``simulate``, ``demo``: play a COS 418 trace through the protocol core (no services needed), or
  run the live demo (:mod:`.simulate`, :mod:`.demo`).
* ``detector``: run the detector service until SIGINT or SIGTERM (:mod:`.detector`).
* ``status``, ``snapshot``, ``watch``, ``graph``, ``resolve``, ``resolutions``: ask a running
  detector, through its query API (:mod:`.query`, :mod:`.client`); ``resolve`` breaks the
  deadlocks a snapshot proves, ``resolutions`` lists the breaks. Human output uses rich; ``--json``
  prints one JSON object (``watch``: one per line), errors included. ``health``: the detector's
  health check (for probes). With ``--tls-ca`` (and ``--tls-cert``/``--tls-key`` for mutual TLS)
  they connect with TLS.
* ``archive export``, ``archive check``: backfill a Parquet archive from a detector's store (beside
  the live detector, if one runs), and check every file of an archive (:mod:`.archive`).
* ``pipeline``: the Spark jobs over the snapshot archive, handed to :mod:`stablewatch.pipeline.cli`
  (imported only then: PySpark is an optional extra).

Exit statuses (:mod:`.exits`): 0 success, 1 the detector is unreachable or refused (``resolve``:
nothing to break, or no victim reached; or a simulation differs from the expected snapshots), 2
bad flags or input (for ``archive``: a bad store, archive or file), 3 ``snapshot`` was aborted
(``simulate``: a snapshot failed).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from rich.console import Console

from stablewatch import __version__
from stablewatch.cli import (
    archive,
    arguments,
    demo,
    detector,
    graph,
    health,
    pipeline,
    resolutions,
    resolve,
    simulate,
    snapshot,
    status,
    watch,
)

__all__ = ["main"]

# In the order `stablewatch --help` lists them; each module adds its parser and runs its command.
_COMMANDS = {
    "simulate": simulate,
    "demo": demo,
    "detector": detector,
    "status": status,
    "health": health,
    "snapshot": snapshot,
    "watch": watch,
    "graph": graph,
    "resolve": resolve,
    "resolutions": resolutions,
    "archive": archive,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stablewatch`` console script.

    A command whose output is closed early (``stablewatch snapshot --json | head``) ends quietly.
    """
    try:
        return _main(sys.argv[1:] if argv is None else list(argv))
    except BrokenPipeError:
        # Python would complain again when it flushes stdout at exit: point stdout at nothing.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0


def _main(argv: list[str]) -> int:
    if argv[:1] == [pipeline.NAME]:  # the pipeline parses its own arguments
        return pipeline.delegate(argv[1:])
    parser = argparse.ArgumentParser(prog="stablewatch", description="Detect stable properties with snapshots.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in _COMMANDS.values():
        command.add_parser(commands)
    pipeline.add_parser(commands)
    args = parser.parse_args(argv)
    arguments.check_tls(parser, args)
    return _COMMANDS[args.command].run(args, Console())


if __name__ == "__main__":
    sys.exit(main())
