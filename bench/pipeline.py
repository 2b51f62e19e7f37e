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
larger than ``MAX_BLOB_BYTES`` so archived as rows only (generated once into `--workdir`), in
the same run:

* the core: its wait-for graph held in memory as the detector holds it (networkx), reduced by
  ``deadlocked_nodes`` and ``deadlock_cycle`` (best of 3, as ``predicates.py`` times them);
* ``local``, unless ``--no-big-local``: one process of its own (no Spark imported), from the
  archive to every built-in result: the archive's reader reads the snapshot's rows as Arrow
  columns and the columnar evaluation builds and reduces its graph in compact form. It runs
  twice: the second run, warm as the pipeline's driver is after its first snapshot, is the one
  compared (``big_local_seconds``); the first, in a fresh process, is ``big_local_cold_seconds``
  (and ``big_spark_over_cold_local``). Its peak RSS is its own (``VmHWM``);
* ``spark``: the pipeline's ``evaluate`` job, as ``stablewatch pipeline evaluate`` runs it: to its
  result rows written as Parquet (read back, untimed, for the comparison); local and spark
  alternate in `--big-rounds` (3) rounds after one unmeasured round of each (the snapshot's files
  in the page cache for both, the JVM's code for big rows compiled), and the ratio is taken
  within each round. Once more:
  the pipeline to the result rows collected on the driver as Arrow (``big_snapshot_collect_seconds``,
  what earlier runs reported: no job collects its results);
* the reference: the detector's own built-in results of the snapshot (``find_deadlock`` and
  ``built_in_results`` on the graph above), which both must equal byte for byte.

