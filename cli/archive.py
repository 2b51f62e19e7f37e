"""``stablewatch archive export|check``: backfill a Parquet archive from a detector's store (beside the
live detector, if one runs), and check every file of an archive (:mod:`stablewatch.detector.archive`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.text import Text

from stablewatch.cli import arguments
from stablewatch.cli.exits import EXIT_BAD_INPUT
from stablewatch.detector.evaluation.text import plural
from stablewatch.detector.service.store import DB_FILENAME, Store, StoreError

__all__ = ["add_parser", "run"]


def add_parser(commands: argparse._SubParsersAction) -> None:
    archive = commands.add_parser("archive", help="the Parquet archive of finished snapshots: export, check")
    archive_commands = archive.add_subparsers(dest="archive_command", required=True)
    backfill = archive_commands.add_parser(
        "export",
        help="write a store's finished snapshots that an archive lacks",
        description="Write every finished snapshot of the store in --data-dir that the archive does not "
        "hold yet. Safe beside a running detector on that store; a second run writes nothing new.",
    )
    backfill.add_argument("--data-dir", type=Path, required=True, metavar="DIR", help="the detector's store folder")
    backfill.add_argument("--archive", type=Path, required=True, metavar="DIR", help="the archive folder")
    backfill.add_argument("--batch", type=arguments.positive_int, default=1000, metavar="N",
                          help="snapshots per batch (%(default)s)")  # fmt: skip
    backfill.add_argument("--json", action="store_true", help="print one JSON object")
    checking = archive_commands.add_parser(
        "check", help="read every file of an archive and count its rows",
        description="Read and check every file of the archive. Exit status 2 names the first bad file and why.",
    )  # fmt: skip
    checking.add_argument("--archive", type=Path, required=True, metavar="DIR", help="the archive folder")
    checking.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace, console: Console) -> int:
    """``archive export`` or ``archive check``; a bad store, archive or file exits 2 with what and why."""
    from stablewatch.detector.archive.schema import ArchiveError  # pyarrow: not for the other commands

    try:
        if args.archive_command == "export":
            return _export(args, console)
        return _check(args, console)
    except (ArchiveError, StoreError) as error:
        print(f"stablewatch: {error}", file=sys.stderr)
        if args.json:
            print(json.dumps({"error": str(error)}), flush=True)
        return EXIT_BAD_INPUT


def _export(args: argparse.Namespace, console: Console) -> int:
    from stablewatch.detector.archive.export import export

    if not (args.data_dir / DB_FILENAME).is_file():
        raise StoreError(f"{args.data_dir} holds no stablewatch store ({DB_FILENAME} is missing)")
    # Without the lock: a detector may be running on this store. No retention: nothing is deleted.
    with Store(args.data_dir, max_snapshots=None, max_age_seconds=None, lock=False) as store:
        result = export(store, args.archive, args.batch)
    if args.json:
        print(json.dumps({"archive": str(args.archive), **dataclasses.asdict(result)}), flush=True)
    elif result.exported or result.resolutions or result.set_aside:
        breaks = f"; {plural(result.resolutions, 'break')} of deadlocks" if result.resolutions else ""
        aside = (
            f"; {plural(result.set_aside, 'snapshot')} the archive cannot hold set aside, not exported (each logged)"
            if result.set_aside
            else ""
        )
        console.print(
            Text(
                f"exported {plural(result.exported, 'snapshot')}{breaks} to {args.archive} in "
                f"{plural(result.batches, 'batch', 'batches')} ({plural(result.files, 'file')}); "
                f"{result.already} were there already{aside}"
            ),
            highlight=False,
            soft_wrap=True,
        )
    else:
        console.print(
            Text(
                f"nothing new to export: {args.archive} holds all {plural(result.already, 'finished snapshot')} "
                f"of {args.data_dir}"
            ),
            highlight=False,
            soft_wrap=True,
        )
    return 0


def _check(args: argparse.Namespace, console: Console) -> int:
    from stablewatch.detector.archive.reader import check

    found = check(args.archive)
    if args.json:
        print(json.dumps({"archive": str(args.archive), **dataclasses.asdict(found)}), flush=True)
        return 0
    snapshots = ", ".join(f"{count} {outcome}" for outcome, count in found.outcomes.items()) or "none"
    console.print(
        Text(f"{args.archive}: schema version {found.schema_version}, snapshots: {snapshots}"),
        highlight=False,
        soft_wrap=True,
    )
    for table, files in found.files.items():
        console.print(f"  {table:<11} {found.rows[table]:>10} rows in {files} files", highlight=False, soft_wrap=True)
    if found.resolutions:
        breaks = ", ".join(f"{count} {outcome}" for outcome, count in found.resolutions.items())
        console.print(Text(f"breaks of deadlocks: {breaks}"), highlight=False, soft_wrap=True)
    return 0
