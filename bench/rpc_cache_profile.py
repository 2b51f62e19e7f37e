"""Benchmark: one cold RPC-mode unary call's instructions and cache misses, counted under cachegrind.

``rpc_hot_path.py --cold MB`` times each call after evicting the CPU's caches, and on a shared
machine those timings move by tens of percent from round to round. This benchmark counts the
same thing instead of timing it: valgrind's cachegrind runs the call on a simulated machine
(``SIMULATED_CACHES``: I1 32 KiB, D1 48 KiB, last level 2 MiB) and counts its instructions and its
misses in each cache exactly, the same on every run, whatever else the machine is doing.

Each case is one of ``rpc_hot_path.py``'s (any name from its ``cases()`` or ``aio_cases()``; by
default ``stamp_only``, ``instrumented``, ``aio_stamp_only`` and ``aio_instrumented``). A child
process builds the case, warms it up (``WARMUP_CALLS`` calls), then ``--calls`` (200) times evicts
the caches (copies ``EVICT_BYTES``, twice the simulated last level) and makes one call: each call
starts with none of its lines cached. Cachegrind counts a whole process, start-up included and
valgrind 3.19 cannot switch counting on and off, so each case runs twice, with its calls and with
the same evictions and no call, and the difference over ``--calls`` is what one cold call costs
(``PYTHONHASHSEED=0`` in both; a garbage collection after the warm-up, and an exit without the
interpreter's teardown, keep the counts the same from run to run to within a few instructions a
call). Asyncio cases are awaited in one event loop, as ``rpc_hot_path.py`` awaits them.

The table and the last line (JSON) give, per call of each case: ``<case>_ir`` (instructions),
``<case>_l1_misses`` (first-level misses, instructions and data: I1mr + D1mr + D1mw),
``<case>_ll_misses`` (last-level misses, the ones that go to memory) and its parts
``<case>_ll_instruction_misses`` (ILmr) and ``<case>_ll_data_misses`` (DLmr + DLmw); for each case
but the floor (``--floor``, ``stamp_only``), ``<case>_above_floor_ir`` and
``<case>_above_floor_ll_misses``. Then where each case's extra last-level misses go: the functions
(source file:function, from CPython's debug information; a function inlined from a header counts
under the header, and ``???:???`` is code without debug information, such as gRPC's compiled
extension) whose last-level misses per call grow most above the floor's, ``--top`` (20) of them,
with their instructions and last-level misses per call above the floor; ``top_functions`` holds
them for the first case that is not the floor. Above ``stamp_only``, an asyncio case counts the
event loop's and coroutines' own work too: ``--cases aio_stamp_only,aio_instrumented --floor
aio_stamp_only`` leaves it out.
``calls``, ``floor`` and ``simulated_caches`` say how it was counted. Counts only: turning them
into time takes a model of a real machine, which this benchmark leaves out.

    python bench/rpc_cache_profile.py [--cases stamp_only,instrumented,aio_stamp_only,aio_instrumented]
        [--calls 200] [--floor stamp_only] [--top 20]

It needs valgrind (``apt-get install valgrind``). Each run takes about half a minute, mostly
Python's start-up under valgrind; two run at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import rpc_hot_path
from report import json_line
from rich.console import Console
from rich.table import Table


class Cache(NamedTuple):
    """One simulated cache, as valgrind's ``--I1``/``--D1``/``--LL`` options take it."""

    size: int  # bytes
    ways: int
    line: int  # bytes

    def option(self) -> str:
        return f"{self.size},{self.ways},{self.line}"


