"""The ``stablewatch`` command line.

* ``simulate``, ``demo``: play a COS 418 trace through the protocol core (no services needed).
* ``detector``: run the detector service until SIGINT or SIGTERM.
* ``status``, ``snapshot``, ``watch``, ``graph``: ask a running detector, through its query API
  (:mod:`stablewatch.detector.cli.client`). Human output uses rich; ``--json`` prints one JSON object
  (``watch``: one per line), errors included. ``health``: the detector's health check (for probes).
  With ``--tls-ca`` (and ``--tls-cert``/``--tls-key`` for mutual TLS) they connect with TLS.
* ``archive export``, ``archive check``: backfill a Parquet archive from a detector's store (beside
  the live detector, if one runs), and check every file of an archive
  (:mod:`stablewatch.detector.archive`).
* ``pipeline``: the Spark jobs over the snapshot archive, handed to :mod:`stablewatch.pipeline.cli`
  (imported only then: PySpark is an optional extra).

Exit statuses: 0 success, 1 the detector is unreachable or refused (or a simulation differs from
the expected snapshots), 2 bad flags or input (for ``archive``: a bad store, archive or file), 3
``snapshot`` was aborted (``simulate``: a snapshot failed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import shutil
import signal
import ssl
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from rich.console import Console
from rich.live import Live
from rich.markup import escape

from stablewatch.agents.core import DEFAULT_MAX_RECORDINGS
from stablewatch.agents.tls import channel_credentials, read_pem, server_name_options
from stablewatch.detector.cli.client import DEFAULT_ADDRESS, DEFAULT_TIMEOUT, DetectorClient, DetectorError
from stablewatch.detector.cli.demo import run_demo
from stablewatch.detector.cli.render import (
    WatchView,
    demo_summary,
    members_table,
    proto_dict,
    results_report,
    snapshot_report,
)
from stablewatch.detector.evaluation import evaluate, new_baselines, wait_for_dot
from stablewatch.detector.evaluation.plugins import PluginError, UserPredicate, entry_point_predicates, load_predicate
from stablewatch.detector.evaluation.text import plural
from stablewatch.detector.service.detector import Detector, DetectorConfig
from stablewatch.detector.service.limits import Limits, parse_rate
from stablewatch.detector.service.query import outcome_name
from stablewatch.detector.service.store import DB_FILENAME, Store, StoreError
from stablewatch.detector.sim.cos418 import (
    TOKENS,
    TraceError,
    compare_snaps,
    expected_snap_files,
    format_snap,
    parse_delays,
    parse_events,
    parse_snap,
    parse_topology,
    snap_from_snapshot,
)
from stablewatch.detector.sim.simulator import Simulation, random_delays, tape_delays
from stablewatch.v1.query_pb2 import SNAPSHOT_OUTCOME_COMPLETED, SnapshotResults, WatchEvent

__all__ = ["main"]

EXIT_MISMATCH = 1
EXIT_ERROR = 1  # the detector is unreachable, refused the request, or cannot start
EXIT_BAD_INPUT = 2  # argparse exits with it too
EXIT_ABORTED = 3  # `snapshot`: the snapshot was aborted; `simulate`: a snapshot failed
EXIT_INTERRUPTED = 130  # Ctrl-C, except in `watch` where it is the normal way out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stablewatch", description="Detect stable properties with snapshots.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {importlib.metadata.version('stablewatch')}")
    commands = parser.add_subparsers(dest="command", required=True)

    simulate = commands.add_parser(
        "simulate", help="run a COS 418 trace through the protocol core and write .snap files"
    )
    simulate.add_argument("--topology", type=Path, required=True, help=".top file")
    simulate.add_argument("--events", type=Path, required=True, help=".events file")
    delays = simulate.add_mutually_exclusive_group()
    delays.add_argument("--delays", type=Path, help="delay tape, one integer a line (reproduces COS 418 runs)")
    delays.add_argument("--seed", type=int, default=0, help="seed for random delays 0-4 (default 0)")
    simulate.add_argument("--out", type=Path, required=True, help="folder for <snapshot id>.snap files")
    simulate.add_argument("--expected", type=Path, help="folder or path prefix of expected .snap files")
    simulate.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    simulate.add_argument("--max-recordings", type=_positive_int, metavar="N",
        help=f"refuse a snapshot at a process already recording N, as agents do ({DEFAULT_MAX_RECORDINGS}; "
        "default: no bound)")  # fmt: skip
    simulate.add_argument("--max-recorded-bytes", type=_positive_int, metavar="N",
        help="fail a snapshot whose recording at a process passes N bytes (16 a token message), as agents do "
        "(default: no bound)")  # fmt: skip

    demo = commands.add_parser(
        "demo",
        help="live demo: a token bank, dining philosophers, a terminating job and a shop of gRPC services, "
        "each watched by a detector",
    )
    demo.add_argument("--duration", type=_positive, default=60.0, metavar="S", help="stop after S seconds at most (60)")
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

    config = DetectorConfig()
    limits = config.limits
    detector = commands.add_parser(
        "detector",
        help="run the detector: scheduled snapshots, predicates, the query API, /metrics",
        description="Run the detector until SIGINT or SIGTERM. Agents attach to --listen, and the "
        "status, snapshot, watch and graph commands query it there.",
    )
    add = detector.add_argument
    add("--listen", type=_address, default=config.listen, metavar="HOST:PORT",
        help="gRPC address (%(default)s; port 0: any free port, which --json reports)")  # fmt: skip
    add("--data-dir", type=Path, default=Path("stablewatch-data"), metavar="DIR", help="store folder (%(default)s)")
    add("--metrics-port", type=_metrics_port, default=config.metrics_port, metavar="N",
        help="/metrics port (%(default)s; 0: any free port, which --json reports; -1 or none: off)")  # fmt: skip
    add("--metrics-address", metavar="HOST",
        help="where /metrics listens (default: the --listen host; 127.0.0.1 keeps it on this machine)")  # fmt: skip
    add("--interval", type=_interval, default=config.interval, metavar="S",
        help="seconds between scheduled snapshots (%(default)s; 0 or off: only on demand)")  # fmt: skip
    add("--jitter", type=_fraction, default=config.jitter, metavar="F",
        help="stretch or shrink each interval by up to this fraction (%(default)s)")  # fmt: skip
    add("--deadline", type=_positive, default=config.deadline, metavar="S",
        help="abort a snapshot not complete after S seconds (%(default)s)")  # fmt: skip
    add("--max-concurrent", type=_positive_int, default=config.max_concurrent, metavar="N",
        help="scheduled snapshots running at once (%(default)s)")  # fmt: skip
    add("--min-members", type=_positive_int, default=config.min_members, metavar="N",
        help="snapshots wait until N agents are attached (default %(default)s)")  # fmt: skip
    add("--members", type=_members, default=((), 0), metavar="ID,ID,...|N",
        help="the system's processes, by id or by number: termination and conservation are unknown "
        "(never true) on a snapshot without all of them (default: whoever is attached)")  # fmt: skip
    add("--heartbeat-timeout", type=_positive, default=config.heartbeat_timeout, metavar="S",
        help="detach an agent silent this long (%(default)s); agents beat every S/3 s, at most 1 s")  # fmt: skip
    add("--expect", type=_expected_total, action="append", default=[], metavar="COUNTER=TOTAL",
        help="expected total of a conserved counter (repeatable; default: the first snapshot's)")  # fmt: skip
    add("--predicate", type=_predicate, action="append", default=[], metavar="MODULE:FUNCTION",
        help="a user predicate (repeatable); `stablewatch.predicates` entry points are always loaded")  # fmt: skip
    add("--keep", type=_keep, default=config.max_snapshots, metavar="N",
        help="keep the newest N snapshots (%(default)s; none: no limit)")  # fmt: skip
    add("--keep-days", type=_keep_days, default=7.0, metavar="D",
        help="delete snapshots older than D days (%(default)s; none: no limit)")  # fmt: skip
    add("--archive", type=Path, metavar="DIR",
        help="also write every finished snapshot to this Parquet archive (a local or mounted folder)")  # fmt: skip
    add("--archive-batch", type=_positive_int, default=config.archive_batch, metavar="N",
        help="with --archive: write a batch once N snapshots wait (%(default)s)")  # fmt: skip
    add("--archive-age", type=_positive, default=config.archive_age, metavar="S",
        help="with --archive: or once the oldest has waited S seconds (%(default)s)")  # fmt: skip
    add("--json", action="store_true",
        help='print {"event": "ready", "address": ..., "metrics": ...} (the ports it bound) when serving')  # fmt: skip
    security = detector.add_argument_group(
        "security", "TLS, mutual TLS and the bounds against abuse (SECURITY.md tells what they protect)"
    )
    add = security.add_argument
    add("--tls-cert", type=_pem("certificate"), metavar="FILE",
        help="serve gRPC over TLS (and /metrics over HTTPS) with this certificate (PEM)")  # fmt: skip
    add("--tls-key", type=_pem("private key"), metavar="FILE", help="the private key of --tls-cert (PEM)")
    add("--tls-client-ca", type=_pem("client CA certificate"), metavar="FILE",
        help="mutual TLS: agents and clients must show a certificate from this CA; it binds agents to "
        "stablewatch://process/<id> and grants stablewatch://role/reader or operator")  # fmt: skip
    add("--trigger-rate", type=_rate, default=_rate_text(limits.trigger_rate), metavar="N/S",
        help="at most N triggered snapshots per S seconds, in bursts of N (%(default)s; off: no limit)")  # fmt: skip
    add("--max-agents", type=_positive_int, default=limits.max_agents, metavar="N",
        help="agents attached at once (%(default)s)")  # fmt: skip
    add("--max-part-bytes", type=_positive_int, default=limits.max_part_bytes, metavar="N",
        help="largest snapshot part an agent may send (%(default)s bytes)")  # fmt: skip

    # The query commands share --detector and --json; --timeout bounds every call.
    query = argparse.ArgumentParser(add_help=False)
    query.add_argument("--detector", type=_address, default=DEFAULT_ADDRESS, metavar="HOST:PORT",
                       help="the detector's gRPC address (%(default)s)")  # fmt: skip
    query.add_argument("--json", action="store_true", help="print JSON instead of tables")
    tls = query.add_argument_group(
        "TLS", "connect with TLS: trust --tls-ca; for mutual TLS show --tls-cert and --tls-key"
    )
    tls.add_argument("--tls-ca", type=_pem("CA certificate"), metavar="FILE",
                     help="the CA that signed the detector's certificate (PEM)")  # fmt: skip
    tls.add_argument("--tls-cert", type=_pem("certificate"), metavar="FILE",
                     help="client certificate (PEM) with the role the command needs: stablewatch://role/reader, "
                     "or stablewatch://role/operator for snapshot")  # fmt: skip
    tls.add_argument("--tls-key", type=_pem("private key"), metavar="FILE", help="the key of --tls-cert (PEM)")
    tls.add_argument("--tls-server-name", metavar="NAME",
                     help="the name the detector's certificate must carry (default: the --detector host)")  # fmt: skip
    timeout = argparse.ArgumentParser(add_help=False)
    timeout.add_argument("--timeout", type=_positive, default=DEFAULT_TIMEOUT, metavar="S",
                         help="give up on the detector after S seconds (%(default)s)")  # fmt: skip

    commands.add_parser("status", parents=[query, timeout], help="attached agents and the latest predicate values")
    commands.add_parser(
        "health",
        parents=[query, timeout],
        help="the detector's health check: exit 0 when it is serving (for probes)",
        description="Ask the detector's grpc.health.v1 check. Exit status 0 when it is SERVING, 1 otherwise.",
    )

    snapshot = commands.add_parser(
        "snapshot",
        parents=[query],
        help="take a snapshot now and show its results",
        description="Take a snapshot now. Exit status 0 if it completed, 3 if it was aborted, 1 on errors.",
    )
    snapshot.add_argument("--timeout", type=_positive, metavar="S",
                          help="abort the snapshot after S seconds (default: the detector's --deadline)")  # fmt: skip

    watch = commands.add_parser("watch", parents=[query, timeout], help="follow predicate values live")
    watch.add_argument("--changes-only", action="store_true", help="only snapshots that change a predicate's value")
    watch.add_argument("--count", type=_positive_int, metavar="N", help="stop after N events")

    graph = commands.add_parser("graph", parents=[query, timeout], help="a snapshot's wait-for graph (DOT, PNG, SVG)")
    graph.add_argument("--snapshot", type=_positive_int, metavar="ID", help="snapshot id (default: the latest)")
    graph.add_argument("--format", choices=("dot", "png", "svg"), default="dot",
                       help="DOT text, or an image drawn by Graphviz (%(default)s)")  # fmt: skip
    graph.add_argument("--out", type=Path, metavar="FILE", help="write to FILE instead of stdout")

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
    backfill.add_argument("--batch", type=_positive_int, default=1000, metavar="N",
                          help="snapshots per batch (%(default)s)")  # fmt: skip
    backfill.add_argument("--json", action="store_true", help="print one JSON object")
    checking = archive_commands.add_parser(
        "check", help="read every file of an archive and count its rows",
        description="Read and check every file of the archive. Exit status 2 names the first bad file and why.",
    )  # fmt: skip
    checking.add_argument("--archive", type=Path, required=True, metavar="DIR", help="the archive folder")
    checking.add_argument("--json", action="store_true", help="print one JSON object")
    # Listed for --help only: main() hands `pipeline ...` to the pipeline's own parser.
    commands.add_parser("pipeline", help="analyse the snapshot archive with Spark: evaluate, history, follow")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stablewatch`` console script.

    A command whose output is closed early (``stablewatch snapshot --json | head``) ends quietly.
    """
    try:
        return _main(argv)
    except BrokenPipeError:
        # Python would complain again when it flushes stdout at exit: point stdout at nothing.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0


