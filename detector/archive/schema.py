"""The archive's tables: their Arrow schemas, and the one conversion between snapshots and rows.

The archive is a folder of Parquet tables, one sub-folder per table, each partitioned by day
(``<table>/day=YYYY-MM-DD/<file>.parquet``, hive style, the day of the snapshot's start in UTC).
Every row carries its ``snapshot_id``. One row per:

* ``snapshots`` — a finished snapshot: ids, times, outcome, abort kind and reason, sizes, what
  the cut was measured against, and (when small enough) the serialized ``GlobalSnapshot``;
* ``processes`` — a process state: active, attributes (JSON);
* ``counters`` — a counter holding: in a process (its state's value, zeros included) or on a
  channel (the sum over the channel's recorded messages);
* ``wait_edges`` — a declared wait edge: waiter process/task -> target process/task, model,
  flow control, and which wait of the process it belongs to (a wait without targets is one row
  with null targets);
* ``channels`` — a channel: n, m, recorded count and bytes, and the acknowledgement positions at
  the receiver's and the sender's recordings (null when unknown; since version 2);
* ``messages`` — a recorded message: position, payload, size, counters, no_wake, wakes_task;
* ``results`` — a predicate result: holds, unknown, summary, error, missing processes, evidence
  as JSON, and the serialized ``PredicateResult``.

:func:`snapshot_rows` turns one finished snapshot into rows; :func:`snapshot_from_rows` turns the
rows back into the identical ``GlobalSnapshot``. The format is versioned
(:data:`SCHEMA_VERSION`, in every file's metadata and in the folder's marker file); a reader
refuses a newer version with :class:`ArchiveError`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
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
from stablewatch.v1.query_pb2 import SnapshotSummary

__all__ = [
    "MARKER_FILE",
    "MAX_BLOB_BYTES",
    "METADATA_KEY",
    "SCHEMA_VERSION",
    "TABLES",
    "ArchiveError",
    "day_of",
    "outcome_word",
    "snapshot_from_rows",
    "snapshot_rows",
    "table_schema",
]

#: The archive format this code writes and reads (and every older one).
SCHEMA_VERSION = 2
#: The file at the archive's root that says it is one, and of which version.
MARKER_FILE = "_stablewatch_archive.json"
#: The Parquet key-value metadata key holding the schema version of every file.
METADATA_KEY = b"stablewatch.archive.schema_version"
#: Snapshots larger than this, serialized, are archived as rows only (no ``snapshot`` blob); the
#: pipeline rebuilds them from their rows.
MAX_BLOB_BYTES = 64 * 1024 * 1024


class ArchiveError(Exception):
    """An archive, a file in it, or a row cannot be read: names the file or folder and the reason."""


_ts = pa.timestamp("us", tz="UTC")

#: Every table's Arrow schema; ``day`` is the partition column, kept in the folder names.
# An AckPosition: incarnations and next_seq (uint64) kept in int64 by their bits.
_ACK_POSITION = pa.struct(
    [("sender_incarnation", pa.int64()), ("receiver_incarnation", pa.int64()), ("next_seq", pa.int64())]
)

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
}
#: Columns added after version 1: table -> column -> the version that added it.
_ADDED: dict[str, dict[str, int]] = {"channels": {"receiver_acked": 2, "sender_ack_seen": 2}}

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
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in TABLES}
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


def table_schema(table: str, version: int = SCHEMA_VERSION) -> pa.Schema:
    """The columns of `table` in files of schema `version` (an older one lacks the columns added since)."""
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
    """The rows of table `name` as an Arrow table with its archive schema."""
    return pa.Table.from_pylist(list(rows), schema=TABLES[name])
