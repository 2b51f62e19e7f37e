"""Seeded random global snapshots and archives for the pipeline's tests.

The snapshots mix what the wait-for rules distinguish: AND, OR and unspecified waits, waits of
tasks and of processes, flow-control waits, targets outside the cut, active and passive
processes, recorded messages that wake their receiver, only one of its tasks, or nobody
(heartbeats), acknowledgement positions on channels (one in transit, none, of other
incarnations, unknown), mostly on the channels of flow-control waits, and counters on processes
and on messages; whether each handler waits (recorded either way, or not); cuts are open or closed.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow.parquet as pq

from stablewatch.detector.archive.files import ensure_archive, parquet_files, write_batch
from stablewatch.detector.archive.schema import (
    MARKER_FILE,
    METADATA_KEY,
    TABLES,
    snapshot_rows,
    table_from_rows,
    table_schema,
)
from stablewatch.detector.evaluation import UserPredicate, evaluate, new_baselines
from stablewatch.detector.evaluation.columnar import SnapshotRows
from stablewatch.pipeline.evaluate import order_key
from stablewatch.v1 import (
    WAIT_MODEL_AND,
    WAIT_MODEL_OR,
    AckPosition,
    ChannelSnapshot,
    Evaluation,
    GlobalSnapshot,
    LocalState,
    ProcessSnapshot,
    RecordedMessage,
    Wait,
    WaitNode,
)
from stablewatch.v1.control_pb2 import BREAK_OUTCOME_BROKEN
from stablewatch.v1.query_pb2 import SNAPSHOT_OUTCOME_ABORTED, SNAPSHOT_OUTCOME_COMPLETED, Resolution, SnapshotSummary

START = datetime(2026, 3, 1, 23, 50, tzinfo=UTC)  # snapshots a few minutes apart cross midnight: two days
_TASKS = ["", "", "", "t0", "t1"]
_MODELS = [WAIT_MODEL_AND, WAIT_MODEL_OR, WAIT_MODEL_OR, 0]  # 0: unspecified, which counts as AND


@dataclass
class Archived:
    """One archived snapshot: its summary, and its global state unless it was aborted."""

    summary: SnapshotSummary
    snapshot: GlobalSnapshot | None = None


def random_snapshot(
    rng: random.Random, snapshot_id: int, started_at: datetime, processes: int = 0, max_millis: int = 90_000
) -> GlobalSnapshot:
    """A random snapshot of `processes` processes (2 to 8 when 0) that took up to `max_millis`, seeded by `rng`."""
    n = processes or rng.randint(2, 8)
    pids = [f"P{i}" for i in range(n)]
    outsiders = ["X0", "X1"] if rng.random() < 0.4 else []
    snapshot = GlobalSnapshot(snapshot_id=snapshot_id)
    snapshot.started_at.FromDatetime(started_at)
    snapshot.completed_at.FromDatetime(started_at + timedelta(milliseconds=rng.randint(1, max_millis)))

    def target() -> WaitNode:
        process = rng.choice(outsiders) if outsiders and rng.random() < 0.1 else rng.choice(pids)
        return WaitNode(process=process, task=rng.choice(_TASKS))

    for pid in pids:
        state = LocalState(active=rng.random() < 0.2)
        for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):
            wait = Wait(task=rng.choice(_TASKS), model=rng.choice(_MODELS), flow_control=rng.random() < 0.1)
            wait.targets.extend(target() for _ in range(rng.choice([0, 1, 1, 2, 2, 3])))
            state.waits.append(wait)
        if rng.random() < 0.8:
            state.counters["tokens"] = rng.randint(0, 20)
        if rng.random() < 0.2:
            state.counters["credits"] = rng.randint(-3, 9)
        if rng.random() < 0.2:
            state.attributes.update({"queue": rng.randint(0, 5), "role": rng.choice(["a", "b"])})
        snapshot.processes.append(ProcessSnapshot(process_id=pid, state=state))

    for src, dst in rng.sample(
        [(a, b) for a in pids for b in pids if a != b], k=min(n * (n - 1), rng.randint(0, 2 * n))
    ):
        messages = []
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
            message = RecordedMessage(payload=rng.randbytes(rng.randint(0, 40)), no_wake=rng.random() < 0.3)
            message.wakes_task = rng.choice(["", "", "t0", "t1"])
            if rng.random() < 0.5:
                message.counters["tokens"] = rng.randint(0, 5)
            messages.append(message)
        received = rng.randint(0, 50)
        snapshot.channels.append(
            ChannelSnapshot(
                src=src,
                dst=dst,
                sent_before_marker=received + len(messages),
                received_before_recording=received,
                messages=messages,
            )
        )
    _add_ack_positions(random.Random(snapshot_id * 1_000_003 + n), snapshot)
    _add_handler_waits(random.Random(snapshot_id * 999_983 + n), snapshot)
    _straddle_the_sign_bit(random.Random(snapshot_id * 999_979 + n), snapshot)
    snapshot.expected_members.extend(pids + (["P_gone"] if rng.random() < 0.08 else []))
    if rng.random() < 0.05:
        snapshot.expected_member_count = n + 1
    if outsiders and rng.random() < 0.3:
        snapshot.outside_peers.append(outsiders[0])
    return snapshot


def _add_handler_waits(rng: random.Random, snapshot: GlobalSnapshot) -> None:
    """Whether each process's handler waits, as agents record it now, or unset as an older agent
    leaves it (a generator of its own, so the rest of each seed's snapshot stays as it was)."""
    for process in snapshot.processes:
        choice = rng.choice([None, True, False])
        if choice is not None:
            process.state.handler_waits = choice


def _add_ack_positions(rng: random.Random, snapshot: GlobalSnapshot) -> None:
    """Give channels acknowledgement positions, most of those a flow-control wait sends on (adding
    such a channel, empty, now and then), so that the acknowledgement rule applies and does not.

    Its own `rng`, so that the rest of the generated snapshots stays as it was.
    """
    members = {p.process_id for p in snapshot.processes}
    flow = {
        (p.process_id, t.process)
        for p in snapshot.processes
        for w in p.state.waits
        if w.flow_control
        for t in w.targets
        if t.process in members and t.process != p.process_id
    }
    have = {(c.src, c.dst) for c in snapshot.channels}
    for src, dst in sorted(flow - have):
        if rng.random() < 0.5:
            count = rng.randint(0, 30)
            snapshot.channels.append(
                ChannelSnapshot(src=src, dst=dst, sent_before_marker=count, received_before_recording=count)
            )
    for channel in snapshot.channels:
        if rng.random() >= (0.9 if (channel.src, channel.dst) in flow else 0.3):
            continue
        incarnations = (rng.choice([1, 7, 2**63 + 5, 2**64 - 1]), rng.choice([2, 9, 2**63]))
        seen = rng.randint(0, 40)
        acked = seen + rng.choice([-3, 0, 0, 1, 1, 4])
        if acked < 0:
            acked = 0
        case = rng.random()
        if case < 0.8 or case >= 0.85:
            channel.receiver_acked.CopyFrom(_position(incarnations, acked))
        if case < 0.85:
            channel.sender_ack_seen.CopyFrom(_position(incarnations, seen))
        if 0.7 <= case < 0.8:  # a restart between them: positions of other incarnations
            channel.receiver_acked.receiver_incarnation += 1
        elif 0.85 <= case < 0.9:
            channel.ClearField("receiver_acked")


def _straddle_the_sign_bit(rng: random.Random, snapshot: GlobalSnapshot) -> None:
    """Move some acknowledgement positions in transit up to where the receiver's is past 2**63 and
    the sender's below it: a uint64 read as a signed long there orders them the other way round.
    Their order as unsigned numbers, all the evaluations should read, is kept."""
    for channel in snapshot.channels:
        if not (channel.HasField("receiver_acked") and channel.HasField("sender_ack_seen")) or rng.random() >= 0.3:
            continue
        acked, seen = channel.receiver_acked, channel.sender_ack_seen
        if acked.next_seq > seen.next_seq:
            shift = 2**63 - 1 - seen.next_seq
            acked.next_seq, seen.next_seq = acked.next_seq + shift, seen.next_seq + shift


def _position(incarnations: tuple[int, int], next_seq: int) -> AckPosition:
    sender, receiver = incarnations
    return AckPosition(sender_incarnation=sender, receiver_incarnation=receiver, next_seq=next_seq)


def pair_deadlocked(snapshot_id: int, started: datetime) -> GlobalSnapshot:
    """A closed cut, taken in half a second from `started`, in which P0 and P1 wait on each other: a deadlock."""
    snapshot = GlobalSnapshot(snapshot_id=snapshot_id, expected_members=["P0", "P1"])
    snapshot.started_at.FromDatetime(started)
    snapshot.completed_at.FromDatetime(started + timedelta(milliseconds=500))
    for pid, other in (("P0", "P1"), ("P1", "P0")):
        state = LocalState(waits=[Wait(targets=[WaitNode(process=other)])])
        snapshot.processes.append(ProcessSnapshot(process_id=pid, state=state))
    return snapshot


def pair_break(resolution_id: int, sent_at: datetime) -> Resolution:
    """A break of P0's wait in :func:`pair_deadlocked`'s deadlock (snapshot 1), sent at ``sent_at`` and
    reported broken 200 ms later."""
    resolution = Resolution(
        resolution_id=resolution_id,
        snapshot_id=1,
        process_id="P0",
        instance=resolution_id,
        policy="youngest",
        requested_by="detector",
        component=[WaitNode(process="P0"), WaitNode(process="P1")],
        deadlock="a cycle",
        outcome=BREAK_OUTCOME_BROKEN,
    )
    resolution.wait_began_at.FromDatetime(sent_at - timedelta(seconds=30))
    resolution.sent_at.FromDatetime(sent_at)
    resolution.reported_at.FromDatetime(sent_at + timedelta(milliseconds=200))
    return resolution


def summary_of(snapshot: GlobalSnapshot) -> SnapshotSummary:
    """The detector's summary of a completed `snapshot`."""
    summary = SnapshotSummary(
        snapshot_id=snapshot.snapshot_id,
        outcome=SNAPSHOT_OUTCOME_COMPLETED,
        processes=len(snapshot.processes),
        channels=len(snapshot.channels),
        messages_in_flight=sum(len(c.messages) for c in snapshot.channels),
    )
    summary.started_at.CopyFrom(snapshot.started_at)
    summary.finished_at.CopyFrom(snapshot.completed_at)
    return summary


def rows_of(snapshot: GlobalSnapshot) -> SnapshotRows:
    """`snapshot` as the archive's writer writes it, as Arrow tables (the columnar evaluation's input)."""
    rows = snapshot_rows(summary_of(snapshot), snapshot)
    tables = ("processes", "counters", "wait_edges", "channels", "messages")
    return SnapshotRows(rows["snapshots"][0], **{name: table_from_rows(name, rows[name]) for name in tables})


def aborted(snapshot_id: int, started_at: datetime, kind: str = "deadline", seconds: float = 5.0) -> Archived:
    """An aborted snapshot: a summary row only."""
    summary = SnapshotSummary(
        snapshot_id=snapshot_id, outcome=SNAPSHOT_OUTCOME_ABORTED, abort_kind=kind, abort_reason=f"{kind}: test"
    )
    summary.started_at.FromDatetime(started_at)
    summary.finished_at.FromDatetime(started_at + timedelta(seconds=seconds))
    return Archived(summary)


def random_archive(
    seed: int, count: int, aborted_every: int = 0, max_millis: int = 90_000, first: int = 1
) -> list[Archived]:
    """`count` random snapshots a minute apart (ids from `first`); every `aborted_every`-th one aborted.

    Snapshots take up to `max_millis`: over a minute, some finish after the next one.
    """
    rng = random.Random(seed)
    items = []
    for sid in range(first, first + count):
        started = START + timedelta(minutes=sid)
        if aborted_every and sid % aborted_every == 0:
            items.append(aborted(sid, started))
        else:
            snapshot = random_snapshot(rng, sid, started, max_millis=max_millis)
            items.append(Archived(summary_of(snapshot), snapshot))
    return items


def write_archive(
    root: Path,
    items: Iterable[Archived],
    batch_size: int = 25,
    evaluations: dict[int, Evaluation] | None = None,
    blobless: Iterable[int] = (),
) -> Path:
    """Write `items` to the archive at `root` in batches of `batch_size` snapshots, as the detector does.

    The snapshots whose ids are in `blobless` are archived as rows only, as the detector does for
    one larger than ``MAX_BLOB_BYTES``.
    """
    ensure_archive(root)
    batch: dict[str, list[dict]] = {}
    items = list(items)
    without_blob = set(blobless)
    for i, item in enumerate(items, 1):
        evaluation = (evaluations or {}).get(item.summary.snapshot_id)
        rows = snapshot_rows(item.summary, item.snapshot, evaluation)
        if item.summary.snapshot_id in without_blob:
            rows["snapshots"][0]["snapshot"] = None
        for table, table_rows in rows.items():
            batch.setdefault(table, []).extend(table_rows)
        if i % batch_size == 0 or i == len(items):
            _land_after_the_others(root, write_batch(root, batch))
            batch = {}
    return root


def _land_after_the_others(root: Path, written: Sequence[Path]) -> None:
    """Move the batch's files, in the order they were written, to after every earlier ``snapshots`` file.

    A file stream takes files in modification-time order, at millisecond resolution; the detector
    writes its batches seconds apart, but this writes them within milliseconds, where ties would
    make the landing order (and so the order baselines are set in) the directory listing's.
    """
    earlier = [path.stat().st_mtime_ns for path in parquet_files(root, "snapshots") if path not in written]
    if not earlier or not written:
        return
    shift = max(0, max(earlier) + 5_000_000 - min(path.stat().st_mtime_ns for path in written))
    for path in written:
        mtime = path.stat().st_mtime_ns + shift
        os.utime(path, ns=(mtime, mtime))


def as_version(root: Path, version: int) -> Path:
    """Rewrite the archive at `root` as a stablewatch of schema `version` would have written it: each
    file with that version's columns only, and its marker. It must hold no table that came later."""
    for table in TABLES:
        for path in parquet_files(root, table):
            schema = table_schema(table, version)
            old = pq.read_table(path).select([name for name in schema.names if name != "day"])
            pq.write_table(old.replace_schema_metadata({METADATA_KEY: str(version).encode()}), path)
    (root / MARKER_FILE).write_text(json.dumps({"format": "stablewatch-archive", "schema_version": version}))
    return root


def detector_evaluations(
    items: Sequence[Archived], expected: dict[str, int] | None = None, plugins: Sequence[UserPredicate] = ()
) -> dict[int, Evaluation]:
    """Evaluate the completed snapshots as the detector does: in the order they finished, keeping baselines."""
    totals = dict(expected or {})
    completed = [item.snapshot for item in items if item.snapshot is not None]
    evaluations = {}
    for snapshot in sorted(completed, key=lambda s: order_key(s.completed_at.ToDatetime(UTC), s.snapshot_id)):
        evaluation = evaluate(snapshot, totals, plugins)
        totals.update(new_baselines(evaluation))
        evaluations[snapshot.snapshot_id] = evaluation
    return evaluations
