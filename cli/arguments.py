"""The argument types the commands share; argparse turns their ArgumentTypeError into exit status 2
and the message."""

from __future__ import annotations

import argparse
import math
import ssl
from collections.abc import Callable
from pathlib import Path

from stablewatch.agents.certificates import read_pem
from stablewatch.detector.evaluation import predicates
from stablewatch.detector.evaluation.plugins import PluginError, UserPredicate, load_predicate
from stablewatch.detector.service.limits import parse_rate
from stablewatch.v1.ids import space_problem

__all__ = [
    "address",
    "check_tls",
    "expected_total",
    "fraction",
    "interval",
    "keep",
    "keep_days",
    "members",
    "metrics_port",
    "pem",
    "positive",
    "positive_int",
    "predicate",
    "rate",
    "rate_limit",
    "rate_text",
]

_OFF = ("none", "off")


def address(text: str) -> str:
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


def positive(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def positive_int(text: str) -> int:
    value = int(_number(text, integer=True))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text}")
    return value


def replica(text: str) -> int:
    """A detector's replica number: the id space of its snapshots (stablewatch.v1.ids)."""
    value = int(_number(text, integer=True))
    problem = space_problem(value)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return value


def fraction(text: str) -> float:
    value = _number(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, not {text}")
    return value


def interval(text: str) -> float | None:
    """Seconds between scheduled snapshots; 0 or off: none (on demand only)."""
    if text.lower() in _OFF or _number(text) == 0:
        return None
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"must be 0 or off (on demand only) or a positive number of seconds, not {text}"
        )
    return value


def metrics_port(text: str) -> int | None:
    """A port for /metrics; -1, none or off: no /metrics."""
    if text.lower() in _OFF or text == "-1":
        return None
    port = int(_number(text, integer=True))
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0-65535, or -1/none for no /metrics, not {text}")
    return port


def keep(text: str) -> int | None:
    """How many snapshots to keep; none or off: no limit."""
    if text.lower() in _OFF:
        return None
    count = int(_number(text, integer=True))
    if count < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, or none, not {text}")
    return count


def keep_days(text: str) -> float | None:
    return None if text.lower() in _OFF else positive(text)


def members(text: str) -> tuple[tuple[str, ...], int]:
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


def expected_total(text: str) -> tuple[str, int]:
    """``COUNTER=TOTAL``: the expected total of a conserved counter."""
    try:
        return predicates.expected_total(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def pem(what: str) -> Callable[[str], Path]:
    """A PEM file holding `what`, readable now: a missing or non-PEM file exits 2 naming it."""

    def check(text: str) -> Path:
        try:
            read_pem(text, what)
        except (OSError, ValueError) as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return Path(text)

    return check


def rate_text(rate: tuple[int, float] | None) -> str:
    """A rate as ``--trigger-rate`` takes it: ``N/S``, or off."""
    return "off" if rate is None else f"{rate[0]}/{rate[1]:g}"


def rate(text: str) -> tuple[int, float] | None:
    """``N/S``: at most N in S seconds; off or none: no limit."""
    return None if text.lower() in _OFF else rate_limit(text)


def rate_limit(text: str) -> tuple[int, float]:
    """``N/S``: at most N in S seconds, for a rate that is always bounded (no off)."""
    if text.lower() in _OFF:
        raise argparse.ArgumentTypeError(f"expected N/S (this rate cannot be off), not {text!r}")
    try:
        return parse_rate(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def predicate(spec: str) -> UserPredicate:
    """``MODULE:FUNCTION``: a user predicate, loaded now so that a bad one exits 2."""
    try:
        return load_predicate(spec)
    except PluginError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def check_tls(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The TLS flags that only make sense together; a wrong pairing exits 2 with what is wrong."""
    cert, key = getattr(args, "tls_cert", None), getattr(args, "tls_key", None)
    if (cert is None) != (key is None):
        parser.error("--tls-cert and --tls-key go together")
    if cert is not None:
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
        except ssl.SSLError as error:
            parser.error(f"--tls-key {key} is not the key of --tls-cert {cert} ({error.reason})")
    if getattr(args, "tls_client_ca", None) is not None and cert is None:
        parser.error("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
