"""The live demo: four detectors watching four small systems of real services, on this machine.

* a token bank (three branches moving tokens): conservation holds in every snapshot;
* dining philosophers (five seats): they eat for a while, then deadlock; the deadlock is
  reported with its cycle, the empty channels along it, and a picture of the wait-for graph;
* a distributed job (three workers): termination is detected once, and only once, it is true;
* a shop of ordinary gRPC services (orders, payments, inventory and a client, in RPC mode: only
  interceptors): its call cycle exhausts the worker pools at once; the deadlock is reported with
  its cycle of calls (service, method, call), and the shop is stopped as soon as it is.

Every service is its own OS process (``stablewatch.examples``), embedding the agent or, for the
shop, its gRPC interceptors; the detectors run in this process, each with its own gRPC API,
/metrics endpoint and SQLite store. As soon as
they listen, their addresses are printed whole (a JSON line with ``--json``). The demo ends when
all three outcomes are seen (or after ``duration`` seconds, or on Ctrl-C), stops every process it
started, and removes its temporary data; what it leaves is in the output folder: the wait-for
graph of the deadlock (DOT, and PNG when Graphviz is installed) and the Parquet archive of every
finished snapshot, one per system (``archive/<system>``, replaced on every run), which the
pipeline's jobs read. The ``demo`` command (:mod:`.demo`) runs it and prints what it found.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from stablewatch.cli.render import verdict_text
from stablewatch.detector.evaluation import Verdict, wait_for_dot
from stablewatch.detector.evaluation.plugins import load_predicate
from stablewatch.detector.evaluation.waitfor import label
from stablewatch.detector.service.detector import Detector, DetectorConfig
from stablewatch.detector.service.query import outcome_name
from stablewatch.examples.shop import PLACE
from stablewatch.examples.shop import ROLES as SHOP
from stablewatch.examples.shop_processes import ShopProcesses
from stablewatch.v1 import WaitForGraph
from stablewatch.v1.query_pb2 import SnapshotResults

__all__ = ["DemoReport", "calls_text", "run_demo", "write_graph"]

BANK = ["A", "B", "C"]
SEATS = ["P0", "P1", "P2", "P3", "P4"]
WORKERS = ["W1", "W2", "W3"]
TOKENS_PER_BRANCH = 1000


@dataclass
class _System:
    """One monitored system: its detector, its processes and what was seen so far."""

    name: str
    module: str
    ids: list[str]
    options: list[str]
    detector: Detector
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    completed: int = 0
    aborted: int = 0
    latest: SnapshotResults | None = None
    first_seen: dict[str, float] = field(default_factory=dict)  # predicate -> elapsed s when first true
    conservation_broken: bool = False
    shop: ShopProcesses | None = None  # the shop's processes, started and stopped together
    calls: list[dict[str, str]] = field(default_factory=list)  # the shop's cycle of calls, once reported
    stopped_at: float | None = None  # elapsed s when the shop was stopped (after its deadlock)

    def observe(self, results: SnapshotResults, elapsed: float) -> None:
        if outcome_name(results.snapshot.outcome) != "completed":
            self.aborted += 1
            return
        self.completed += 1
        self.latest = results
        for result in results.results:
            verdict = Verdict.of(result)
            if verdict is Verdict.TRUE:
                self.first_seen.setdefault(result.name, elapsed)
            if self.shop is not None and result.name == "deadlock" and verdict is Verdict.TRUE and not self.calls:
                calls = [call_of(node.process, node.task) for node in result.deadlock.cycle]
                start = next((i for i, call in enumerate(calls) if call["method"] == PLACE), 0)
                self.calls = calls[start:] + calls[:start]  # told from the order's side: Place first
            if result.name.startswith("conservation(") and verdict is Verdict.FALSE:
                self.conservation_broken = True


@dataclass
class DemoReport:
    """What the demo found, as printed by ``stablewatch demo --json``."""

    snapshots_completed: int
    deadlock_detected: bool
    deadlock_cycle: list[str]
    termination_detected: bool
    conservation_ok: bool
    seconds: float
    bank_totals: dict[str, int]
    graph_dot: str | None  # the deadlock's wait-for graph, in the output folder
    graph_png: str | None  # the same drawn by Graphviz, when `dot` is installed
    archives: dict[str, str]  # system -> its Parquet archive of finished snapshots
    shop_deadlock_detected: bool
    shop_deadlock_calls: list[dict[str, str]]  # the cycle of calls: service, method, call
    shop_stopped: bool  # the shop's processes were stopped once the deadlock was reported
    out_dir: str
    data_dir: str | None  # kept only when given; a temporary one is removed
    systems: dict[str, dict[str, object]]
    history: dict[str, object] | None = None  # the pipeline's history job on the philosophers' archive


async def run_demo(
    duration: float,
    data_dir: Path | None,
    out_dir: Path,
    console: Console,
    live: bool,
    stay: bool = False,
    on_ready: Callable[[dict[str, dict[str, str | None]]], None] | None = None,
) -> DemoReport:
    """Run the demo for at most ``duration`` seconds; see the module docstring.

    ``on_ready`` gets every system's gRPC address and /metrics URL as soon as the detectors
    listen. With ``stay`` it runs the whole ``duration`` (or until Ctrl-C) even once everything
    is seen, so the detectors can be queried meanwhile (``stablewatch status --detector ...``).
    """
    temporary = data_dir is None
    work = Path(tempfile.mkdtemp(prefix="stablewatch-demo-")) if data_dir is None else data_dir
    work.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    archives = out_dir / "archive"
    shutil.rmtree(archives, ignore_errors=True)  # this run's snapshots only
    systems = [
        _system(
            "bank", "bank", BANK, ["--branches", ",".join(BANK), "--tokens", str(TOKENS_PER_BRANCH)], work, archives
        ),
        _system(
            "philosophers", "philosophers", SEATS, ["--seats", ",".join(SEATS), "--deadlock-after", "3"], work, archives
        ),
        _system("job", "job", WORKERS, ["--workers", ",".join(WORKERS), "--tasks", "30"], work, archives),
        _system("shop", "shop", list(SHOP), [], work, archives),
    ]
    started = time.monotonic()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signum, stop.set)
    watchers: list[asyncio.Task[None]] = []
    try:
        for system in systems:
            await system.detector.start()
        if on_ready is not None:
            on_ready({s.name: {"address": s.detector.address, "metrics": s.detector.metrics_url} for s in systems})
        for system in systems:
            watchers.append(asyncio.ensure_future(_follow(system, started)))
            await _launch(system, work)
        await _show(systems, started, duration, stop, console, live, stay)
        report = _report(systems, time.monotonic() - started, out_dir, None if temporary else work)
    finally:
        for task in watchers:
            task.cancel()
        for system in systems:
            _terminate(system.processes)
            if system.shop is not None:
                system.shop.stop()
        for system in systems:
            await system.detector.stop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signum)
        if temporary:
            shutil.rmtree(work, ignore_errors=True)
    return report


def _system(name: str, module: str, ids: list[str], options: list[str], work: Path, archives: Path) -> _System:
    config = DetectorConfig(
        data_dir=work / name / "data",
        listen="127.0.0.1:0",
        metrics_port=0,
        interval=0.2,
        deadline=2.0,
        heartbeat_interval=0.5,
        heartbeat_timeout=5.0,
        min_members=len(ids),  # no snapshot before every service is attached
        expected_members=tuple(ids),  # a cut without one of them proves no termination or conservation
        expected_totals={"tokens": TOKENS_PER_BRANCH * len(ids)} if name == "bank" else {},
        archive=archives / name,
        archive_age=2.0,  # a short demo: small batches, written often
    )
    plugins = [load_predicate("stablewatch.examples.job:all_tasks_done")] if name == "job" else []
    return _System(name, module, ids, options, Detector(config, plugins=plugins))


async def _launch(system: _System, work: Path) -> None:
    if system.name == "shop":
        system.shop = ShopProcesses(work / "shop" / "processes", "deadlock", system.detector.address)
        await asyncio.to_thread(system.shop.start)
        return
    peers = work / system.name / "peers"
    peers.mkdir(parents=True, exist_ok=True)
    logs = work / system.name / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for pid in system.ids:
        command = [sys.executable, "-m", f"stablewatch.examples.{system.module}", "--id", pid]
        command += [*system.options, "--peers-dir", str(peers), "--detector", system.detector.address]
        with (logs / f"{pid}.log").open("wb") as log:
            system.processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))


async def _follow(system: _System, started: float) -> None:
    async for event in system.detector.watch():
        system.observe(event.results, time.monotonic() - started)
        if system.shop is not None and system.calls and system.stopped_at is None:
            # The shop's deadlock is reported: it will never move again, so stop its processes now.
            await asyncio.to_thread(system.shop.stop)
            system.stopped_at = time.monotonic() - started


def calls_text(calls: Sequence[dict[str, str]]) -> str:
    """A cycle of calls (each a service, a method and a call) on one line, closing back to the first."""
    return " -> ".join(f"{c['service']} {c['method']}#{c['call']}" for c in [*calls, *calls[:1]])


def call_of(service: str, task: str) -> dict[str, str]:
    """A node of the shop's cycle as service, method and call (the task is ``{method}#{caller}:{seq}``)."""
    method, _, call = task.partition("#")
    return {"service": service, "method": method, "call": call}


