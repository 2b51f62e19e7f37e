"""The benchmarks run end to end at a tiny size and end with their JSON line (no timing asserted)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from typing import Any

import pytest

from conftest import ROOT


def bench_json(script: str, *options: str, timeout: float) -> dict[str, Any]:
    """Run ``bench/<script>`` with ``options``; the JSON object on its last line of output."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *options],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_predicate_benchmark_prints_its_json_line() -> None:
    sizes = ["--nodes", "2000", "--edges", "6000", "--chain", "100", "--repeat", "1"]
    result = bench_json("predicates.py", *sizes, timeout=120)
    assert {"nodes", "edges", "deadlock_seconds", "scc_seconds", "ratio"} <= result.keys()
    assert result["nodes"] == 2100
    assert result["edges"] == 6100
    assert result["ratio"] > 0
    assert result["graphs"]["acyclic"]["deadlocked"] == 0
    assert result["graphs"]["random"]["deadlocked"] > 0


@pytest.mark.timeout(300)
def test_fault_benchmark_prints_its_json_line() -> None:
    sizes = ["--resets", "20", "--kills", "1", "--restarts", "2", "--failovers", "2", "--fuzz", "3000"]
    result = bench_json("faults.py", *sizes, timeout=280)
    keys = {"resets", "lost", "duplicated", "kills", "kills_recovered", "detector_restarts", "fuzzed", "crashes"}
    keys |= {"detector_failovers", "deadlocks_during_failover", "detected_during_failover", "double_breaks"}
    assert keys <= result.keys()
    assert result["resets"] >= 20
    assert (result["lost"], result["duplicated"], result["crashes"]) == (0, 0, 0)
    assert result["kills_recovered"] == result["kills"] == 1, result
    assert result["completed_after_restart"] == result["detector_restarts"] == 2, result
    # Each replica killed once; a deadlock formed while it was down, proven by the other, broken once.
    assert result["detector_failovers"] == result["deadlocks_during_failover"] == 2, result
    assert result["detected_during_failover"] == 2 and result["double_breaks"] == 0, result
    assert result["failover_tokens_conserved"] == 1, result
    assert result["fuzzed"] == 3000


@pytest.mark.timeout(180)
@pytest.mark.parametrize("detectors", [1, 2])
def test_channel_benchmark_prints_its_json_line(detectors: int) -> None:
    sizes = ["--seconds", "1", "--warmup", "0.5", "--rounds", "2", "--detectors", str(detectors)]
    result = bench_json("channel_throughput.py", *sizes, timeout=150)
    cases = ("raw", "agent", "with_snapshots", "batch") + (("two_detectors",) if detectors == 2 else ())
    for case in cases:
        low, high = result[f"{case}_spread"]
        assert 0 < low <= high, result
    assert result["ratio_spread"][0] <= result["ratio"] <= result["ratio_spread"][1], result
    assert (result["rounds"], result["detectors"]) == (2, detectors)
    assert result["snapshots_completed"] >= 1, result  # the detector's schedule ran while measured
    targets = {"ratio_at_least_0.8", "agent_at_least_200k", "overhead_at_most_0.05"}
    if detectors == 2:
        # Both detectors' schedules ran while measured, and the gap is the per-round one's median.
        assert all(each > 0 for each in result["two_at_5_snapshots_per_s_each"]), result
        for key in ("overhead_one_at_10", "overhead_two_at_5", "overhead_gap_points"):
            assert result[f"{key}_spread"][0] <= result[key] <= result[f"{key}_spread"][1], (key, result)
        assert result["overhead_one_at_10"] == result["snapshot_overhead"], result
        targets.add("overhead_gap_within_2_points")
    assert set(result["targets"]) == targets


