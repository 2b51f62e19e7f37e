"""Benchmark: the Spark pipeline's ``evaluate`` against single-process evaluation of the same archive, same run.

Archives of about `--rows-small` (1 M) and `--rows-large` (10 M) rows over all tables, of
generated snapshots of about `--processes` processes each (AND and OR waits, tasks, messages
in flight that do and do not wake, counters), written with the archive's own writer in batches
of `--batch` snapshots. On each, timed in interleaved rounds (spark small, local small, spark
large, local large; `--rounds` of them):

* ``spark`` — ``evaluate`` on Spark (``local[*]`` unless spark-submit says otherwise): every
  predicate for every snapshot, written as Parquet. The session is started and warmed up on a
  tiny archive first; that start-up is reported apart and excluded from every time.
* ``local`` — one Python process: the archive's checked reader (pyarrow), the shared
  ``evaluate`` in finish order keeping baselines, the same Parquet table written.

Then ``big``: one snapshot of `--big-nodes` (1 M) processes and `--big-edges` (3 M) wait edges,
larger than ``MAX_BLOB_BYTES`` so archived as rows only, evaluated by the pipeline (rebuilt from
rows, reduced on DataFrames, finished by the shared algorithm); and, unless ``--no-big-local``,
by the shared ``evaluate`` on the snapshot rebuilt from its rows in one process.

Prints a table, then one JSON object as the last line: ``rows_small``, ``rows_large``,
``spark_seconds_small``, ``spark_seconds_large``, ``local_seconds_small``,
``local_seconds_large`` (best of the rounds; ``*_spread`` is max - min), ``identical`` (every
result row equal between spark and local, both archives and the big snapshot), ``scaling``
(spark large / spark small), ``ratio_large`` (spark large / local large),
``big_snapshot_seconds`` and the targets met. Targets: identical; scaling <= 12; ratio_large <= 1.0.
Archives are generated once into `--workdir` and reused. Spark's driver gets `--driver-memory`
(8g; in ``local[*]`` the executors live in the driver's JVM) unless ``PYSPARK_SUBMIT_ARGS`` is set:
the default 1g cannot hold the big snapshot's million-node graph.

    python bench/pipeline.py
    python bench/pipeline.py --rows-small 20000 --rows-large 200000 --big-nodes 20000 --big-edges 60000 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from report import json_line, timed
from rich.console import Console
from rich.table import Table

from stablewatch.detector.archive.files import ensure_archive, read_table, write_batch
from stablewatch.detector.archive.schema import snapshot_from_rows, snapshot_rows
from stablewatch.detector.evaluation import evaluate, new_baselines
from stablewatch.pipeline.evaluate import EVALUATIONS, evaluate_archive, order_key, result_table, write_evaluations
from stablewatch.pipeline.session import get_session
from stablewatch.pipeline.tables import open_archive
from stablewatch.v1 import (
    WAIT_MODEL_AND,
    WAIT_MODEL_OR,
    ChannelSnapshot,
    GlobalSnapshot,
    LocalState,
    ProcessSnapshot,
    RecordedMessage,
    Wait,
    WaitNode,
)
from stablewatch.v1.query_pb2 import SNAPSHOT_OUTCOME_COMPLETED, SnapshotSummary

T0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
TEMPLATES = 400  # distinct generated snapshots; an archive repeats them under new ids and times


# -- generated archives -------------------------------------------------------------------------------------


def template(rng: random.Random, processes: int) -> GlobalSnapshot:
    """One random snapshot of about `processes` processes: waits, channels, messages, counters."""
    n = max(2, round(processes * rng.uniform(0.5, 1.5)))
    pids = [f"svc-{i:03d}" for i in range(n)]
    snapshot = GlobalSnapshot(expected_members=pids)
    for pid in pids:
        state = LocalState(active=rng.random() < 0.3)
        state.counters["tokens"] = rng.randint(0, 50)
        if rng.random() < 0.6:
            model = WAIT_MODEL_OR if rng.random() < 0.3 else WAIT_MODEL_AND
            task = rng.choice(["", "", "", "worker-1", "worker-2"])
            targets = [WaitNode(process=rng.choice(pids), task=rng.choice(["", "", "worker-1"])) for _ in range(2)]
            state.waits.append(Wait(task=task, model=model, targets=targets, flow_control=rng.random() < 0.05))
        snapshot.processes.append(ProcessSnapshot(process_id=pid, state=state))
    for _ in range(round(1.5 * n)):
        src, dst = rng.sample(pids, 2)
        messages = []
        if rng.random() < 0.3:
            for _ in range(rng.randint(1, 2)):
                message = RecordedMessage(payload=rng.randbytes(32), no_wake=rng.random() < 0.3)
                message.counters["tokens"] = rng.randint(0, 3)
                messages.append(message)
        snapshot.channels.append(ChannelSnapshot(src=src, dst=dst, sent_before_marker=len(messages), messages=messages))
    return snapshot


def summary_of(snapshot: GlobalSnapshot) -> SnapshotSummary:
    summary = SnapshotSummary(snapshot_id=snapshot.snapshot_id, outcome=SNAPSHOT_OUTCOME_COMPLETED)
    summary.started_at.CopyFrom(snapshot.started_at)
    summary.finished_at.CopyFrom(snapshot.completed_at)
    summary.processes = len(snapshot.processes)
    summary.channels = len(snapshot.channels)
    return summary


def rows_of(rows: dict[str, list[dict[str, Any]]]) -> int:
    return sum(len(table_rows) for table_rows in rows.values())


def write_generated(root: Path, target_rows: int, processes: int, batch: int, seed: int) -> tuple[int, int]:
    """Write an archive of about `target_rows` rows; return (rows, snapshots). Reused when already complete."""
    done = root / ".bench-complete"
    if done.exists():
        rows, snapshots = json.loads(done.read_text())
        return rows, snapshots
    shutil.rmtree(root, ignore_errors=True)
    ensure_archive(root)
    rng = random.Random(seed)
    templates = [template(rng, processes) for _ in range(TEMPLATES)]
    rows = snapshots = 0
    pending: dict[str, list[dict[str, Any]]] = {}
    while rows < target_rows:
        snapshots += 1
        snapshot = GlobalSnapshot()
        snapshot.CopyFrom(templates[snapshots % TEMPLATES])
        snapshot.snapshot_id = snapshots
        snapshot.started_at.FromDatetime(T0 + timedelta(seconds=snapshots))
        snapshot.completed_at.FromDatetime(T0 + timedelta(seconds=snapshots, milliseconds=400))
        for table, table_rows in snapshot_rows(summary_of(snapshot), snapshot).items():
            pending.setdefault(table, []).extend(table_rows)
            rows += len(table_rows)
        if snapshots % batch == 0:
            write_batch(root, pending)
            pending = {}
    if pending:
        write_batch(root, pending)
    done.write_text(json.dumps([rows, snapshots]))
    return rows, snapshots


def big_snapshot(nodes: int, edges: int, seed: int) -> GlobalSnapshot:
    """`nodes` processes and `edges` wait edges at random (a third of the waiters OR), a few active or free."""
    rng = random.Random(seed)
    pids = [f"service-instance-{i:08d}" for i in range(nodes)]  # long ids: the blob exceeds MAX_BLOB_BYTES
    snapshot = GlobalSnapshot(snapshot_id=1, expected_members=pids)
    snapshot.started_at.FromDatetime(T0)
    snapshot.completed_at.FromDatetime(T0 + timedelta(seconds=3))
    waiters = rng.sample(range(nodes), k=int(nodes * 0.95))
    share = [edges // len(waiters)] * len(waiters)
    for i in range(edges - sum(share)):
        share[i] += 1
    targets_of = dict(zip(waiters, share, strict=True))
    for i, pid in enumerate(pids):
        state = LocalState(active=rng.random() < 0.01)
        state.counters["tokens"] = 1
        count = targets_of.get(i, 0)
        if count:
            model = WAIT_MODEL_OR if rng.random() < 1 / 3 else WAIT_MODEL_AND
            chosen = rng.sample(range(nodes), k=count)
            state.waits.append(Wait(model=model, targets=[WaitNode(process=pids[t]) for t in chosen]))
        snapshot.processes.append(ProcessSnapshot(process_id=pid, state=state))
    return snapshot


# -- the two ways to evaluate -------------------------------------------------------------------------------


def evaluate_locally(root: Path, out: Path) -> pa.Table:
    """The single-process baseline: checked pyarrow reader, shared evaluate in finish order, same Parquet out."""
    snapshots = read_table(root, "snapshots").filter(pc.field("outcome") == "completed")
    heads = snapshots.select(["snapshot_id", "started_at", "finished_at", "day", "snapshot"])
    keys = [
        order_key(finished, sid)
        for finished, sid in zip(heads["finished_at"].to_pylist(), heads["snapshot_id"].to_pylist(), strict=True)
    ]
    heads = heads.take(sorted(range(len(keys)), key=keys.__getitem__))
    totals: dict[str, int] = {}
    per_snapshot = []
    for blob in heads["snapshot"].to_pylist():
        evaluation = evaluate(GlobalSnapshot.FromString(blob), totals)
        totals.update(new_baselines(evaluation))
        per_snapshot.append(evaluation.results)
    table = result_table(heads, per_snapshot)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out / "evaluations.parquet", compression="zstd")
    return table


def evaluate_with_spark(spark: Any, root: Path, out: Path) -> dict[str, float]:
    """The pipeline's evaluate job; returns the seconds of its phases (first jobs, then the evaluating write)."""
    start = time.perf_counter()
    archive = open_archive(spark, root)
    evaluated = evaluate_archive(archive)
    planned = time.perf_counter()
    write_evaluations(evaluated.evaluations, out, archive)
    return {"prepare": planned - start, "evaluate_and_write": time.perf_counter() - planned}


