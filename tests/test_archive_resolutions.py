"""The archive's ``resolutions`` table: every break of a deadlock, written once, read back equal.

Breaks reach the writer as the detector finishes them (``ArchiveWriter.add_resolution``) and, after
a crash or a failed write, from the store (resync); export copies them from a store. Unit tests
drive an :class:`ArchiveWriter` over a real store on one event loop, and set up the crash windows
by hand.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from polling import async_poll
from stablewatch.cli.main import main
from stablewatch.detector.archive.export import export
from stablewatch.detector.archive.files import ensure_archive, parquet_files, read_table, write_resolutions
from stablewatch.detector.archive.reader import check, read_resolutions
from stablewatch.detector.archive.recovery import archived_resolutions, repair
from stablewatch.detector.archive.schema import (
    RESOLUTION_OUTCOMES,
    ArchiveError,
    resolution_from_row,
    resolution_key,
    resolution_row,
)
from stablewatch.detector.archive.writer import ArchiveWriter, write_resolution_batch
from stablewatch.detector.service.store import Store
from stablewatch.v1 import WaitNode
from stablewatch.v1.control_pb2 import (
    BREAK_OUTCOME_ALREADY_BROKEN,
    BREAK_OUTCOME_BROKEN,
    BREAK_OUTCOME_GONE,
    BREAK_OUTCOME_UNSPECIFIED,
)
from stablewatch.v1.query_pb2 import Resolution

pytestmark = pytest.mark.timeout(60)

DAY_US = 86_400_000_000
T0_US = 1_700_000_000_000_000  # 2023-11-14 22:13:20 UTC


def a_break(
    resolution_id: int = 1,
    *,
    sent_us: int = T0_US,
    outcome: int = BREAK_OUTCOME_BROKEN,
    answered: bool = True,
    snapshot_id: int = 41,
) -> Resolution:
    """A break of the deadlock of two processes, as the detector records it."""
    resolution = Resolution(
        resolution_id=resolution_id,
        snapshot_id=snapshot_id,
        process_id="orders",
        task="checkout",
        instance=2**64 - 1 - resolution_id,  # all 64 bits
        policy="youngest",
        requested_by="detector",
        component=[WaitNode(process="orders", task="checkout"), WaitNode(process="stock")],
        deadlock="orders/checkout -> stock -> orders/checkout",
        outcome=outcome,
        detail="outgoing call /shop.Stock/Reserve cancelled: ABORTED" if answered else "",
    )
    resolution.wait_began_at.FromMicroseconds(sent_us - 40_000)
    resolution.sent_at.FromMicroseconds(sent_us)
    if answered:
        resolution.reported_at.FromMicroseconds(sent_us + 3_000)
    return resolution


def stored_break(store: Store, *, sent_us: int = T0_US, outcome: int = BREAK_OUTCOME_BROKEN) -> Resolution:
    """A break stored as sent, then answered, as the detector stores it; returns the answered one."""
    sent = a_break(0, sent_us=sent_us, outcome=BREAK_OUTCOME_UNSPECIFIED, answered=False)
    resolution = store.add_resolution(sent)
    resolution.outcome = outcome
    resolution.reported_at.FromMicroseconds(sent_us + 3_000)
    store.update_resolution(resolution)
    return resolution


def run(coroutine_function: Callable[[], Any]) -> Any:
    return asyncio.run(coroutine_function())


def restart_writer(root: Path, store: Any, batch_size: int = 500) -> ArchiveWriter:
    """Start a writer (it resyncs with the store) and close it."""

    async def cycle() -> ArchiveWriter:
        writer = ArchiveWriter(root, store, batch_size=batch_size)
        await writer.start()
        await writer.close()
        return writer

    return run(cycle)


def assert_each_break_once(root: Path, wanted: list[Resolution]) -> None:
    """The archive holds exactly these breaks, once each, equal to what the detector had."""
    check(root)  # no file unreadable, no break twice
    assert read_resolutions(root) == sorted(wanted, key=lambda r: (r.resolution_id, r.snapshot_id))


# -- rows -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("outcome", "answered", "word"),
    [
        (BREAK_OUTCOME_BROKEN, True, "broken"),
        (BREAK_OUTCOME_GONE, True, "gone"),
        (BREAK_OUTCOME_ALREADY_BROKEN, True, "already_broken"),
        (BREAK_OUTCOME_UNSPECIFIED, True, "unanswered"),  # the detector gave up waiting
        (BREAK_OUTCOME_UNSPECIFIED, False, "pending"),
    ],
)
def test_a_break_round_trips_through_its_row(outcome: int, answered: bool, word: str) -> None:
    resolution = a_break(outcome=outcome, answered=answered)
    row = resolution_row(resolution)
    assert (row["outcome"], row["day"], row["instance"]) == (word, "2023-11-14", -2)
    assert row["component"] == [{"process": "orders", "task": "checkout"}, {"process": "stock", "task": ""}]
    assert word in RESOLUTION_OUTCOMES
    assert resolution_from_row(row) == resolution


def test_a_break_without_a_known_start_or_with_an_unknown_outcome_keeps_the_rest() -> None:
    resolution = a_break()
    resolution.ClearField("wait_began_at")
    assert resolution_from_row(resolution_row(resolution)) == resolution
    resolution.outcome = 77  # a newer detector's answer: archived as not answered in a known way
    row = resolution_row(resolution)
    assert row["outcome"] == "unanswered"
    assert resolution_from_row(row).outcome == BREAK_OUTCOME_UNSPECIFIED


# -- the writer -------------------------------------------------------------------------------------


def test_breaks_are_written_with_the_next_batch_by_age_and_on_close_partitioned_by_day(
    store: Store, tmp_path: Path
) -> None:
    root = tmp_path / "archive"
    first = a_break(1)
    late = a_break(2, sent_us=T0_US + DAY_US, outcome=BREAK_OUTCOME_GONE)  # the next day
    last = a_break(3, outcome=BREAK_OUTCOME_ALREADY_BROKEN)

    async def scenario() -> None:
        by_age = ArchiveWriter(root, store, batch_size=1000, max_age=0.05)
        await by_age.start()
        by_age.add_resolution(first)
        by_age.add_resolution(first)  # the same break twice: once
        by_age.add_resolution(late)
        first.detail = "changed by the detector afterwards"  # the writer keeps its own copy
        await async_poll(lambda: by_age.resolutions_written == 2, "two breaks, by age")
        await by_age.close()

        on_close = ArchiveWriter(root, store, batch_size=1000, max_age=3600)
        await on_close.start()
        on_close.add_resolution(last)
        assert on_close.pending_resolutions == 1 and on_close.resolutions_written == 0
        await on_close.close()
        assert on_close.resolutions_written == 1
        on_close.add_resolution(a_break(4))  # after close: ignored
        assert on_close.pending_resolutions == 0

    run(scenario)
    first.detail = a_break(1).detail
    assert_each_break_once(root, [first, late, last])
    days = sorted(path.parent.name for path in parquet_files(root, "resolutions"))
    assert days == ["day=2023-11-14", "day=2023-11-14", "day=2023-11-15"]
    assert read_table(root, "snapshots").num_rows == 0  # breaks need no snapshot batch
    found = check(root)
    assert (found.rows["resolutions"], found.resolutions) == (3, {"already_broken": 1, "broken": 1, "gone": 1})


def test_breaks_a_detector_did_not_flush_are_written_from_the_store_on_its_next_start(
    store: Store, tmp_path: Path
) -> None:
    root = tmp_path / "archive"
    broken = stored_break(store)
    gone = stored_break(store, sent_us=T0_US + DAY_US, outcome=BREAK_OUTCOME_GONE)
    waiting = store.add_resolution(a_break(0, answered=False, outcome=BREAK_OUTCOME_UNSPECIFIED))
    assert restart_writer(root, store).resolutions_written == 2  # not the one still waiting for its answer
    assert_each_break_once(root, [broken, gone])
    assert restart_writer(root, store).resolutions_written == 0  # all there: nothing again

    waiting.outcome = BREAK_OUTCOME_BROKEN
    waiting.reported_at.FromMicroseconds(T0_US + 10_000)
    store.update_resolution(waiting)
    assert restart_writer(root, store).resolutions_written == 1
    assert_each_break_once(root, [broken, gone, waiting])


def test_a_failed_write_of_breaks_is_logged_and_they_are_written_once_later(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "archive"
    ensure_archive(root)
    blocker = root / "resolutions"  # a file where the table's folder must be: every write fails
    blocker.write_text("in the way")
    resolutions = [stored_break(store), stored_break(store)]

    async def scenario() -> None:
        writer = ArchiveWriter(root, store, batch_size=10, max_age=0.05)
        await writer.start()  # the catch-up fails: logged, and the detector goes on
        assert "cannot write 2 resolutions" in caplog.text
        resolutions.append(stored_break(store))
        writer.add_resolution(resolutions[-1])
        await async_poll(lambda: caplog.text.count("stay in the store") >= 2, "the next attempt failing too")
        assert writer.resolutions_written == 0
        blocker.unlink()
        await async_poll(lambda: writer.resolutions_written == 3, "the resync to write them all")
        await writer.close()

    run(scenario)
    assert_each_break_once(root, resolutions)


class NoListing:
    """A store that cannot list its breaks (an older store, a test double): the writer's fallback."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        if name == "resolutions":
            raise AttributeError(name)
        return getattr(self._store, name)


