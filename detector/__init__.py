"""The central detector, grouped into rooms that each do one thing.

* :mod:`~stablewatch.detector.evaluation` — what a consistent cut proves: the wait-for graph,
  deadlock, termination, conservation, user predicates, and :func:`evaluate`, the one pure
  function from a global snapshot to its :class:`~stablewatch.v1.Evaluation`. No I/O.
* :mod:`~stablewatch.detector.assembly` — local snapshot parts merged into consistent global
  snapshots, with the per-channel proof. No I/O: the service and the simulator both run it.
* :mod:`~stablewatch.detector.service` — the running detector: control streams and membership,
  the scheduler, the SQLite store and its migrations, the query API, metrics, and the wiring.
* :mod:`~stablewatch.detector.archive` — completed snapshots as day-partitioned Parquet tables:
  the schema (shared with the Spark pipeline), the batched writer and the reader.
* :mod:`~stablewatch.detector.sim` — the deterministic simulator and the COS 418 trace formats.
* :mod:`~stablewatch.detector.lockfile` — the one-writer lock that the store and the archive take.

Dependencies point one way: evaluation ← service, assembly ← service and sim, evaluation ← archive
← service. The front door, :mod:`stablewatch.cli`, sits above the detector and the pipeline.
"""
