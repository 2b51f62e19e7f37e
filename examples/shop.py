"""A shop of three ordinary gRPC services whose call cycle can exhaust their worker pools.

What it demonstrates: RPC mode. The services are plain synchronous ``grpc.server`` processes with
bounded worker pools and generic byte handlers (no generated stubs); stablewatch sees them only
through the interceptors of an :class:`~stablewatch.agents.rpc.agent.RpcAgent`, two lines in
:func:`_instrument`; each process's stablewatch id is its service's name. Without ``--detector``
they run the same, without stablewatch.

The call graph (each arrow a unary call without deadline, made from inside the handler)::

    client ──Place──▶ orders ──Charge──▶ payments ──Reserve──▶ inventory
                        ▲                                          │
                        └─────────────────Confirm──────────────────┘  (with probability --confirm-rate)

``orders.Confirm`` calls no one. A handler holds its worker for the whole call chain below it, so a
Place holds an orders worker until its Confirm has run, on another orders worker.

Two workloads (``--workload``) set the pools, the client's concurrency and the call-back rate:

* ``deadlock``: every pool has 2 workers, the client keeps 4 Places going and every Reserve calls
  back. As soon as two Places hold both orders workers, their Confirms queue behind them: the
  2 Places wait on their Charges, the Charges on their Reserves, the Reserves on their Confirms,
  and the Confirms (queued) on the busy orders workers. The pools are exhausted for real and
  nothing ever moves again; stablewatch reports the cycle of calls
  ``orders Place#… -> payments Charge#… -> inventory Reserve#… -> orders Confirm#… -> orders Place#…``.
* ``churn``: the same call graph under load that never deadlocks: orders has 4 workers for the
  client's 3 Places, so one is always free for a Confirm; payments and inventory keep 2 workers
  each, so Charges and Reserves queue. Half the Reserves call back.

Every process also serves an admin endpoint (its own server, no interceptors, so it answers even
when the shop is stuck): ``/shop.Admin/Status`` returns JSON with the calls the process has
outstanding right now (what a naive poller sees, ``bench/rpc_phantom.py``), its busy handlers and
its counts of finished calls.

Run the shop (one terminal each, or in the background), with peers found through a folder::

    for s in orders payments inventory client; do
        python -m stablewatch.examples.shop --service $s --workload deadlock \\
            --peers-dir /tmp/shop --detector HOST:PORT &
    done

or with fixed addresses: ``--listen 127.0.0.1:7001 --peer payments=127.0.0.1:7002 ...``. Once
serving, each process prints one JSON line on stdout:
``{"event": "ready", "service": ..., "address": ..., "admin": ...}``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from stablewatch.agents.rpc.agent import RpcAgent
from stablewatch.agents.state import LocalStateKeeper
from stablewatch.examples._common import PeerDirectory, configure_logging

__all__ = [
    "CHARGE",
    "CONFIRM",
    "PLACE",
    "RESERVE",
    "ROLES",
    "SERVICES",
    "STATUS",
    "WORKLOADS",
    "Outstanding",
    "Workload",
    "main",
    "read_status",
]

log = logging.getLogger("stablewatch.examples.shop")

SERVICES = ("orders", "payments", "inventory")
ROLES = (*SERVICES, "client")  # the client only calls: it is the shop's load
PLACE = "/shop.Orders/Place"
CONFIRM = "/shop.Orders/Confirm"
CHARGE = "/shop.Payments/Charge"
RESERVE = "/shop.Inventory/Reserve"
STATUS = "/shop.Admin/Status"
CALLEE = {PLACE: "orders", CONFIRM: "orders", CHARGE: "payments", RESERVE: "inventory"}

PEER_TIMEOUT = 60.0  # seconds to wait for a peer's address in --peers-dir
STOP_GRACE = 2.0  # seconds the servers give running calls at shutdown


@dataclass(frozen=True)
class Workload:
    """The pools, the client's concurrency and the call-back rate of one workload."""

    workers: dict[str, int]  # service -> worker threads of its server
    concurrency: int  # Place calls the client keeps going at once
    confirm_rate: float  # probability that a Reserve calls back orders.Confirm


