"""An agent's detectors: one control stream per detector, when several run side by side.

Several detectors (replicas) may watch the same agents, each with its own schedule, store and
alerts (DESIGN.md, "Several detectors side by side"). The agent attaches to each on a
:class:`~stablewatch.agents.control.ControlClient` of its own, with its own backoff and status, so
one detector down never blocks the other. What belongs to one detector goes to that detector
alone: a snapshot's parts and failures go to the detector whose id space holds the snapshot id
(:mod:`stablewatch.v1.ids`), and a break's report goes back on the stream its order came on (the
control client does that). Hints go to every detector. Two detectors that name the same id space
could hand out the same id, so the second to register is refused until the first is gone.

Breaking stays exactly once only while every detector picks the same victim of a deadlock: the
clients share one :class:`~stablewatch.agents.breaking.PolicyAgreement`, which hears each
detector's resolve policy as it registers, and while two differ every automatic break is refused
(``BREAK_OUTCOME_POLICIES_DISAGREE``, naming them) and logged once; an operator's order goes through.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from stablewatch.agents.breaking import PolicyAgreement
from stablewatch.agents.control import ControlClient
from stablewatch.v1 import LocalSnapshotPart
from stablewatch.v1.control_pb2 import WaitHint
from stablewatch.v1.ids import LOCAL_ID_BASE, id_space

__all__ = ["DetectorLinks", "DetectorStatus", "detector_addresses"]


def detector_addresses(detector: str | Sequence[str] | None) -> tuple[str, ...]:
    """The detectors an agent attaches to: None, one ``host:port``, several separated by commas, or
    a sequence of them. Raises ValueError for an empty or repeated address."""
    if detector is None:
        return ()
    items = detector.split(",") if isinstance(detector, str) else list(detector)
    addresses = tuple(item.strip() for item in items)
    for position, address in enumerate(addresses, 1):
        if not address:
            raise ValueError(f"detector address {position} of {detector!r} is empty")
    repeated = sorted({address for address in addresses if addresses.count(address) > 1})
    if repeated:
        raise ValueError(f"detector {repeated[0]} is given more than once in {detector!r}")
    return addresses


@dataclass(frozen=True, slots=True)
class DetectorStatus:
    """Where one of an agent's control streams stands."""

    address: str
    connected: bool
    id_space: int | None  # the detector's replica, once it registered this agent
    event: str  # the latest of ControlClient's EVENTS ("" before any)
    detail: str  # what came with it
    resolve_policy: str = ""  # what the detector stated at its latest registration ("" if nothing)


class DetectorLinks:
    """The control clients of one agent, one per detector; all methods run on the agent's loop.

    ``make_client(address, on_registered, on_event)`` builds the client for one detector (the agent
    gives the callbacks that act on its own core); ``on_change(address, connected)`` hears when a
    stream goes up or down, and hears every detector down as :meth:`start` begins, so that one never
    reached reads as down (its ``detector_connected`` gauge 0) rather than not at all.
    """

    def __init__(
        self,
        addresses: Iterable[str],
        make_client: Callable[[str, Callable[[int], str | None], Callable[[str, str], None]], ControlClient],
        on_change: Callable[[str, bool], None] | None = None,
    ) -> None:
        self._on_change = on_change
        self._events: dict[str, tuple[str, str]] = {}
        self._by_space: dict[int, ControlClient] = {}
        #: The detectors' resolve policies, compared: automatic breaks are refused while they differ.
        self.policies = PolicyAgreement()
        self._addresses = tuple(addresses)
        self.clients: tuple[ControlClient, ...] = tuple(
            make_client(address, self._claimer(address), self._listener(address)) for address in self._addresses
        )
        for client in self.clients:  # the agent made them: the shared rule is set here, as a doorbell is
            client.policies = self.policies

    async def start(self) -> None:
        """Dial every detector in the background, each down until its stream comes up."""
        if self._on_change is not None:
            for address in self._addresses:
                self._on_change(address, False)
        for client in self.clients:
            await client.start()

    async def stop(self) -> None:
        """Close every stream."""
        for client in self.clients:
            await client.stop()

    @property
    def connected(self) -> bool:
        """Whether at least one detector has this agent registered."""
        return any(client.connected for client in self.clients)

    def status(self) -> tuple[DetectorStatus, ...]:
        """Each detector's stream, in the order they were given."""
        return tuple(
            DetectorStatus(
                client.target,
                client.connected,
                client.id_space,
                *self._events.get(client.target, ("", "")),
                resolve_policy=self.policies.policy(client.target),
            )
            for client in self.clients
        )

    @property
    def disagreement(self) -> str | None:
        """Why this agent refuses automatic breaks (its detectors' policies differ), or None."""
        return self.policies.disagreement()

    def client_for(self, snapshot_id: int) -> ControlClient | None:
        """The stream of the detector whose id space holds ``snapshot_id`` (None for a local id)."""
        if snapshot_id >= LOCAL_ID_BASE:
            return None
        return self._by_space.get(id_space(snapshot_id))

    def report_part(self, part: LocalSnapshotPart) -> bool:
        """Queue ``part`` for the detector that runs its snapshot; False when dropped."""
        client = self.client_for(part.snapshot_id)
        return client is not None and client.report_part(part)

    def report_failure(self, snapshot_id: int, reason: str) -> bool:
        """Tell the detector that runs ``snapshot_id`` this process cannot take part; False when dropped."""
        client = self.client_for(snapshot_id)
        return client is not None and client.report_failure(snapshot_id, reason)

    def send_hint(self, hint: WaitHint) -> bool:
        """Hint a long wait to every connected detector; whether one took it."""
        sent = [client.send_hint(hint) for client in self.clients if client.connected]
        return any(sent)

    def _claimer(self, address: str) -> Callable[[int], str | None]:
        def claim(space: int) -> str | None:
            owner = self._by_space.get(space)
            if owner is not None and owner.target != address and owner.connected:
                return (
                    f"the detector at {owner.target} already has id space {space} (replica {space}): "
                    "give each detector its own --replica"
                )
            for stale in [s for s, client in self._by_space.items() if client.target == address]:
                del self._by_space[stale]  # restarted with another replica number
            self._by_space[space] = next(client for client in self.clients if client.target == address)
            return None

        return claim

    def _listener(self, address: str) -> Callable[[str, str], None]:
        def listen(event: str, detail: str) -> None:
            if event != "dropped":  # a message lost says nothing about the stream
                self._events[address] = (event, detail)
            if event in ("connected", "disconnected") and self._on_change is not None:
                self._on_change(address, event == "connected")

        return listen
