"""The archive's tables: their Arrow schemas, and the one conversion between snapshots and rows.

The archive is a folder of Parquet tables, one sub-folder per table, each partitioned by day
(``<table>/day=YYYY-MM-DD/<file>.parquet``, hive style, the day of the snapshot's start in UTC).
Every row carries its ``snapshot_id``. One row per:

* ``snapshots`` — a finished snapshot: ids, times, outcome, abort kind and reason, sizes, what
  the cut was measured against, and (when small enough) the serialized ``GlobalSnapshot``;
* ``processes`` — a process state: active, attributes (JSON), and whether its message handler
  was in a run that waits (``handler_waits``; null when not recorded; since version 4);
* ``counters`` — a counter holding: in a process (its state's value, zeros included) or on a
  channel (the sum over the channel's recorded messages);
* ``wait_edges`` — a declared wait edge: waiter process/task -> target process/task, model,
  flow control, and which wait of the process it belongs to (a wait without targets is one row
  with null targets), with that wait's ``instance`` and ``began_at`` (since version 3; an agent
  reports one ``Wait`` per instance, so one task often has several);
* ``channels`` — a channel: n, m, recorded count and bytes, and the acknowledgement positions at
  the receiver's and the sender's recordings (null when unknown; since version 2);
* ``messages`` — a recorded message: position, payload, size, counters, no_wake, wakes_task;
* ``results`` — a predicate result: holds, unknown, summary, error, missing processes, evidence
  as JSON, and the serialized ``PredicateResult``.

Those tables belong to snapshots (:data:`SNAPSHOT_TABLES`): a batch of snapshots writes them
together. One table does not (since version 3):

* ``resolutions`` — one break of a proven deadlock (a ``Resolution``, DESIGN.md "Breaking a
  proven deadlock"): which wait of which process, the snapshot that proved the deadlock, the
  policy, who asked, the sink component, when the break was sent and answered, and the outcome as
  a word. Partitioned by the day it was sent; its ``snapshot_id`` is the proving snapshot's,
  which may be in another day or (retention) nowhere in the archive. A break has one row, or two
  when its agent's answer came after the detector gave it up: the ``unanswered`` row, then the
  answer's, in another file of the same day (files are never rewritten). The answer is the
  break's record: :func:`latest_rows` keeps, of the rows of one break (:func:`resolution_key`),
  the one of the most final outcome (an agent's answer, over ``unanswered``, over ``pending``),
  the latest ``reported_at`` among equals. Every reader of the table must do the same.

:func:`snapshot_rows` turns one finished snapshot into rows; :func:`snapshot_from_rows` turns the
rows back into the identical ``GlobalSnapshot``; :func:`resolution_row` and
:func:`resolution_from_row` do the same for a ``Resolution``. The format is versioned
(:data:`SCHEMA_VERSION`, in every file's metadata and in the folder's marker file); a reader
refuses a newer version with :class:`ArchiveError`, and reads every older one: the columns added
since read as null, which the conversions take as the fields' defaults (a wait of a version 2
file has instance 0 and no start).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa
from google.protobuf import json_format

from stablewatch.v1 import (
    AckPosition,
    ChannelSnapshot,
    Evaluation,
    GlobalSnapshot,
    LocalState,
    PredicateResult,
    ProcessSnapshot,
    RecordedMessage,
    Wait,
    WaitModel,
    WaitNode,
)
from stablewatch.v1.control_pb2 import BREAK_OUTCOME_UNSPECIFIED, BreakOutcome
from stablewatch.v1.query_pb2 import Resolution, SnapshotSummary

__all__ = [
    "ANSWERS",
    "MARKER_FILE",
    "MAX_BLOB_BYTES",
    "METADATA_KEY",
    "RESOLUTION_OUTCOMES",
    "SCHEMA_VERSION",
    "SNAPSHOT_TABLES",
    "TABLES",
    "ArchiveError",
    "RowsError",
    "day_of",
    "latest_rows",
    "outcome_rank",
    "outcome_word",
    "resolution_from_row",
    "resolution_key",
    "resolution_outcome",
    "resolution_row",
    "snapshot_from_rows",
    "snapshot_rows",
    "table_schema",
]

#: The archive format this code writes and reads (and every older one).
SCHEMA_VERSION = 4
#: The file at the archive's root that says it is one, and of which version.
MARKER_FILE = "_stablewatch_archive.json"
#: The Parquet key-value metadata key holding the schema version of every file.
METADATA_KEY = b"stablewatch.archive.schema_version"
#: Snapshots larger than this, serialized, are archived as rows only (no ``snapshot`` blob); the
#: pipeline rebuilds them from their rows.
MAX_BLOB_BYTES = 64 * 1024 * 1024


class ArchiveError(Exception):
    """An archive, a file in it, or a row cannot be read: names the file or folder and the reason."""


class RowsError(ArchiveError):
    """Rows that no file can hold: a value does not fit its column. The snapshot's fault, not the disk's."""


_ts = pa.timestamp("us", tz="UTC")

#: Every table's Arrow schema; ``day`` is the partition column, kept in the folder names.
# An AckPosition: incarnations and next_seq (uint64) kept in int64 by their bits.
_ACK_POSITION = pa.struct(
    [("sender_incarnation", pa.int64()), ("receiver_incarnation", pa.int64()), ("next_seq", pa.int64())]
)
# A WaitNode of a resolution's component.
_NODE = pa.struct([("process", pa.string()), ("task", pa.string())])

TABLES: dict[str, pa.Schema] = {
    "snapshots": pa.schema(
        [
            ("snapshot_id", pa.int64()),
            ("started_at", _ts),
            ("finished_at", _ts),
            ("outcome", pa.string()),  # "completed" or "aborted"
            ("abort_kind", pa.string()),
            ("abort_reason", pa.string()),
            ("processes", pa.int32()),
            ("channels", pa.int32()),
            ("messages_in_flight", pa.int64()),
            ("recorded_bytes", pa.int64()),
            ("wait_edges", pa.int64()),
            ("expected_members", pa.list_(pa.string())),
            ("expected_member_count", pa.int32()),
            ("outside_peers", pa.list_(pa.string())),
            ("closed", pa.bool_()),  # the cut covers the whole system (evaluation's coverage)
            ("snapshot", pa.binary()),  # GlobalSnapshot; null when aborted or larger than MAX_BLOB_BYTES
            ("day", pa.string()),
        ]
    ),
    "processes": pa.schema(
        [
            ("snapshot_id", pa.int64()),
            ("process_id", pa.string()),
            ("process_index", pa.int32()),  # position in the snapshot
            ("active", pa.bool_()),
            ("attributes", pa.string()),  # JSON object; "" when the process reported none
            ("handler_waits", pa.bool_()),  # LocalState.handler_waits; null: not recorded; since version 4
            ("day", pa.string()),
        ]
    ),
    "counters": pa.schema(
        [
            ("snapshot_id", pa.int64()),
            ("counter", pa.string()),
            ("process_id", pa.string()),  # set for a process's own balance
            ("src", pa.string()),  # set (with dst) for units in flight on a channel
            ("dst", pa.string()),
            ("amount", pa.int64()),
            ("day", pa.string()),
        ]
    ),
    "wait_edges": pa.schema(
        [
            ("snapshot_id", pa.int64()),
            ("waiter_process", pa.string()),
            ("waiter_task", pa.string()),
            ("target_process", pa.string()),  # null for a wait without targets
            ("target_task", pa.string()),
            ("model", pa.string()),  # "and", "or" or "unspecified" (which counts as "and")
            ("flow_control", pa.bool_()),
            ("wait_index", pa.int32()),  # position of the wait in the process's state
            ("target_index", pa.int32()),  # position of the target in the wait
            ("instance", pa.int64()),  # the wait's instance (uint64 by its bits); since version 3
            ("began_at", _ts),  # when the wait began, on the agent's clock; null: unknown; since version 3
            ("day", pa.string()),
        ]
    ),
    "channels": pa.schema(
        [
            ("snapshot_id", pa.int64()),
            ("src", pa.string()),
            ("dst", pa.string()),
            ("channel_index", pa.int32()),  # position in the snapshot
            ("sent_before_marker", pa.int64()),  # n
            ("received_before_recording", pa.int64()),  # m
            ("recorded", pa.int64()),  # messages in flight: m + recorded == n
            ("recorded_bytes", pa.int64()),
            ("receiver_acked", _ACK_POSITION),  # since version 2
            ("sender_ack_seen", _ACK_POSITION),  # since version 2
            ("day", pa.string()),
        ]
    ),
    "messages": pa.schema(
        [
            ("snapshot_id", pa.int64()),
            ("src", pa.string()),
            ("dst", pa.string()),
            ("position", pa.int32()),  # FIFO order on its channel
            ("payload", pa.binary()),
            ("size", pa.int64()),
            ("counters", pa.map_(pa.string(), pa.int64())),
            ("no_wake", pa.bool_()),
            ("wakes_task", pa.string()),
            ("receive_index", pa.int64()),
            ("day", pa.string()),
        ]
    ),
    "results": pa.schema(
        [
            ("snapshot_id", pa.int64()),
            ("position", pa.int32()),  # order of the results as evaluated
            ("name", pa.string()),
            ("holds", pa.bool_()),
            ("unknown", pa.bool_()),
            ("summary", pa.string()),
            ("error", pa.string()),
            ("missing_processes", pa.list_(pa.string())),
            ("evidence", pa.string()),  # JSON of the result's evidence; "" when it has none
            ("result", pa.binary()),  # the PredicateResult, serialized
            ("day", pa.string()),
        ]
    ),
    "resolutions": pa.schema(
        [
            ("resolution_id", pa.int64()),  # the detector's break id (uint64 by its bits)
            ("snapshot_id", pa.int64()),  # the snapshot that proved the deadlock
            ("process_id", pa.string()),  # the victim wait's process
            ("task", pa.string()),  # its waiter ("": the process itself)
            ("instance", pa.int64()),  # its instance (uint64 by its bits)
            ("wait_began_at", _ts),  # null: unknown
            ("policy", pa.string()),  # youngest, oldest, operator
            ("requested_by", pa.string()),  # "detector", or the operator's identity
            ("component", pa.list_(_NODE)),  # the deadlocked sink component the victim was chosen from
            ("deadlock", pa.string()),  # its cycle as text
            ("sent_at", _ts),
            ("reported_at", _ts),  # null: no answer yet (an archived break has one, or was given up on)
            ("outcome", pa.string()),  # a word of RESOLUTION_OUTCOMES
            ("detail", pa.string()),
            ("day", pa.string()),  # of sent_at
        ]
    ),
}
#: The tables a batch of snapshots writes, every row of them belonging to one snapshot.
SNAPSHOT_TABLES: tuple[str, ...] = tuple(name for name in TABLES if name != "resolutions")
#: Columns added after version 1: table -> column -> the version that added it.
_ADDED: dict[str, dict[str, int]] = {
    "processes": {"handler_waits": 4},
    "channels": {"receiver_acked": 2, "sender_ack_seen": 2},
    "wait_edges": {"instance": 3, "began_at": 3},
}
#: Tables added after version 1: table -> the version that added it (no older file holds one).
_TABLE_ADDED: dict[str, int] = {"resolutions": 3}
#: What became of a break, as the ``resolutions`` table says it: the agent's answer, ``unanswered``
#: when the detector gave up waiting for one (or could not send the break), ``pending`` for a break
#: archived before its outcome was known (the detector and export archive a break once it is).
#: ``policies_disagree`` (an agent refused an automatic break: its detectors' policies differ) and
#: ``failed`` (breaking the wait raised at the agent) are words, not columns: files of version 3
#: hold them, and a reader without them reads ``unanswered``.
RESOLUTION_OUTCOMES = ("broken", "gone", "already_broken", "policies_disagree", "failed", "unanswered", "pending")
#: The outcomes that are an agent's answer: a break has at most one.
ANSWERS = ("broken", "gone", "already_broken", "policies_disagree", "failed")

# The agent's answers, as words: broken, gone, already_broken, policies_disagree, failed.
_BREAK_OUTCOMES = {
    BreakOutcome.Name(value).removeprefix("BREAK_OUTCOME_").lower(): value
    for value in BreakOutcome.values()
    if value != BREAK_OUTCOME_UNSPECIFIED
}
_OUTCOMES = {2: "completed", 3: "aborted"}  # SnapshotOutcome values of a finished snapshot


def outcome_word(summary: SnapshotSummary) -> str:
    """``completed`` or ``aborted``; ValueError for a snapshot that has not finished."""
    word = _OUTCOMES.get(summary.outcome)
    if word is None:
        raise ValueError(f"snapshot {summary.snapshot_id} has not finished: only finished snapshots are archived")
    return word


def day_of(started_at: datetime) -> str:
    """The partition of a snapshot that started at `started_at`: its UTC date, ``YYYY-MM-DD``."""
    return started_at.astimezone(UTC).strftime("%Y-%m-%d")


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _datetime(timestamp: Any) -> datetime | None:
    if not timestamp.seconds and not timestamp.nanos:
        return None
    return datetime.fromtimestamp(timestamp.ToMicroseconds() / 1e6, UTC)


def _json(message: Any) -> str:
    return json_format.MessageToJson(message, indent=None, preserving_proto_field_name=True, sort_keys=True)


def snapshot_rows(
    summary: SnapshotSummary, snapshot: GlobalSnapshot | None = None, evaluation: Evaluation | None = None
) -> dict[str, list[dict[str, Any]]]:
    """The rows of every table for one finished snapshot (an aborted one has only its summary row).

    O(size of the snapshot).
    """
    snapshot_id = summary.snapshot_id
    # The snapshot's own times (microseconds, as the detector sets them) make the round trip exact.
    own_start = None if snapshot is None else _datetime(snapshot.started_at)
    started = own_start or _datetime(summary.started_at) or datetime.fromtimestamp(0, UTC)
    day = day_of(started)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in SNAPSHOT_TABLES}
    head: dict[str, Any] = {
        "snapshot_id": snapshot_id,
        "started_at": started,
        "finished_at": _datetime(summary.finished_at),
        "outcome": outcome_word(summary),
        "abort_kind": summary.abort_kind,
        "abort_reason": summary.abort_reason,
        "processes": summary.processes,
        "channels": summary.channels,
        "messages_in_flight": summary.messages_in_flight,
        "recorded_bytes": 0,
        "wait_edges": 0,
        "expected_members": [],
        "expected_member_count": 0,
        "outside_peers": [],
        "closed": None,
        "snapshot": None,
        "day": day,
    }
    rows["snapshots"].append(head)
    if snapshot is None:
        return rows
    if snapshot.snapshot_id != snapshot_id:
        raise ValueError(f"snapshot {snapshot.snapshot_id} does not belong to the summary of {snapshot_id}")
    blob = snapshot.SerializeToString(deterministic=True)
    head.update(
        expected_members=list(snapshot.expected_members),
        expected_member_count=snapshot.expected_member_count,
        outside_peers=list(snapshot.outside_peers),
        snapshot=blob if len(blob) <= MAX_BLOB_BYTES else None,
    )
    if evaluation is not None:
        head["closed"] = evaluation.coverage.closed
    head["finished_at"] = _datetime(snapshot.completed_at) or head["finished_at"]

    for process_index, process in enumerate(snapshot.processes):
        pid, state = process.process_id, process.state
        attributes = _json(state.attributes) if state.HasField("attributes") else ""
        rows["processes"].append(
            {
                "snapshot_id": snapshot_id,
                "process_id": pid,
                "process_index": process_index,
                "active": state.active,
                "attributes": attributes,
                "handler_waits": state.handler_waits if state.HasField("handler_waits") else None,
                "day": day,
            }
        )
        for counter, amount in sorted(state.counters.items()):
            rows["counters"].append(
                {
                    "snapshot_id": snapshot_id,
                    "counter": counter,
                    "process_id": pid,
                    "src": None,
                    "dst": None,
                    "amount": amount,
                    "day": day,
                }
            )
        for wait_index, wait in enumerate(state.waits):
            model = WaitModel.Name(wait.model).removeprefix("WAIT_MODEL_").lower()
            targets = list(wait.targets) or [None]
            for target_index, target in enumerate(targets):
                rows["wait_edges"].append(
                    {
                        "snapshot_id": snapshot_id,
                        "waiter_process": pid,
                        "waiter_task": wait.task,
                        "target_process": None if target is None else target.process,
                        "target_task": None if target is None else target.task,
                        "model": model,
                        "flow_control": wait.flow_control,
                        "wait_index": wait_index,
                        "target_index": target_index,
                        "instance": _signed(wait.instance),
                        # Microseconds as they are: any int64 fits, a datetime might not.
                        "began_at": wait.began_at_us or None,
                        "day": day,
                    }
                )
    recorded_bytes = 0
    for channel_index, channel in enumerate(snapshot.channels):
        in_flight: dict[str, int] = {}
        channel_bytes = 0
        for position, m in enumerate(channel.messages):
            channel_bytes += len(m.payload)
            for counter, amount in m.counters.items():
                in_flight[counter] = in_flight.get(counter, 0) + amount
            rows["messages"].append(
                {
                    "snapshot_id": snapshot_id,
                    "src": channel.src,
                    "dst": channel.dst,
                    "position": position,
                    "payload": m.payload,
                    "size": len(m.payload),
                    "counters": sorted(m.counters.items()),
                    "no_wake": m.no_wake,
                    "wakes_task": m.wakes_task,
                    "receive_index": m.receive_index,
                    "day": day,
                }
            )
        recorded_bytes += channel_bytes
        rows["channels"].append(
            {
                "snapshot_id": snapshot_id,
                "src": channel.src,
                "dst": channel.dst,
                "channel_index": channel_index,
                "sent_before_marker": channel.sent_before_marker,
                "received_before_recording": channel.received_before_recording,
                "recorded": len(channel.messages),
                "recorded_bytes": channel_bytes,
                "receiver_acked": _ack_row(channel, "receiver_acked"),
                "sender_ack_seen": _ack_row(channel, "sender_ack_seen"),
                "day": day,
            }
        )
        for counter, amount in sorted(in_flight.items()):
            rows["counters"].append(
                {
                    "snapshot_id": snapshot_id,
                    "counter": counter,
                    "process_id": None,
                    "src": channel.src,
                    "dst": channel.dst,
                    "amount": amount,
                    "day": day,
                }
            )
    head["recorded_bytes"] = recorded_bytes
    head["wait_edges"] = len(rows["wait_edges"])

    if evaluation is not None:
        for position, result in enumerate(evaluation.results):
            rows["results"].append(_result_row(snapshot_id, position, result, day))
    return rows


def _result_row(snapshot_id: int, position: int, result: PredicateResult, day: str) -> dict[str, Any]:
    kind = result.WhichOneof("evidence")
    return {
        "snapshot_id": snapshot_id,
        "position": position,
        "name": result.name,
        "holds": result.holds,
        "unknown": result.unknown,
        "summary": result.summary,
        "error": result.error,
        "missing_processes": list(result.missing_processes),
        "evidence": _json(getattr(result, kind)) if kind else "",
        "result": result.SerializeToString(deterministic=True),
        "day": day,
    }


def snapshot_from_rows(
    head: Mapping[str, Any],
    processes: Iterable[Mapping[str, Any]],
    counters: Iterable[Mapping[str, Any]],
    wait_edges: Iterable[Mapping[str, Any]],
    channels: Iterable[Mapping[str, Any]],
    messages: Iterable[Mapping[str, Any]],
) -> GlobalSnapshot:
    """Rebuild the ``GlobalSnapshot`` of one snapshot from its rows (the inverse of :func:`snapshot_rows`).

    Rows may come in any order. Raises :class:`ArchiveError` when they do not fit together.
    """
    snapshot_id = head["snapshot_id"]
    snapshot = GlobalSnapshot(
        snapshot_id=snapshot_id,
        expected_members=head.get("expected_members") or [],
        expected_member_count=head.get("expected_member_count") or 0,
        outside_peers=head.get("outside_peers") or [],
    )
    states: dict[str, LocalState] = {}
    for row in sorted(processes, key=lambda r: r["process_index"]):
        state = LocalState(active=bool(row["active"]))
        if row.get("handler_waits") is not None:
            state.handler_waits = row["handler_waits"]
        if row["attributes"]:
            json_format.Parse(row["attributes"], state.attributes)
        states[row["process_id"]] = state
    for row in counters:
        if row["process_id"] is not None:
            _state(states, row["process_id"], snapshot_id).counters[row["counter"]] = row["amount"]
    waits: dict[tuple[str, int], list[Mapping[str, Any]]] = {}
    for row in wait_edges:
        waits.setdefault((row["waiter_process"], row["wait_index"]), []).append(row)
    for (pid, _), group in sorted(waits.items()):
        group = sorted(group, key=lambda r: r["target_index"])
        first = group[0]
        wait = Wait(
            task=first["waiter_task"] or "",
            model=WaitModel.Value(f"WAIT_MODEL_{first['model'].upper()}"),
            flow_control=bool(first["flow_control"]),
            instance=(first.get("instance") or 0) % 2**64,  # null in files before version 3
            began_at_us=_micros(first.get("began_at")) or 0,
            targets=[
                WaitNode(process=r["target_process"], task=r["target_task"] or "")
                for r in group
                if r["target_process"] is not None
            ],
        )
        _state(states, pid, snapshot_id).waits.append(wait)
    snapshot.processes.extend(ProcessSnapshot(process_id=pid, state=state) for pid, state in states.items())

    recorded: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for row in messages:
        recorded.setdefault((row["src"], row["dst"]), []).append(row)
    for row in sorted(channels, key=lambda r: r["channel_index"]):
        key = (row["src"], row["dst"])
        in_flight = sorted(recorded.pop(key, []), key=lambda r: r["position"])
        if len(in_flight) != row["recorded"]:
            raise ArchiveError(
                f"snapshot {snapshot_id} channel {key[0]}->{key[1]}: {row['recorded']} messages recorded, "
                f"{len(in_flight)} rows"
            )
        snapshot.channels.append(
            ChannelSnapshot(
                src=row["src"],
                dst=row["dst"],
                sent_before_marker=row["sent_before_marker"],
                received_before_recording=row["received_before_recording"],
                receiver_acked=_ack_position(row.get("receiver_acked")),
                sender_ack_seen=_ack_position(row.get("sender_ack_seen")),
                messages=[
                    RecordedMessage(
                        payload=m["payload"],
                        counters=dict(m["counters"] or []),
                        no_wake=bool(m["no_wake"]),
                        wakes_task=m["wakes_task"] or "",
                        receive_index=m["receive_index"],
                    )
                    for m in in_flight
                ],
            )
        )
    if recorded:
        src, dst = next(iter(recorded))
        raise ArchiveError(f"snapshot {snapshot_id}: messages recorded on {src}->{dst}, a channel it does not have")
    for name in ("started_at", "finished_at"):
        moment = head.get(name)
        if moment is not None:
            target = snapshot.started_at if name == "started_at" else snapshot.completed_at
            target.FromMicroseconds(round(moment.timestamp() * 1_000_000))
    return snapshot


def _ack_row(channel: ChannelSnapshot, name: str) -> dict[str, int] | None:
    """An ``AckPosition`` field of `channel` as a row value; uint64 numbers kept in int64 by their bits."""
    if not channel.HasField(name):
        return None
    position = getattr(channel, name)
    return {field: _signed(getattr(position, field)) for field in _ACK_POSITION.names}


def _ack_position(value: Mapping[str, int] | None) -> AckPosition | None:
    """The inverse of :func:`_ack_row`."""
    if value is None:
        return None
    return AckPosition(**{field: number % 2**64 for field, number in value.items()})


def _signed(number: int) -> int:
    return number - 2**64 if number >= 2**63 else number


def _micros(moment: datetime | int | None) -> int | None:
    """A timestamp cell as microseconds since the epoch, exactly: readers give a ``datetime``, or
    the int64 itself when they read the column as integers (a time a ``datetime`` cannot hold)."""
    if moment is None or isinstance(moment, int):
        return moment
    return (moment - _EPOCH) // timedelta(microseconds=1)


def _day_of_micros(micros: int) -> str:
    try:
        return day_of(_EPOCH + timedelta(microseconds=micros))
    except OverflowError:  # no calendar day: the epoch's, rather than no partition
        return day_of(_EPOCH)


def resolution_outcome(resolution: Resolution) -> str:
    """What became of a break, as a word of :data:`RESOLUTION_OUTCOMES`."""
    for word, value in _BREAK_OUTCOMES.items():
        if resolution.outcome == value:
            return word
    return "unanswered" if resolution.HasField("reported_at") else "pending"


def resolution_key(resolution: Resolution) -> tuple[int, int]:
    """What identifies an archived break: its proving snapshot and its break id, as the table holds them.

    The break id alone is one store's; the snapshot id tells two detectors' breaks apart in an
    archive that both export to.
    """
    return (_signed(resolution.snapshot_id), _signed(resolution.resolution_id))


def outcome_rank(word: str | None) -> int:
    """How final an outcome word of the ``resolutions`` table is: ``pending`` 0, ``unanswered`` 1,
    an agent's answer 2 (a word this code does not know counts as one: only an answer can be new)."""
    if word == "pending" or word is None:
        return 0
    return 1 if word == "unanswered" else 2