def _done(systems: list[_System]) -> bool:
    bank, philosophers, job, shop = systems
    return (
        bank.completed >= 20
        and "deadlock" in philosophers.first_seen
        and "termination" in job.first_seen
        and shop.stopped_at is not None
    )


async def _show(
    systems: list[_System],
    started: float,
    duration: float,
    stop: asyncio.Event,
    console: Console,
    live: bool,
    stay: bool,
) -> None:
    """Refresh the live view until every outcome is seen, time is up, or Ctrl-C."""
    deadline = started + duration
    view = Live(_view(systems, started, duration), console=console, refresh_per_second=4) if live else None
    with view if view is not None else contextlib.nullcontext():
        while not stop.is_set() and time.monotonic() < deadline and (stay or not _done(systems)):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)
            if view is not None:
                view.update(_view(systems, started, duration))


def _view(systems: list[_System], started: float, duration: float) -> Group:
    elapsed = time.monotonic() - started
    table = Table(title=f"stablewatch demo — {elapsed:4.1f} s of at most {duration:g} s")
    for column in ("system", "members", "snapshots", "aborted", "predicates (latest complete snapshot)", "gRPC API"):
        table.add_column(column)
    for system in systems:
        members = f"{len(system.detector.coordinator.members)}/{len(system.ids)}"
        cells = Text()
        for result in system.latest.results if system.latest else []:
            cells.append_text(verdict_text(result, named=True))
            cells.append("  ")
        where = system.detector.address
        table.add_row(system.name, members, str(system.completed), str(system.aborted), cells, where)
    lines = [table, Text(f"metrics: {', '.join(s.detector.metrics_url or '-' for s in systems)}", style="dim")]
    for system in systems:
        for name, at in sorted(system.first_seen.items(), key=lambda item: item[1]):
            if name in ("deadlock", "termination"):
                lines.append(Text(f"  {system.name}: {name} first reported at {at:.1f} s", style="bold"))
        if system.calls:
            lines.append(Text(f"    cycle of calls: {calls_text(system.calls)}"))
        if system.stopped_at is not None:
            lines.append(Text(f"    the shop's processes stopped at {system.stopped_at:.1f} s", style="dim"))
    return Group(*lines)


