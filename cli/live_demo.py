"""The live demo: four detectors watching four small systems of real services, on this machine.

* a token bank (three branches moving tokens): conservation holds in every snapshot;
* dining philosophers (five seats): they eat for a while, then deadlock; the deadlock is
  reported with its cycle, the empty channels along it, and a picture of the wait-for graph;
* a distributed job (three workers): termination is detected once, and only once, it is true;
* a shop of ordinary gRPC services (orders, payments, inventory and a client, in RPC mode: only
  interceptors): its call cycle exhausts the worker pools at once; the deadlock is reported with
  its cycle of calls (service, method, call), and its detector, which breaks the deadlocks it
  proves (``resolve="youngest"``), refuses one call of the cycle with ``ABORTED``; the client
  places that order again after a back-off, orders complete again, and the shop soon deadlocks
  anew, to be broken again.

For the shop's first break, :class:`ShopBreaks` reads the shop's own books
(``/shop.Admin/Status``, the services' clocks): the victim's caller's ``ABORTED`` (naming the
snapshot that proved the deadlock), the ``ABORTED`` the client's Place saw, the time from the last
worker blocking (the latest start among the services' outgoing calls out at the moment of the
victim's ``ABORTED``: every worker of the three services is in the deadlock, so those calls are
its edges) to that ``ABORTED``, and the orders the client completed by then and since.

Every service is its own OS process (``stablewatch.examples``), embedding the agent or, for the
shop, its gRPC interceptors; the detectors run in this process, each with its own gRPC API,
/metrics endpoint (and web page, where the detector serves one) and SQLite store. As soon as
they listen, their addresses are printed whole (a JSON line with ``--json``). The demo ends
:data:`LINGER` seconds after all four outcomes are seen (the bank's conservation, the
philosophers' deadlock, the job's termination, and a shop deadlock broken with orders completed
after it: the archive then shows each system after its outcome too), or after ``duration``
seconds, or on Ctrl-C. With ``stay``, the systems and their detectors then stay up (their web pages
too) until Ctrl-C. It stops every process it started and removes its temporary data; what it
leaves is in the output folder: the wait-for graph of the philosophers' deadlock (DOT, and PNG when
Graphviz is installed) and the Parquet archive of every finished snapshot, one per system
(``archive/<system>``, replaced on every run), which the pipeline's jobs read. The ``demo``
command (:mod:`.demo`) runs it and prints what it found.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from stablewatch.cli.render import resolution_line, verdict_text
from stablewatch.detector.evaluation import Verdict, wait_for_dot
from stablewatch.detector.evaluation.plugins import load_predicate
from stablewatch.detector.evaluation.text import plural
from stablewatch.detector.evaluation.waitfor import label
from stablewatch.detector.service.detector import Detector, DetectorConfig
from stablewatch.detector.service.query import outcome_name
from stablewatch.detector.service.resolutions import outcome_word
from stablewatch.examples.shop import PLACE, SERVICES
from stablewatch.examples.shop import ROLES as SHOP
from stablewatch.examples.shop_processes import ShopProcesses
from stablewatch.v1 import PredicateResult, WaitForGraph
from stablewatch.v1.control_pb2 import BREAK_OUTCOME_BROKEN
from stablewatch.v1.query_pb2 import Resolution, SnapshotResults

__all__ = ["DemoReport", "ShopBreaks", "call_of", "calls_text", "run_demo", "write_graph"]

BANK = ["A", "B", "C"]
SEATS = ["P0", "P1", "P2", "P3", "P4"]
WORKERS = ["W1", "W2", "W3"]
TOKENS_PER_BRANCH = 1000
SHOP_POLICY = "youngest"  # the shop's detector breaks the deadlocks it proves (--resolve youngest)
BOOKS_EVERY = 0.5  # seconds between reads of the shop's books once a deadlock was broken
BREAK_LINES = 3  # the latest breaks the live view shows under the shop
VICTIM_TEXT = "stablewatch broke"  # in the details of the ABORTED a victim's caller sees
VICTIM_SNAPSHOT = re.compile(r"proven by snapshot (\d+)")
LINGER = 2.0  # seconds the demo goes on once every outcome was seen, so its history shows what came after
REPORT_WAIT = 2.0  # seconds the summary waits for the reports of breaks sent just before the end
REPORT_POLL = 0.02  # seconds between looks at the detector's breaks meanwhile
JOB_WORK_MS = "80"  # at most per task: the job runs for a few seconds, long enough to be seen running


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
    conservation_broken: bool = False  # a snapshot's conservation was false
    conserved: int = 0  # completed snapshots whose conservation was true (every counter's)
    conservation_unknown: int = 0  # completed snapshots whose conservation was unknown (an open cut), none false
    conserved_totals: dict[str, int] = field(default_factory=dict)  # the latest conserved snapshot's totals
    shop: ShopProcesses | None = None  # the shop's processes, started and stopped together
    calls: list[dict[str, str]] = field(default_factory=list)  # the shop's cycle of calls, once reported
    breaks: ShopBreaks | None = None  # the shop's: its detector's breaks and its books about the first
    stopped_cleanly: bool = False  # the shop's processes all exited on SIGTERM at the end (none killed)

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
        self._count_conservation([r for r in results.results if r.name.startswith("conservation(")])

    def _count_conservation(self, results: Sequence[PredicateResult]) -> None:
        """Count a completed snapshot's conservation: proved (its totals kept), broken, or unknown.
        Only a true result proves it: an unknown one (an open cut) sums only part of the tokens."""
        verdicts = {Verdict.of(result) for result in results}
        if not verdicts:
            return
        if Verdict.FALSE in verdicts:
            self.conservation_broken = True
        elif verdicts == {Verdict.TRUE}:
            self.conserved += 1
            self.conserved_totals = {result.conservation.counter: result.conservation.observed for result in results}
        else:
            self.conservation_unknown += 1


@dataclass(frozen=True)
class BookedCall:
    """A finished outgoing call as a process of the shop booked it (wall-clock seconds)."""

    role: str
    method: str
    began: float
    ended: float
    code: str
    details: str


@dataclass
class ShopBreaks:
    """The shop's deadlocks its detector broke, and what the shop's own books say about the first.

    Sans-I/O: fed the detector's breaks as they are sent and answered (:meth:`seen`) and the
    processes' ``/shop.Admin/Status`` JSON (:meth:`read`, any subset of the roles, as often as
    wanted). The first break reported broken is the one explained: its victim wait, the ``ABORTED``
    its caller saw (the first finished call of a service that names the break's snapshot), the
    ``ABORTED`` the client's Place saw (the first one), the moment the last worker blocked before
    the victim's ``ABORTED``, and the client's completed Places (code OK) up to that ``ABORTED``
    and after it. The books keep only each process's latest 5000 finished calls, so each figure is
    taken once, from the first read that shows it; the Places after the break only ever grow.
    """

    resolutions: dict[int, Resolution] = field(default_factory=dict)  # break id -> latest news of it
    first: Resolution | None = None  # the first break reported broken
    victim_aborted: BookedCall | None = None  # its caller's ABORTED, in a service's books
    last_block: float | None = None  # wall clock: the latest start among the calls out at that ABORTED
    client_aborted: BookedCall | None = None  # the first Place the client saw ABORTED
    orders_at_break: int | None = None  # Places completed by the victim's ABORTED
    orders_after: int = 0  # Places completed after it

    def seen(self, resolution: Resolution) -> None:
        """A break was sent or answered (``WatchEvent.resolution``). The news of its sending may come
        after its answer (the watch lags the detector's store): it replaces no answer."""
        known = self.resolutions.get(resolution.resolution_id)
        if known is not None and outcome_word(resolution) == "pending" and outcome_word(known) != "pending":
            return
        self.resolutions[resolution.resolution_id] = resolution
        if self.first is None and resolution.outcome == BREAK_OUTCOME_BROKEN:
            self.first = resolution

    @property
    def broken(self) -> int:
        """Breaks the victim's agent reported broken."""
        return sum(r.outcome == BREAK_OUTCOME_BROKEN for r in self.resolutions.values())

    def outcomes(self) -> dict[str, int]:
        """Breaks by outcome word (broken, gone, pending, ...)."""
        counts: dict[str, int] = {}
        for resolution in self.resolutions.values():
            word = outcome_word(resolution)
            counts[word] = counts.get(word, 0) + 1
        return counts

    def keep(self, ids: set[int]) -> None:
        """Forget the breaks not among ``ids`` (sent after the end the report is taken at). If the
        first one broken was one of them, the first broken among the rest is explained instead, from
        the next read of the books."""
        self.resolutions = {key: value for key, value in self.resolutions.items() if key in ids}
        if self.first is not None and self.first.resolution_id not in ids:
            self.first = self.victim_aborted = self.client_aborted = None
            self.last_block = self.orders_at_break = None
            self.orders_after = 0
            for key in sorted(self.resolutions):
                self.seen(self.resolutions[key])

    def latest(self, count: int) -> list[Resolution]:
        """The ``count`` newest breaks, oldest first."""
        return [self.resolutions[key] for key in sorted(self.resolutions)[-count:]]

    @property
    def wants_services(self) -> bool:
        """Whether the services' books are still needed: a break is known but not yet its ``ABORTED``."""
        return self.first is not None and self.victim_aborted is None

    @property
    def recovery_ms(self) -> float | None:
        """From the last worker blocking to the victim's ``ABORTED``, in ms (the services' clocks)."""
        if self.victim_aborted is None or self.last_block is None:
            return None
        return round((self.victim_aborted.ended - self.last_block) * 1e3, 1)

    @property
    def report_ms(self) -> float | None:
        """From the detector sending the first break to the agent's report of it, in ms."""
        first = self.first
        if first is None or not first.HasField("reported_at") or not first.HasField("sent_at"):
            return None
        return round((first.reported_at.ToMicroseconds() - first.sent_at.ToMicroseconds()) / 1e3, 1)

    def read(self, books: Mapping[str, Mapping[str, Any]]) -> None:
        """Take in the books of the roles read (role -> its ``/shop.Admin/Status``)."""
        if self.first is None:
            return
        if self.victim_aborted is None and all(role in books for role in SERVICES):
            self._victim_aborted(books)
        client = books.get("client")
        if client is None:
            return
        places = [call for call in _finished("client", client) if call.method == PLACE]
        if self.client_aborted is None:
            aborted = [call for call in places if call.code == "ABORTED"]
            self.client_aborted = min(aborted, key=lambda call: call.ended, default=None)
        if self.victim_aborted is not None:
            moment = self.victim_aborted.ended
            completed = [call for call in places if call.code == "OK"]
            if self.orders_at_break is None:
                self.orders_at_break = sum(call.ended <= moment for call in completed)
            self.orders_after = max(self.orders_after, sum(call.ended > moment for call in completed))

    def _victim_aborted(self, books: Mapping[str, Mapping[str, Any]]) -> None:
        assert self.first is not None
        finished = [call for role in SERVICES for call in _finished(role, books[role])]
        victim = min(
            (call for call in finished if call.code == "ABORTED" and _names(call.details) == self.first.snapshot_id),
            key=lambda call: call.ended,
            default=None,
        )
        if victim is None:
            return
        # The services' calls out at that moment (finished since, or still out): the deadlock's edges.
        moment = victim.ended
        starts = [call.began for call in finished if call.began <= moment <= call.ended]
        for role in SERVICES:
            starts += [float(call["began"]) for call in books[role].get("outstanding", [])]
        self.victim_aborted = victim
        self.last_block = max((began for began in starts if began <= moment), default=None)


def _names(details: str) -> int | None:
    """The snapshot a victim's ``ABORTED`` names (stablewatch's message), None for any other error."""
    named = VICTIM_SNAPSHOT.search(details)
    return int(named[1]) if named and VICTIM_TEXT in details else None


def _finished(role: str, status: Mapping[str, Any]) -> list[BookedCall]:
    return [
        BookedCall(role, call["method"], float(call["began"]), float(call["ended"]), call["code"], call["details"])
        for call in status.get("finished", [])
    ]


@dataclass
class DemoReport:
    """What the demo found, as printed by ``stablewatch demo --json``."""

    snapshots_completed: int
    deadlock_detected: bool
    deadlock_cycle: list[str]
    termination_detected: bool
    conservation_ok: bool  # proved in a snapshot of the bank at least, and false in none
    seconds: float
    bank_totals: dict[str, int]  # from the latest snapshot that proved conservation; empty if none did
    graph_dot: str | None  # the deadlock's wait-for graph, in the output folder
    graph_png: str | None  # the same drawn by Graphviz, when `dot` is installed
    archives: dict[str, str]  # system -> its Parquet archive of finished snapshots
    shop_deadlock_detected: bool
    shop_deadlock_calls: list[dict[str, str]]  # the cycle of calls: service, method, call
    shop_stopped: bool  # the shop's processes all exited on SIGTERM at the end (none had to be killed)
    out_dir: str
    data_dir: str | None  # kept only when given; a temporary one is removed
    systems: dict[str, dict[str, object]]
    # Breaking the shop's deadlocks (its detector runs with resolve=SHOP_POLICY):
    shop_breaks: int = 0  # the shop's deadlocks broken (breaks its agents reported broken)
    # every break sent, by outcome (broken, gone, pending, ...)
    shop_break_outcomes: dict[str, int] = field(default_factory=dict)
    shop_break_snapshot: int | None = None  # the snapshot that proved the first deadlock broken
    shop_victim: dict[str, object] | None = None  # the first break's victim wait: process, task, instance
    # the waiting calls of the deadlock it broke (service, method, call): its sink component
    shop_break_component: list[dict[str, str]] = field(default_factory=list)
    shop_victim_aborted: dict[str, str] | None = None  # the ABORTED its caller saw: service, method, details
    shop_aborted_details: str | None = None  # the details of the first ABORTED the client's Place saw
    shop_recovery_ms: float | None = None  # from the last worker blocking to the victim's ABORTED (shop's clocks)
    shop_break_report_ms: float | None = None  # from the detector sending that break to the agent's report
    shop_orders_at_break: int | None = None  # orders the client completed by the victim's ABORTED
    shop_orders_after_break: int = 0  # orders the client completed after it
    history: dict[str, object] | None = None  # the pipeline's history job on every system's archive
    bank_conserved: int = 0  # the bank's snapshots whose conservation was true
    bank_conservation_unknown: int = 0  # ... unknown (an open cut: a branch's tokens not counted)
    bank_conservation_broken: bool = False  # ... false in one at least


async def run_demo(
    duration: float,
    data_dir: Path | None,
    out_dir: Path,
    console: Console,
    live: bool,
    stay: bool = False,
    on_ready: Callable[[dict[str, dict[str, str | None]]], None] | None = None,
    on_stay: Callable[[DemoReport], None] | None = None,
) -> DemoReport:
    """Run the demo for at most ``duration`` seconds; see the module docstring.

    ``on_ready`` gets every system's web page (None where the detector serves none), gRPC address
    and /metrics URL as soon as the detectors listen. With ``stay``, once the demo is over (all
    seen or ``duration`` passed, not Ctrl-C) ``on_stay`` gets its report, and everything stays up
    until Ctrl-C (or SIGTERM), so the detectors and their web pages can be visited meanwhile.
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
        _system(
            "job",
            "job",
            WORKERS,
            ["--workers", ",".join(WORKERS), "--tasks", "30", "--work-ms", JOB_WORK_MS],
            work,
            archives,
        ),
        _system("shop", "shop", list(SHOP), [], work, archives, resolve=SHOP_POLICY),
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
            on_ready({s.name: _where(s.detector) for s in systems})
        for system in systems:
            watchers.append(asyncio.ensure_future(_follow(system, started)))
            await _launch(system, work)
            if system.breaks is not None:
                watchers.append(asyncio.ensure_future(_read_books(system)))
        await _show(systems, started, duration, stop, console, live)
        seconds = time.monotonic() - started
        await _read_books_last(systems[-1])
        report = _report(systems, seconds, out_dir, None if temporary else work)
        if stay and not stop.is_set():
            if on_stay is not None:
                on_stay(report)
            await stop.wait()
        for task in watchers:
            task.cancel()
        report.shop_stopped = await _stop_shop(systems[-1])
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


def _system(
    name: str, module: str, ids: list[str], options: list[str], work: Path, archives: Path, resolve: str | None = None
) -> _System:
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
        resolve=resolve,
    )
    plugins = [load_predicate("stablewatch.examples.job:all_tasks_done")] if name == "job" else []
    breaks = None if resolve is None else ShopBreaks()
    return _System(name, module, ids, options, Detector(config, plugins=plugins), breaks=breaks)


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
        if event.HasField("resolution"):
            if system.breaks is not None:
                system.breaks.seen(event.resolution)
            continue
        system.observe(event.results, time.monotonic() - started)


async def _read_books(system: _System) -> None:
    """Once the shop's detector broke a deadlock, read the shop's books every ``BOOKS_EVERY`` s: the
    services' until the first break's ``ABORTED`` is found in them, the client's all along."""
    assert system.breaks is not None
    while True:
        await asyncio.sleep(BOOKS_EVERY)
        if system.breaks.first is not None:
            await _read_once(system)


async def _read_once(system: _System) -> None:
    shop, breaks = system.shop, system.breaks
    assert shop is not None and breaks is not None
    roles = [*SERVICES, "client"] if breaks.wants_services else ["client"]
    try:
        books = await asyncio.to_thread(lambda: {role: shop.status(role) for role in roles})
    except grpc.RpcError:
        return  # a process is busy or gone; the next read tells
    breaks.read(books)


async def _read_books_last(system: _System) -> None:
    """Read the shop's breaks and books one last time, for the report: the breaks sent by now, each
    with its report if that comes within :data:`REPORT_WAIT` seconds (a break sent just before the
    end is answered some milliseconds later, and is not pending), and none sent after."""
    if system.shop is None or system.breaks is None:
        return
    store = system.detector.store
    latest = store.resolutions(100_000)
    sent = {resolution.resolution_id for resolution in latest}
    deadline = time.monotonic() + REPORT_WAIT
    while _pending(latest, sent) and time.monotonic() < deadline:
        await asyncio.sleep(REPORT_POLL)
        latest = store.resolutions(100_000)
    # Every break the store holds, oldest first: the final word on each, even one whose
    # watch event had not been read yet.
    for resolution in reversed(latest):
        system.breaks.seen(resolution)
    system.breaks.keep(sent)
    if system.breaks.first is not None:
        await _read_once(system)
    system.breaks.keep(sent)  # the watch may have brought newer ones meanwhile


def _pending(resolutions: Sequence[Resolution], ids: set[int]) -> bool:
    """Whether a break of ``ids`` among ``resolutions`` still waits for its report."""
    return any(outcome_word(r) == "pending" for r in resolutions if r.resolution_id in ids)


async def _stop_shop(system: _System) -> bool:
    """Stop the shop's processes; whether they all exited on SIGTERM (none had to be killed)."""
    if system.shop is None:
        return False
    codes = await asyncio.to_thread(system.shop.stop)
    system.stopped_cleanly = bool(codes) and all(code is not None for code in codes.values())
    return system.stopped_cleanly


def _where(detector: Detector) -> dict[str, str | None]:
    """Where a detector listens: its web page (None when it serves none), gRPC API and /metrics."""
    return {"web": detector.web_url, "address": detector.address, "metrics": detector.metrics_url}


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
        and bank.conserved > 0
        and "deadlock" in philosophers.first_seen
        and "termination" in job.first_seen
        and shop.breaks is not None
        and shop.breaks.broken >= 1
        and shop.breaks.orders_after > 0
    )


async def _show(
    systems: list[_System],
    started: float,
    duration: float,
    stop: asyncio.Event,
    console: Console,
    live: bool,
) -> None:
    """Refresh the live view until every outcome was seen :data:`LINGER` seconds ago, time is up, or Ctrl-C."""
    deadline = started + duration
    all_seen: float | None = None  # when every outcome was first seen
    view = Live(_view(systems, started, duration), console=console, refresh_per_second=4) if live else None
    with view if view is not None else contextlib.nullcontext():
        while not stop.is_set() and time.monotonic() < deadline:
            if all_seen is None and _done(systems):
                all_seen = time.monotonic()
            if all_seen is not None and time.monotonic() >= all_seen + LINGER:
                break
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
        table.add_row(Text(system.name), members, str(system.completed), str(system.aborted), cells, Text(where))
    lines = [table, Text(f"metrics: {', '.join(s.detector.metrics_url or '-' for s in systems)}", style="dim")]
    for system in systems:
        for name, at in sorted(system.first_seen.items(), key=lambda item: item[1]):
            if name in ("deadlock", "termination"):
                lines.append(Text(f"  {system.name}: {name} first reported at {at:.1f} s", style="bold"))
        if system.calls:
            lines.append(Text(f"    cycle of calls: {calls_text(system.calls)}"))
        if system.breaks is not None and system.breaks.resolutions:
            lines.extend(_breaks_lines(system.breaks))
    return Group(*lines)


def _breaks_lines(breaks: ShopBreaks) -> list[Text]:
    """Under the shop: how many breaks, the orders since the first, and the latest few breaks."""
    total = len(breaks.resolutions)
    others = ", ".join(f"{count} {word}" for word, count in sorted(breaks.outcomes().items()) if word != "broken")
    head = f"    {plural(total, 'break')} ({SHOP_POLICY}): {breaks.broken} broken" + (f", {others}" if others else "")
    if breaks.orders_at_break is not None:
        head += f"; orders completed: {breaks.orders_at_break} by the first break, {breaks.orders_after} since"
    lines = [Text(head, style="bold")]
    for resolution in breaks.latest(BREAK_LINES):
        line = Text("      ")
        line.append_text(resolution_line(resolution))
        lines.append(line)
    return lines


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
    return DemoReport(
        snapshots_completed=sum(system.completed for system in systems),
        deadlock_detected="deadlock" in philosophers.first_seen,
        deadlock_cycle=cycle,
        termination_detected="termination" in job.first_seen,
        conservation_ok=bank.conserved > 0 and not bank.conservation_broken,
        seconds=round(seconds, 2),
        bank_totals=dict(bank.conserved_totals),
        bank_conserved=bank.conserved,
        bank_conservation_unknown=bank.conservation_unknown,
        bank_conservation_broken=bank.conservation_broken,
        graph_dot=graph_dot,
        graph_png=graph_png,
        archives={system.name: str(system.detector.config.archive) for system in systems},
        shop_deadlock_detected="deadlock" in shop.first_seen,
        shop_deadlock_calls=shop.calls,
        shop_stopped=shop.stopped_cleanly,
        **_shop_breaks_report(shop.breaks),
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


def _shop_breaks_report(breaks: ShopBreaks | None) -> dict[str, Any]:
    """The report's ``shop_*`` fields about breaking the shop's deadlocks."""
    breaks = breaks or ShopBreaks()
    first, victim, client = breaks.first, breaks.victim_aborted, breaks.client_aborted
    return {
        "shop_breaks": breaks.broken,
        "shop_break_outcomes": breaks.outcomes(),
        "shop_break_snapshot": None if first is None else first.snapshot_id,
        "shop_victim": None
        if first is None
        else {"process": first.process_id, "task": first.task, "instance": first.instance},
        "shop_break_component": [] if first is None else [call_of(n.process, n.task) for n in first.component],
        "shop_victim_aborted": None
        if victim is None
        else {"service": victim.role, "method": victim.method, "details": victim.details},
        "shop_aborted_details": None if client is None else client.details,
        "shop_recovery_ms": breaks.recovery_ms,
        "shop_break_report_ms": breaks.report_ms,
        "shop_orders_at_break": breaks.orders_at_break,
        "shop_orders_after_break": breaks.orders_after,
    }


def _first_deadlock(system: _System) -> int | None:
    history = system.detector.store.predicate_history("deadlock", limit=100_000)
    deadlocked = [snapshot_id for snapshot_id, holds in history if holds]
    return min(deadlocked) if deadlocked else None