def latest_rows(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """One row per break (:func:`resolution_key`'s columns) of ``resolutions`` rows: the one that is
    its record, of the most final outcome (:func:`outcome_rank`), then the latest ``reported_at``
    (a ``datetime`` or microseconds). O(rows); the rows kept in the order each break first appears.

    >>> given_up = {"snapshot_id": 1, "resolution_id": 2, "outcome": "unanswered", "reported_at": 5}
    >>> [row["outcome"] for row in latest_rows([given_up, {**given_up, "outcome": "broken", "reported_at": 9}])]
    ['broken']
    """
    kept: dict[tuple[int, int], Mapping[str, Any]] = {}
    for row in rows:
        key = (row["snapshot_id"], row["resolution_id"])
        other = kept.get(key)
        if other is None or _finality(row) > _finality(other):
            kept[key] = row
    return list(kept.values())


def _finality(row: Mapping[str, Any]) -> tuple[int, int]:
    reported = _micros(row.get("reported_at"))
    return (outcome_rank(row["outcome"]), -(2**63) if reported is None else reported)


def _stamp(resolution: Resolution, name: str) -> int | None:
    return getattr(resolution, name).ToMicroseconds() if resolution.HasField(name) else None


def resolution_row(resolution: Resolution) -> dict[str, Any]:
    """The ``resolutions`` row of one break (times in microseconds; the inverse of :func:`resolution_from_row`).

    An outcome this code does not know (a newer detector's) is archived as ``unanswered`` or
    ``pending``: the row keeps every known field exactly.
    """
    sent = _stamp(resolution, "sent_at")
    return {
        "resolution_id": _signed(resolution.resolution_id),
        "snapshot_id": _signed(resolution.snapshot_id),
        "process_id": resolution.process_id,
        "task": resolution.task,
        "instance": _signed(resolution.instance),
        "wait_began_at": _stamp(resolution, "wait_began_at"),
        "policy": resolution.policy,
        "requested_by": resolution.requested_by,
        "component": [{"process": node.process, "task": node.task} for node in resolution.component],
        "deadlock": resolution.deadlock,
        "sent_at": sent,
        "reported_at": _stamp(resolution, "reported_at"),
        "outcome": resolution_outcome(resolution),
        "detail": resolution.detail,
        "day": _day_of_micros(sent or 0),
    }


def resolution_from_row(row: Mapping[str, Any]) -> Resolution:
    """The ``Resolution`` of one ``resolutions`` row (times as ``datetime`` or microseconds)."""
    resolution = Resolution(
        resolution_id=row["resolution_id"] % 2**64,
        snapshot_id=row["snapshot_id"] % 2**64,
        process_id=row["process_id"] or "",
        task=row["task"] or "",
        instance=(row["instance"] or 0) % 2**64,
        policy=row["policy"] or "",
        requested_by=row["requested_by"] or "",
        component=[WaitNode(process=n["process"] or "", task=n["task"] or "") for n in row["component"] or []],
        deadlock=row["deadlock"] or "",
        outcome=_BREAK_OUTCOMES.get(row["outcome"], BREAK_OUTCOME_UNSPECIFIED),
        detail=row["detail"] or "",
    )
    for field in ("wait_began_at", "sent_at", "reported_at"):
        micros = _micros(row[field])
        if micros is not None:
            getattr(resolution, field).FromMicroseconds(micros)
    return resolution


def table_schema(table: str, version: int = SCHEMA_VERSION) -> pa.Schema:
    """The columns of `table` in files of schema `version` (an older one lacks the columns added since).

    ArchiveError for a table that files of `version` cannot hold (it came later).
    """
    added = _TABLE_ADDED.get(table, 1)
    if version < added:
        raise ArchiveError(f"schema version {version} has no {table} table (it came with version {added})")
    schema = TABLES[table]
    for name, added in _ADDED.get(table, {}).items():
        if version < added:
            schema = schema.remove(schema.get_field_index(name))
    return schema


def _state(states: dict[str, LocalState], pid: str, snapshot_id: int) -> LocalState:
    state = states.get(pid)
    if state is None:
        raise ArchiveError(f"snapshot {snapshot_id}: a row names process {pid!r}, which has no process row")
    return state


def table_from_rows(name: str, rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """The rows of table `name` as an Arrow table with its archive schema; :class:`RowsError` when a
    value does not fit its column (a uint64 of 2**63 or more in an int64 column, say)."""
    try:
        return pa.Table.from_pylist(list(rows), schema=TABLES[name])
    except (pa.ArrowException, OverflowError, TypeError, ValueError) as exc:
        raise RowsError(f"a value of the {name} table does not fit its column: {exc}") from exc
