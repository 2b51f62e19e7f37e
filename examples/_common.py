"""What the example services share: options, peer discovery through a folder, the run loop.

Every example is one agent per OS process. Processes find each other through a folder that
they all can read (``--peers-dir``): once listening, a process writes its address to
``DIR/<id>.addr`` (atomically, so a reader never sees half an address) and resolves a peer by
reading ``DIR/<peer>.addr`` when it first sends to it. Use a fresh folder for each run: a file
left by an earlier run would point at a dead address.

:func:`run_service` does the rest: logging to stderr, the agent's life cycle, ``--duration``,
and a clean exit (status 0) on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from stablewatch.agents import Agent, ChannelSettings, TlsConfig

__all__ = [
    "PeerDirectory",
    "Service",
    "configure_logging",
    "id_list",
    "run_service",
    "send_now",
    "service_parser",
    "service_rng",
]

PEER_TIMEOUT = 60.0  # seconds a service waits for its peers to publish their addresses
_POLL = 0.02  # seconds between looks into the peers folder

log = logging.getLogger("stablewatch.examples")


class Service(Protocol):
    """An example's application logic; its agent is already started when :meth:`run` is called."""

    async def run(self) -> None:
        """Do the work, normally forever; the service is stopped by cancelling this coroutine."""


def id_list(text: str) -> list[str]:
    """Parse ``"A,B,C"`` into ``["A", "B", "C"]`` (an argparse ``type``); ids must be distinct."""
    ids = [part.strip() for part in text.split(",") if part.strip()]
    if len(ids) < 2 or len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"expected at least two distinct comma-separated ids, got {text!r}")
    return ids