#: The simulated machine. The first levels are a current x86 core's (32 KiB of instructions,
#: 48 KiB of data). The last level is much smaller than our hosts' (32 MiB): what counts is that
#: a call starts with none of its lines cached, and the eviction before each call must copy more
#: than the last level, every byte of it simulated by valgrind; 2 MiB keeps that copy cheap (a
#: 32 MiB last level would need 64 MiB copied before every call) and still holds far more than
#: one call touches.
SIMULATED_CACHES = {
    "I1": Cache(32 * 1024, 8, 64),
    "D1": Cache(48 * 1024, 12, 64),
    "LL": Cache(2 * 1024 * 1024, 16, 64),
}
#: The bytes copied before each call: twice the last level, so that the copy's own lines (source
#: and target) push out every line the previous call left.
EVICT_BYTES = 2 * SIMULATED_CACHES["LL"].size
#: Calls before counting: the case's lazy set-up, caches of the interpreter and of the agents, and
#: one-time allocations happen in both runs alike, before the calls that count.
WARMUP_CALLS = 50
#: Cachegrind runs at once: our machines have 2 cores, and each run is one single-threaded process.
PARALLEL_RUNS = 2
DEFAULT_CASES = ("stamp_only", "instrumented", "aio_stamp_only", "aio_instrumented")
#: Cachegrind's events, combined into the figures reported.
FIGURES: dict[str, tuple[str, ...]] = {
    "ir": ("Ir",),
    "l1_misses": ("I1mr", "D1mr", "D1mw"),
    "ll_misses": ("ILmr", "DLmr", "DLmw"),
    "ll_instruction_misses": ("ILmr",),
    "ll_data_misses": ("DLmr", "DLmw"),
}


# -- the child: one case's calls, each after an eviction ---------------------------------------------------


def build(name: str) -> tuple[Callable[[bytes], Any], bool]:
    """Case ``name``'s method, and whether it is an asyncio one (awaited)."""
    methods, _ = rpc_hot_path.cases()
    if name in methods:
        return methods[name], False
    aio_methods, _ = rpc_hot_path.aio_cases()
    return aio_methods[name], True


def run_child(name: str, iterations: int, calls: int) -> None:
    """Warm case ``name`` up, then ``iterations`` times evict the caches and, the first ``calls``
    times, make one call; then leave at once.

    A garbage collection after the warm-up starts the counted part with the collector's counts at
    zero, so that its collections fall at the same calls in every run, whatever the start-up
    allocated; and leaving without the interpreter's teardown keeps what the calls left behind
    from being counted as theirs.
    """
    method, is_aio = build(name)
    source, target = bytearray(EVICT_BYTES), bytearray(EVICT_BYTES)
    if is_aio:
        aio_method: Callable[[bytes], Awaitable[Any]] = method

        async def cold_calls() -> None:
            for _ in range(WARMUP_CALLS):
                await aio_method(rpc_hot_path.PAYLOAD)
            gc.collect()
            for i in range(iterations):
                target[:] = source
                if i < calls:
                    await aio_method(rpc_hot_path.PAYLOAD)

        asyncio.new_event_loop().run_until_complete(cold_calls())
    else:
        for _ in range(WARMUP_CALLS):
            method(rpc_hot_path.PAYLOAD)
        gc.collect()
        for i in range(iterations):
            target[:] = source
            if i < calls:
                method(rpc_hot_path.PAYLOAD)
    sys.stdout.flush()
    os._exit(0)


# -- cachegrind's output ----------------------------------------------------------------------------------------


class Profile(NamedTuple):
    """One cachegrind run: its events' totals, and each function's (``file:function``)."""

    summary: dict[str, int]
    functions: dict[str, dict[str, int]]


_PYTHON_SOURCE = re.compile(r"(?:^|/)Python-3\.[^/]*/")


def readable(path: str) -> str:
    """``path`` without the build directory's prefix: ``Objects/longobject.c``, not
    ``/tmp/python-build.2026.../Python-3.11.7/./Objects/longobject.c``."""
    found = _PYTHON_SOURCE.search(path)
    if found:
        path = path[found.end() :]
    elif "/site-packages/" in path:
        path = path.rsplit("/site-packages/", 1)[1]
    return os.path.normpath(path) if path != "???" else path


_COMPRESSED = re.compile(r"\((\d+)\)(?: (.*))?")


def _names(table: dict[str, str], value: str) -> str:
    """The name a ``fl=``/``fn=`` line gives, with valgrind's name compression: ``(1) name`` defines
    number 1, a later ``(1)`` stands for it (``(below main)`` is a name)."""
    compressed = _COMPRESSED.fullmatch(value)
    if compressed is None:
        return value
    number, name = compressed.groups()
    if name is not None:
        table[number] = name
    return table[number]


