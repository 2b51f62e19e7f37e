"""The example services, each process one agent, against a stub detector and the real predicates.

* bank: every snapshot conserves tokens; with drops, conservation fails with a negative drift
  equal to what the branches report they lost.
* philosophers: no deadlock until one really forms; then the whole ring's cycle, with empty
  channels, in every later snapshot, while nobody eats again (so the report was no false alarm).
* job: termination only once every task of the job is done, and from then on in every snapshot.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from detector_stub import StubDetector

from stablewatch.detector.evaluation import evaluate
from stablewatch.detector.evaluation.plugins import load_predicate
from stablewatch.examples.job import total_tasks
from stablewatch.v1 import GlobalSnapshot, PredicateResult

pytestmark = pytest.mark.timeout(120)

STARTUP = 60.0  # seconds for the processes to start and attach (slow 2-core machines)


class Cluster:
    """The processes of one example, each logging to its own file under `folder`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.peers_dir = folder / "peers"
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, example: str, ids: list[str], *args: str) -> None:
        """Start one ``python -m stablewatch.examples.<example>`` process per id."""
        args = ("--peers-dir", str(self.peers_dir), *args)
        for process_id in ids:
            with (self.folder / f"{process_id}.log").open("wb") as log:
                self.processes[process_id] = subprocess.Popen(
                    [sys.executable, "-m", f"stablewatch.examples.{example}", "--id", process_id, *args],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )

    def log(self, process_id: str) -> str:
        return (self.folder / f"{process_id}.log").read_text(errors="replace")

    def check_running(self) -> None:
        for process_id, process in self.processes.items():
            if process.poll() is not None:
                raise AssertionError(f"{process_id} exited with {process.returncode}:\n{self.log(process_id)}")

    def wait_attached(self, detector: StubDetector, timeout: float = STARTUP) -> None:
        """Poll until every process is a member of `detector`; fail early if one died."""
        deadline = time.monotonic() + timeout
        while set(detector.coordinator.members) != set(self.processes):
            self.check_running()
            if time.monotonic() > deadline:
                raise TimeoutError(f"attached {detector.members()}, expected {sorted(self.processes)}")
            time.sleep(0.02)

    def stop(self) -> dict[str, int | None]:
        """SIGTERM every process, kill any that does not exit in time; return the exit codes."""
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        for process_id, process in self.processes.items():
            try:
                codes[process_id] = process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
                codes[process_id] = None  # had to be killed
        return codes


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    started = Cluster(tmp_path)
    yield started
    codes = started.stop()  # a no-op for a test that stopped them itself
    for process_id in started.processes:  # shown by pytest when the test failed
        print(f"--- {process_id} (exit {codes[process_id]}) ---\n{started.log(process_id)[-3000:]}")


def stop_cleanly(cluster: Cluster) -> None:
    codes = cluster.stop()
    assert codes == dict.fromkeys(cluster.processes, 0), f"exit codes after SIGTERM: {codes}"


def assert_no_rejections(detector: StubDetector) -> None:
    """No part was refused (late reports of channels opened after a cut are not refusals)."""
    assert not detector.rejections, detector.rejections


def by_name(results: list[PredicateResult]) -> dict[str, PredicateResult]:
    return {result.name: result for result in results}


def attribute_sum(snapshot: GlobalSnapshot, key: str) -> int:
    return sum(int(p.state.attributes[key]) for p in snapshot.processes)


# -- bank ------------------------------------------------------------------------------------------

BRANCHES = ["A", "B", "C"]
TOKENS = 1000


def start_bank(cluster: Cluster, detector: StubDetector, *args: str) -> None:
    bank_args = ["--branches", ",".join(BRANCHES), "--tokens", str(TOKENS), "--detector", detector.address]
    cluster.start("bank", BRANCHES, *bank_args, *args)
    cluster.wait_attached(detector)


def test_bank_conserves_tokens_in_every_snapshot(detector: StubDetector, cluster: Cluster) -> None:
    start_bank(cluster, detector, "--seed", "1")
    totals = {"tokens": len(BRANCHES) * TOKENS}
    taken = in_flight = 0
    deadline = time.monotonic() + 30
    while taken < 50 or in_flight < 10:  # many snapshots, some of them catching tokens on the way
        assert time.monotonic() < deadline, f"{taken} snapshots, {in_flight} with tokens in flight"
        snapshot = detector.snapshot(timeout=10)
        taken += 1
        results = by_name(evaluate(snapshot, totals).results)
        conservation = results["conservation(tokens)"]
        assert conservation.holds, conservation.summary
        assert conservation.conservation.drift == 0
        assert not results["deadlock"].holds and not results["termination"].holds  # busy branches
        in_flight += any(m.counters.get("tokens") for c in snapshot.channels for m in c.messages)
    assert_no_rejections(detector)
    stop_cleanly(cluster)