def test_hot_path_benchmark_prints_its_json_line() -> None:
    result = bench_json("hot_paths.py", "--seconds", "0.05", "--rounds", "2", timeout=120)
    cases = ("send", "await_floor", "append_floor", "decode", "decode_before")
    cases += ("part_build", "part_serialize", "assembly", "assembly_before")
    for case in cases:
        low, high = result[f"{case}_spread"]
        assert 0 < low <= result[f"{case}_ns"] <= high, (case, result)


def test_rpc_hot_path_benchmark_prints_its_json_line() -> None:
    result = bench_json("rpc_hot_path.py", "--seconds", "0.05", "--rounds", "2", timeout=120)
    cases = ("loopback", "stamp_only", "instrumented", "instrumented_recording", "client_interceptor")
    cases += ("least_agent", "bare_bookkeeping", "aio_least_agent", "aio_bare_bookkeeping")
    cases += ("pooled_stamp_only", "pooled_instrumented", "pooled_plain_agent", "pooled_least_agent")
    for case in (*cases, "aio_loopback", "aio_stamp_only", "aio_instrumented", "aio_client_interceptors"):
        low, high = result[f"{case}_spread"]
        assert 0 < low <= result[f"{case}_us"] <= high, (case, result)
        assert result[f"{case}_calls"] > 0, (case, result)
        assert (f"{case}_added_us" in result) == (case not in ("loopback", "aio_loopback")), result
    # The agents were really on the path of their cases: every request made was stamped.
    agent_cases = ("instrumented", "instrumented_recording", "client_interceptor", "pooled_instrumented")
    agent_cases += ("pooled_plain_agent",)
    for case in (*agent_cases, "aio_instrumented", "aio_client_interceptors"):
        assert result[f"{case}_stamped_requests"] == result[f"{case}_calls"], (case, result)
    assert "stamp_only_stamped_requests" not in result and "aio_stamp_only_stamped_requests" not in result
    # The least agents were on the path too: each took in the server's stamped response of every call.
    least_cases = ("least_agent", "bare_bookkeeping", "aio_least_agent", "aio_bare_bookkeeping", "pooled_least_agent")
    for case in least_cases:
        assert result[f"{case}_stamped_responses"] == result[f"{case}_calls"], (case, result)
    # The agents' own cost above the stamp-only floor, and the least agents', paired within each round.
    keys = ("hot_path_agent_us", "hot_path_agent_recording_us", "aio_hot_path_agent_us")
    keys += ("hot_path_least_agent_us", "hot_path_bare_bookkeeping_us", "hot_path_agent_over_least_us")
    keys += ("aio_hot_path_least_agent_us", "aio_hot_path_bare_bookkeeping_us", "aio_hot_path_agent_over_least_us")
    keys += ("hot_path_agent_pooled_us", "hot_path_agent_plain_pool_us", "hot_path_pool_picture_us")
    keys += ("hot_path_least_agent_pooled_us", "hot_path_agent_pooled_over_least_us")
    for key in keys:
        low, high = result[f"{key}_spread"]
        assert low <= result[key] <= high, (key, result)
    assert result["hot_path_agent_us"] > 0, result
    assert set(result["targets"]) == {"hot_path_agent_us_at_most_4", "aio_hot_path_agent_us_at_most_4"}
    assert result["cold_mb"] == 0, result


def test_rpc_hot_path_benchmark_runs_each_call_cold_when_asked() -> None:
    result = bench_json("rpc_hot_path.py", "--seconds", "0.05", "--rounds", "2", "--cold", "1", timeout=120)
    assert result["cold_mb"] == 1, result
    # Each call timed alone after an eviction; the agents were on every call's path.
    for case in ("loopback", "stamp_only", "instrumented", "pooled_instrumented", "aio_stamp_only", "aio_instrumented"):
        low, high = result[f"{case}_spread"]
        assert 0 < low <= result[f"{case}_us"] <= high, (case, result)
        assert result[f"{case}_calls"] > 0, (case, result)
    for case in ("instrumented", "pooled_instrumented", "pooled_plain_agent", "aio_instrumented"):
        assert result[f"{case}_stamped_requests"] == result[f"{case}_calls"], (case, result)
    for key in ("hot_path_agent_us", "aio_hot_path_agent_us", "hot_path_agent_pooled_us", "hot_path_pool_picture_us"):
        low, high = result[f"{key}_spread"]
        assert low <= result[key] <= high, (key, result)
    assert "targets" not in result, result  # set for the warm measure only


