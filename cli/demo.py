"""``stablewatch demo``: the live demo (:mod:`.live_demo`), what it found, then the pipeline's history job.

Exit status 0 when the philosophers' deadlock, the job's termination, the bank's conservation and
a shop deadlock broken with orders completed after it were all seen (and the history job ran,
unless ``--no-history``), 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

from rich.console import Console, Group
from rich.text import Text

from stablewatch.cli import arguments
from stablewatch.cli.live_demo import SHOP_POLICY, DemoReport, call_of, calls_text, run_demo
from stablewatch.detector.evaluation.text import plural

__all__ = ["add_parser", "demo_summary", "run", "shop_breaks_lines"]


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
        "--stay", action="store_true", help="keep running for the whole duration, to query the detectors meanwhile"
    )
    demo.add_argument(
        "--no-history",
        action="store_true",
        help="skip the Spark history job on the philosophers' archive at the end",
    )


def run(args: argparse.Namespace, console: Console) -> int:
    def ready(systems: dict[str, dict[str, str | None]]) -> None:
        """The detectors listen: say where, whole, before anything else (a JSON line with --json)."""
        if args.json:
            print(json.dumps({"event": "ready", "systems": systems}), flush=True)
            return
        for name, where in systems.items():
            console.print(f"{name}: gRPC API {where['address']}  metrics {where['metrics']}", soft_wrap=True)
        console.print(f"e.g. stablewatch status --detector {next(iter(systems.values()))['address']}", soft_wrap=True)

    report = asyncio.run(
        run_demo(args.duration, args.data_dir, args.out, console, live=not args.json, stay=args.stay, on_ready=ready)
    )
    found = report.deadlock_detected and report.termination_detected and report.conservation_ok
    found = found and report.shop_breaks >= 1 and report.shop_orders_after_break > 0
    if not args.json:
        console.print()
        console.print(demo_summary(report))
    if not args.no_history:
        report.history = _history(Path(report.archives["philosophers"]), args.out / "pipeline", console, args.json)
    if args.json:
        print(json.dumps(dataclasses.asdict(report)))
    return 0 if found and (args.no_history or report.history is not None) else 1


def _history(archive: Path, out: Path, console: Console, quiet: bool) -> dict[str, object] | None:
    """Run the pipeline's ``history`` job on `archive` with Spark (local), print its summary; None if it cannot run."""
    if importlib.util.find_spec("pyspark") is None:
        from stablewatch.pipeline.cli import INSTALL_HINT

        print(f"stablewatch: the history job needs PySpark, which is not installed: {INSTALL_HINT}", file=sys.stderr)
        return None
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        print("stablewatch: the history job needs a Java 17 or later runtime for Spark, and none is on PATH "
              "(e.g. apt-get install openjdk-17-jre-headless)", file=sys.stderr)  # fmt: skip
        return None
    from stablewatch.pipeline.history import run_history

    if not quiet:
        console.print(f"\nThe pipeline's history job on {archive}, with Spark (local):")
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # the demo's Spark stays on loopback
    history = run_history(archive, out, None if quiet else console)
    episodes = history.tables["deadlock_episodes"]
    return {
        "archive": str(archive),
        "out": str(out),
        "evaluated": history.evaluated,
        "deadlock_episodes": episodes.num_rows,
        "chart": None if history.chart is None else str(history.chart),
        "tables": [str(path) for path in history.files],
    }


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
    totals = ", ".join(f"{name} = {total}" for name, total in sorted(report.bank_totals.items())) or "none"
    verdict = "conserved in every snapshot" if report.conservation_ok else "NOT conserved"
    lines.append(Text(f"bank totals: {totals} ({verdict})", style="green" if report.conservation_ok else "red"))
    lines.append(Text(f"{plural(report.snapshots_completed, 'snapshot')} completed in {report.seconds:.1f} s"))
    lines.append(
        Text(f"results in {report.out_dir}" + (f"; data kept in {report.data_dir}" if report.data_dir else ""))
    )
    if report.archives:
        archive = Path(next(iter(report.archives.values()))).parent
        lines.append(Text(f"every finished snapshot archived as Parquet in {archive}/<system>"))
    return Group(*lines)
