"""A snapshot whose conversion into rows fails for want of memory is not set aside for good.

Setting aside is for a snapshot the archive can never hold (a value no column takes). Running out
of memory while converting says nothing about the snapshot: the batch fails, the snapshots stay in
the store unarchived, and the writer's next resync archives them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_store_review import T0, archived_mark, complete

import stablewatch.detector.archive.writer as writer_module
from polling import async_poll, run
from stablewatch.detector.archive.reader import read_snapshots
from stablewatch.detector.archive.writer import ArchiveWriter
from stablewatch.detector.service.store import Store

pytestmark = pytest.mark.timeout(60)


def test_a_snapshot_whose_conversion_ran_out_of_memory_is_archived_on_the_next_try(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = writer_module.snapshot_rows
    failed: list[int] = []

    def out_of_memory_once(summary: Any, *args: Any) -> Any:
        if not failed:
            failed.append(summary.snapshot_id)
            raise MemoryError()
        return real(summary, *args)

    monkeypatch.setattr(writer_module, "snapshot_rows", out_of_memory_once)

    async def scenario() -> None:
        with Store(tmp_path / "data") as store:
            ids = [complete(store, T0 + i) for i in range(3)]
            writer = ArchiveWriter(tmp_path / "archive", store, batch_size=10, max_age=0.05)
            await writer.start()
            try:
                await async_poll(lambda: not store.unarchived(10), "the store to hold nothing unarchived")
            finally:
                await writer.close()
            assert failed, "the conversion never failed: the test tested nothing"
            assert {h["snapshot_id"] for h, _ in read_snapshots(tmp_path / "archive")} == set(ids)
            assert [archived_mark(store, sid) for sid in ids] == [1, 1, 1]  # none set aside (2)

    run(scenario())