def test_without_a_listing_store_breaks_wait_in_memory_until_the_archive_works(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "archive"
    ensure_archive(root)
    blocker = root / "resolutions"
    blocker.write_text("in the way")
    resolution = a_break(5)

    async def scenario() -> None:
        writer = ArchiveWriter(root, NoListing(store), batch_size=10, max_age=0.05)
        await writer.start()
        writer.add_resolution(resolution)
        await async_poll(lambda: "cannot write 1 resolutions" in caplog.text, "a failed write")
        assert writer.pending_resolutions == 1  # nowhere else to find it again: kept
        blocker.unlink()
        await async_poll(lambda: writer.resolutions_written == 1, "written once the archive works")
        await writer.close()

    run(scenario)
    assert_each_break_once(root, [resolution])


# -- crash windows ----------------------------------------------------------------------------------


def test_a_torn_write_of_breaks_is_removed_and_what_it_lacked_is_written_once(store: Store, tmp_path: Path) -> None:
    """Killed while writing breaks of two days: day one's file renamed into place, day two's still a
    temporary file, half written."""
    root = tmp_path / "archive"
    ensure_archive(root)
    day1 = [stored_break(store), stored_break(store)]
    day2 = [stored_break(store, sent_us=T0_US + DAY_US, outcome=BREAK_OUTCOME_GONE)]
    files = write_resolution_batch(root, day1 + day2)
    assert [f.parent.name for f in files] == ["day=2023-11-14", "day=2023-11-15"]
    torn = files[1].with_name(f".{files[1].name}.tmp")
    torn.write_bytes(files[1].read_bytes()[:40])  # the rename never happened
    files[1].unlink()
    assert archived_resolutions(root) == {resolution_key(r) for r in day1}  # readers see day one only

    assert repair(root) == [torn]
    assert not torn.exists() and files[0].exists()  # a whole visible file stays
    assert restart_writer(root, store).resolutions_written == 1  # day two's break, once more
    assert_each_break_once(root, day1 + day2)
    assert restart_writer(root, store).resolutions_written == 0


def test_a_break_archived_twice_is_named_by_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "archive"
    ensure_archive(root)
    [first] = write_resolutions(root, [resolution_row(a_break(1)), resolution_row(a_break(2))])
    [twin] = write_resolutions(root, [resolution_row(a_break(2))])  # another file, holding break 2 again
    assert first != twin
    with pytest.raises(ArchiveError, match=rf"break 2 of snapshot 41 is archived twice \(also in {first}\)"):
        check(root)
    assert main(["archive", "check", "--archive", str(root)]) == 2
    assert str(twin) in capsys.readouterr().err


def test_a_resolutions_file_claiming_an_older_schema_is_refused(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from stablewatch.detector.archive.schema import METADATA_KEY

    root = tmp_path / "archive"
    ensure_archive(root)
    [path] = write_resolutions(root, [resolution_row(a_break(1))])
    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: b"2"}), path)
    with pytest.raises(ArchiveError, match=rf"{path}: schema version 2 has no resolutions table"):
        read_resolutions(root)


# -- export -----------------------------------------------------------------------------------------


def test_export_copies_the_answered_breaks_once(
    store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    answered = [stored_break(store), stored_break(store, sent_us=T0_US + DAY_US, outcome=BREAK_OUTCOME_GONE)]
    waiting = store.add_resolution(a_break(0, answered=False, outcome=BREAK_OUTCOME_UNSPECIFIED))
    root = tmp_path / "archive"
    argv = ["archive", "export", "--data-dir", str(tmp_path / "data"), "--archive", str(root), "--json"]

    first = export(store, root)
    assert (first.resolutions, first.resolutions_already, first.exported, first.files) == (2, 0, 0, 2)
    assert_each_break_once(root, answered)
    waiting.outcome = BREAK_OUTCOME_ALREADY_BROKEN
    waiting.reported_at.FromMicroseconds(T0_US + 9_000)
    store.update_resolution(waiting)
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["resolutions"], printed["resolutions_already"]) == (1, 2)
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["resolutions"] == 0  # idempotent
    assert_each_break_once(root, [*answered, waiting])
    assert restart_writer(root, store).resolutions_written == 0  # a detector finds them all in place