@pytest.mark.timeout(900)
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed (apt-get install valgrind)")
def test_rpc_cache_profile_counts_cold_calls_under_cachegrind() -> None:
    # Four runs under valgrind, about half a minute each on a quiet machine, two at a time.
    options = ["--cases", "stamp_only,instrumented", "--calls", "3", "--top", "5"]
    result = bench_json("rpc_cache_profile.py", *options, timeout=840)
    assert (result["calls"], result["floor"]) == (3, "stamp_only"), result
    assert set(result["simulated_caches"]) == {"I1", "D1", "LL"}, result
    figures = ("ir", "l1_misses", "ll_misses", "ll_instruction_misses", "ll_data_misses")
    for case in ("stamp_only", "instrumented"):
        for figure in figures:
            assert result[f"{case}_{figure}"] > 0, (case, figure, result)
        parts = result[f"{case}_ll_instruction_misses"] + result[f"{case}_ll_data_misses"]
        assert parts == pytest.approx(result[f"{case}_ll_misses"], abs=0.2), (case, result)
    assert "stamp_only_above_floor_ir" not in result, result  # the floor is not compared with itself
    # The agents' calls run more instructions than the floor's; above the floor is the difference.
    assert result["instrumented_ir"] > result["stamp_only_ir"], result
    difference = result["instrumented_ir"] - result["stamp_only_ir"]
    assert result["instrumented_above_floor_ir"] == pytest.approx(difference, abs=0.11), result
    difference = result["instrumented_ll_misses"] - result["stamp_only_ll_misses"]
    assert result["instrumented_above_floor_ll_misses"] == pytest.approx(difference, abs=0.11), result
    # Where the extra misses go: functions by name, the most grown first.
    functions = result["top_functions"]
    assert 0 < len(functions) <= 5, result
    assert all(isinstance(each["function"], str) and each["function"] for each in functions), functions
    assert all(each["ll_misses"] > 0 for each in functions), functions
    assert [each["ll_misses"] for each in functions] == sorted((each["ll_misses"] for each in functions), reverse=True)


def test_rpc_cache_profile_refuses_an_unknown_case() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "rpc_cache_profile.py"), "--cases", "stamp_only,no_such_case"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode != 0
    assert "no_such_case" in run.stderr and "instrumented" in run.stderr, run.stderr  # the known cases listed


@pytest.mark.timeout(180)
def test_rpc_phantom_benchmark_prints_its_json_line() -> None:
    result = bench_json("rpc_phantom.py", "--snapshots", "30", "--max-seconds", "60", timeout=150)
    assert result["finished"] is True, result
    assert result["snapshots"] >= 30
    assert result["stablewatch_deadlocks"] == 0, result  # the churn workload never deadlocks
    assert result["cuts_with_calls_out"] > 0, result  # the cuts saw calls waiting
    assert result["naive_polls"] > 0
    assert 0 <= result["naive_deadlocks_proven"] <= result["naive_deadlocks"] <= result["naive_polls"]
    assert result["places"] > 0 and result["moving_at_end"] is True, result
    assert result["seconds"] > 0


