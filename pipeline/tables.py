"""The archive as Spark DataFrames, every file checked before Spark reads it.

Bad input names the file and the reason, with :class:`~stablewatch.detector.archive.schema.ArchiveError`:
a folder that is not an archive or of a newer version (its marker, checked by the archive's own
:func:`~stablewatch.detector.archive.files.check_marker`), and, per file, from its footer alone: not
Parquet, not written by stablewatch (no version metadata), of a newer schema version, or with
other columns. Spark then reads exactly the files that were checked. A file whose footer is fine
but whose data is corrupt fails inside Spark; :meth:`Archive.reading` then reads each file with the
archive's reader (:func:`~stablewatch.detector.archive.files.read_file`) to name it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from py4j.protocol import Py4JJavaError
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.types import StructType

from stablewatch.detector.archive.files import check_marker, parquet_files, read_file
from stablewatch.detector.archive.schema import METADATA_KEY, SCHEMA_VERSION, TABLES, ArchiveError, table_schema

__all__ = ["Archive", "check_archive", "check_file", "naming_corrupt", "open_archive", "spark_schema"]


def spark_schema(table: str) -> StructType:
    """The Spark schema of archive table `table`, with its ``day`` partition column."""
    return from_arrow_schema(TABLES[table])


def check_file(path: Path, table: str) -> None:
    """Check the footer of one file of `table`: ArchiveError naming it unless it is a readable
    Parquet file of a stablewatch archive, of this schema version or older, with the table's columns.

    Reads the footer only, O(columns): the data is left to Spark.
    """
    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as exc:
        raise ArchiveError(f"{path}: not a readable Parquet file ({exc})") from exc
    version = (schema.metadata or {}).get(METADATA_KEY)
    if version is None:
        raise ArchiveError(f"{path}: not a stablewatch archive file (no {METADATA_KEY.decode()} metadata)")
    if not version.isdigit():
        raise ArchiveError(f"{path}: bad schema version {version!r}")
    if int(version) > SCHEMA_VERSION:
        raise ArchiveError(
            f"{path}: schema version {int(version)} is newer than this stablewatch reads ({SCHEMA_VERSION}); "
            "upgrade stablewatch"
        )
    # An older file lacks the columns added since: Spark reads them as null.
    try:
        expected = table_schema(table, int(version))
    except ArchiveError as error:  # a table that came later than the file's version
        raise ArchiveError(f"{path}: {error}") from None
    expected = expected.remove(expected.get_field_index("day"))
    if not schema.remove_metadata().equals(expected):
        raise ArchiveError(f"{path}: its columns do not match the {table} table of schema version {int(version)}")


@dataclass
class Archive:
    """An archive folder opened for Spark: its tables as DataFrames, limited to a range of days.

    `first_day` and `last_day` (``YYYY-MM-DD``, inclusive, None for no bound) select partitions
    before anything is read.
    """

    spark: SparkSession
    root: Path
    first_day: str | None = None
    last_day: str | None = None
    _checked: dict[str, list[Path]] = field(default_factory=dict, repr=False)

    def files(self, table: str) -> list[Path]:
        """The visible files of `table` in the day range, each checked (once) with :func:`check_file`."""
        if table not in self._checked:
            files = [path for path in parquet_files(self.root, table) if self._in_range(path)]
            for path in files:
                check_file(path, table)
            self._checked[table] = files
        return self._checked[table]

    def table(self, table: str) -> DataFrame:
        """Table `table` as a DataFrame with the archive's schema (``day`` included); for
        ``resolutions``, one row per break (:func:`latest_breaks`)."""
        files = self.files(table)
        schema = spark_schema(table)
        if not files:
            return self.spark.createDataFrame([], schema)
        reader = self.spark.read.schema(schema).option("basePath", str(self.root / table))
        frame = reader.parquet(*(str(path) for path in files))
        return latest_breaks(frame) if table == "resolutions" else frame

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Run Spark actions over this archive; when Spark fails, name the corrupt file if there is one.

        On a failure, every file read so far is read again with the archive's own checked reader,
        and the first that fails raises its ArchiveError; otherwise Spark's error propagates.
        """
        with naming_corrupt((path, table) for table, files in self._checked.items() for path in files):
            yield

    def _in_range(self, path: Path) -> bool:
        day = path.parent.name.removeprefix("day=")
        return (self.first_day is None or day >= self.first_day) and (self.last_day is None or day <= self.last_day)


def latest_breaks(resolutions: DataFrame) -> DataFrame:
    """One row per break of ``resolutions`` rows: the record of each, as the detector's reader keeps
    it (:func:`stablewatch.detector.archive.schema.latest_rows`). A report that came after the
    detector gave up on a break is archived as a second row of that break (the archive's files are
    never rewritten): an agent's answer wins over ``unanswered``, which wins over ``pending``, then
    the latest ``reported_at``. Both rows are filed under the day the break was sent, so a read of
    some days has both or neither."""
    outcome = F.col("outcome")
    finality = F.when(outcome.isNull() | (outcome == "pending"), 0).when(outcome == "unanswered", 1).otherwise(2)
    latest = Window.partitionBy("snapshot_id", "resolution_id").orderBy(
        finality.desc(), F.col("reported_at").desc_nulls_last()
    )
    return resolutions.withColumn("_latest", F.row_number().over(latest)).where(F.col("_latest") == 1).drop("_latest")


@contextmanager
def naming_corrupt(files: Iterable[tuple[Path, str]]) -> Iterator[None]:
    """Run Spark actions that read `files` (each a path and its table); when Spark fails, read each with the
    archive's own checked reader and raise the ArchiveError of the first that fails (naming it), else
    Spark's error. `files` is only iterated on a failure."""
    try:
        yield
    except (Py4JJavaError, PySparkException):
        for path, table in files:
            read_file(path, table)
        raise


def check_archive(root: Path) -> None:
    """ArchiveError unless `root` is a folder holding an archive this code reads (no Spark needed)."""
    if not Path(root).is_dir():
        raise ArchiveError(f"{root} is not a folder")
    check_marker(Path(root))


def open_archive(spark: SparkSession, root: Path, first_day: str | None = None, last_day: str | None = None) -> Archive:
    """Open the archive at `root`; ArchiveError when it is not one or is newer than this code."""
    check_archive(root)
    return Archive(spark, Path(root), first_day, last_day)