WORKLOADS = {
    "deadlock": Workload({"orders": 2, "payments": 2, "inventory": 2}, concurrency=4, confirm_rate=1.0),
    "churn": Workload({"orders": 4, "payments": 2, "inventory": 2}, concurrency=3, confirm_rate=0.5),
}


FINISHED_KEPT = 5000  # the most recent finished calls each process keeps in its books


class Outstanding:
    """The calls this process has out right now, and what finished: the application's own books.

    Kept by the shop itself, apart from stablewatch, so that a naive poller can read them, and so
    that ``bench/resolution.py`` can tell from the services' own clocks when the last worker
    blocked and when a victim's call came back ``ABORTED``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        # id -> (callee, method, thread, since (monotonic), began (wall clock))
        self._calls: dict[int, tuple[str, str, str, float, float]] = {}
        self._busy = 0
        self.counts: dict[str, int] = {}  # method -> calls handled (services) or completed (client)
        # (began, ended) on the wall clock, method, status code name, details: the latest finished calls
        self.finished: collections.deque[tuple[float, float, str, str, str]] = collections.deque(maxlen=FINISHED_KEPT)

    @contextlib.contextmanager
    def call(self, method: str) -> Iterator[None]:
        """Book an outgoing call to `method` while the block runs."""
        began = time.time()
        with self._lock:
            self._next += 1
            token = self._next
            self._calls[token] = (CALLEE[method], method, threading.current_thread().name, time.monotonic(), began)
        code, details = "OK", ""
        try:
            yield
        except grpc.RpcError as error:
            code, details = error.code().name, str(error.details() or "")[:300]
            raise
        finally:
            ended = time.time()
            with self._lock:
                del self._calls[token]
                self.finished.append((began, ended, method, code, details))

    @contextlib.contextmanager
    def handling(self, method: str) -> Iterator[None]:
        """Count a busy handler of `method` while the block runs, and the call once it returned
        (not one that raised: an aborted order is not a completed one)."""
        with self._lock:
            self._busy += 1
        try:
            yield
        except BaseException:
            with self._lock:
                self._busy -= 1
            raise
        with self._lock:
            self._busy -= 1
            self.counts[method] = self.counts.get(method, 0) + 1

    def status(self) -> dict[str, object]:
        now = time.monotonic()
        with self._lock:
            calls = [
                {
                    "id": token,
                    "to": callee,
                    "method": method,
                    "thread": thread,
                    "age_ms": round((now - since) * 1e3, 3),
                    "began": began,
                }
                for token, (callee, method, thread, since, began) in self._calls.items()
            ]
            finished = [
                {"began": began, "ended": ended, "method": method, "code": code, "details": details}
                for began, ended, method, code, details in self.finished
            ]
            return {"outstanding": calls, "busy": self._busy, "counts": dict(self.counts), "finished": finished}


class Peers:
    """Channels to the other services, dialled on first use, each instrumented by the agent (if any)."""

    def __init__(
        self,
        fixed: dict[str, str],
        directory: PeerDirectory | None,
        instrument: Callable[[grpc.Channel, str], grpc.Channel],
    ) -> None:
        self._fixed = fixed
        self._directory = directory
        self._instrument = instrument  # (channel, the service it leads to) -> the channel to use
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._methods: dict[str, Callable[[bytes], bytes]] = {}
        self._closed = False

    def method(self, method: str) -> Callable[[bytes], bytes]:
        """A blocking callable for `method` (bytes in, bytes out) on the callee's channel."""
        callable_ = self._methods.get(method)
        if callable_ is None:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the shop is stopping")
                service = CALLEE[method]
                channel = self._channels.get(service)
                if channel is None:
                    channel = self._instrument(grpc.insecure_channel(self._resolve(service)), service)
                    self._channels[service] = channel
                callable_ = self._methods[method] = channel.unary_unary(method)
        return callable_

    def _resolve(self, service: str) -> str:
        if service in self._fixed:
            return self._fixed[service]
        if self._directory is None:
            raise SystemExit(f"no address for {service}: give --peer {service}=HOST:PORT or --peers-dir")
        deadline = time.monotonic() + PEER_TIMEOUT
        while True:
            with contextlib.suppress(KeyError):
                return self._directory.resolve(service)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{service} published no address in {self._directory.folder} in {PEER_TIMEOUT:g}s")
            time.sleep(0.02)

    def close(self) -> None:
        """Close every channel: calls still out end with CANCELLED (how a stuck shop is stopped)."""
        with self._lock:
            self._closed = True
            channels = list(self._channels.values())
        for channel in channels:
            channel.close()