def _main(argv: Sequence[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["pipeline"]:  # PySpark is an optional extra: imported only for this command
        from stablewatch.pipeline.cli import main as pipeline_main

        return pipeline_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if (getattr(args, "tls_cert", None) is None) != (getattr(args, "tls_key", None) is None):
        parser.error("--tls-cert and --tls-key go together")
    if getattr(args, "tls_cert", None) is not None:
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(args.tls_cert, args.tls_key)
        except ssl.SSLError as error:
            parser.error(f"--tls-key {args.tls_key} is not the key of --tls-cert {args.tls_cert} ({error.reason})")
    if getattr(args, "tls_client_ca", None) is not None and args.tls_cert is None:
        parser.error("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    console = Console()
    if args.command == "detector":
        return _detector(args)
    if args.command in _QUERIES:
        return _query(args, console)
    if args.command == "archive":
        return _archive(args, console)
    try:
        if args.command == "simulate":
            delays = (
                tape_delays(parse_delays(args.delays), str(args.delays)) if args.delays else random_delays(args.seed)
            )
            return _simulate(args, delays, console)
        if args.command == "demo":
            return _demo(args, console)
    except TraceError as error:
        print(f"stablewatch: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


# -- demo ---------------------------------------------------------------------------------------------------


def _demo(args: argparse.Namespace, console: Console) -> int:
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
    if not args.json:
        console.print()
        console.print(demo_summary(report))
    if not args.no_history:
        report.history = _demo_history(Path(report.archives["philosophers"]), args.out / "pipeline", console, args.json)
    if args.json:
        print(json.dumps(dataclasses.asdict(report)))
    return 0 if found and (args.no_history or report.history is not None) else 1


def _demo_history(archive: Path, out: Path, console: Console, quiet: bool) -> dict[str, object] | None:
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


# -- simulate, demo -----------------------------------------------------------------------------------------


def _simulate(args: argparse.Namespace, delays: Iterator[int], console: Console) -> int:
    """Replay a trace, write and print its snapshots; a failed snapshot is printed with its reason and
    exits 3, a difference from the expected snapshots exits 1."""
    topology_path, events_path, out, expected, as_json = args.topology, args.events, args.out, args.expected, args.json
    topology = parse_topology(topology_path)
    events = parse_events(events_path, topology)
    expected_snaps = [parse_snap(path) for path in expected_snap_files(expected)] if expected else None
    simulation = Simulation(
        topology,
        delays,
        events_source=str(events_path),
        max_recordings=args.max_recordings,
        max_recorded_bytes=args.max_recorded_bytes,
    )
    snapshots = simulation.run(events)

    totals = {TOKENS: sum(topology.balances.values())}
    entries = []
    for snapshot in snapshots:
        evaluation = evaluate(snapshot, totals)
        totals.update(new_baselines(evaluation))
        entries.append((snapshot, list(evaluation.results)))
    snaps = [snap_from_snapshot(snapshot) for snapshot in snapshots]
    if out is not None:
        try:
            out.mkdir(parents=True, exist_ok=True)
            for snap in snaps:
                (out / f"{snap.snapshot_id}.snap").write_text(format_snap(snap))
        except FileExistsError:
            raise TraceError(out, 0, "--out must be a folder, and this is an existing file") from None
        except OSError as error:
            raise TraceError(out, 0, f"cannot write the .snap files: {error.strerror or error}") from None
    differences = compare_snaps(snaps, expected_snaps) if expected_snaps is not None else []

    if as_json:
        report = {
            "snapshots": [
                {
                    "snapshot_id": snapshot.snapshot_id,
                    "snap": format_snap(snap),
                    "results": [MessageToDict(result) for result in results],
                }
                for (snapshot, results), snap in zip(entries, snaps, strict=True)
            ],
            "started": simulation.started,
            "failed": [{"snapshot_id": aborted.snapshot_id, "reason": aborted.reason} for aborted in simulation.failed],
            "matches_expected": None if expected_snaps is None else not differences,
            "differences": differences,
        }
        print(json.dumps(report))
    else:
        console.print(snapshot_report(entries, title=f"{plural(len(snapshots), 'snapshot')} of {events_path.name}"))
        if out is not None:
            console.print(f"wrote {plural(len(snaps), '.snap file')} to {out}")
        for aborted in simulation.failed:
            console.print(f"[red]failed[/]: snapshot {aborted.snapshot_id}: {escape(aborted.reason)}", soft_wrap=True)
        if simulation.failed:
            console.print(f"[red]{len(simulation.failed)} of {plural(simulation.started, 'snapshot')} failed[/]")
        if expected_snaps is not None:
            for difference in differences:
                console.print(f"[red]differs[/]: {difference}")
            if not differences:
                matched = plural(len(expected_snaps), "expected snapshot")
                console.print(f"[green]{'the' if len(expected_snaps) == 1 else 'all'} {matched} match[/]")
    if simulation.failed:
        return EXIT_ABORTED
    return EXIT_MISMATCH if differences else 0


# -- detector -----------------------------------------------------------------------------------------------


def _detector(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host = args.listen.rpartition(":")[0]
    config = DetectorConfig(
        data_dir=args.data_dir,
        listen=args.listen,
        metrics_port=args.metrics_port,
        metrics_address=(args.metrics_address or host).removeprefix("[").removesuffix("]"),
        interval=args.interval,
        jitter=args.jitter,
        deadline=args.deadline,
        max_concurrent=args.max_concurrent,
        min_members=args.min_members,
        expected_members=args.members[0],
        expected_member_count=args.members[1],
        heartbeat_interval=min(1.0, args.heartbeat_timeout / 3),
        heartbeat_timeout=args.heartbeat_timeout,
        expected_totals=dict(args.expect),
        max_snapshots=args.keep,
        max_age_seconds=None if args.keep_days is None else args.keep_days * 86400,
        archive=args.archive,
        archive_batch=args.archive_batch,
        archive_age=args.archive_age,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        limits=dataclasses.replace(
            Limits(), trigger_rate=args.trigger_rate, max_agents=args.max_agents, max_part_bytes=args.max_part_bytes
        ),
    )
    detector = Detector(config, plugins=[*entry_point_predicates(), *args.predicate])
    try:
        asyncio.run(_serve(detector, args.json))
    except _CannotStart as error:
        print(f"stablewatch: the detector cannot start: {error}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:  # while starting, or a second Ctrl-C while stopping
        return EXIT_INTERRUPTED
    return 0


class _CannotStart(Exception):
    """The detector cannot listen, serve /metrics or open its store; the message says why."""


async def _serve(detector: Detector, as_json: bool) -> None:
    """Run `detector` until SIGINT or SIGTERM, then stop it."""
    from stablewatch.detector.archive.schema import ArchiveError  # pyarrow: not for the other commands

    log = logging.getLogger("stablewatch.detector")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await detector.start()
    # grpc raises RuntimeError for an address it cannot bind
    except (OSError, RuntimeError, StoreError, ArchiveError) as error:
        with contextlib.suppress(Exception):
            await detector.stop()
        message = str(error)
        if isinstance(error, OSError) and error.errno is not None:  # from prometheus-client's HTTP server
            message = f"/metrics on {detector.config.metrics_address}:{detector.config.metrics_port}: {error.strerror}"
        raise _CannotStart(message) from error
    except BaseException:
        with contextlib.suppress(Exception):
            await detector.stop()
        raise
    log.info("gRPC (agent control, query API, health, reflection) on %s", detector.address)
    log.info("metrics on %s", detector.metrics_url or "nothing: /metrics is off")
    if as_json:
        print(json.dumps({"event": "ready", "address": detector.address, "metrics": detector.metrics_url}), flush=True)
    await stop.wait()
    for signum in (signal.SIGINT, signal.SIGTERM):  # a second signal ends the process at once
        loop.remove_signal_handler(signum)
    log.info("stopping")
    await detector.stop()


# -- archive export, check ---------------------------------------------------------------------------------


def _archive(args: argparse.Namespace, console: Console) -> int:
    """``archive export`` or ``archive check``; a bad store, archive or file exits 2 with what and why."""
    from stablewatch.detector.archive.schema import ArchiveError  # pyarrow: not for the other commands

    try:
        if args.archive_command == "export":
            return _archive_export(args, console)
        return _archive_check(args, console)
    except (ArchiveError, StoreError) as error:
        print(f"stablewatch: {error}", file=sys.stderr)
        if args.json:
            _print_json({"error": str(error)})
        return EXIT_BAD_INPUT


def _archive_export(args: argparse.Namespace, console: Console) -> int:
    from stablewatch.detector.archive.export import export

    if not (args.data_dir / DB_FILENAME).is_file():
        raise StoreError(f"{args.data_dir} holds no stablewatch store ({DB_FILENAME} is missing)")
    # Without the lock: a detector may be running on this store. No retention: nothing is deleted.
    with Store(args.data_dir, max_snapshots=None, max_age_seconds=None, lock=False) as store:
        result = export(store, args.archive, args.batch)
    if args.json:
        _print_json({"archive": str(args.archive), **dataclasses.asdict(result)})
    elif result.exported:
        console.print(
            f"exported {_count(result.exported, 'snapshot')} to {args.archive} in {_count(result.batches, 'batch')} "
            f"({_count(result.files, 'file')}); {result.already} were there already",
            highlight=False,
            soft_wrap=True,
        )
    else:
        console.print(
            f"nothing new to export: {args.archive} holds all {_count(result.already, 'finished snapshot')} "
            f"of {args.data_dir}",
            highlight=False,
            soft_wrap=True,
        )
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 'es' if noun.endswith('ch') else 's'}"


def _archive_check(args: argparse.Namespace, console: Console) -> int:
    from stablewatch.detector.archive.reader import check

    found = check(args.archive)
    if args.json:
        _print_json({"archive": str(args.archive), **dataclasses.asdict(found)})
        return 0
    snapshots = ", ".join(f"{count} {outcome}" for outcome, count in found.outcomes.items()) or "none"
    console.print(
        f"{args.archive}: schema version {found.schema_version}, snapshots: {snapshots}",
        highlight=False,
        soft_wrap=True,
    )
    for table, files in found.files.items():
        console.print(f"  {table:<10} {found.rows[table]:>10} rows in {files} files", highlight=False, soft_wrap=True)
    return 0


# -- status, snapshot, watch, graph -------------------------------------------------------------------------


class _CommandError(Exception):
    """A query command cannot do what was asked (exit 1); the message says why."""


def _query(args: argparse.Namespace, console: Console) -> int:
    """Run a query command; the detector's errors exit 1 with the message (also as JSON with --json)."""
    credentials = None
    if args.tls_ca is not None or args.tls_cert is not None:
        credentials = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)
    options = server_name_options(args.tls_server_name)
    try:
        with DetectorClient(
            args.detector, timeout=args.timeout or DEFAULT_TIMEOUT, credentials=credentials, options=options
        ) as client:
            return _QUERIES[args.command](client, args, console)
    except (DetectorError, _CommandError) as error:
        print(f"stablewatch: {error}", file=sys.stderr)
        if args.json:
            code = getattr(error, "code", None)
            _print_json({"error": str(error), "code": code.name if code else None})
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 0 if args.command == "watch" else EXIT_INTERRUPTED


def _status(client: DetectorClient, args: argparse.Namespace, console: Console) -> int:
    membership = client.membership()
    members = list(membership.members)
    latest = _latest_or_none(client)
    if args.json:
        _print_json(
            {
                "detector": client.address,
                "members": [proto_dict(member) for member in members],
                "expected_missing": list(membership.expected_missing),
                "expected_count": membership.expected_count,
                "latest": None if latest is None else proto_dict(latest),
            }
        )
    else:
        console.print(members_table(members) if members else "[dim]no agent is attached[/]")
        if membership.expected_missing:
            missing = ", ".join(membership.expected_missing)
            console.print(f"[yellow]expected but not attached: {missing}[/] (whole-system predicates are unknown)")
        if membership.expected_count and len(members) < membership.expected_count:
            console.print(f"[yellow]{len(members)} of {membership.expected_count} expected processes are attached[/]")
        console.print(results_report(latest) if latest else "[dim]no snapshot has completed yet[/]")
    return 0


def _health(client: DetectorClient, args: argparse.Namespace, console: Console) -> int:
    status = client.health()
    if args.json:
        _print_json({"detector": client.address, "status": status})
    else:
        console.print(f"{client.address}: {status}", highlight=False)
    return 0 if status == "SERVING" else EXIT_ERROR


def _snapshot(client: DetectorClient, args: argparse.Namespace, console: Console) -> int:
    if args.json:
        results = client.trigger_snapshot(args.timeout)
    else:
        with console.status(f"taking a snapshot of the agents attached to {client.address}…"):
            results = client.trigger_snapshot(args.timeout)
    summary = results.snapshot
    if args.json:
        _print_json(
            {
                "detector": client.address,
                "snapshot_id": summary.snapshot_id,
                "outcome": outcome_name(summary.outcome),
                "abort_reason": summary.abort_reason,
                "results": proto_dict(results),
            }
        )
        if summary.outcome != SNAPSHOT_OUTCOME_COMPLETED:  # for whoever reads the script's stderr
            print(f"stablewatch: snapshot {summary.snapshot_id} aborted: {summary.abort_reason}", file=sys.stderr)
    else:
        console.print(results_report(results))  # the summary line gives an abort's reason
    return 0 if summary.outcome == SNAPSHOT_OUTCOME_COMPLETED else EXIT_ABORTED


def _watch(client: DetectorClient, args: argparse.Namespace, console: Console) -> int:
    client.members()  # fails within --timeout when the detector is not there; the stream has no deadline
    view = WatchView()
    events = client.watch(args.changes_only)
    live = None if args.json else Live(view.render(), console=console, auto_refresh=False)
    try:
        if live is not None:
            live.start(refresh=True)
        for seen, event in enumerate(events, 1):
            if live is None:
                _print_json(_watch_json(event))
            else:
                view.update(event)
                live.update(view.render(), refresh=True)
            if seen == args.count:
                return 0
    finally:
        events.close()
        if live is not None:
            live.stop()
            if not console.is_terminal:  # rich leaves the last line open when output is not a terminal
                console.line()
    raise _CommandError(f"the detector at {client.address} ended the stream (it is shutting down)")


def _graph(client: DetectorClient, args: argparse.Namespace, console: Console) -> int:
    if args.format != "dot" and shutil.which("dot") is None:
        raise _CommandError(
            f"--format {args.format} needs Graphviz's `dot` command: install graphviz "
            "(e.g. `apt install graphviz`, `brew install graphviz`) or use --format dot"
        )
    if args.format != "dot" and args.out is None and (args.json or sys.stdout.isatty()):
        raise _CommandError(f"--format {args.format} needs --out FILE here (or redirect stdout to a file)")
    snapshot_id = args.snapshot or client.latest_results().snapshot.snapshot_id
    graph = client.wait_for_graph(snapshot_id)
    dot = wait_for_dot(graph)
    data = dot.encode() if args.format == "dot" else _graphviz(dot, args.format)
    if args.out is not None:
        try:
            args.out.write_bytes(data)
        except OSError as error:
            raise _CommandError(f"cannot write {args.out}: {error.strerror or error}") from None
    if args.json:
        written = None if args.out is None else str(args.out)
        _print_json({"snapshot_id": snapshot_id, "out": written, "dot": dot, "graph": proto_dict(graph)})
    elif args.out is None:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        console.print(f"wrote the wait-for graph of snapshot {snapshot_id} to {args.out}", highlight=False)
    return 0


_QUERIES: dict[str, Callable[[DetectorClient, argparse.Namespace, Console], int]] = {
    "status": _status,
    "health": _health,
    "snapshot": _snapshot,
    "watch": _watch,
    "graph": _graph,
}


def _print_json(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def _latest_or_none(client: DetectorClient) -> SnapshotResults | None:
    try:
        return client.latest_results()
    except DetectorError as error:
        if error.code == grpc.StatusCode.NOT_FOUND:
            return None
        raise


def _watch_json(event: WatchEvent) -> dict[str, Any]:
    outcome = outcome_name(event.results.snapshot.outcome) if event.HasField("results") else None
    return {"outcome": outcome, **proto_dict(event)}


def _graphviz(dot: str, image_format: str) -> bytes:
    try:
        drawn = subprocess.run(["dot", f"-T{image_format}"], input=dot.encode(), capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise _CommandError(f"Graphviz's `dot` failed: {error}") from None
    if drawn.returncode != 0:
        raise _CommandError(f"Graphviz's `dot` failed: {drawn.stderr.decode(errors='replace').strip()}")
    return drawn.stdout


# -- argument types (argparse turns their ArgumentTypeError into exit status 2 and the message) -------------

_OFF = ("none", "off")


def _address(text: str) -> str:
    """``HOST:PORT`` (an IPv6 host in brackets); port 0 lets the system pick one."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, e.g. 127.0.0.1:50051, not {text!r}")
    return text


def _number(text: str, *, integer: bool = False) -> float:
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if integer else 'a number'}, not {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, not {text!r}")
    return value


def _positive(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(_number(text, integer=True))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text}")
    return value


def _fraction(text: str) -> float:
    value = _number(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, not {text}")
    return value


def _interval(text: str) -> float | None:
    if text.lower() in _OFF or _number(text) == 0:
        return None
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"must be 0 or off (on demand only) or a positive number of seconds, not {text}"
        )
    return value


def _metrics_port(text: str) -> int | None:
    if text.lower() in _OFF or text == "-1":
        return None
    port = int(_number(text, integer=True))
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0-65535, or -1/none for no /metrics, not {text}")
    return port


def _keep(text: str) -> int | None:
    if text.lower() in _OFF:
        return None
    count = int(_number(text, integer=True))
    if count < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, or none, not {text}")
    return count


def _keep_days(text: str) -> float | None:
    return None if text.lower() in _OFF else _positive(text)


def _members(text: str) -> tuple[tuple[str, ...], int]:
    """``--members``: a comma-separated list of process ids, or how many processes there are."""
    text = text.strip()
    if text.isdigit():
        count = int(text)
        if count < 1:
            raise argparse.ArgumentTypeError(f"a number of members must be at least 1, not {text}")
        return (), count
    ids = tuple(part.strip() for part in text.split(","))
    if not text or any(not part for part in ids):
        raise argparse.ArgumentTypeError(f"expected ID,ID,... or a number, not {text!r}")
    return tuple(dict.fromkeys(ids)), 0


def _expected_total(text: str) -> tuple[str, int]:
    counter, sep, total = text.partition("=")
    if not sep or not counter.strip():
        raise argparse.ArgumentTypeError(f"expected COUNTER=TOTAL, e.g. tokens=300, not {text!r}")
    return counter.strip(), int(_number(total.strip(), integer=True))


def _pem(what: str) -> Callable[[str], Path]:
    """A PEM file holding `what`, readable now: a missing or non-PEM file exits 2 naming it."""

    def check(text: str) -> Path:
        try:
            read_pem(text, what)
        except (OSError, ValueError) as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return Path(text)

    return check


def _rate_text(rate: tuple[int, float] | None) -> str:
    return "off" if rate is None else f"{rate[0]}/{rate[1]:g}"


def _rate(text: str) -> tuple[int, float] | None:
    if text.lower() in _OFF:
        return None
    try:
        return parse_rate(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _predicate(spec: str) -> UserPredicate:
    try:
        return load_predicate(spec)
    except PluginError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


if __name__ == "__main__":
    sys.exit(main())