def test_bank_with_drops_fails_conservation(detector: StubDetector, cluster: Cluster) -> None:
    start_bank(cluster, detector, "--seed", "2", "--drop-rate", "0.5")
    totals = {"tokens": len(BRANCHES) * TOKENS}
    drifts: list[int] = []
    deadline = time.monotonic() + 30
    while len(drifts) < 3:  # until it fails, then a few more: the loss is stable
        assert time.monotonic() < deadline, "conservation never failed"
        snapshot = detector.snapshot(timeout=10)
        conservation = by_name(evaluate(snapshot, totals).results)["conservation(tokens)"]
        drift = conservation.conservation.drift
        # The branches report what they dropped, atomically with the loss: the drift is exactly that.
        assert drift == -attribute_sum(snapshot, "dropped")
        assert conservation.holds == (drift == 0)
        if drifts or not conservation.holds:
            drifts.append(drift)
    assert drifts[0] < 0
    assert drifts == sorted(drifts, reverse=True), "tokens came back"
    assert_no_rejections(detector)
    stop_cleanly(cluster)


# -- philosophers ----------------------------------------------------------------------------------

SEATS = ["P0", "P1", "P2", "P3", "P4"]


def test_philosophers_deadlock_is_reported_once_real_and_stays(detector: StubDetector, cluster: Cluster) -> None:
    args = ["--seats", ",".join(SEATS), "--deadlock-after", "2", "--seed", "3", "--detector", detector.address]
    cluster.start("philosophers", SEATS, *args)
    cluster.wait_attached(detector)
    totals = {"forks": len(SEATS)}

    def take() -> tuple[GlobalSnapshot, dict[str, PredicateResult]]:
        snapshot = detector.snapshot(timeout=10)
        results = by_name(evaluate(snapshot, totals).results)
        assert results["conservation(forks)"].holds, results["conservation(forks)"].summary
        return snapshot, results

    before = with_waits = 0
    deadline = time.monotonic() + 40
    while True:
        assert time.monotonic() < deadline, f"no deadlock reported after {before} snapshots"
        snapshot, results = take()
        if results["deadlock"].holds:
            break
        before += 1
        with_waits += any(p.state.waits for p in snapshot.processes)
    assert before > 0, "the table deadlocked before the first snapshot"
    assert with_waits > 0, "no snapshot before the deadlock saw a philosopher waiting"

    evidence = results["deadlock"].deadlock
    cycle = [node.process for node in evidence.cycle]
    assert all(not node.task for node in evidence.cycle)
    start = cycle.index(SEATS[0])
    assert cycle[start:] + cycle[:start] == SEATS, f"cycle {cycle}"  # each waits on its right neighbour
    assert sorted(node.process for node in evidence.deadlocked) == SEATS
    ring = {(SEATS[(i + 1) % len(SEATS)], seat) for i, seat in enumerate(SEATS)}
    assert {(c.src, c.dst) for c in evidence.empty_channels} == ring
    meals = attribute_sum(snapshot, "meals")

    # Stable, and real: later snapshots report the same cycle, and no one has eaten since.
    later = 0
    until = time.monotonic() + 0.5
    while later < 3 or time.monotonic() < until:
        snapshot, results = take()
        later += 1
        assert results["deadlock"].holds, f"deadlock no longer reported: {results['deadlock'].summary}"
        assert [n.process for n in results["deadlock"].deadlock.cycle] == cycle
        assert attribute_sum(snapshot, "meals") == meals, "a philosopher ate after the deadlock was reported"
    assert_no_rejections(detector)
    stop_cleanly(cluster)


# -- job -------------------------------------------------------------------------------------------

WORKERS = ["W1", "W2", "W3"]
JOB = {"seed": 1, "tasks": 30, "depth": 4}


def test_job_terminates_only_when_every_task_is_done(detector: StubDetector, cluster: Cluster) -> None:
    expected = total_tasks(JOB["seed"], JOB["tasks"], JOB["depth"], WORKERS)
    args = [f"--{key}={value}" for key, value in JOB.items()]
    args += ["--workers", ",".join(WORKERS), "--work-ms", "40", "--detector", detector.address]
    cluster.start("job", WORKERS, *args)
    cluster.wait_attached(detector)
    plugins = [load_predicate("stablewatch.examples.job:all_tasks_done")]

    terminated: list[bool] = []
    deadline = time.monotonic() + 40
    while terminated.count(True) < 3:  # until it terminates, then a few more: termination is stable
        assert time.monotonic() < deadline, f"no termination after {len(terminated)} snapshots"
        snapshot = detector.snapshot(timeout=10)
        results = by_name(evaluate(snapshot, plugins=plugins).results)
        holds = results["termination"].holds
        done, created = attribute_sum(snapshot, "done"), attribute_sum(snapshot, "created")
        assert done <= created <= expected
        if holds:
            # Never reported before the work is really complete: every task of the job processed.
            assert done == created == expected, f"terminated with {done} of {created} done, {expected} in the job"
            assert results["all_tasks_done"].holds
            assert attribute_sum(snapshot, "queued") == 0
        terminated.append(holds)
    assert not terminated[0], "the job was over before the first snapshot"
    first = terminated.index(True)
    assert all(terminated[first:]), f"termination not stable: {terminated}"
    assert_no_rejections(detector)
    stop_cleanly(cluster)
    for worker in WORKERS:
        assert "no work: idle" in cluster.log(worker)
