"""Read and write the COS 418 Chandy–Lamport trace formats (.top, .events, .snap).

Every parse error is a :class:`TraceError` naming the file, the line and what was wrong.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from stablewatch.v1 import GlobalSnapshot

__all__ = [
    "Send",
    "SnapFile",
    "SnapshotEvent",
    "Tick",
    "Topology",
    "TraceError",
    "TraceEvent",
    "compare_snaps",
    "expected_snap_files",
    "format_events",
    "format_snap",
    "format_topology",
    "parse_delays",
    "parse_events",
    "parse_snap",
    "parse_topology",
    "snap_from_snapshot",
]

TOKENS = "tokens"  # the counter the COS 418 token bank conserves


class TraceError(Exception):
    """Bad input in a trace file: which file, which line (0 for the file as a whole), and why."""

    def __init__(self, path: str | Path, line: int, reason: str) -> None:
        where = f"{path}:{line}" if line else str(path)
        super().__init__(f"{where}: {reason}")
        self.path = str(path)
        self.line = line
        self.reason = reason


@dataclass(frozen=True)
class Topology:
    """Processes with their initial balances, and directed links."""

    balances: dict[str, int]
    links: dict[str, list[str]]  # src -> sorted destinations

    @property
    def processes(self) -> list[str]:
        return sorted(self.balances)


@dataclass(frozen=True, slots=True)
class Send:
    src: str
    dst: str
    tokens: int
    line: int


@dataclass(frozen=True, slots=True)
class SnapshotEvent:
    process: str
    line: int


@dataclass(frozen=True, slots=True)
class Tick:
    steps: int
    line: int


TraceEvent = Send | SnapshotEvent | Tick


@dataclass
class SnapFile:
    """One snapshot as the .snap format holds it."""

    snapshot_id: int
    balances: dict[str, int]
    messages: list[tuple[str, str, int]] = field(default_factory=list)  # (src, dst, tokens), in order

    def by_destination(self) -> dict[str, list[tuple[str, int]]]:
        """Recorded messages per destination, in order: what a comparison must match."""
        grouped: dict[str, list[tuple[str, int]]] = {}
        for src, dst, tokens in self.messages:
            grouped.setdefault(dst, []).append((src, tokens))
        return grouped


def _lines(path: Path) -> Iterator[tuple[int, list[str]]]:
    """Numbered, split, non-blank lines that are not comments."""
    try:
        text = path.read_text()
    except OSError as error:
        raise TraceError(path, 0, f"cannot read: {error.strerror or error}") from error
    for number, raw in enumerate(text.splitlines(), start=1):
        words = raw.split()
        if words and not words[0].startswith("#"):
            yield number, words


def _integer(path: Path, line: int, word: str, what: str, minimum: int) -> int:
    try:
        value = int(word)
    except ValueError:
        raise TraceError(path, line, f"{what} must be an integer, got {word!r}") from None
    if value < minimum:
        raise TraceError(path, line, f"{what} must be at least {minimum}, got {value}")
    return value


def _headed(path: Path, what: str, minimum: int, empty: str) -> tuple[int, list[tuple[int, list[str]]]]:
    """A file that starts with one integer, ``what`` (at least ``minimum``): it, and the lines after it.

    ``empty`` is the error for a file without lines.
    """
    lines = list(_lines(path))
    if not lines:
        raise TraceError(path, 0, empty)
    first_line, words = lines[0]
    if len(words) != 1:
        raise TraceError(path, first_line, f"expected {what}, got {' '.join(words)!r}")
    return _integer(path, first_line, words[0], what, minimum), lines[1:]


def parse_topology(path: str | Path) -> Topology:
    """Parse a .top file: N, then N lines ``ID tokens``, then links ``SRC DST``."""
    path = Path(path)
    empty = "empty topology: expected the number of processes on the first line"
    count, lines = _headed(path, "the number of processes", 1, empty)
    if len(lines) < count:
        raise TraceError(path, 0, f"declares {count} processes but lists {len(lines)}")
    balances: dict[str, int] = {}
    for number, words in lines[:count]:
        if len(words) != 2:
            raise TraceError(path, number, f"expected 'ID tokens', got {' '.join(words)!r}")
        if words[0] in balances:
            raise TraceError(path, number, f"process {words[0]} is listed twice")
        balances[words[0]] = _integer(path, number, words[1], "the initial balance", 0)
    links: dict[str, set[str]] = {process: set() for process in balances}
    for number, words in lines[count:]:
        if len(words) != 2:
            raise TraceError(path, number, f"expected a link 'SRC DST', got {' '.join(words)!r}")
        src, dst = words
        for process in (src, dst):
            if process not in balances:
                raise TraceError(path, number, f"link names unknown process {process}")
        if src != dst:  # a link to itself is ignored, as the format says
            links[src].add(dst)
    return Topology(balances, {src: sorted(dsts) for src, dsts in links.items()})


def parse_events(path: str | Path, topology: Topology) -> list[TraceEvent]:
    """Parse a .events file against ``topology`` (names and links are checked here)."""
    path = Path(path)
    events: list[TraceEvent] = []
    for number, words in _lines(path):
        kind, args = words[0], words[1:]
        if kind == "send" and len(args) == 3:
            src, dst, amount = args
            for process in (src, dst):
                if process not in topology.balances:
                    raise TraceError(path, number, f"unknown process {process}")
            if dst not in topology.links[src]:
                raise TraceError(path, number, f"no link {src} -> {dst} in the topology")
            events.append(Send(src, dst, _integer(path, number, amount, "the number of tokens", 1), number))
        elif kind == "snapshot" and len(args) == 1:
            if args[0] not in topology.balances:
                raise TraceError(path, number, f"unknown process {args[0]}")
            events.append(SnapshotEvent(args[0], number))
        elif kind == "tick" and len(args) <= 1:
            steps = _integer(path, number, args[0], "the number of ticks", 1) if args else 1
            events.append(Tick(steps, number))
        else:
            raise TraceError(
                path,
                number,
                f"expected 'send SRC DST N', 'snapshot ID' or 'tick [N]', got {' '.join(words)!r}",
            )
    return events


def parse_delays(path: str | Path) -> list[int]:
    """Parse a delay tape: one integer 0 or more a line."""
    path = Path(path)
    delays = []
    for number, words in _lines(path):
        if len(words) != 1:
            raise TraceError(path, number, f"expected one delay, got {' '.join(words)!r}")
        delays.append(_integer(path, number, words[0], "a delay", 0))
    return delays


def parse_snap(path: str | Path) -> SnapFile:
    """Parse a .snap file: the id, ``ID tokens`` lines, then ``SRC DST token(N)`` lines."""
    path = Path(path)
    snapshot_id, lines = _headed(path, "the snapshot id", 0, "empty snapshot file")
    snap = SnapFile(snapshot_id, {})
    for number, words in lines:
        if len(words) == 2 and not snap.messages:
            if words[0] in snap.balances:
                raise TraceError(path, number, f"process {words[0]} is listed twice")
            snap.balances[words[0]] = _integer(path, number, words[1], "a balance", 0)
        elif len(words) == 3 and words[2].startswith("token(") and words[2].endswith(")"):
            tokens = _integer(path, number, words[2][len("token(") : -1], "a token count", 0)
            snap.messages.append((words[0], words[1], tokens))
        else:
            raise TraceError(path, number, f"expected 'ID tokens' or 'SRC DST token(N)', got {' '.join(words)!r}")
    return snap


def snap_from_snapshot(snapshot: GlobalSnapshot) -> SnapFile:
    """The .snap view of a global snapshot: token balances and recorded token messages.

    Messages are listed by destination, in the order they arrived there.
    """
    balances = {p.process_id: p.state.counters.get(TOKENS, 0) for p in snapshot.processes}
    arrivals = [
        (channel.dst, message.receive_index, channel.src, message.counters.get(TOKENS, 0))
        for channel in snapshot.channels
        for message in channel.messages
    ]
    messages = [(src, dst, tokens) for dst, _, src, tokens in sorted(arrivals)]
    return SnapFile(snapshot.snapshot_id, balances, messages)


def format_topology(topology: Topology) -> str:
    """Render ``topology`` in the .top format."""
    lines = [str(len(topology.balances))]
    lines += [f"{process} {topology.balances[process]}" for process in topology.processes]
    lines += [f"{src} {dst}" for src in topology.processes for dst in topology.links[src]]
    return "\n".join(lines) + "\n"


def format_events(events: Sequence[TraceEvent]) -> str:
    """Render ``events`` in the .events format."""
    lines = []
    for event in events:
        if isinstance(event, Send):
            lines.append(f"send {event.src} {event.dst} {event.tokens}")
        elif isinstance(event, SnapshotEvent):
            lines.append(f"snapshot {event.process}")
        else:
            lines.append("tick" if event.steps == 1 else f"tick {event.steps}")
    return "\n".join(lines) + "\n"


def format_snap(snap: SnapFile) -> str:
    """Render ``snap`` in the .snap format."""
    lines = [str(snap.snapshot_id)]
    lines += [f"{process} {snap.balances[process]}" for process in sorted(snap.balances)]
    lines += [f"{src} {dst} token({tokens})" for src, dst, tokens in snap.messages]
    return "\n".join(lines) + "\n"


def expected_snap_files(spec: str | Path) -> list[Path]:
    """The expected .snap files named by ``spec``: a folder (its ``*.snap``) or a path prefix.

    A prefix ``P`` names ``P.snap`` and ``P<id>.snap``, as the conformance cases do.
    """
    spec = Path(spec)
    if spec.is_dir():
        files = sorted(spec.glob("*.snap"))
    else:
        files = [spec.with_name(spec.name + ".snap")] if spec.with_name(spec.name + ".snap").is_file() else []
        files += sorted(
            path for path in spec.parent.glob(f"{spec.name}*.snap") if path.stem[len(spec.name) :].isdigit()
        )
    if not files:
        raise TraceError(spec, 0, "no expected .snap files found (give a folder or a path prefix)")
    return files


def compare_snaps(actual: list[SnapFile], expected: list[SnapFile]) -> list[str]:
    """Differences between two sets of snapshots: balances exactly, recorded messages per destination."""
    differences = []
    actual_by_id = {snap.snapshot_id: snap for snap in actual}
    expected_by_id = {snap.snapshot_id: snap for snap in expected}
    for snapshot_id in sorted(expected_by_id.keys() - actual_by_id.keys()):
        differences.append(f"snapshot {snapshot_id}: expected but not produced")
    for snapshot_id in sorted(actual_by_id.keys() - expected_by_id.keys()):
        differences.append(f"snapshot {snapshot_id}: produced but not expected")
    for snapshot_id in sorted(actual_by_id.keys() & expected_by_id.keys()):
        got, want = actual_by_id[snapshot_id], expected_by_id[snapshot_id]
        for process in sorted(got.balances.keys() | want.balances.keys()):
            if got.balances.get(process) != want.balances.get(process):
                differences.append(
                    f"snapshot {snapshot_id}: {process} has {got.balances.get(process)} tokens, "
                    f"expected {want.balances.get(process)}"
                )
        got_messages, want_messages = got.by_destination(), want.by_destination()
        for dst in sorted(got_messages.keys() | want_messages.keys()):
            got_at, want_at = got_messages.get(dst, []), want_messages.get(dst, [])
            if got_at != want_at:
                differences.append(
                    f"snapshot {snapshot_id}: messages recorded at {dst} are "
                    f"{_describe(got_at)}, expected {_describe(want_at)}"
                )
    return differences


def _describe(messages: list[tuple[str, int]]) -> str:
    return "[" + ", ".join(f"{src}:token({tokens})" for src, tokens in messages) + "]" if messages else "none"
