"""The Parquet archive of finished snapshots and of the deadlocks broken, for the Spark pipeline and
anyone with a Parquet reader.

* :mod:`.schema` — the tables and the one conversion between a snapshot (or a break) and its rows;
* :mod:`.files` — the folder on disk: marker, atomic batches, checked reading, the writer lock;
* :mod:`.recovery` — setting right what a killed writer left;
* :mod:`.writer` — :class:`~.writer.ArchiveWriter`, the detector's batched, exactly-once writer
  (its docstring says which mounted volumes and object stores can hold an archive);
* :mod:`.export` — backfilling an archive from a store;
* :mod:`.reader` — whole snapshots and the breaks back, and a check of every file.

The archive never imports the service: the writer and export take any object with the store's
methods (:class:`~.writer.ArchivingStore`).
"""