@pytest.mark.timeout(180)
def test_rpc_overhead_benchmark_prints_its_json_line() -> None:
    sizes = ["--seconds", "0.5", "--warmup", "0.2", "--rounds", "2", "--concurrency", "2"]
    result = bench_json("rpc_overhead.py", *sizes, timeout=150)
    cases = ("plain", "noop", "stamp_only", "stamp_only_with_snapshots", "intercepted", "with_snapshots")
    cases += ("realistic_plain", "realistic_stamp_only", "realistic", "standin", "realistic_standin")
    cases += ("client_interceptor", "least_agent", "realistic_least_agent", "bare_bookkeeping")
    for case in (*cases, "plain_pool", *(f"aio_{case}" for case in cases)):  # the plain pool's is sync only
        low, high = result[f"{case}_p50_us_spread"]
        assert 0 < low <= result[f"{case}_p50_us"] <= high, (case, result)
        assert result[f"{case}_calls_per_s"] > 0, (case, result)
        cpu = result[f"{case}_cpu_us_per_call"]
        assert cpu > 0 and result[f"{case}_client_cpu_us"] + result[f"{case}_server_cpu_us"] >= cpu - 0.2, result
    assert "aio_plain_pool_p50_us" not in result, result
    for key in ("pool_picture_p50", "plain_pool_over_least_cpu_overhead", "plain_pool_floor_throughput_ratio"):
        low, high = result[f"{key}_spread"]
        assert low <= result[key] <= high, (key, result)
    # The realistic handler waits about 1 ms, so its calls take longer than the echo's.
    assert result["realistic_plain_p50_us"] > 1000 and result["aio_realistic_plain_p50_us"] > 1000, result
    assert result["realistic_handler"]["sync_iterations"] > 0 and result["realistic_handler"]["aio_iterations"] > 0
    # The python stand-in was calibrated in each of the four processes, near half of its 4 µs a call.
    standin = result["python_standin"]
    assert standin["us_per_call"] == 4.0, standin
    for api in ("sync", "aio"):
        for side in ("server", "client"):
            assert standin[f"{api}_{side}_iterations"] >= 1, standin
            assert 0 < standin[f"{api}_{side}_us"] < 20, standin
    keys = ("noop_overhead_p50", "stamp_only_overhead_p50", "overhead_p50", "overhead_p50_with_snapshots")
    keys += ("stamp_only_throughput_ratio", "throughput_ratio", "cpu_overhead", "stamp_only_cpu_overhead")
    keys += ("noop_cpu_overhead", "floor_overhead_p50", "floor_throughput_ratio", "floor_cpu_overhead")
    keys += ("realistic_overhead_p50", "realistic_throughput_ratio", "realistic_cpu_overhead")
    keys += ("realistic_floor_overhead_p50", "realistic_floor_throughput_ratio", "realistic_floor_cpu_overhead")
    keys += ("realistic_over_floor_p50", "realistic_over_floor_throughput_ratio")
    keys += ("standin_floor_overhead_p50", "standin_floor_throughput_ratio", "standin_floor_cpu_overhead")
    keys += ("over_standin_p50", "over_standin_cpu_overhead")
    keys += ("realistic_standin_overhead_p50", "realistic_standin_throughput_ratio", "realistic_standin_cpu_overhead")
    keys += ("client_interceptor_overhead_p50", "client_interceptor_throughput_ratio")
    keys += ("least_floor_overhead_p50", "least_floor_throughput_ratio", "least_floor_cpu_overhead")
    keys += ("bare_floor_overhead_p50", "bare_floor_throughput_ratio", "bare_floor_cpu_overhead")
    keys += ("over_least_p50", "over_least_cpu_overhead")
    keys += ("realistic_least_overhead_p50", "realistic_least_throughput_ratio", "realistic_least_cpu_overhead")
    for key in (*keys, *(f"aio_{name}" for name in keys)):
        low, high = result[f"{key}_spread"]
        assert low <= result[key] <= high, (key, result)
    assert result["throughput_ratio"] > 0 and result["floor_throughput_ratio"] > 0
    assert (result["rounds"], result["api"]) == (2, "both")
    assert result["snapshots_per_s"] > 0, result  # the detector's schedule ran while measured
    targets = {"floor_overhead_p50_at_most_0.05", "floor_throughput_ratio_at_least_0.95"}
    targets |= {"realistic_overhead_p50_at_most_0.03", "realistic_throughput_ratio_at_least_0.97"}
    assert set(result["targets"]) == targets | {f"aio_{target}" for target in targets}