class Shop:
    """The handlers of one service, or the client's load; the same object for every workload."""

    def __init__(self, service: str, args: argparse.Namespace, peers: Peers) -> None:
        self.service = service
        self.peers = peers
        self.books = Outstanding()
        self.work = args.work_ms / 1000
        self.confirm_rate: float = args.confirm_rate
        self.rng = random.Random(f"{args.seed}/{service}")
        self.rng_lock = threading.Lock()
        self.stopping = threading.Event()
        #: The agent's local state, when there is an agent: the client reports its orders in it.
        self.state: LocalStateKeeper | None = None

    def _call(self, method: str, request: bytes) -> bytes:
        with self.books.call(method):
            return self.peers.method(method)(request)

    def _handler(self, method: str, body: Callable[[bytes], bytes]) -> grpc.RpcMethodHandler:
        def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
            with self.books.handling(method):
                if self.work:
                    time.sleep(self.work)
                try:
                    return body(request)
                except grpc.RpcError as error:  # a call below failed (at shutdown: CANCELLED); say so, quietly
                    # Its details go along: a broken deadlock's ABORTED names the deadlock all the way up.
                    cause = f": {error.details()}" if error.details() else ""
                    context.abort(error.code(), f"{method}: a call it made ended in {error.code().name}{cause}")
                except (ValueError, RuntimeError):  # a channel closed under it: the shop is stopping
                    if not self.stopping.is_set():
                        raise
                    context.abort(grpc.StatusCode.UNAVAILABLE, f"{method}: the shop is stopping")

        return grpc.unary_unary_rpc_method_handler(handle)  # no (de)serializers: bytes in, bytes out

    def handlers(self) -> grpc.GenericRpcHandler:
        """The service's methods as one generic handler."""
        if self.service == "orders":
            methods = {PLACE: self._place, CONFIRM: self._confirm}
        elif self.service == "payments":
            methods = {CHARGE: self._charge}
        else:
            methods = {RESERVE: self._reserve}
        name = next(iter(methods)).split("/")[1]
        return grpc.method_handlers_generic_handler(
            name, {method.rsplit("/", 1)[1]: self._handler(method, body) for method, body in methods.items()}
        )

    def _place(self, order: bytes) -> bytes:
        self._call(CHARGE, order)
        return b"placed " + order

    def _confirm(self, order: bytes) -> bytes:
        return b"confirmed " + order

    def _charge(self, order: bytes) -> bytes:
        self._call(RESERVE, order)
        return b"charged " + order

    def _reserve(self, order: bytes) -> bytes:
        with self.rng_lock:
            call_back = self.rng.random() < self.confirm_rate
        if call_back:
            self._call(CONFIRM, order)
        return b"reserved " + order

    def rng_backoff(self) -> float:
        """A retry's back-off: 10 to 50 ms, random so that retried orders do not move in step."""
        with self.rng_lock:
            return self.rng.uniform(0.010, 0.050)

    def run_client(self, concurrency: int) -> list[threading.Thread]:
        """Start `concurrency` threads that each place orders one after another until stopped."""
        threads = [
            threading.Thread(target=self._place_orders, args=(number,), name=f"buyer-{number}", daemon=True)
            for number in range(concurrency)
        ]
        for thread in threads:
            thread.start()
        return threads

    def _place_orders(self, number: int) -> None:
        sequence = 0
        while not self.stopping.is_set():
            sequence += 1
            try:
                with self.books.handling(PLACE):  # counts the Places completed
                    self._call(PLACE, f"order-{number}-{sequence}".encode())
                if self.state is not None:  # what snapshots (and the demo's history) see of the orders
                    self.state.set_attribute("orders", self.books.counts.get(PLACE, 0))
            except grpc.RpcError as error:
                if self.stopping.is_set():
                    return
                if error.code() == grpc.StatusCode.ABORTED:
                    # stablewatch broke a proven deadlock and this order's call chain was its victim:
                    # nothing of it ran to the end, so place it again after a short back-off.
                    log.warning("Place of order-%d-%d aborted: %s", number, sequence, error.details())
                    time.sleep(self.rng_backoff())
                    continue
                log.warning("Place failed: %s", error.code())
                time.sleep(0.1)