def _terminate(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def write_graph(graph: WaitForGraph, dot: Path) -> tuple[Path, Path | None]:
    """Write `graph` as DOT to `dot`, and as a PNG beside it when Graphviz's ``dot`` is on PATH.

    Returns the DOT file and the PNG (None without Graphviz, or if it failed to draw).
    """
    dot.write_text(wait_for_dot(graph))
    png = dot.with_suffix(".png")
    png.unlink(missing_ok=True)
    if shutil.which("dot"):
        subprocess.run(["dot", "-Tpng", str(dot), "-o", str(png)], check=False, timeout=30, capture_output=True)
    return dot, png if png.exists() else None


def _report(systems: list[_System], seconds: float, out_dir: Path, kept: Path | None) -> DemoReport:
    bank, philosophers, job, shop = systems
    cycle: list[str] = []
    graph_dot = graph_png = None
    deadlock_id = _first_deadlock(philosophers)
    if deadlock_id is not None:
        graph = philosophers.detector.store.wait_for_graph(deadlock_id)
        assert graph is not None
        cycle = [label(node) for node in graph.deadlock.cycle]
        dot, png = write_graph(graph, out_dir / "philosophers-deadlock.dot")
        graph_dot, graph_png = str(dot), None if png is None else str(png)
    totals: dict[str, int] = {}
    if bank.latest is not None:
        for result in bank.latest.results:
            if result.WhichOneof("evidence") == "conservation":
                totals[result.conservation.counter] = result.conservation.observed
    return DemoReport(
        snapshots_completed=sum(system.completed for system in systems),
        deadlock_detected="deadlock" in philosophers.first_seen,
        deadlock_cycle=cycle,
        termination_detected="termination" in job.first_seen,
        conservation_ok=bank.completed > 0 and not bank.conservation_broken,
        seconds=round(seconds, 2),
        bank_totals=totals,
        graph_dot=graph_dot,
        graph_png=graph_png,
        archives={system.name: str(system.detector.config.archive) for system in systems},
        shop_deadlock_detected="deadlock" in shop.first_seen,
        shop_deadlock_calls=shop.calls,
        shop_stopped=shop.stopped_at is not None,
        out_dir=str(out_dir),
        data_dir=None if kept is None else str(kept),
        systems={
            system.name: {
                "snapshots_completed": system.completed,
                "snapshots_aborted": system.aborted,
                "first_seen_seconds": {name: round(at, 2) for name, at in system.first_seen.items()},
            }
            for system in systems
        },
    )


def _first_deadlock(system: _System) -> int | None:
    history = system.detector.store.predicate_history("deadlock", limit=100_000)
    deadlocked = [snapshot_id for snapshot_id, holds in history if holds]
    return min(deadlocked) if deadlocked else None