Prints a table, then one JSON object as the last line: ``rows_small``, ``rows_large``,
``spark_seconds_small``, ``spark_seconds_large``, ``local_seconds_small``,
``local_seconds_large`` (best of the rounds; ``*_spread`` is max - min), ``identical`` (every
result row equal between spark and local, both archives), ``scaling`` (spark large / spark
small), ``ratio_large`` (spark large / local large); for the big snapshot ``big_local_seconds``
(with ``big_local_phases``: read, graph, deadlock, results), ``big_core_seconds``,
``big_local_over_core``, ``big_snapshot_seconds`` (Spark), ``big_spark_over_local`` (medians over
the rounds, each with its ``_spread``), ``big_snapshot_collect_seconds``,
``big_local_peak_mb``, ``big_identical`` (Spark and local equal to the detector's); and the
targets met. Targets: identical; scaling <= 12; ratio_large <= 1.0; big_identical;
big_local_seconds <= 5 x big_core_seconds; big_snapshot_seconds <= big_local_seconds.
`--only archives` or `--only big` runs one part. Archives are generated once into `--workdir`
and reused. Spark's driver gets `--driver-memory` (8g; in ``local[*]`` the executors live in the
driver's JVM) unless ``PYSPARK_SUBMIT_ARGS`` is set.

    python bench/pipeline.py
    python bench/pipeline.py --rows-small 20000 --rows-large 200000 --big-nodes 20000 --big-edges 60000 --rounds 1
    python bench/pipeline.py --only big --big-nodes 100000 --big-edges 300000
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from report import json_line, median_or_none, spread, timed
from rich.console import Console
from rich.table import Table

from stablewatch.detector.archive.files import ensure_archive, read_table, write_batch
from stablewatch.detector.archive.schema import snapshot_rows
from stablewatch.detector.evaluation import built_in_results, coverage, evaluate, new_baselines
from stablewatch.detector.evaluation.deadlock import deadlock_cycle, deadlocked_nodes
from stablewatch.detector.evaluation.waitfor import build_wait_for, find_deadlock, wait_counts
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
    parser.add_argument("--big-rounds", type=int, default=3, help="interleaved rounds of the big snapshot's runs")
    parser.add_argument(
        "--only",
        choices=("all", "archives", "big"),
        default="all",
        help="run only the archives' cases or only the big snapshot",
    )
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
    sizes = [("warmup", 5_000)]
    if args.only != "big":
        sizes += [("small", args.rows_small), ("large", args.rows_large)]
    for name, target in sizes:
        root = work / f"archive-{name}-{target}-{args.processes}-{args.batch}-{args.seed}"
        seconds, (rows, snapshots) = timed(
            lambda r=root, t=target: write_generated(r, t, args.processes, args.batch, args.seed)
        )
        generated[name] = {"root": root, "rows": rows, "snapshots": snapshots, "generate_seconds": seconds}
        console.print(f"archive {name}: {rows:,} rows, {snapshots:,} snapshots ({seconds:.1f} s to generate or reuse)")

    startup, spark = timed(get_session)
    warmup, _ = timed(lambda: evaluate_with_spark(spark, generated["warmup"]["root"], work / "out-warmup"))
    console.print(f"Spark: {spark.sparkContext.master}, started in {startup:.1f} s, warmed up in {warmup:.1f} s")
    result: dict[str, Any] = {"startup_seconds": round(startup, 2), "warmup_seconds": round(warmup, 2)}
    targets: dict[str, bool] = {}
    if args.only != "big":
        figures, met = measure_archives(spark, args, work, generated, console)
        result.update(figures)
        targets.update(met)
    if args.only != "archives":
        big = measure_big(spark, args, work, console)
        result.update(big_figures(args, big))
        targets.update(big_targets(big))
    result.update(rounds=args.rounds, cores=os.cpu_count(), master=spark.sparkContext.master, targets=targets)
    json_line(result)


def measure_archives(
    spark: Any, args: argparse.Namespace, work: Path, generated: dict[str, dict[str, Any]], console: Console
) -> tuple[dict[str, Any], dict[str, bool]]:
    """The many-snapshot archives, small and large, Spark and one process in interleaved rounds."""
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
    console.print(table)
    for size in ("small", "large"):
        best = min(phases[size], key=lambda p: sum(p.values()))
        console.print(f"spark {size} phases (best round): " + ", ".join(f"{k} {v:.1f} s" for k, v in best.items()))

    spark_small, spark_large = stats["spark_small"]["best"], stats["spark_large"]["best"]
    local_large = stats["local_large"]["best"]
    figures = {
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
        "identical": identical,
        "scaling": round(spark_large / spark_small, 2),
        "ratio_large": round(spark_large / local_large, 3),
    }
    met = {
        "identical": identical,
        "scaling_at_most_12": spark_large / spark_small <= 12,
        "spark_within_1x_of_local_at_large": spark_large <= local_large,
    }
    return figures, met


# -- the big snapshot ---------------------------------------------------------------------------------------


def write_big(root: Path, snapshot: GlobalSnapshot) -> tuple[int, bool]:
    """Archive `snapshot` as rows only (once: reused when complete).

    Returns the rows and whether the writer dropped the blob (else it is dropped here)."""
    done = root / ".bench-complete"
    if done.exists():
        count, blob_dropped = json.loads(done.read_text())
        return count, blob_dropped
    rows = snapshot_rows(summary_of(snapshot), snapshot)
    blob_dropped = rows["snapshots"][0]["snapshot"] is None
    rows["snapshots"][0]["snapshot"] = None  # a small test size fits a blob: archive it as rows only anyway
    shutil.rmtree(root, ignore_errors=True)
    ensure_archive(root)
    write_batch(root, rows)
    count = rows_of(rows)
    done.write_text(json.dumps([count, blob_dropped]))
    return count, blob_dropped


def core_and_reference(snapshot: GlobalSnapshot, repeat: int = 3) -> tuple[float, list[bytes]]:
    """The deadlock reduction of `snapshot`'s wait-for graph held in memory (networkx, as the detector
    holds it): ``deadlocked_nodes`` and ``deadlock_cycle``, best of `repeat`, as ``predicates.py``
    times it; and the detector's own built-in results of `snapshot`, serialized (the reference)."""
    gc.disable()  # millions of small dicts that live for the whole run: freeze them, as predicates.py does
    wait_for = build_wait_for(snapshot)
    gc.freeze()
    gc.enable()
    G = wait_for.graph
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        dead = deadlocked_nodes(G)
        deadlock_cycle(G, dead)
        seconds.append(time.perf_counter() - start)
        del dead
    found = find_deadlock(wait_for)
    results = built_in_results(snapshot, found, wait_counts(wait_for), {}, coverage(snapshot))
    reference = [r.SerializeToString(deterministic=True) for r in results]
    del G, wait_for, found, results
    gc.unfreeze()
    return min(seconds), reference


#: The single process's run, in a process of its own that imports only what it uses (no Spark): the
#: archive's rows of the big snapshot read as columns, to every built-in result (the columnar
#: evaluation), twice: cold, then warm (the one compared). Prints one JSON line: seconds (wall and
#: CPU) and per phase of the warm run, the cold run's, its own peak RSS (VmHWM), and the results (hex).
LOCAL_CHILD = """
import json, sys, time
from stablewatch.detector.archive.reader import read_snapshot_rows
from stablewatch.detector.evaluation.columnar import compact_wait_for, find_compact_deadlock, light_results

def run():
    phases = {}
    start, cpu = time.perf_counter(), time.process_time()
    at = start
    def phase(name):
        nonlocal at
        now = time.perf_counter()
        phases[name] = round(now - at, 3)
        at = now
    rows = read_snapshot_rows(sys.argv[1], 1)
    phase("read")
    wait_for = compact_wait_for(rows)
    phase("graph")
    found = find_compact_deadlock(wait_for)
    phase("deadlock")
    results = light_results(rows, found, wait_for.counts, {})
    phase("results")
    return at - start, time.process_time() - cpu, phases, results

# Twice: the first in a fresh process (its memory taken from the system, pyarrow's pools started),
# the second warm, as the pipeline's driver is after its first snapshot: the one compared.
cold, _, cold_phases, _ = run()
seconds, cpu, phases, results = run()
# This process's own high-water mark: ru_maxrss would carry the parent's across the spawn (Linux).
status = open("/proc/self/status").read()
peak = int(status.split("VmHWM:")[1].split()[0]) / 1024
serialized = [r.SerializeToString(deterministic=True).hex() for r in results]
print(json.dumps({"seconds": seconds, "cpu": cpu, "phases": phases, "cold_seconds": cold,
                  "cold_phases": cold_phases, "peak_mb": peak, "results": serialized}))
"""


def run_local_child(root: Path) -> dict[str, Any]:
    """The single process's run of the big snapshot (:data:`LOCAL_CHILD`): its figures and results."""
    child = subprocess.run([sys.executable, "-c", LOCAL_CHILD, str(root)], capture_output=True, text=True, check=True)
    return json.loads(child.stdout.strip().splitlines()[-1])


def measure_big(spark: Any, args: argparse.Namespace, work: Path, console: Console) -> dict[str, Any]:
    """One big snapshot archived as rows only: its deadlock reduction in memory (the core), then in
    `--big-rounds` interleaved rounds the single process from the archive (a child process) and the
    pipeline's ``evaluate`` job to its written Parquet; once more the pipeline to the result rows
    collected on the driver (what no job does, kept for comparison with earlier runs)."""
    root = work / f"archive-big-{args.big_nodes}-{args.big_edges}-{args.seed}"
    snapshot = big_snapshot(args.big_nodes, args.big_edges, args.seed)
    count, blob_dropped = write_big(root, snapshot)
    console.print(f"big snapshot: {count:,} rows, blob {'dropped by the writer' if blob_dropped else 'dropped'}")
    core, reference = core_and_reference(snapshot)
    del snapshot
    gc.collect()
    console.print(f"big snapshot, deadlock reduction in memory (networkx): {core:.2f} s")
    big: dict[str, Any] = {"rows": count, "blob_dropped": blob_dropped, "core_seconds": core}
    out = work / "out-big"

    def job() -> Any:
        evaluated = evaluate_archive(open_archive(spark, root))
        write_evaluations(evaluated.evaluations, out)
        return evaluated

    locals_: list[dict[str, Any]] = []
    jobs: list[float] = []
    identical = True
    # One round unmeasured: the files in the page cache and the JVM's code for big rows compiled, for both.
    if not args.no_big_local:
        run_local_child(root)
    job()
    for round_ in range(args.big_rounds):
        if not args.no_big_local:
            local = run_local_child(root)
            identical &= [bytes.fromhex(r) for r in local.pop("results")] == reference
            locals_.append(local)
        seconds, evaluated = timed(job)
        jobs.append(seconds)
        written = ds.dataset(out, format="parquet", partitioning="hive").to_table().sort_by("position").to_pylist()
        identical &= [r["result"] for r in written] == reference
        console.print(
            f"big snapshot, round {round_ + 1}: pipeline evaluate {seconds:.2f} s"
            + (f", one process {locals_[-1]['seconds']:.2f} s ({locals_[-1]['phases']})" if locals_ else "")
        )

    def collected() -> tuple[Any, list[dict[str, Any]]]:
        evaluated = evaluate_archive(open_archive(spark, root))
        # Collected, then put in order for the comparison (a sort on Spark would shuffle the evidence).
        return evaluated, evaluated.evaluations.toArrow().sort_by("position").to_pylist()

    collect_seconds, (evaluated, found) = timed(collected)
    identical &= [r["result"] for r in found] == reference
    deadlock = next(r for r in found if r["name"] == "deadlock")
    big.update(
        seconds=jobs,
        collect_seconds=collect_seconds,
        local=locals_,
        identical=identical,
        rounds=evaluated.rounds,
        remaining=evaluated.remaining,
        deadlocked=len(json.loads(deadlock["evidence"]).get("deadlocked", [])),
    )
    console.print(
        f"big snapshot, pipeline to the rows collected: {collect_seconds:.1f} s, {evaluated.rounds} rounds, "
        f"{evaluated.remaining:,} edges left; identical to the detector's: {identical}"
    )
    return big


def local_and_ratios(big: dict[str, Any]) -> tuple[list[float], list[float]]:
    """The single process's (warm) seconds per round, and the Spark job's over it within each round."""
    seconds = [local["seconds"] for local in big["local"]]
    return seconds, [job / local for job, local in zip(big["seconds"], seconds, strict=True)]


def big_figures(args: argparse.Namespace, big: dict[str, Any]) -> dict[str, Any]:
    jobs, locals_ = big["seconds"], big["local"]
    figures: dict[str, Any] = {
        "big_nodes": args.big_nodes,
        "big_edges": args.big_edges,
        "big_rows": big["rows"],
        "big_blob_dropped_by_writer": big["blob_dropped"],
        "big_snapshot_seconds": median_or_none(jobs, 2),
        "big_snapshot_seconds_spread": spread(jobs, 2),
        "big_snapshot_collect_seconds": round(big["collect_seconds"], 2),
        "big_core_seconds": round(big["core_seconds"], 3),
        "big_identical": big["identical"],
        "big_rounds": big["rounds"],
        "big_remaining_edges": big["remaining"],
        "big_deadlocked": big["deadlocked"],
        "big_measured_rounds": len(jobs),
    }
    if locals_:
        seconds, ratios = local_and_ratios(big)
        figures.update(
            big_local_seconds=median_or_none(seconds, 2),
            big_local_seconds_spread=spread(seconds, 2),
            big_local_cold_seconds=median_or_none([local["cold_seconds"] for local in locals_], 2),
            big_spark_over_cold_local=median_or_none(
                [job / local["cold_seconds"] for job, local in zip(jobs, locals_, strict=True)], 3
            ),
            big_local_cpu_seconds=median_or_none([local["cpu"] for local in locals_], 2),
            big_local_phases=locals_[seconds.index(sorted(seconds)[len(seconds) // 2])]["phases"],
            big_local_peak_mb=round(max(local["peak_mb"] for local in locals_)),
            big_local_over_core=round(statistics.median(seconds) / big["core_seconds"], 2),
            big_spark_over_local=median_or_none(ratios, 3),
            big_spark_over_local_spread=spread(ratios, 3),
        )
    return figures


def big_targets(big: dict[str, Any]) -> dict[str, bool]:
    met = {"big_identical": big["identical"]}
    if big["local"]:
        seconds, ratios = local_and_ratios(big)
        met["big_local_within_5x_core"] = statistics.median(seconds) <= 5 * big["core_seconds"]
        met["big_spark_within_1x_local"] = statistics.median(ratios) <= 1.0
    return met


if __name__ == "__main__":
    main()