@pytest.mark.timeout(120)
def test_rpc_overhead_benchmark_reports_the_ratios_of_the_cases_it_ran() -> None:
    cases = "aio stamp-only+snapshots,aio instrumented+snapshots,aio least agent+snapshots"
    sizes = ["--seconds", "0.5", "--warmup", "0.2", "--rounds", "2", "--concurrency", "2"]
    result = bench_json("rpc_overhead.py", *sizes, "--api", "aio", "--cases", cases, timeout=100)
    for case in ("aio_stamp_only_with_snapshots", "aio_with_snapshots", "aio_least_agent"):
        low, high = result[f"{case}_p50_us_spread"]
        assert 0 < low <= result[f"{case}_p50_us"] <= high, (case, result)
    for key in ("aio_floor_overhead_p50", "aio_floor_throughput_ratio", "aio_least_floor_overhead_p50"):
        low, high = result[f"{key}_spread"]
        assert low <= result[key] <= high, (key, result)
    assert "aio_over_least_p50" in result and "aio_least_floor_cpu_overhead" in result, result
    # Nothing whose cases did not run: no sync case, no realistic ratio, no plain.
    general = {"seconds", "warmup", "rounds", "concurrency", "workers", "api", "targets", "snapshots_completed"}
    general |= {"snapshots_per_s", "realistic_handler", "python_standin"}
    assert {key for key in result if not key.startswith("aio_")} == general, result
    assert "aio_realistic_overhead_p50" not in result and "aio_plain_p50_us" not in result, result
    assert set(result["targets"]) == {"aio_floor_overhead_p50_at_most_0.05", "aio_floor_throughput_ratio_at_least_0.95"}
    assert result["snapshots_per_s"] > 0, result


def test_rpc_overhead_benchmark_refuses_cases_of_another_api() -> None:
    command = [sys.executable, str(ROOT / "bench" / "rpc_overhead.py"), "--api", "sync", "--cases", "aio plain"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "none of the cases aio plain is of --api sync" in run.stderr


@pytest.mark.timeout(300)
def test_resolution_benchmark_prints_its_json_line() -> None:
    sizes = ["--deadlocks", "2", "--churn-snapshots", "20", "--detection-rounds", "1", "--max-seconds", "60"]
    sizes += ["--hint-rounds", "1", "--hint-seconds", "0.5", "--hint-warmup", "0.2"]
    result = bench_json("resolution.py", *sizes, timeout=280)
    # What is never a matter of timing: every deadlock proven is broken once, its victim sees ABORTED,
    # and the churn workload (no deadlock) gets no break.
    assert result["deadlocks"] >= 2, result
    assert result["resolved"] == result["deadlocks"] == result["victim_aborteds"], result
    assert result["double_breaks"] == 0 and result["churn_breaks"] == 0, result
    assert result["churn_snapshots"] >= 20, result
    assert result["recoveries"] >= 2 and result["recovery_p50_ms"] > 0, result
    assert result["scheduled_snapshots_per_s"] == 1.0
    for case in ("hints_on_1", "hints_off_1", "hints_on_10", "hints_off_10"):
        low, high = result[f"detect_{case}_spread"]
        assert 0 < low <= result[f"detect_{case}_p50_ms"] <= high, (case, result)
    low, high = result["hint_throughput_ratio_spread"]
    assert 0 < low <= result["hint_throughput_ratio"] <= high, result
    assert set(result["targets"]) == {
        "resolved_equals_deadlocks",
        "recovery_p50_at_most_100ms",
        "recovery_p99_at_most_300ms",
        "churn_breaks_zero",
        "double_breaks_zero",
        "enough_deadlocks",
        "enough_churn_snapshots",
    }
    assert result["target_met"] == all(result["targets"].values())