def sorted_rows(table: pa.Table) -> pa.Table:
    table = table.select(EVALUATIONS.names).cast(EVALUATIONS)
    return table.sort_by([("snapshot_id", "ascending"), ("position", "ascending")])


def spark_output(folder: Path) -> pa.Table:
    table = ds.dataset(folder, format="parquet", partitioning="hive").to_table()
    return sorted_rows(table.set_column(table.schema.get_field_index("day"), "day", table["day"].cast(pa.string())))


# -- measuring ----------------------------------------------------------------------------------------------


def describe(seconds: list[float]) -> dict[str, float]:
    return {"best": min(seconds), "median": statistics.median(seconds), "spread": max(seconds) - min(seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows-small", type=int, default=1_000_000)
    parser.add_argument("--rows-large", type=int, default=10_000_000)
    parser.add_argument("--processes", type=int, default=20, help="processes per generated snapshot (on average)")
    parser.add_argument("--batch", type=int, default=500, help="snapshots per archive batch")
    parser.add_argument("--big-nodes", type=int, default=1_000_000)
    parser.add_argument("--big-edges", type=int, default=3_000_000)
    parser.add_argument("--no-big-local", action="store_true", help="skip the single-process run of the big snapshot")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=418)
    parser.add_argument("--driver-memory", default="8g", help="Spark driver memory (%(default)s)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "stablewatch-bench-pipeline")
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_SUBMIT_ARGS", f"--driver-memory {args.driver_memory} pyspark-shell")
    console = Console()
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)

    generated: dict[str, dict[str, Any]] = {}
    for name, target in (("warmup", 5_000), ("small", args.rows_small), ("large", args.rows_large)):
        root = work / f"archive-{name}-{target}-{args.processes}-{args.batch}-{args.seed}"
        seconds, (rows, snapshots) = timed(
            lambda r=root, t=target: write_generated(r, t, args.processes, args.batch, args.seed)
        )
        generated[name] = {"root": root, "rows": rows, "snapshots": snapshots, "generate_seconds": seconds}
        console.print(f"archive {name}: {rows:,} rows, {snapshots:,} snapshots ({seconds:.1f} s to generate or reuse)")

    startup, spark = timed(get_session)
    warmup, _ = timed(lambda: evaluate_with_spark(spark, generated["warmup"]["root"], work / "out-warmup"))
    console.print(f"Spark: {spark.sparkContext.master}, started in {startup:.1f} s, warmed up in {warmup:.1f} s")

    times: dict[str, list[float]] = {f"{how}_{size}": [] for size in ("small", "large") for how in ("spark", "local")}
    phases: dict[str, list[dict[str, float]]] = {"small": [], "large": []}
    identical = True
    for round_ in range(args.rounds):
        for size in ("small", "large"):
            root = generated[size]["root"]
            seconds, split = timed(lambda r=root, s=size: evaluate_with_spark(spark, r, work / f"out-spark-{s}"))
            times[f"spark_{size}"].append(seconds)
            phases[size].append(split)
            seconds, local = timed(lambda r=root, s=size: evaluate_locally(r, work / f"out-local-{s}"))
            times[f"local_{size}"].append(seconds)
            if round_ == 0:
                same = spark_output(work / f"out-spark-{size}").equals(sorted_rows(local))
                generated[size]["identical"] = same
                identical = identical and same
            console.print(f"round {round_ + 1} {size}: spark {times[f'spark_{size}'][-1]:.1f} s, local {seconds:.1f} s")
            del local

    big = measure_big(spark, args, work, console)
    identical = identical and big.get("identical", True)

    stats = {key: describe(values) for key, values in times.items()}
    table = Table(title=f"pipeline evaluate vs single process ({os.cpu_count()} cores, {args.rounds} rounds)")
    for column in ("case", "rows", "snapshots", "best s", "median s", "spread s", "identical"):
        table.add_column(column, justify="left" if column == "case" else "right")
    for size in ("small", "large"):
        for how in ("spark", "local"):
            s = stats[f"{how}_{size}"]
            table.add_row(
                f"{how} {size}",
                f"{generated[size]['rows']:,}",
                f"{generated[size]['snapshots']:,}",
                f"{s['best']:.1f}",
                f"{s['median']:.1f}",
                f"{s['spread']:.1f}",
                str(generated[size]["identical"]),
            )
    table.add_row(
        "big snapshot (spark)", f"{big['rows']:,}", "1", f"{big['seconds']:.1f}", "", "", str(big.get("identical", ""))
    )
    if "local_seconds" in big:
        table.add_row("big snapshot (local)", f"{big['rows']:,}", "1", f"{big['local_seconds']:.1f}", "", "", "")
    console.print(table)
    for size in ("small", "large"):
        best = min(phases[size], key=lambda p: sum(p.values()))
        console.print(f"spark {size} phases (best round): " + ", ".join(f"{k} {v:.1f} s" for k, v in best.items()))

    spark_small, spark_large = stats["spark_small"]["best"], stats["spark_large"]["best"]
    local_large = stats["local_large"]["best"]
    result = {
        "rows_small": generated["small"]["rows"],
        "rows_large": generated["large"]["rows"],
        "snapshots_small": generated["small"]["snapshots"],
        "snapshots_large": generated["large"]["snapshots"],
        "spark_seconds_small": round(spark_small, 2),
        "spark_seconds_large": round(spark_large, 2),
        "local_seconds_small": round(stats["local_small"]["best"], 2),
        "local_seconds_large": round(local_large, 2),
        **{f"{key}_median": round(s["median"], 2) for key, s in stats.items()},
        **{f"{key}_spread": round(s["spread"], 2) for key, s in stats.items()},
        "spark_phases_large": {k: round(v, 2) for k, v in min(phases["large"], key=lambda p: sum(p.values())).items()},
        "startup_seconds": round(startup, 2),
        "warmup_seconds": round(warmup, 2),
        "identical": identical,
        "scaling": round(spark_large / spark_small, 2),
        "ratio_large": round(spark_large / local_large, 3),
        "big_snapshot_seconds": round(big["seconds"], 2),
        "big_local_seconds": round(big["local_seconds"], 2) if "local_seconds" in big else None,
        "big_nodes": args.big_nodes,
        "big_edges": args.big_edges,
        "big_blob_dropped_by_writer": big["blob_dropped"],
        "big_rounds": big["rounds"],
        "big_remaining_edges": big["remaining"],
        "big_deadlocked": big["deadlocked"],
        "rounds": args.rounds,
        "cores": os.cpu_count(),
        "master": spark.sparkContext.master,
        "targets": {
            "identical": identical,
            "scaling_at_most_12": spark_large / spark_small <= 12,
            "spark_within_1x_of_local_at_large": spark_large <= local_large,
        },
    }
    json_line(result)


def measure_big(spark: Any, args: argparse.Namespace, work: Path, console: Console) -> dict[str, Any]:
    """Archive one big snapshot as rows only and evaluate it with the pipeline (and in one process)."""
    root = work / f"archive-big-{args.big_nodes}-{args.big_edges}-{args.seed}"
    snapshot = big_snapshot(args.big_nodes, args.big_edges, args.seed)
    rows = snapshot_rows(summary_of(snapshot), snapshot)
    blob_dropped = rows["snapshots"][0]["snapshot"] is None
    rows["snapshots"][0]["snapshot"] = None  # a small test size fits a blob: archive it as rows only anyway
    shutil.rmtree(root, ignore_errors=True)
    ensure_archive(root)
    write_batch(root, rows)
    count = rows_of(rows)
    del rows
    console.print(f"big snapshot: {count:,} rows, blob {'dropped by the writer' if blob_dropped else 'dropped'}")

    def pipeline() -> tuple[Any, list[dict[str, Any]]]:
        evaluated = evaluate_archive(open_archive(spark, root))
        return evaluated, evaluated.evaluations.orderBy("position").toArrow().to_pylist()

    seconds, (evaluated, found) = timed(pipeline)
    deadlock = next(r for r in found if r["name"] == "deadlock")
    big: dict[str, Any] = {
        "rows": count,
        "seconds": seconds,
        "blob_dropped": blob_dropped,
        "rounds": evaluated.rounds,
        "remaining": evaluated.remaining,
        "deadlocked": len(json.loads(deadlock["evidence"]).get("deadlocked", [])),
    }
    console.print(
        f"big snapshot, pipeline: {seconds:.1f} s, {evaluated.rounds} rounds, {evaluated.remaining:,} edges left"
    )
    if not args.no_big_local:

        def local() -> list[bytes]:
            parts = ("snapshots", "processes", "counters", "wait_edges", "channels", "messages")
            tables = {name: read_table(root, name).to_pylist() for name in parts}
            rebuilt = snapshot_from_rows(tables["snapshots"][0], *(tables[name] for name in parts[1:]))
            return [r.SerializeToString(deterministic=True) for r in evaluate(rebuilt, {}).results]

        del snapshot
        big["local_seconds"], expected = timed(local)
        big["identical"] = [r["result"] for r in found] == expected
        console.print(f"big snapshot, one process: {big['local_seconds']:.1f} s, identical {big['identical']}")
    return big


if __name__ == "__main__":
    main()