def read_profile(path: Path) -> Profile:
    """Parse a cachegrind out file: the ``events:`` line, ``fl=``/``fn=`` lines (and ``fi=``/``fe=``,
    an inlined file), cost lines (a line number, then a count per event, trailing zeros possibly
    left out) and the ``summary:`` line."""
    events: list[str] = []
    summary: dict[str, int] = {}
    functions: dict[str, list[int]] = {}
    files: dict[str, str] = {}
    names: dict[str, str] = {}
    file = function = "???"
    costs: list[int] | None = None
    with path.open() as lines:
        for line in lines:
            if line[:1].isdigit():
                if costs is None:
                    costs = functions.setdefault(f"{readable(file)}:{function}", [0] * len(events))
                for index, count in enumerate(line.split()[1:]):
                    costs[index] += int(count)
            elif line.startswith(("fl=", "fi=", "fe=")):
                file, costs = _names(files, line[3:].rstrip("\n")), None
            elif line.startswith("fn="):
                function, costs = _names(names, line[3:].rstrip("\n")), None
            elif line.startswith("events:"):
                events = line.split()[1:]
            elif line.startswith("summary:"):
                summary = dict(zip(events, map(int, line.split()[1:]), strict=True))
    if not events or not summary:
        raise ValueError(f"{path}: not a cachegrind out file (no events or no summary line)")
    return Profile(summary, {name: dict(zip(events, counts, strict=True)) for name, counts in functions.items()})


def tenths(value: float) -> float:
    """``value`` per call as reported: to one decimal, and never ``-0.0``."""
    return round(value, 1) + 0.0


def figures(counts: Mapping[str, float]) -> dict[str, float]:
    """The reported figures (``FIGURES``) of one set of event counts."""
    return {figure: sum(counts.get(event, 0) for event in events) for figure, events in FIGURES.items()}


class PerCall(NamedTuple):
    """One case's counts per call: its figures in all, and each function's."""

    totals: dict[str, float]
    functions: dict[str, dict[str, float]]


def per_call(with_calls: Profile, without: Profile, calls: int) -> PerCall:
    """What ``calls`` calls add to a run, per call: the run with them less the run without."""

    def difference(more: Mapping[str, int], less: Mapping[str, int]) -> dict[str, float]:
        return figures(
            {event: (more.get(event, 0) - less.get(event, 0)) / calls for event in more.keys() | less.keys()}
        )

    empty: dict[str, int] = {}
    functions = {
        name: difference(with_calls.functions.get(name, empty), without.functions.get(name, empty))
        for name in with_calls.functions.keys() | without.functions.keys()
    }
    return PerCall(difference(with_calls.summary, without.summary), functions)


def grown(case: PerCall, floor: PerCall, top: int) -> list[dict[str, Any]]:
    """The ``top`` functions whose last-level misses per call grow most from ``floor`` to ``case``,
    with their instructions and last-level misses per call above the floor's."""
    zero = dict.fromkeys(FIGURES, 0.0)
    above = {
        name: {
            figure: case.functions.get(name, zero)[figure] - floor.functions.get(name, zero)[figure]
            for figure in ("ir", "ll_misses")
        }
        for name in case.functions.keys() | floor.functions.keys()
    }
    ranked = sorted(above.items(), key=lambda item: (-item[1]["ll_misses"], item[0]))
    return [
        {"function": name, "ir": tenths(values["ir"]), "ll_misses": tenths(values["ll_misses"])}
        for name, values in ranked[:top]
        if values["ll_misses"] > 0
    ]


# -- the parent: two runs under cachegrind per case ----------------------------------------------------------


def cachegrind(name: str, iterations: int, calls: int, directory: Path) -> Profile:
    """Run the child of case ``name`` under cachegrind (``calls`` of ``iterations`` evictions followed
    by a call) and read its counts."""
    out = directory / f"{name}.{calls}.out"
    command = ["valgrind", "--tool=cachegrind", "--cache-sim=yes"]
    command += [f"--{cache}={config.option()}" for cache, config in SIMULATED_CACHES.items()]
    command += [f"--cachegrind-out-file={out}", sys.executable, str(Path(__file__).resolve())]
    command += ["--calls", str(iterations), "--child", name, str(calls)]
    run = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"}, check=False
    )
    if run.returncode != 0:
        raise RuntimeError(f"cachegrind of {name} ({calls} calls) failed ({run.returncode}):\n{run.stderr[-3000:]}")
    return read_profile(out)


def profile_cases(names: list[str], calls: int, console: Console) -> dict[str, PerCall]:
    """Each case's counts per cold call, two cachegrind runs at a time."""
    with (
        tempfile.TemporaryDirectory(prefix="rpc_cache_profile.") as directory,
        ThreadPoolExecutor(PARALLEL_RUNS) as pool,
    ):
        runs = {
            (name, made): pool.submit(cachegrind, name, calls, made, Path(directory))
            for name in names
            for made in (calls, 0)
        }
        results = {}
        for name in names:
            results[name] = per_call(runs[name, calls].result(), runs[name, 0].result(), calls)
            console.print(f"counted {name}", style="dim")
        return results


