"""Bad input stops a job with a non-zero status and a message naming the file and the reason.

A folder that is not an archive, or of a newer version; a file that is not Parquet, not
stablewatch's, of a newer schema or with other columns; a file whose footer is fine but whose
data is corrupt (only Spark finds out); and no PySpark at all.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import SparkSession
from snapshot_gen import random_archive, write_archive

from stablewatch.detector.archive.files import parquet_files
from stablewatch.detector.archive.schema import MARKER_FILE, METADATA_KEY, SCHEMA_VERSION, TABLES
from stablewatch.pipeline import cli

pytestmark = pytest.mark.timeout(600)
NEWER = SCHEMA_VERSION + 1  # a schema version this code does not read


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    return write_archive(tmp_path / "archive", random_archive(seed=3, count=12), batch_size=6)


def run(capsys: pytest.CaptureFixture[str], job: str, archive: Path, out: Path, *flags: str) -> tuple[int, str]:
    status = cli.main([job, "--archive", str(archive), "--out", str(out), *flags])
    return status, " ".join(capsys.readouterr().err.split())


def snapshots_file(archive: Path) -> Path:
    return parquet_files(archive, "snapshots")[0]


def test_a_folder_that_is_not_an_archive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, err = run(capsys, "evaluate", tmp_path / "missing", tmp_path / "out")
    assert status == 2 and f"{tmp_path / 'missing'} is not a folder" in err
    status, err = run(capsys, "history", tmp_path, tmp_path / "out")
    assert status == 2 and f"{tmp_path} is not a stablewatch archive: {MARKER_FILE} is missing" in err


def test_an_archive_of_a_newer_version(archive: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (archive / MARKER_FILE).write_text(json.dumps({"format": "stablewatch-archive", "schema_version": 9}))
    status, err = run(capsys, "follow", archive, tmp_path / "out", "--once")
    assert status == 2
    reads = f"this stablewatch reads ({SCHEMA_VERSION})"
    assert f"{archive / MARKER_FILE}: archive schema version 9 is newer than {reads}" in err


def always(snapshot: object) -> bool:
    """A user predicate for the pipeline to load."""
    return True


def test_two_user_predicates_of_one_name_are_refused_before_spark_starts(
    archive: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = f"{__name__}:always"
    status, err = run(capsys, "evaluate", archive, tmp_path / "out", "--predicate", spec, "--predicate", spec)
    assert status == 2 and "two user predicates are named 'always'" in err
    assert not (tmp_path / "out").exists()


def _write_with(path: Path, table: pa.Table, version: bytes | None) -> None:
    metadata = None if version is None else {METADATA_KEY: version}
    pq.write_table(table.replace_schema_metadata(metadata), path)


def _snapshots_table() -> pa.Table:
    schema = TABLES["snapshots"]
    return schema.remove(schema.get_field_index("day")).empty_table()


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("garbage", "not a readable Parquet file"),
        ("foreign", "not a stablewatch archive file (no stablewatch.archive.schema_version metadata)"),
        ("newer", f"schema version {NEWER} is newer than this stablewatch reads ({SCHEMA_VERSION}); upgrade"),
        ("columns", "its columns do not match the snapshots table of schema version 1"),
    ],
)
def test_a_bad_file_is_named_with_the_reason(
    spark: SparkSession, archive: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str, reason: str
) -> None:
    bad = snapshots_file(archive).with_name("part-bad.parquet")
    if damage == "garbage":
        bad.write_bytes(b"this is not parquet at all" * 10)
    elif damage == "foreign":
        _write_with(bad, _snapshots_table(), None)
    elif damage == "newer":
        _write_with(bad, _snapshots_table(), str(NEWER).encode())
    else:
        _write_with(bad, pa.table({"snapshot_id": pa.array([1], pa.int64())}), b"1")
    for job in ("evaluate", "history", "follow"):
        status, err = run(capsys, job, archive, tmp_path / job, *(["--once"] if job == "follow" else []))
        assert status == 2, job
        assert f"stablewatch: {bad}: {reason}" in err, (job, err)


def test_corrupt_data_behind_a_good_footer_is_named(
    spark: SparkSession, archive: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = snapshots_file(archive)
    data = bytearray(path.read_bytes())
    data[4:68] = b"\xff" * 64  # the first page header: the footer (at the end) still reads fine
    path.write_bytes(bytes(data))
    status, err = run(capsys, "evaluate", archive, tmp_path / "out")
    assert status == 2
    assert f"stablewatch: {path}: corrupt Parquet file" in err


def test_a_bad_file_in_another_table_is_named_too(
    spark: SparkSession, archive: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = parquet_files(archive, "channels")[0].with_name("part-foreign.parquet")
    _write_with(bad, pa.table({"x": [1]}), None)
    status, err = run(capsys, "history", archive, tmp_path / "out")
    assert status == 2 and f"stablewatch: {bad}: not a stablewatch archive file" in err


def test_a_bad_resolutions_file_is_named_by_history(
    spark: SparkSession, archive: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = archive / "resolutions" / "day=2026-03-01" / "part-old.parquet"
    bad.parent.mkdir(parents=True)
    schema = TABLES["resolutions"]
    _write_with(bad, schema.remove(schema.get_field_index("day")).empty_table(), b"2")  # before the table
    status, err = run(capsys, "history", archive, tmp_path / "out")
    assert status == 2 and f"stablewatch: {bad}: schema version 2 has no resolutions table" in err


def test_the_stablewatch_command_hands_pipeline_to_it(tmp_path: Path) -> None:
    """Through the console script's hook, and no Spark is started for a folder that is not an archive."""
    command = [sys.executable, "-m", "stablewatch.cli.main", "pipeline", "history"]
    done = subprocess.run(
        [*command, "--archive", str(tmp_path), "--out", str(tmp_path / "out"), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert json.loads(done.stdout) == {"error": f"{tmp_path} is not a stablewatch archive: {MARKER_FILE} is missing"}


def test_without_pyspark_it_says_how_to_install_it(tmp_path: Path) -> None:
    hide = "import sys; sys.modules['pyspark'] = None; from stablewatch.cli.main import main; "
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            hide + f"sys.exit(main(['pipeline', 'evaluate', '--archive', '{tmp_path}', '--out', 'x']))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert "the pipeline needs PySpark, which is not installed: pip install 'stablewatch[spark]'" in done.stderr
