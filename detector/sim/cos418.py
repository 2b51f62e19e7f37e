"""Read and write the COS 418 Chandy–Lamport trace formats (.top, .events, .snap).

Every parse error is a :class:`TraceError` naming the file, the line and what was wrong. A process
id follows the detector's rule (:func:`~stablewatch.v1.bounds.process_id_problem`), and a balance,
a token count and the tokens of a whole file stay within ``MAX_COUNTER_UNITS``, the units the
evaluation counts a total in; a tick count and a delay stay within :data:`MAX_TICKS`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from stablewatch.v1 import GlobalSnapshot
from stablewatch.v1.bounds import MAX_COUNTER_UNITS, process_id_problem, quoted_prefix

__all__ = [
    "MAX_TICKS",
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
    "parse_expected",
    "parse_snap",
    "parse_topology",
    "snap_from_snapshot",
]

TOKENS = "tokens"  # the counter the COS 418 token bank conserves
#: The most ticks one ``tick N`` line, or one delay of a tape, may take: a trace's steps are small,
#: and a huge one would only keep the simulator busy (idle ticks are skipped, delays are not).
MAX_TICKS = 1_000_000


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
    source: str | None = field(default=None, compare=False)  # the file it was read from, if any

    def by_destination(self) -> dict[str, list[tuple[str, int]]]:
        """Recorded messages per destination, in order: what a comparison must match."""
        grouped: dict[str, list[tuple[str, int]]] = {}
        for src, dst, tokens in self.messages:
            grouped.setdefault(dst, []).append((src, tokens))
        return grouped


def _lines(path: Path) -> Iterator[tuple[int, list[str]]]:
    """Numbered, split, non-blank lines that are not comments."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise TraceError(path, 0, f"cannot read: {error.strerror or error}") from error
    try:
        text = data.decode()
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise TraceError(path, line, f"is not UTF-8 text (byte 0x{data[error.start]:02x})") from None
    for number, raw in enumerate(text.splitlines(), start=1):
        words = raw.split()
        if words and not words[0].startswith("#"):
            yield number, words