def known_cases() -> list[str]:
    """Every case of ``rpc_hot_path.py``, sync and asyncio."""
    return [*rpc_hot_path.cases()[0], *rpc_hot_path.aio_cases()[0]]


def above_floor(result: PerCall, floor: PerCall) -> dict[str, float]:
    """``result``'s instructions and last-level misses per call above ``floor``'s, as reported."""
    return {figure: tenths(result.totals[figure] - floor.totals[figure]) for figure in ("ir", "ll_misses")}


def _rows(results: Mapping[str, PerCall], floor: str) -> Iterator[list[str]]:
    for name, result in results.items():
        cells = [format(tenths(result.totals[figure]), ",.1f") for figure in FIGURES]
        if name == floor:
            yield [name, *cells, "", ""]
        else:
            above = above_floor(result, results[floor]).values()
            yield [name, *cells, *(format(value, ",.1f") for value in above)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--cases",
        default=",".join(DEFAULT_CASES),
        help=f"comma-separated cases of rpc_hot_path.py ({','.join(DEFAULT_CASES)})",
    )
    parser.add_argument("--calls", type=int, default=200, help="cold calls counted per case (200)")
    parser.add_argument("--floor", default="stamp_only", help="the case the others are compared with (stamp_only)")
    parser.add_argument("--top", type=int, default=20, help="functions listed per case (20)")
    parser.add_argument("--child", nargs=2, metavar=("CASE", "CALLS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, calls = args.child
        run_child(name, args.calls, int(calls))
        return
    if args.calls < 1:
        parser.error("--calls must be at least 1")
    names = list(dict.fromkeys(name for name in args.cases.split(",") if name))
    if args.floor not in names:
        names.insert(0, args.floor)
    known = known_cases()
    for name in names:
        if name not in known:
            parser.error(f"unknown case {name!r}: the cases are {', '.join(known)}")
    if shutil.which("valgrind") is None:
        sys.exit(
            "valgrind not found: this benchmark runs each case under valgrind's cachegrind;"
            " install it (apt-get install valgrind)"
        )

    console = Console(width=140)
    progress = Console(stderr=True)
    progress.print(f"cachegrind: {len(names)} cases, 2 runs each of {args.calls} evictions, {PARALLEL_RUNS} at a time")
    results = profile_cases(names, args.calls, progress)

    caches = ", ".join(f"{cache} {config.size // 1024} KiB" for cache, config in SIMULATED_CACHES.items())
    table = Table(title=f"one cold unary call, counted by cachegrind per call ({args.calls} calls; simulated {caches})")
    columns = ("case", "instructions", "L1 misses", "LL misses", "LL instr. misses", "LL data misses")
    for column in (*columns, "instr. above floor", "LL misses above floor"):
        table.add_column(column, justify="left" if column == "case" else "right")
    for row in _rows(results, args.floor):
        table.add_row(*row)
    console.print(table)

    summary: dict[str, object] = {"calls": args.calls, "floor": args.floor}
    summary["simulated_caches"] = {cache: config._asdict() for cache, config in SIMULATED_CACHES.items()}
    summary["evicted_bytes"] = EVICT_BYTES
    top_functions: list[dict[str, Any]] | None = None
    for name, result in results.items():
        for figure, value in result.totals.items():
            summary[f"{name}_{figure}"] = tenths(value)
        if name == args.floor:
            continue
        for figure, value in above_floor(result, results[args.floor]).items():
            summary[f"{name}_above_floor_{figure}"] = value
        functions = grown(result, results[args.floor], args.top)
        if top_functions is None:
            top_functions = functions
        table = Table(title=f"{name}: the functions whose LL misses per cold call grow most above {args.floor}'s")
        for column in ("function", "LL misses above floor", "instr. above floor"):
            table.add_column(column, justify="left" if column == "function" else "right")
        for function in functions:
            table.add_row(function["function"], format(function["ll_misses"], ",.1f"), format(function["ir"], ",.1f"))
        console.print(table)
    summary["top_functions"] = top_functions or []
    json_line(summary)


if __name__ == "__main__":
    main()
