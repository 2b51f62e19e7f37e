"""What the commands that ask a running detector share: their flags, the connection, and errors.

``status``, ``health``, ``snapshot``, ``watch``, ``graph``, ``resolve`` and ``resolutions`` take
``--detector`` and ``--json``, connect with TLS given ``--tls-ca`` (and ``--tls-cert``/``--tls-key``
for mutual TLS), and exit 1 with the message (also as JSON with ``--json``) when the detector is
unreachable or refuses.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from rich.console import Console

from stablewatch.agents.certificates import channel_credentials, server_name_options
from stablewatch.cli import arguments
from stablewatch.cli.client import DEFAULT_ADDRESS, DEFAULT_TIMEOUT, DetectorClient, DetectorError
from stablewatch.cli.exits import EXIT_ERROR, EXIT_INTERRUPTED

__all__ = ["CommandError", "Query", "connection_options", "run_query", "timeout_option"]

#: A query command's body: it asks `client` and prints; returns the exit status.
Query = Callable[[DetectorClient, argparse.Namespace, Console], int]


class CommandError(Exception):
    """A query command cannot do what was asked (exit 1); the message says why."""


def connection_options() -> argparse.ArgumentParser:
    """The parent parser of every query command: --detector, --json and the TLS flags."""
    query = argparse.ArgumentParser(add_help=False)
    query.add_argument("--detector", type=arguments.address, default=DEFAULT_ADDRESS, metavar="HOST:PORT",
                       help="the detector's gRPC address (%(default)s)")  # fmt: skip
    query.add_argument("--json", action="store_true", help="print JSON instead of tables")
    tls = query.add_argument_group(
        "TLS", "connect with TLS: trust --tls-ca; for mutual TLS show --tls-cert and --tls-key"
    )
    tls.add_argument("--tls-ca", type=arguments.pem("CA certificate"), metavar="FILE",
                     help="the CA that signed the detector's certificate (PEM)")  # fmt: skip
    tls.add_argument("--tls-cert", type=arguments.pem("certificate"), metavar="FILE",
                     help="client certificate (PEM) with the role the command needs: stablewatch://role/reader, "
                     "or stablewatch://role/operator for snapshot and resolve")  # fmt: skip
    tls.add_argument("--tls-key", type=arguments.pem("private key"), metavar="FILE", help="the key of --tls-cert (PEM)")
    tls.add_argument("--tls-server-name", metavar="NAME",
                     help="the name the detector's certificate must carry (default: the --detector host)")  # fmt: skip
    return query


def timeout_option() -> argparse.ArgumentParser:
    """The parent parser of the query commands whose every call --timeout bounds."""
    timeout = argparse.ArgumentParser(add_help=False)
    timeout.add_argument("--timeout", type=arguments.positive, default=DEFAULT_TIMEOUT, metavar="S",
                         help="give up on the detector after S seconds (%(default)s)")  # fmt: skip
    return timeout


def run_query(query: Query, args: argparse.Namespace, console: Console) -> int:
    """Connect as the flags say and run `query`; the detector's errors exit 1 with the message."""
    credentials = None
    if args.tls_ca is not None or args.tls_cert is not None:
        credentials = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)
    options = server_name_options(args.tls_server_name)
    try:
        with DetectorClient(
            args.detector, timeout=args.timeout or DEFAULT_TIMEOUT, credentials=credentials, options=options
        ) as client:
            return query(client, args, console)
    except (DetectorError, CommandError) as error:
        print(f"stablewatch: {error}", file=sys.stderr)
        if args.json:
            code = getattr(error, "code", None)
            print(json.dumps({"error": str(error), "code": code.name if code else None}), flush=True)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 0 if args.command == "watch" else EXIT_INTERRUPTED
