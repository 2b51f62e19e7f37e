"""The ``stablewatch`` command as a user runs it, for end-to-end tests: one-off commands, and the
detector as an OS process (``stablewatch detector --json``)."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["STABLEWATCH", "DetectorProcess", "LineReader", "stablewatch"]

_SCRIPT = Path(sys.executable).with_name("stablewatch")
STABLEWATCH = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "stablewatch.cli.main"]


def stablewatch(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run ``stablewatch *args`` to its end; its exit status, stdout and stderr."""
    return subprocess.run([*STABLEWATCH, *args], capture_output=True, text=True, timeout=timeout)


class LineReader:
    """Lines of a pipe, read on a thread, so that waiting for one can time out."""

    def __init__(self, pipe: Any) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe: Any) -> None:
        for line in pipe:
            self.seen.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def next(self, timeout: float = 15, fail: Callable[[], str] = lambda: "") -> str:
        """The next line; `fail` says why when the stream ended instead (e.g. the process's stderr)."""
        line = self.lines.get(timeout=timeout)
        assert line is not None, f"the stream ended: {fail()}"
        return line


class DetectorProcess:
    """``stablewatch detector --json`` with a free gRPC port and a free /metrics port."""

    def __init__(self, data_dir: Path, *args: str) -> None:
        command = [*STABLEWATCH, "detector", "--json", "--listen", "127.0.0.1:0", "--metrics-port", "0"]
        self.process = subprocess.Popen(
            [*command, "--data-dir", str(data_dir), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.stdout = LineReader(self.process.stdout)
        self.stderr = LineReader(self.process.stderr)  # drained, so logging never blocks on a full pipe
        try:
            ready = json.loads(self.stdout.next(timeout=30))
        except BaseException:
            self.stop()
            raise
        assert ready["event"] == "ready", ready
        self.address: str = ready["address"]
        self.metrics: str = ready["metrics"]

    def stop(self, signum: int = signal.SIGTERM) -> int:
        """Signal the detector and return its exit status (SIGKILL if it does not stop in 15 s)."""
        if self.process.poll() is None:
            self.process.send_signal(signum)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        return self.process.returncode
