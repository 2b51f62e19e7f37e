"""The PySpark pipeline over the snapshot archive: evaluate, history, follow.

The detector archives every finished global snapshot as day-partitioned Parquet tables
(:mod:`stablewatch.detector.archive`). These jobs read that archive on Spark, ``local[*]`` by
default or any cluster through ``spark-submit``:

* ``evaluate`` — every predicate for every snapshot, in parallel across snapshots, with the
  detector's own :func:`~stablewatch.detector.evaluation.evaluate`; a snapshot archived without its
  blob is evaluated from its rows in columnar form, its graph reduced on DataFrames first only
  when too large to take whole (:mod:`.reduce`);
* ``history`` — deadlock and termination episodes, recurring processes, the deadlocks the
  detector broke, conservation drift, channel backlog and snapshot outcomes, as tables, a
  terminal summary and a chart;
* ``follow`` — Structured Streaming over the archive folder, each new batch evaluated as it
  lands, resuming from its checkpoint.

One module per job: :mod:`.session` (the Spark session), :mod:`.tables` (the archive as checked
DataFrames), :mod:`.evaluate`, :mod:`.reduce`, :mod:`.history`, :mod:`.chart`, :mod:`.summary`,
:mod:`.story` (what each system went through: phases and a sentence), :mod:`.follow`,
:mod:`.cli` (``stablewatch pipeline ...``), :mod:`.defaults` (the reduction's settings,
:class:`~.defaults.Reduction`, and their defaults, without PySpark) and :mod:`.jobs` (the file to
give ``spark-submit``). The pipeline imports only the detector's ``evaluation`` and ``archive``
rooms.
This ``__init__`` imports nothing, so that the command line can say how to install PySpark when
it is missing.
"""
