"""The ``stablewatch`` command as a user runs it, for end-to-end tests: one-off commands, and the
detector as an OS process (``stablewatch detector --json``: :mod:`stablewatch.testing.detector_process`,
which the benchmarks use too)."""

from __future__ import annotations

import subprocess

from stablewatch.testing.detector_process import STABLEWATCH, DetectorProcess
from stablewatch.testing.json_process import LineReader

__all__ = ["STABLEWATCH", "DetectorProcess", "LineReader", "stablewatch"]


def stablewatch(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run ``stablewatch *args`` to its end; its exit status, stdout and stderr."""
    return subprocess.run([*STABLEWATCH, *args], capture_output=True, text=True, timeout=timeout)