def _integer(path: Path, line: int, word: str, what: str, minimum: int, maximum: int | None = None) -> int:
    try:
        value = int(word)
    except ValueError:
        raise TraceError(path, line, f"{what} must be an integer, got {quoted_prefix(word)}") from None
    if value < minimum:
        raise TraceError(path, line, f"{what} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise TraceError(path, line, f"{what} must be at most {maximum}, got {quoted_prefix(word)}")
    return value


def _units(path: Path, line: int, word: str, what: str) -> int:
    """A number of tokens: 0 or more, and at most ``MAX_COUNTER_UNITS``."""
    return _integer(path, line, word, what, 0, MAX_COUNTER_UNITS)


def _process(path: Path, line: int, word: str) -> str:
    """``word`` as a process id, refused as the detector refuses it (too long, a control character)."""
    problem = process_id_problem(word)
    if problem is not None:
        raise TraceError(path, line, problem)
    return word


def _total(path: Path, amounts: Iterable[int], what: str) -> None:
    """Refuse a file whose tokens add up past ``MAX_COUNTER_UNITS``: every sum of them must stay one."""
    total = sum(amounts)
    if total > MAX_COUNTER_UNITS:
        raise TraceError(path, 0, f"{what} add up to {total}, past the {MAX_COUNTER_UNITS} a total is counted in")


def _headed(path: Path, what: str, minimum: int, empty: str) -> tuple[int, list[tuple[int, list[str]]]]:
    """A file that starts with one integer, ``what`` (at least ``minimum``): it, and the lines after it.

    ``empty`` is the error for a file without lines.
    """
    lines = list(_lines(path))
    if not lines:
        raise TraceError(path, 0, empty)
    first_line, words = lines[0]
    if len(words) != 1:
        raise TraceError(path, first_line, f"expected {what}, got {quoted_prefix(' '.join(words))}")
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
            raise TraceError(path, number, f"expected 'ID tokens', got {quoted_prefix(' '.join(words))}")
        process = _process(path, number, words[0])
        if process in balances:
            raise TraceError(path, number, f"process {process} is listed twice")
        balances[process] = _units(path, number, words[1], "the initial balance")
    _total(path, balances.values(), "the initial balances")
    links: dict[str, set[str]] = {process: set() for process in balances}
    for number, words in lines[count:]:
        if len(words) != 2:
            raise TraceError(path, number, f"expected a link 'SRC DST', got {quoted_prefix(' '.join(words))}")
        src, dst = words
        for process in (src, dst):
            if process not in balances:
                raise TraceError(path, number, f"link names unknown process {_process(path, number, process)}")
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
                    raise TraceError(path, number, f"unknown process {_process(path, number, process)}")
            if dst not in topology.links[src]:
                raise TraceError(path, number, f"no link {src} -> {dst} in the topology")
            tokens = _integer(path, number, amount, "the number of tokens", 1, MAX_COUNTER_UNITS)
            events.append(Send(src, dst, tokens, number))
        elif kind == "snapshot" and len(args) == 1:
            if args[0] not in topology.balances:
                raise TraceError(path, number, f"unknown process {_process(path, number, args[0])}")
            events.append(SnapshotEvent(args[0], number))
        elif kind == "tick" and len(args) <= 1:
            steps = _integer(path, number, args[0], "the number of ticks", 1, MAX_TICKS) if args else 1
            events.append(Tick(steps, number))
        else:
            raise TraceError(
                path,
                number,
                f"expected 'send SRC DST N', 'snapshot ID' or 'tick [N]', got {quoted_prefix(' '.join(words))}",
            )
    return events


def parse_delays(path: str | Path) -> list[int]:
    """Parse a delay tape: one integer 0 or more a line."""
    path = Path(path)
    delays = []
    for number, words in _lines(path):
        if len(words) != 1:
            raise TraceError(path, number, f"expected one delay, got {quoted_prefix(' '.join(words))}")
        delays.append(_integer(path, number, words[0], "a delay", 0, MAX_TICKS))
    return delays


def parse_snap(path: str | Path) -> SnapFile:
    """Parse a .snap file: the id, ``ID tokens`` lines, then ``SRC DST token(N)`` lines."""
    path = Path(path)
    snapshot_id, lines = _headed(path, "the snapshot id", 0, "empty snapshot file")
    snap = SnapFile(snapshot_id, {}, source=str(path))
    for number, words in lines:
        if len(words) == 2 and not snap.messages:
            process = _process(path, number, words[0])
            if process in snap.balances:
                raise TraceError(path, number, f"process {process} is listed twice")
            snap.balances[process] = _units(path, number, words[1], "a balance")
        elif len(words) == 3 and words[2].startswith("token(") and words[2].endswith(")"):
            src, dst = _process(path, number, words[0]), _process(path, number, words[1])
            tokens = _units(path, number, words[2][len("token(") : -1], "a token count")
            snap.messages.append((src, dst, tokens))
        else:
            raise TraceError(
                path, number, f"expected 'ID tokens' or 'SRC DST token(N)', got {quoted_prefix(' '.join(words))}"
            )
    _total(path, [*snap.balances.values(), *(tokens for _, _, tokens in snap.messages)], "its tokens")
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
    return [path for path, _ in _expected_files(Path(spec))]


def _expected_files(spec: Path) -> list[tuple[Path, str | None]]:
    """:func:`expected_snap_files`, each with the snapshot id its name gives (``<id>.snap`` in a
    folder, ``P<id>.snap`` for a prefix ``P``), or None when its name gives none."""
    if spec.is_dir():
        files = [(path, path.stem if path.stem.isdigit() else None) for path in sorted(spec.glob("*.snap"))]
    else:
        whole = spec.with_name(spec.name + ".snap")
        files = [(whole, None)] if whole.is_file() else []
        files += [
            (path, path.stem[len(spec.name) :])
            for path in sorted(spec.parent.glob(f"{spec.name}*.snap"))
            if path.stem[len(spec.name) :].isdigit()
        ]
    if not files:
        raise TraceError(spec, 0, "no expected .snap files found (give a folder or a path prefix)")
    return files


def parse_expected(spec: str | Path) -> list[SnapFile]:
    """Parse the expected .snap files named by ``spec`` (see :func:`expected_snap_files`).

    A file whose name gives an id other than the one inside is refused (which of the two was meant
    cannot be told), and so are two files with one id (only one of them could be compared).
    """
    snaps = []
    for path, named in _expected_files(Path(spec)):
        snap = parse_snap(path)
        if named is not None and int(named) != snap.snapshot_id:
            raise TraceError(path, 1, f"holds snapshot {snap.snapshot_id}, but its name says snapshot {int(named)}")
        snaps.append(snap)
    _by_id(snaps)  # two files with one id: refused now, before anything is simulated or written
    return snaps


def compare_snaps(actual: list[SnapFile], expected: list[SnapFile]) -> list[str]:
    """Differences between two sets of snapshots: balances exactly, recorded messages per destination.

    Two expected snapshots with one id are refused (a :class:`TraceError` naming both files), as
    only one of them could be compared.
    """
    differences = []
    actual_by_id = {snap.snapshot_id: snap for snap in actual}
    expected_by_id = _by_id(expected)
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


def _by_id(expected: list[SnapFile]) -> dict[int, SnapFile]:
    """``expected`` by snapshot id, refusing an id given twice."""
    by_id: dict[int, SnapFile] = {}
    for snap in expected:
        first = by_id.setdefault(snap.snapshot_id, snap)
        if first is not snap:
            where = snap.source or "expected snapshots"
            raise TraceError(
                where, 1, f"snapshot {snap.snapshot_id} is expected twice: here and in {first.source or 'another'}"
            )
    return by_id


def _describe(messages: list[tuple[str, int]]) -> str:
    return "[" + ", ".join(f"{src}:token({tokens})" for src, tokens in messages) + "]" if messages else "none"