def service_parser(example: str, description: str) -> argparse.ArgumentParser:
    """An argument parser for ``python -m stablewatch.examples.<example>`` with the options every example takes."""
    parser = argparse.ArgumentParser(prog=f"python -m stablewatch.examples.{example}", description=description)
    parser.add_argument("--id", required=True, help="this process's id")
    parser.add_argument("--listen", default="127.0.0.1:0", help="where the agent listens (default: a free port)")
    parser.add_argument(
        "--peers-dir", required=True, type=Path, help="folder where processes publish their addresses (<id>.addr)"
    )
    parser.add_argument(
        "--detector",
        metavar="HOST:PORT",
        help="the detector's control address; several, separated by commas, when detectors run side by side",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random choices (default 0)")
    parser.add_argument("--duration", type=float, help="seconds to run (default: until SIGTERM or SIGINT)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    tls = parser.add_argument_group("TLS", "mutual TLS to peers and the detector (all three, or none)")
    tls.add_argument("--tls-cert", type=Path, help="this process's certificate, naming stablewatch://process/<id>")
    tls.add_argument("--tls-key", type=Path, help="the key of --tls-cert")
    tls.add_argument("--tls-ca", type=Path, help="the CA that signs the detector's and the peers' certificates")
    return parser


def service_tls(args: argparse.Namespace) -> TlsConfig | None:
    """The TLS identity of ``--tls-cert``, ``--tls-key`` and ``--tls-ca``; None without them."""
    given = [args.tls_cert, args.tls_key, args.tls_ca]
    if not any(given):
        return None
    if not all(given):
        raise SystemExit("--tls-cert, --tls-key and --tls-ca go together")
    return TlsConfig(args.tls_cert, args.tls_key, args.tls_ca)


def service_rng(args: argparse.Namespace, purpose: str = "") -> random.Random:
    """A generator seeded by ``--seed``, this process's id and `purpose`: reproducible, distinct per use."""
    return random.Random(f"{args.seed}/{args.id}/{purpose}")


def send_now(
    agent: Agent, dest: str, payload: bytes, *, counters: dict[str, int] | None = None, wakes: bool = True
) -> None:
    """Send without awaiting, so the send is atomic with the state change around it.

    Examples send a handful of messages per window, so a full window means something is wrong.
    """
    if not agent.try_send(dest, payload, counters=counters, wakes=wakes):
        raise RuntimeError(f"the channel to {dest} is full")


class PeerDirectory:
    """Peer discovery through a shared folder: ``<id>.addr`` files holding ``host:port``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _path(self, process_id: str) -> Path:
        return self.folder / f"{process_id}.addr"

    def publish(self, process_id: str, address: str) -> None:
        """Write `address` for `process_id`: to a temporary file first, then renamed into place."""
        self.folder.mkdir(parents=True, exist_ok=True)
        temporary = self.folder / f".{process_id}.addr.{os.getpid()}"
        temporary.write_text(address + "\n")
        os.replace(temporary, self._path(process_id))

    def withdraw(self, process_id: str) -> None:
        """Remove `process_id`'s file (on a clean exit), so no one dials a dead address later."""
        with contextlib.suppress(FileNotFoundError):
            self._path(process_id).unlink()

    def resolve(self, process_id: str) -> str:
        """The published address of `process_id`; KeyError if it has none (the agent's peer resolver)."""
        try:
            address = self._path(process_id).read_text().strip()
        except FileNotFoundError:
            raise KeyError(process_id) from None
        if not address:
            raise KeyError(process_id)
        return address

    async def wait_for_peers(self, ids: Iterable[str], timeout: float = PEER_TIMEOUT) -> dict[str, str]:
        """Poll until every id in `ids` has published; return their addresses. TimeoutError after `timeout`."""
        wanted = sorted(set(ids))
        deadline = time.monotonic() + timeout
        while True:
            found: dict[str, str] = {}
            for process_id in wanted:
                with contextlib.suppress(KeyError):
                    found[process_id] = self.resolve(process_id)
            if len(found) == len(wanted):
                return found
            if time.monotonic() > deadline:
                missing = ", ".join(p for p in wanted if p not in found)
                raise TimeoutError(f"peers {missing} did not publish an address in {self.folder} within {timeout:g}s")
            await asyncio.sleep(_POLL)


def configure_logging(level: str, process: str) -> None:
    """Log to stderr from ``level`` (a name, e.g. ``info``) up, each line naming ``process``."""
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s.%(msecs)03d {process} %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    # gRPC's and the agent's own chatter stays out of the examples' concise log.
    logging.getLogger("stablewatch.agents").setLevel(logging.WARNING)


ServiceFactory = Callable[[Agent, argparse.Namespace, PeerDirectory], Service]


async def _serve(args: argparse.Namespace, factory: ServiceFactory) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    peers = PeerDirectory(args.peers_dir)
    agent = Agent(
        args.id,
        listen=args.listen,
        peers=peers.resolve,
        detector=args.detector,
        tls=service_tls(args),
        channel_settings=ChannelSettings(backoff_initial=0.01, backoff_max=0.5),
    )
    service = factory(agent, args, peers)  # sets the initial state and the handler before anything arrives
    status = 0
    await agent.start()
    try:
        peers.publish(args.id, agent.address)
        log.info("listening on %s%s", agent.address, f", detector {args.detector}" if args.detector else "")
        work = asyncio.ensure_future(service.run())
        waits: list[asyncio.Future[object]] = [work, asyncio.ensure_future(stop.wait())]
        if args.duration is not None:
            waits.append(asyncio.ensure_future(asyncio.sleep(args.duration)))
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for waiting in waits:
            waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        log.info("stopping (%s)", "signal" if stop.is_set() else "duration over")
    except Exception:
        log.exception("failed")
        status = 1
    finally:
        peers.withdraw(args.id)
        await agent.stop()
    return status


def run_service(args: argparse.Namespace, factory: ServiceFactory) -> int:
    """Run one example process until ``--duration`` passes or a signal arrives; return its exit status.

    `factory(agent, args, peers)` builds the service before the agent starts (so its handler and
    initial state are in place when the first message or snapshot arrives); its ``run()`` is
    then awaited. Status 0 after a signal or the duration, 1 when ``run()`` failed.
    """
    configure_logging(args.log_level, args.id)
    return asyncio.run(_serve(args, factory))
