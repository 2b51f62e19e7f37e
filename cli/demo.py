"""``stablewatch demo``: the live demo (:mod:`.live_demo`), what it found, then the pipeline's history job.

First, as soon as the detectors listen, where they are: each detector's web page (where it serves
one), gRPC API and /metrics. Last, the pipeline's ``history`` job on every system's archive, with
Spark, in a process of its own (the command is printed, to run again by hand): what each system
went through, and a chart with one lane per system.

The output holds only what a person reads: the detectors' routine log lines (a late snapshot
part, a hint) appear with ``--verbose`` only, and the pipeline's Spark starts quietly
(:mod:`stablewatch.pipeline.session`). Spark runs in its own process because its JVM is started
by a ``fork`` (PySpark's), and a fork in this process, where gRPC threads are busy, makes gRPC
log that it skips its fork handlers.

Exit status 0 when the philosophers' deadlock, the job's termination, the bank's conservation
(true in a snapshot at least, false in none: an unknown one proves nothing) and a shop deadlock
broken with orders completed after it were all seen (and the history job ran, unless
``--no-history``), 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from rich.console import Console, Group
from rich.logging import RichHandler
from rich.text import Text

from stablewatch.cli import arguments
from stablewatch.cli.live_demo import SHOP_POLICY, DemoReport, call_of, calls_text, run_demo
from stablewatch.detector.evaluation.text import plural

__all__ = [
    "PROGRESS",
    "add_parser",
    "demo_summary",
    "history_arguments",
    "run",
    "shop_breaks_lines",
    "verbose_logging",
    "where_text",
]

#: Per system, the attribute whose total over its processes tells the work it did (its chart lane's
#: line): meals eaten, tasks done, orders completed (where the shop's client reports them).
PROGRESS = {"philosophers": "meals", "job": "done", "shop": "orders"}


def add_parser(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser(
        "demo",
        help="live demo: a token bank, dining philosophers, a terminating job and a shop of gRPC services, "
        "each watched by a detector (the shop's breaks the deadlocks it proves)",
    )
    demo.add_argument("--duration", type=arguments.positive, default=60.0, metavar="S",
                      help="stop after S seconds at most (60)")  # fmt: skip
    demo.add_argument(
        "--data-dir", type=Path, help="where the detectors keep their data (default: a temporary folder, then removed)"
    )
    demo.add_argument(
        "--out", type=Path, default=Path("stablewatch-demo"), metavar="DIR", help="where the results go (%(default)s)"
    )
    demo.add_argument("--json", action="store_true", help="no live view; print one JSON object at the end")
    demo.add_argument(
        "--stay",
        action="store_true",
        help="once the demo is over, keep the systems, the detectors and their web pages up until Ctrl-C",
    )
    demo.add_argument(
        "--verbose",
        action="store_true",
        help="also show the detectors' routine log (late snapshot parts, hints), at debug level",
    )
    demo.add_argument(
        "--no-history",
        action="store_true",
        help="skip the Spark history job on the systems' archives at the end",
    )


def run(args: argparse.Namespace, console: Console) -> int:
    where: dict[str, dict[str, str | None]] = {}
    stayed = False

    def ready(systems: dict[str, dict[str, str | None]]) -> None:
        """The detectors listen: say where, whole, before anything else (a JSON line with --json)."""
        where.update(systems)
        if args.json:
            print(json.dumps({"event": "ready", "systems": systems}), flush=True)
        else:
            console.print(where_text(systems))

    def staying(report: DemoReport) -> None:
        """The demo is over and everything stays up: what was found, and where to look, until Ctrl-C."""
        nonlocal stayed
        stayed = True
        if args.json:
            print(json.dumps({"event": "staying", "systems": where}), flush=True)
            return
        console.print()
        console.print(demo_summary(report))
        console.print("\nEverything stays up until Ctrl-C.", style="bold")
        console.print(where_text(where))

    if args.verbose:
        verbose_logging(None if args.json else console)
    report = asyncio.run(
        run_demo(
            args.duration,
            args.data_dir,
            args.out,
            console,
            live=not args.json,
            stay=args.stay,
            on_ready=ready,
            on_stay=staying,
        )
    )
    found = report.deadlock_detected and report.termination_detected and report.conservation_ok
    found = found and report.shop_breaks >= 1 and report.shop_orders_after_break > 0
    if not args.json and not stayed:
        console.print()
        console.print(demo_summary(report))
    if not args.no_history:
        report.history = _history(report.archives, args.out / "pipeline", console, args.json)
    if args.json:
        print(json.dumps(dataclasses.asdict(report)))
    return 0 if found and (args.no_history or report.history is not None) else 1


def where_text(systems: Mapping[str, Mapping[str, str | None]]) -> Group:
    """Where the detectors are: every web page first (where they serve one), then the gRPC APIs and /metrics."""
    width = max(len(name) for name in systems)
    lines: list[Text] = []
    pages = {name: place["web"] for name, place in systems.items() if place.get("web")}
    if pages:
        lines.append(Text("The detectors' web pages, live:", style="bold"))
        lines.extend(Text(f"  {name:<{width}}  {page}") for name, page in pages.items())
    lines.append(Text("gRPC APIs and /metrics:"))
    for name, place in systems.items():
        lines.append(Text(f"  {name:<{width}}  {place['address']}  {place['metrics'] or ''}".rstrip()))
    lines.append(Text(f"e.g. stablewatch status --detector {next(iter(systems.values()))['address']}"))
    return Group(*lines)


def verbose_logging(console: Console | None) -> logging.Handler:
    """Show stablewatch's log down to debug (the detectors' routine lines: a late snapshot part, a hint)
    on `console` (above the live view), or on stderr without one. Returns the handler it added."""
    handler: logging.Handler
    if console is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    else:
        handler = RichHandler(console=console, show_path=False, markup=False)
    logger = logging.getLogger("stablewatch")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    return handler


def history_arguments(archives: Mapping[str, str], out: Path) -> list[str]:
    """The arguments of ``stablewatch pipeline`` for the history of every system's archive, with
    each system's :data:`PROGRESS` attribute."""
    arguments = ["history"]
    for name, folder in archives.items():
        arguments += ["--archive", f"{name}={folder}"]
    for name, attribute in PROGRESS.items():
        if name in archives:
            arguments += ["--progress", f"{name}={attribute}"]
    return [*arguments, "--out", str(out)]


