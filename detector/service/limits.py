"""The bounds the detector keeps against abuse, and the token bucket that limits triggered snapshots.

Every input an agent or a client controls is bounded, so that no one can make the detector crash
or grow its memory without limit: the size of a part and the messages it records, the agents
attached and the control streams open, the time a stream may take to register, the query API's
page size and tokens, the watch streams (in all and per client), and how often and how many
snapshots clients may trigger. Each breach is refused with a reason from :data:`REFUSAL_REASONS`
(or, for a part, a rejection reason of the assembler) and counted in a metric; the values come
from :class:`Limits`, part of the detector's configuration. The strings an agent sends (process
ids, tasks, names, addresses) have maxima of their own, fixed by the wire contract
(:mod:`stablewatch.v1.bounds`), and a refusal quotes at most a short prefix of any of them
(:func:`stablewatch.v1.bounds.quoted_prefix`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "REFUSAL_REASONS",
    "LimitExceeded",
    "Limits",
    "TokenBucket",
    "parse_rate",
]

#: Why the detector refused a stream or a call (bounded: safe as a metric label).
REFUSAL_REASONS = (
    "identity_mismatch",  # an agent registered a process id its certificate does not name
    "already_attached",  # that process id is attached through another stream
    "too_many_agents",  # Limits.max_agents are attached
    "too_many_streams",  # Limits.max_control_streams control streams are open
    "too_many_unregistered",  # the caller holds Limits.max_unregistered_per_identity unregistered streams
    "no_register",  # a control stream did not begin with a Register in time
    "bad_register",  # a Register's process id or address is empty, too long or holds a control character
    "unauthenticated",  # a call without a client certificate where one is required
    "permission_denied",  # a certificate without the role the call needs
    "rate_limited",  # TriggerSnapshot beyond Limits.trigger_rate
    "too_many_triggers",  # Limits.max_running_triggers triggered snapshots are running
    "too_many_watchers",  # Limits.max_watchers watch streams are open
    "too_many_watchers_for_identity",  # the caller holds Limits.max_watchers_per_identity watch streams
    "bad_request",  # a query over a bound: page size or token, expected members
    "malformed",  # a request message that is not protobuf (detector.service.malformed)
)


class LimitExceeded(Exception):
    """A request over one of the detector's limits; ``reason`` is one of :data:`REFUSAL_REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Limits:
    """Bounds on what agents and clients can make the detector hold or do (defaults in brackets)."""

    #: A snapshot part larger than this (serialized) is rejected (``too_large``) and its snapshot
    #: aborted; gRPC itself refuses any message more than :data:`MESSAGE_SLACK` above it.
    max_part_bytes: int = 8 * 1024 * 1024
    #: Recorded in-flight messages in one part, over all its channels (``too_many_messages``).
    max_part_messages: int = 100_000
    max_agents: int = 10_000  # attached at once
    max_control_streams: int = 10_240  # open at once, registered or not
    #: Control streams one identity (a client certificate; without one, a peer address) holds open
    #: before they register: one client cannot take the slots of ``max_control_streams`` from others.
    max_unregistered_per_identity: int = 8
    #: Seconds a new control stream has to send its Register (an agent sends it first thing).
    register_timeout: float = 2.0
    max_page_size: int = 1000  # ListSnapshots
    max_watchers: int = 100  # Watch streams open at once
    #: Watch streams one identity (a client certificate; without one, a peer address) holds at once;
    #: below ``max_watchers``, so that one client holding its share never locks the others out.
    max_watchers_per_identity: int = 10
    #: TriggerSnapshot: at most ``count`` calls per ``seconds`` (a burst of ``count``); None: no limit.
    trigger_rate: tuple[int, float] | None = (10, 1.0)
    max_running_triggers: int = 4  # triggered snapshots running at once
    #: Snapshots started for agents' long-wait hints: at most ``count`` per ``seconds`` (one runs at a time).
    hint_rate: tuple[int, float] = (20, 1.0)

    def __post_init__(self) -> None:
        for name in (
            "max_part_bytes",
            "max_part_messages",
            "max_agents",
            "max_control_streams",
            "max_unregistered_per_identity",
            "max_page_size",
            "max_watchers",
            "max_watchers_per_identity",
            "max_running_triggers",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be at least 1, not {getattr(self, name)}")
        if self.max_watchers_per_identity >= self.max_watchers:
            raise ValueError(
                f"Limits.max_watchers_per_identity ({self.max_watchers_per_identity}) must be below max_watchers "
                f"({self.max_watchers}), or one identity could take every watch stream"
            )
        if self.register_timeout <= 0:
            raise ValueError(f"Limits.register_timeout must be above 0, not {self.register_timeout}")
        if self.trigger_rate is not None:
            TokenBucket(*self.trigger_rate)  # validates it
        TokenBucket(*self.hint_rate)

    @property
    def grpc_max_message(self) -> int:
        """``grpc.max_receive_message_length`` for the detector's server."""
        return self.max_part_bytes + MESSAGE_SLACK


#: Room above ``max_part_bytes`` for a message's envelope, so that a part just over the limit still
#: arrives and is rejected with its reason; a message beyond it ends its stream (RESOURCE_EXHAUSTED).
MESSAGE_SLACK = 64 * 1024


class TokenBucket:
    """At most ``count`` events per ``seconds``, in bursts of up to ``count``.

    The bucket holds up to ``count`` tokens and gains ``count / seconds`` tokens a second; each
    event takes one. ``clock`` (monotonic seconds) is injectable for tests.
    """

    def __init__(self, count: int, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        if count < 1 or not seconds > 0:
            raise ValueError(f"a rate needs a count of at least 1 and a period above 0, not {count}/{seconds}")
        self.count = count
        self.seconds = seconds
        self._clock = clock
        self._tokens = float(count)
        self._at = clock()

    def take(self) -> bool:
        """Take a token if there is one; False means the event is over the rate."""
        now = self._clock()
        self._tokens = min(self.count, self._tokens + (now - self._at) * self.count / self.seconds)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def wait(self) -> float:
        """Seconds until the next token (0 when there is one now)."""
        missing = 1 - min(self.count, self._tokens + (self._clock() - self._at) * self.count / self.seconds)
        return max(0.0, missing * self.seconds / self.count)

    def __str__(self) -> str:
        return f"{self.count} per {self.seconds:g} s"


def parse_rate(text: str) -> tuple[int, float]:
    """``N/S``: N events per S seconds (``10/60``); ``N`` alone means per second. Raises ValueError."""
    count, _, seconds = text.partition("/")
    try:
        rate = (int(count), float(seconds) if seconds else 1.0)
    except ValueError:
        raise ValueError(f"expected N/S (N events per S seconds, e.g. 10/60), not {text!r}") from None
    TokenBucket(*rate)  # validates it
    return rate
