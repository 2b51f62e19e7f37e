"""``stablewatch detector``: run the detector service until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import sys
from pathlib import Path

from rich.console import Console

from stablewatch.cli import arguments
from stablewatch.cli.exits import EXIT_ERROR, EXIT_INTERRUPTED
from stablewatch.detector.evaluation.plugins import PluginError, entry_point_predicates
from stablewatch.detector.evaluation.victims import POLICIES
from stablewatch.detector.service.detector import Detector, DetectorConfig
from stablewatch.detector.service.limits import Limits
from stablewatch.detector.service.store import StoreError

__all__ = ["add_parser", "run"]


def add_parser(commands: argparse._SubParsersAction) -> None:
    config = DetectorConfig()
    limits = config.limits
    detector = commands.add_parser(
        "detector",
        help="run the detector: scheduled snapshots, predicates, the query API, /metrics",
        description="Run the detector until SIGINT or SIGTERM. Agents attach to --listen, and the "
        "status, snapshot, watch, graph, resolve and resolutions commands query it there.",
    )
    add = detector.add_argument
    add("--listen", type=arguments.address, default=config.listen, metavar="HOST:PORT",
        help="gRPC address (%(default)s; port 0: any free port, which --json reports)")  # fmt: skip
    add("--data-dir", type=Path, default=Path("stablewatch-data"), metavar="DIR", help="store folder (%(default)s)")
    add("--metrics-port", type=arguments.metrics_port, default=config.metrics_port, metavar="N",
        help="/metrics port (%(default)s; 0: any free port, which --json reports; -1 or none: off)")  # fmt: skip
    add("--metrics-address", metavar="HOST",
        help="where /metrics listens (default: the --listen host; 127.0.0.1 keeps it on this machine)")  # fmt: skip
    add("--web-port", type=_web_port, default=config.web_port, metavar="N",
        help="serve the web view (the live wait-for graph, predicates, timeline) on its own port N on "
        "the --metrics-address, with the same TLS (default: at / on the metrics port; 0: any free "
        "port, given as \"web\" by --json)")  # fmt: skip
    add("--interval", type=arguments.interval, default=config.interval, metavar="S",
        help="seconds between scheduled snapshots (%(default)s; 0 or off: only on demand)")  # fmt: skip
    add("--jitter", type=arguments.fraction, default=config.jitter, metavar="F",
        help="stretch or shrink each interval by up to this fraction (%(default)s)")  # fmt: skip
    add("--deadline", type=arguments.positive, default=config.deadline, metavar="S",
        help="abort a snapshot not complete after S seconds (%(default)s)")  # fmt: skip
    add("--max-concurrent", type=arguments.positive_int, default=config.max_concurrent, metavar="N",
        help="scheduled snapshots running at once (%(default)s)")  # fmt: skip
    add("--min-members", type=arguments.positive_int, default=config.min_members, metavar="N",
        help="snapshots wait until N agents are attached (default %(default)s)")  # fmt: skip
    add("--members", type=arguments.members, default=((), 0), metavar="ID,ID,...|N",
        help="the system's processes, by id or by number: termination and conservation are unknown "
        "(never true) on a snapshot without all of them (default: whoever is attached)")  # fmt: skip
    add("--heartbeat-timeout", type=arguments.positive, default=config.heartbeat_timeout, metavar="S",
        help="detach an agent silent this long (%(default)s); agents beat every S/3 s, at most 1 s")  # fmt: skip
    add("--expect", type=arguments.expected_total, action="append", default=[], metavar="COUNTER=TOTAL",
        help="expected total of a conserved counter (repeatable; default: the first snapshot's)")  # fmt: skip
    add("--predicate", type=arguments.predicate, action="append", default=[], metavar="MODULE:FUNCTION",
        help="a user predicate (repeatable); `stablewatch.predicates` entry points are always loaded")  # fmt: skip
    add("--keep", type=arguments.keep, default=config.max_snapshots, metavar="N",
        help="keep the newest N snapshots (%(default)s; none: no limit)")  # fmt: skip
    add("--keep-days", type=arguments.keep_days, default=7.0, metavar="D",
        help="delete snapshots older than D days (%(default)s; none: no limit)")  # fmt: skip
    add("--archive", type=Path, metavar="DIR",
        help="also write every finished snapshot to this Parquet archive (a local or mounted folder)")  # fmt: skip
    add("--archive-batch", type=arguments.positive_int, default=config.archive_batch, metavar="N",
        help="with --archive: write a batch once N snapshots wait (%(default)s)")  # fmt: skip
    add("--archive-age", type=arguments.positive, default=config.archive_age, metavar="S",
        help="with --archive: or once the oldest has waited S seconds (%(default)s)")  # fmt: skip
    add("--replica", type=arguments.replica, default=config.replica, metavar="N",
        help="this detector's replica number, when several run side by side over the same agents "
        "(README: Running two detectors): each needs its own, 0 to 127; its snapshot ids never "
        "collide with the others' (%(default)s)")  # fmt: skip
    add("--json", action="store_true",
        help='print {"event": "ready", "address": ..., "metrics": ..., "web": ...} (what it serves where) '
        "when ready")  # fmt: skip
    resolve = detector.add_argument_group(
        "breaking deadlocks", "end the deadlocks a snapshot proves by breaking one wait of each (DESIGN.md)"
    )
    add = resolve.add_argument
    add("--resolve", choices=POLICIES, metavar="POLICY",
        help="break every deadlock a snapshot proves: its victim's agent ends one wait of it (the caller "
        "gets ABORTED or DeadlockVictim), chosen by POLICY: youngest (the wait that began last) or oldest. "
        "Never on an unknown deadlock, never twice for one deadlock until a later snapshot still shows it. "
        "Default: off (an operator may still break one with `stablewatch resolve`)")  # fmt: skip
    add("--report-timeout", type=arguments.positive, default=config.report_timeout, metavar="S",
        help="give up on a break whose agent has not reported within S seconds (%(default)s)")  # fmt: skip
    add("--no-hints", dest="hints", action="store_false",
        help="ignore the agents' long-wait hints (by default a hint starts a snapshot at once, so a "
        "deadlock is found without waiting for the schedule)")  # fmt: skip
    add("--hint-rate", type=arguments.rate_limit, default=arguments.rate_text(limits.hint_rate), metavar="N/S",
        help="at most N snapshots for hints per S seconds, one at a time (%(default)s)")  # fmt: skip
    security = detector.add_argument_group(
        "security", "TLS, mutual TLS and the bounds against abuse (SECURITY.md tells what they protect)"
    )
    add = security.add_argument
    add("--tls-cert", type=arguments.pem("certificate"), metavar="FILE",
        help="serve gRPC over TLS (and /metrics over HTTPS) with this certificate (PEM)")  # fmt: skip
    add("--tls-key", type=arguments.pem("private key"), metavar="FILE", help="the private key of --tls-cert (PEM)")
    add("--tls-client-ca", type=arguments.pem("client CA certificate"), metavar="FILE",
        help="mutual TLS: agents and clients must show a certificate from this CA; it binds agents to "
        "stablewatch://process/<id> and grants stablewatch://role/reader or operator")  # fmt: skip
    add("--trigger-rate", type=arguments.rate, default=arguments.rate_text(limits.trigger_rate), metavar="N/S",
        help="at most N triggered snapshots per S seconds, in bursts of N (%(default)s; off: no limit)")  # fmt: skip
    add("--max-agents", type=arguments.positive_int, default=limits.max_agents, metavar="N",
        help="agents attached at once (%(default)s)")  # fmt: skip
    add("--max-part-bytes", type=arguments.positive_int, default=limits.max_part_bytes, metavar="N",
        help="largest snapshot part an agent may send (%(default)s bytes)")  # fmt: skip


def run(args: argparse.Namespace, console: Console) -> int:
    """Serve until SIGINT or SIGTERM (exit 0); exit 1 when the detector cannot start."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host = args.listen.rpartition(":")[0]
    config = DetectorConfig(
        data_dir=args.data_dir,
        listen=args.listen,
        metrics_port=args.metrics_port,
        metrics_address=(args.metrics_address or host).removeprefix("[").removesuffix("]"),
        web_port=args.web_port,
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
            Limits(),
            trigger_rate=args.trigger_rate,
            max_agents=args.max_agents,
            max_part_bytes=args.max_part_bytes,
            hint_rate=args.hint_rate,
        ),
        resolve=args.resolve,
        report_timeout=args.report_timeout,
        hints=args.hints,
        replica=args.replica,
    )
    try:
        detector = Detector(config, plugins=[*entry_point_predicates(), *args.predicate])
    except PluginError as error:  # a predicate named like a built-in, or two of one name
        print(f"stablewatch: the detector cannot start: {error}", file=sys.stderr)
        return EXIT_ERROR
    try:
        asyncio.run(_serve(detector, args.json))
    except _CannotStart as error:
        print(f"stablewatch: the detector cannot start: {error}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:  # while starting, or a second Ctrl-C while stopping
        return EXIT_INTERRUPTED
    return 0


def _web_port(text: str) -> int:
    """--web-port: a port 0-65535 (0: any free one)."""
    port = arguments.metrics_port(text)
    if port is None:
        raise argparse.ArgumentTypeError(f"expected a port 0-65535, not {text} (leave it out: on the metrics port)")
    return port


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
    log.info("web view on %s", detector.web_url or "nothing: neither a metrics port nor --web-port")
    if as_json:
        urls = {"metrics": detector.metrics_url, "web": detector.web_url}
        print(json.dumps({"event": "ready", "address": detector.address, **urls}), flush=True)
    await stop.wait()
    for signum in (signal.SIGINT, signal.SIGTERM):  # a second signal ends the process at once
        loop.remove_signal_handler(signum)
    log.info("stopping")
    await detector.stop()