def read_status(admin: str | grpc.Channel, timeout: float = 5.0) -> dict[str, Any]:
    """One process's ``/shop.Admin/Status``: its outstanding calls, busy handlers and counts.

    `admin` is the admin endpoint's address, or a channel to it (to ask often).
    """
    if isinstance(admin, str):
        with grpc.insecure_channel(admin) as channel:
            return read_status(channel, timeout)
    return json.loads(admin.unary_unary(STATUS)(b"", timeout=timeout))


def _instrument(
    args: argparse.Namespace, workers: int
) -> tuple[
    list[grpc.ServerInterceptor],
    Callable[[grpc.Channel, str], grpc.Channel],
    Callable[[], None],
    futures.ThreadPoolExecutor,
    LocalStateKeeper | None,
]:
    """This process's RPC-mode agent: its server interceptors, how a channel to a given service is
    instrumented, how to stop it, the server's worker pool and the agent's local state. Without
    ``--detector`` there is no agent: plain gRPC.
    """
    if args.detector is None:
        pool = futures.ThreadPoolExecutor(workers, thread_name_prefix=f"{args.service}-worker")
        return [], lambda channel, service: channel, lambda: None, pool, None
    agent = RpcAgent(args.service, detector=args.detector).start()
    # The lines a service adds: its worker pool from the agent (so that a request queued in a
    # deadlocked pool can be refused when stablewatch breaks it), an interceptor on its server, and
    # each channel instrumented (naming its peer).
    pool = agent.thread_pool(workers, thread_name_prefix=f"{args.service}-worker")
    server_interceptors = [agent.server_interceptor(workers=pool)]
    return server_interceptors, agent.instrument_channel, agent.stop, pool, agent.state


