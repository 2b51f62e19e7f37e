"""``stablewatch pipeline evaluate|history|follow``: the Spark jobs from the command line.

The same ``main`` runs under ``spark-submit`` through :mod:`.jobs`. Spark starts only once the
flags are parsed, and this module imports PySpark only then, so that a missing PySpark is
reported with how to install it.

``history`` reads one archive, or several systems' archives side by side (``--archive
NAME=DIR``, repeated): then each system's tables go to ``OUT/NAME`` and the chart has one lane per
system telling what happened to it (:func:`~stablewatch.pipeline.history.run_histories`).

Exit statuses: 0 done, 1 the job failed inside Spark, 2 bad flags or bad input (the message names
the file and the reason), 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console

from stablewatch.pipeline.defaults import (
    DEFAULT_FINISH_EDGES,
    DEFAULT_MAX_ROUNDS,
    DEFAULT_MIN_RELEASE,
    Reduction,
    ReductionError,
)

__all__ = ["main"]

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
_V = TypeVar("_V")
INSTALL_HINT = (
    "pip install 'stablewatch[spark]' (and a Java 17 or later runtime: e.g. apt-get install openjdk-17-jre-headless)"
)


def _expected_total(text: str) -> tuple[str, int]:
    """``COUNTER=TOTAL``: the expected total of a conserved counter, as the detector takes it."""
    from stablewatch.detector.evaluation.predicates import expected_total

    try:
        return expected_total(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _named_archive(text: str) -> tuple[str | None, Path]:
    """``NAME=DIR`` (a system's archive) or ``DIR``: the name is a word before the first ``=``."""
    name, sep, folder = text.partition("=")
    if sep and _NAME.fullmatch(name) and folder:
        return name, Path(folder)
    return None, Path(text)


def _named_word(text: str) -> tuple[str, str]:
    """``NAME=ATTRIBUTE``: a system's name and one of its attributes."""
    name, sep, word = text.partition("=")
    if sep and _NAME.fullmatch(name) and word.strip():
        return name, word.strip()
    raise argparse.ArgumentTypeError(f"expected NAME=ATTRIBUTE, e.g. philosophers=meals, not {text!r}")


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None


def _count(text: str) -> int:
    value = _whole(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, not {text}")
    return value


def _fraction(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction from 0 to 1, not {text!r}") from None


def _reduction_setting(name: str, parse: Callable[[str], _V]) -> Callable[[str], _V]:
    """The argparse type of the flag for :class:`Reduction`'s setting `name`: the text `parse`d, its
    range checked by :class:`Reduction` itself, and a value out of it reported as a bad flag."""

    def setting(text: str) -> _V:
        value = parse(text)
        try:
            Reduction(**{name: value})
        except ReductionError as error:
            raise argparse.ArgumentTypeError(error.reason) from None
        return value

    return setting


def _day(text: str) -> str:
    parts = text.split("-")
    if len(text) != 10 or len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected a day YYYY-MM-DD, not {text!r}")
    return text


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, not {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def parser() -> argparse.ArgumentParser:
    """The ``stablewatch pipeline`` argument parser."""
    top = argparse.ArgumentParser(
        prog="stablewatch pipeline",
        description="Analyse the detector's snapshot archive with Spark (local[*] unless spark-submit sets a master).",
    )
    jobs = top.add_subparsers(dest="job", required=True)
    one = argparse.ArgumentParser(add_help=False)
    one.add_argument("--archive", type=Path, required=True, metavar="DIR", help="the detector's archive folder")
    several = argparse.ArgumentParser(add_help=False)
    several.add_argument(
        "--archive",
        type=_named_archive,
        action="append",
        required=True,
        metavar="[NAME=]DIR",
        help="the detector's archive folder; repeat as NAME=DIR for several systems, one chart lane each",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", type=Path, required=True, metavar="DIR", help="where the job writes its tables")
    common.add_argument(
        "--expect",
        type=_expected_total,
        action="append",
        default=[],
        metavar="COUNTER=TOTAL",
        help="expected total of a conserved counter (repeatable; default: the first closed snapshot's)",
    )
    common.add_argument(
        "--predicate",
        action="append",
        default=[],
        metavar="MODULE:FUNCTION",
        help="a user predicate, as for the detector (repeatable; installed entry points always run)",
    )
    common.add_argument(
        "--reduce-above",
        type=_reduction_setting("reduce_above", _whole),
        metavar="EDGES",
        help="also reduce on DataFrames the snapshots with more wait edges (default: only those "
        "archived without their blob)",
    )
    common.add_argument(
        "--max-rounds",
        type=_reduction_setting("max_rounds", _whole),
        default=DEFAULT_MAX_ROUNDS,
        metavar="N",
        help="DataFrame reduction rounds before one process finishes (%(default)s)",
    )
    common.add_argument(
        "--finish-edges",
        type=_reduction_setting("finish_edges", _whole),
        default=DEFAULT_FINISH_EDGES,
        metavar="EDGES",
        help="a snapshot with this many wait edges or fewer is evaluated whole in compact form by one "
        "process; a larger one is reduced on DataFrames first, until this many or fewer remain (%(default)s)",
    )
    common.add_argument(
        "--min-release",
        type=_reduction_setting("min_release", _fraction),
        default=DEFAULT_MIN_RELEASE,
        metavar="FRACTION",
        help="stop the DataFrame rounds after one that removed less than this fraction of its edges "
        "(0 to 1; what remains is then mostly deadlocked and one process finishes it; default %(default)s: "
        "rounds run until --max-rounds or --finish-edges)",
    )
    common.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    days = argparse.ArgumentParser(add_help=False)
    days.add_argument("--from-day", type=_day, metavar="YYYY-MM-DD", help="first day partition to read")
    days.add_argument("--to-day", type=_day, metavar="YYYY-MM-DD", help="last day partition to read")

    evaluate = jobs.add_parser("evaluate", parents=[one, common, days], help="every predicate for every snapshot")
    evaluate.add_argument("--from-id", type=_count, metavar="ID", help="first snapshot id")
    evaluate.add_argument("--to-id", type=_count, metavar="ID", help="last snapshot id")

    history = jobs.add_parser(
        "history",
        parents=[several, common, days],
        help="deadlock episodes and the deadlocks broken, termination, drift, backlog, outcomes; a chart",
    )
    history.add_argument(
        "--progress",
        type=_named_word,
        action="append",
        default=[],
        metavar="NAME=ATTRIBUTE",
        help="the attribute whose total tells system NAME's work, drawn in its lane (e.g. philosophers=meals)",
    )
    history.add_argument(
        "--evaluations",
        type=Path,
        metavar="DIR",
        help="read the results of an earlier `evaluate` (its OUT/evaluations) instead of evaluating",
    )
    history.add_argument("--bucket", type=_count, default=60, metavar="S", help="backlog time buckets (%(default)s s)")
    history.add_argument("--no-chart", action="store_true", help="do not draw history.png")

    follow = jobs.add_parser("follow", parents=[one, common], help="evaluate each new batch of snapshots as it lands")
    follow.add_argument("--checkpoint", type=Path, metavar="DIR", help="streaming checkpoint (default OUT/_checkpoint)")
    follow.add_argument("--once", action="store_true", help="process what is there now, then stop")
    follow.add_argument("--interval", type=_seconds, default=5.0, metavar="S", help="look for new batches every S s")
    follow.add_argument(
        "--max-files",
        type=_count,
        metavar="N",
        help="take at most N new snapshots files per micro-batch (a batch spanning midnight is one per day: "
        "the rest of its batch comes along)",
    )
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Run one pipeline job; returns the exit status."""
    top = parser()
    args = top.parse_args(argv)
    archives = _archives(top, args)
    if importlib.util.find_spec("pyspark") is None:
        print(f"stablewatch: the pipeline needs PySpark, which is not installed: {INSTALL_HINT}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from py4j.protocol import Py4JJavaError
    from pyspark.errors import PySparkException

    from stablewatch.detector.archive.schema import ArchiveError
    from stablewatch.detector.evaluation.plugins import PluginError
    from stablewatch.pipeline.evaluate import user_predicates
    from stablewatch.pipeline.tables import check_archive

    console = Console()
    try:
        for archive in archives.values():
            check_archive(archive)  # before Spark starts: bad input fails fast
        user_predicates(tuple(args.predicate))  # loaded here too, so that a bad one fails before Spark starts
        return _JOBS[args.job](args, console)
    except (ArchiveError, PluginError) as error:
        _fail(args, str(error))
        return EXIT_BAD_INPUT
    except (Py4JJavaError, PySparkException) as error:
        _fail(args, f"the Spark job failed: {_first_line(error)}")
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _archives(top: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Path]:
    """The archives on the command line, by system (a folder's own name when not named); for
    ``history``, the flags that go with several checked (a usage error, status 2, otherwise)."""
    if args.job != "history":
        return {args.archive.name: args.archive}
    found: dict[str, Path] = {}
    for name, folder in args.archive:
        name = name or folder.name
        if name in found:
            top.error(f"two archives are named {name!r}: name each one NAME=DIR")
        found[name] = folder
    if args.evaluations is not None and len(found) > 1:
        top.error("--evaluations reads the evaluations of one archive, not of several systems'")
    unknown = sorted(name for name, _ in args.progress if name not in found)
    if unknown:
        top.error(f"--progress names no archive's system: {', '.join(unknown)}")
    return found


def _fail(args: argparse.Namespace, message: str) -> None:
    print(f"stablewatch: {message}", file=sys.stderr)
    if args.json:
        print(json.dumps({"error": message}, default=str), flush=True)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _evaluation_options(args: argparse.Namespace) -> dict[str, Any]:
    """The flags every job passes to the evaluation."""
    return {
        "expected": dict(args.expect),
        "predicates": args.predicate,
        "reduction": Reduction(
            reduce_above=args.reduce_above,
            max_rounds=args.max_rounds,
            finish_edges=args.finish_edges,
            min_release=args.min_release,
        ),
    }


def _evaluate(args: argparse.Namespace, console: Console) -> int:
    from pyspark.sql import functions as F

    from stablewatch.detector.evaluation import Verdict
    from stablewatch.pipeline.evaluate import evaluate_archive, write_evaluations
    from stablewatch.pipeline.session import get_session
    from stablewatch.pipeline.summary import evaluate_report
    from stablewatch.pipeline.tables import open_archive
    from stablewatch.pipeline.verdict import verdict

    spark = get_session("stablewatch-evaluate")
    archive = open_archive(spark, args.archive, args.from_day, args.to_day)
    evaluated = evaluate_archive(archive, **_evaluation_options(args), first_id=args.from_id, last_id=args.to_id)
    out = args.out / "evaluations"
    write_evaluations(evaluated.evaluations, out, archive)
    verdicts = (
        spark.read.parquet(str(out))
        .withColumn("verdict", verdict())
        .groupBy("name")
        .agg(
            F.min("position").alias("position"),
            *(F.count(F.when(F.col("verdict") == word.value, 1)).alias(word.value) for word in Verdict),
        )
        .orderBy("position", "name")
        .drop("position")
        .toArrow()
    )
    if args.json:
        report = {
            "snapshots": evaluated.snapshots,
            "aborted": evaluated.aborted,
            "large": evaluated.large,
            "rounds": evaluated.rounds,
            "out": str(out),
            "predicates": verdicts.to_pylist(),
        }
        print(json.dumps(report, default=str), flush=True)
    else:
        console.print(
            evaluate_report(
                verdicts, evaluated.snapshots, evaluated.aborted, evaluated.large, evaluated.rounds, str(out)
            )
        )
    return 0


def _history(args: argparse.Namespace, console: Console) -> int:
    from stablewatch.pipeline.history import run_history

    if len(args.archive) > 1 or args.archive[0][0] is not None:
        return _histories(args, console)
    history = run_history(
        args.archive[0][1],
        args.out,
        None if args.json else console,
        **_evaluation_options(args),
        evaluations=args.evaluations,
        bucket_seconds=args.bucket,
        chart=not args.no_chart,
        first_day=args.from_day,
        last_day=args.to_day,
    )
    if args.json:
        outcomes = Counter(history.tables["breaks"].column("outcome").to_pylist())
        report = {
            **_history_report(history),
            "break_outcomes": dict(sorted(outcomes.items())),
            "chart": None if history.chart is None else str(history.chart),
        }
        print(json.dumps(report, default=str), flush=True)
    return 0


def _history_report(history: Any) -> dict[str, Any]:
    """What ``history --json`` says of one system's history (a :class:`~.history.History`)."""
    return {
        "evaluated": history.evaluated,
        "aborted": history.aborted,
        "deadlock_episodes": history.tables["deadlock_episodes"].num_rows,
        "termination_episodes": history.tables["termination_episodes"].num_rows,
        "breaks": history.tables["breaks"].num_rows,
        "deadlocks_broken": Counter(history.tables["breaks"].column("outcome").to_pylist())["broken"],
        "tables": [str(path) for path in history.files],
    }


def _histories(args: argparse.Namespace, console: Console) -> int:
    """``history`` over several systems' archives: their tables, their stories, one chart of lanes."""
    from stablewatch.pipeline.history import run_histories

    archives = {name or folder.name: folder for name, folder in args.archive}
    found = run_histories(
        archives,
        args.out,
        None if args.json else console,
        progress=dict(args.progress),
        chart=not args.no_chart,
        **_evaluation_options(args),
        evaluations=args.evaluations,
        bucket_seconds=args.bucket,
        first_day=args.from_day,
        last_day=args.to_day,
    )
    if args.json:
        systems = {}
        for name, history in found.systems.items():
            systems[name] = {
                "archive": str(archives[name]),
                **_history_report(history),
                **found.stories[name].as_dict(),
            }
        report = {"out": str(found.out), "chart": None if found.chart is None else str(found.chart), "systems": systems}
        print(json.dumps(report, default=str), flush=True)
    return 0


def _follow(args: argparse.Namespace, console: Console) -> int:
    from stablewatch.pipeline.follow import follow

    followed = follow(
        args.archive,
        args.out,
        None if args.json else console,
        **_evaluation_options(args),
        checkpoint=args.checkpoint,
        once=args.once,
        interval=args.interval,
        max_files=args.max_files,
    )
    if args.json:
        report = {"batches": followed.batches, "snapshots": followed.snapshots, "out": str(args.out)}
        print(json.dumps(report, default=str), flush=True)
    return 0


_JOBS = {"evaluate": _evaluate, "history": _history, "follow": _follow}

if __name__ == "__main__":
    sys.exit(main())