def _history(archives: Mapping[str, str], out: Path, console: Console, quiet: bool) -> dict[str, object] | None:
    """Run the pipeline's ``history`` job on every system's archive with Spark (local), in a process of
    its own (see the module doc); print what each system went through. None if it cannot run or failed."""
    if importlib.util.find_spec("pyspark") is None:
        from stablewatch.pipeline.cli import INSTALL_HINT

        print(f"stablewatch: the history job needs PySpark, which is not installed: {INSTALL_HINT}", file=sys.stderr)
        return None
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        print("stablewatch: the history job needs a Java 17 or later runtime for Spark, and none is on PATH "
              "(e.g. apt-get install openjdk-17-jre-headless)", file=sys.stderr)  # fmt: skip
        return None
    from stablewatch.pipeline.story import stories_report

    arguments = history_arguments(archives, out)
    command = f"stablewatch pipeline {shlex.join(arguments)}"
    if not quiet:
        console.print(
            f"\nThe pipeline's history job on the {len(archives)} archives, with Spark (local), about a minute:"
        )
        console.print(Text(command, style="dim"), soft_wrap=True)
    environment = {"SPARK_LOCAL_IP": "127.0.0.1", **os.environ}  # the demo's Spark stays on loopback
    job = [sys.executable, "-m", "stablewatch.pipeline.cli", *arguments, "--json"]
    done = subprocess.run(job, stdout=subprocess.PIPE, text=True, env=environment, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        print(f"stablewatch: the history job failed (exit status {done.returncode})", file=sys.stderr)
        return None
    history: dict[str, object] = {"command": command, **json.loads(lines[-1])}
    if not quiet:
        systems = history["systems"]
        assert isinstance(systems, dict)
        chart = history["chart"]
        console.print(stories_report(list(systems.values()), None if chart is None else str(chart), str(out)))
    return history


def shop_breaks_lines(report: DemoReport) -> list[Text]:
    """How the shop's detector broke its deadlock: the victim, the ABORTEDs, the time it took, the
    orders that completed after it, and how many breaks there were by the end."""
    victim = report.shop_victim
    if victim is None:
        return [Text(f"  its detector (--resolve {SHOP_POLICY}) broke no deadlock in time", style="yellow")]
    call = call_of(str(victim["process"]), str(victim["task"]))
    proven = f"snapshot #{report.shop_break_snapshot}"
    lines = [Text(f"  broken by its detector (--resolve {SHOP_POLICY}), as {proven} proved it:", style="green bold")]
    line = f"    victim: {call['service']} {call['method']}#{call['call']} (wait {victim['instance']})"
    if report.shop_break_component:
        line += f", the {SHOP_POLICY} of the deadlock's {len(report.shop_break_component)} waiting calls"
    if report.shop_break_report_ms is not None:
        line += f"; reported broken {report.shop_break_report_ms:g} ms after the break was sent"
    lines.append(Text(line))
    aborted = report.shop_victim_aborted
    if aborted is not None:
        lines.append(Text(f"    its caller, {aborted['service']}, saw ABORTED: {aborted['details']}"))
    if report.shop_aborted_details is not None:
        details = report.shop_aborted_details
        lines.append(Text(f"    the client's Place saw ABORTED: {details} (placed again after a back-off)"))
    if report.shop_recovery_ms is not None:
        recovery = f"{report.shop_recovery_ms:g} ms (the services' own clocks)"
        lines.append(Text(f"    from the last worker blocking to the ABORTED: {recovery}"))
    if report.shop_orders_at_break is not None:
        after = report.shop_orders_after_break
        line = f"    orders completed: {report.shop_orders_at_break} by the break, {after} more since"
        lines.append(Text(line, style="green" if after > 0 else "yellow"))
    outcomes = ", ".join(f"{count} {word}" for word, count in sorted(report.shop_break_outcomes.items()))
    breaks = plural(sum(report.shop_break_outcomes.values()), "break")
    lines.append(Text(f"  the shop deadlocked again and again: {breaks} by the end ({outcomes})"))
    return lines


def bank_line(report: DemoReport) -> Text:
    """The bank's totals and how many snapshots proved them: only a true conservation counts, and
    the totals are those of a snapshot that proved it (an unknown one, an open cut, sums only part)."""
    totals = ", ".join(f"{name} = {total}" for name, total in sorted(report.bank_totals.items())) or "none"
    unknown = report.bank_conservation_unknown
    if report.bank_conservation_broken:
        return Text(f"bank totals: {totals} (NOT conserved)", style="red")
    if not report.conservation_ok:
        never = f"unknown in {plural(unknown, 'snapshot')}, an open cut" if unknown else "no snapshot of the bank"
        return Text(f"bank totals: {totals} (conservation never proved: {never})", style="yellow")
    if not unknown:
        return Text(f"bank totals: {totals} (conserved in every snapshot)", style="green")
    proved = plural(report.bank_conserved, "snapshot")
    return Text(f"bank totals: {totals} (conserved in {proved}; unknown in {unknown}, an open cut)", style="green")


def demo_summary(report: DemoReport) -> Group:
    """What the live demo found: the deadlock with its evidence, termination, the bank's totals."""
    lines: list[Text] = []
    if report.deadlock_detected:
        cycle = " -> ".join([*report.deadlock_cycle, report.deadlock_cycle[0]]) if report.deadlock_cycle else "?"
        lines.append(Text(f"deadlock among the philosophers: cycle {cycle}", style="red bold"))
        lines.append(Text("  every channel along the cycle was empty: no message in flight could wake anyone"))
        if report.graph_dot:
            drawn = f" and {report.graph_png}" if report.graph_png else " (install Graphviz for a PNG)"
            lines.append(Text(f"  wait-for graph: {report.graph_dot}{drawn}"))
    else:
        lines.append(Text("no deadlock was reported among the philosophers in time", style="yellow"))
    if report.shop_deadlock_detected:
        cycle = calls_text(report.shop_deadlock_calls)
        lines.append(Text(f"deadlock among the shop's gRPC services (RPC mode): {cycle}", style="red bold"))
        lines.append(Text("  each call waits on the next; the queued ones on every busy worker of their pool"))
        lines.extend(shop_breaks_lines(report))
    else:
        lines.append(Text("no deadlock was reported among the shop's gRPC services in time", style="yellow"))
    job = report.systems.get("job", {}).get("first_seen_seconds", {})
    if report.termination_detected:
        lines.append(
            Text(f"the job terminated: detected {job.get('termination', 0):.1f} s into the demo", style="green")
        )
    else:
        lines.append(Text("the job's termination was not detected in time", style="yellow"))
    lines.append(bank_line(report))
    lines.append(Text(f"{plural(report.snapshots_completed, 'snapshot')} completed in {report.seconds:.1f} s"))
    lines.append(
        Text(f"results in {report.out_dir}" + (f"; data kept in {report.data_dir}" if report.data_dir else ""))
    )
    if report.archives:
        archive = Path(next(iter(report.archives.values()))).parent
        lines.append(Text(f"every finished snapshot archived as Parquet in {archive}/<system>"))
    return Group(*lines)