def serve(args: argparse.Namespace) -> int:
    """Run one process of the shop until SIGTERM or SIGINT (or ``--duration``); its exit status."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    workload = WORKLOADS[args.workload]
    workers = args.workers or workload.workers.get(args.service, 1)
    server_interceptors, instrument_channel, stop_agent, pool, state = _instrument(args, workers)
    directory = PeerDirectory(args.peers_dir) if args.peers_dir else None
    peers = Peers(dict(args.peer), directory, instrument_channel)
    shop = Shop(args.service, args, peers)
    shop.state = state

    admin = grpc.server(futures.ThreadPoolExecutor(1, thread_name_prefix="admin"))
    status = grpc.unary_unary_rpc_method_handler(lambda request, context: json.dumps(shop.books.status()).encode())
    admin.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("shop.Admin", {"Status": status})])
    admin_address = _bind(admin, args.admin)
    admin.start()
    server = None
    address = None
    if args.service in SERVICES:
        server = grpc.server(pool, interceptors=server_interceptors)
        server.add_generic_rpc_handlers([shop.handlers()])
        address = _bind(server, args.listen)
        server.start()
        if directory is not None:
            directory.publish(args.service, address)
    ready = {"event": "ready", "service": args.service, "address": address, "admin": admin_address}
    print(json.dumps(ready), flush=True)
    concurrency = args.concurrency or workload.concurrency
    serving = f"{concurrency} buyers" if server is None else f"on {address}, {workers} workers"
    detector = f", detector {args.detector}" if args.detector else ""
    log.info("%s %s, admin %s, workload %s%s", args.service, serving, admin_address, args.workload, detector)
    buyers = shop.run_client(concurrency) if server is None else []
    try:
        _wait_for(stop, args.duration)
        log.info("stopping (%s)", "signal" if stop.is_set() else "duration over")
    finally:
        shop.stopping.set()
        if directory is not None and server is not None:
            directory.withdraw(args.service)
        peers.close()  # a stuck shop's calls end here, so its handlers and buyers return
        for thread in buyers:
            thread.join(STOP_GRACE)
        if server is not None:
            server.stop(STOP_GRACE).wait()
        admin.stop(0).wait()
        stop_agent()
    return 0


def _wait_for(stop: threading.Event, duration: float | None) -> None:
    """Until `stop` is set (by a signal handler) or `duration` seconds pass.

    The handler runs in the main thread, but only once that thread runs Python code again; the
    kernel may hand SIGTERM to one of gRPC's threads, which does not wake a main thread asleep on
    a lock. So the wait wakes every 0.2 s to let the handler run (an unbounded wait once missed
    a SIGTERM for good, and the process had to be killed).
    """
    deadline = None if duration is None else time.monotonic() + duration
    while not stop.wait(0.2 if deadline is None else min(0.2, max(0.0, deadline - time.monotonic()))):
        if deadline is not None and time.monotonic() >= deadline:
            return


def _bind(server: grpc.Server, listen: str) -> str:
    host = listen.rsplit(":", 1)[0]
    port = server.add_insecure_port(listen)
    return f"{host}:{port}"


def _peer(text: str) -> tuple[str, str]:
    service, _, address = text.partition("=")
    if service not in SERVICES or ":" not in address:
        raise argparse.ArgumentTypeError(f"expected SERVICE=HOST:PORT with SERVICE one of {SERVICES}, got {text!r}")
    return service, address


def _probability(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a probability is between 0 and 1, not {value}")
    return value


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m stablewatch.examples.shop", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument(
        "--service", choices=ROLES, required=True, help="which process of the shop this is (also its stablewatch id)"
    )
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="churn", help="(default churn)")
    parser.add_argument("--listen", default="127.0.0.1:0", help="the service's gRPC address (default: a free port)")
    parser.add_argument("--admin", default="127.0.0.1:0", help="the admin endpoint's address (default: a free port)")
    parser.add_argument(
        "--peer", type=_peer, action="append", default=[], metavar="SERVICE=HOST:PORT", help="a peer's address"
    )
    parser.add_argument("--peers-dir", type=Path, help="or: a folder where the services publish their addresses")
    parser.add_argument(
        "--detector",
        metavar="HOST:PORT",
        help="the detector's address; several, separated by commas, when detectors run side by side "
        "(default: no stablewatch)",
    )
    parser.add_argument("--workers", type=int, help="worker threads of the server (default: the workload's)")
    parser.add_argument("--concurrency", type=int, help="the client's Places at once (default: the workload's)")
    parser.add_argument("--confirm-rate", type=_probability, help="Reserves that call back (default: the workload's)")
    parser.add_argument("--work-ms", type=float, default=1.0, help="each handler's own work, ms (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the call-back choices (default 0)")
    parser.add_argument("--duration", type=float, help="seconds to run (default: until SIGTERM or SIGINT)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.confirm_rate is None:
        args.confirm_rate = WORKLOADS[args.workload].confirm_rate
    configure_logging(args.log_level, args.service)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
