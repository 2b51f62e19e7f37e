"""Our test programs as OS processes: lines of their pipes read on threads, and the JSON-lines
protocol of the services the tests drive (commands in on stdin, one event a line out on stdout).

    node = JsonProcess("A", [sys.executable, "-P", "-m", "stablewatch.testing.token_node", "--id", "A"])
    node.command("stats")          # {"cmd": "stats"}
    stats = node.expect("stats")   # the next "stats" event; TimeoutError naming the node otherwise
    node.stop()                    # {"cmd": "exit"}, SIGKILL if it lingers; its exit status

Waiting for a line times out, so a test never hangs on a silent process; its stderr is drained
into ``stderr.seen`` (:meth:`JsonProcess.log`), so that its logging never blocks on a full pipe and
a failing test can show it.
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["JsonProcess", "LineReader"]

_Line = TypeVar("_Line")


class LineReader(Generic[_Line]):
    """Lines of a pipe (each passed through ``parse``), read on a thread, so that waiting for one can time out.

    ``seen`` holds every line read so far, in order; ``lines`` the ones not taken yet, then None
    once the stream has ended.
    """

    def __init__(self, pipe: Any, parse: Callable[[str], _Line] = str) -> None:  # type: ignore[assignment]
        self.lines: queue.Queue[_Line | None] = queue.Queue()
        self.seen: list[_Line] = []
        self._parse = parse
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe: Any) -> None:
        for text in pipe:
            line = self._parse(text)
            self.seen.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def next(self, timeout: float = 15, fail: Callable[[], str] = lambda: "") -> _Line:
        """The next line (``queue.Empty`` after ``timeout``); ``fail`` says why when the stream ended
        instead (e.g. the process's stderr)."""
        line = self.lines.get(timeout=timeout)
        assert line is not None, f"the stream ended: {fail()}"
        return line


class JsonProcess:
    """A service speaking JSON lines, started with ``command``; returns once it printed ``ready``.

    Its ``address`` is the ready event's. ``events`` holds every event printed so far, in order
    (those :meth:`expect` skipped too); :meth:`expect` waits for the next of a kind.
    """

    def __init__(self, process_id: str, command: list[str], ready_timeout: float = 60) -> None:
        self.process_id = process_id
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.stdout: LineReader[dict[str, Any]] = LineReader(self.process.stdout, json.loads)
        self.stderr: LineReader[str] = LineReader(self.process.stderr)
        try:
            self.address = str(self.expect("ready", timeout=ready_timeout)["address"])
        except BaseException:
            self.kill()
            raise

    @property
    def events(self) -> list[dict[str, Any]]:
        """Every event the process has printed so far."""
        return list(self.stdout.seen)

    def count(self, kind: str) -> int:
        """How many events of ``kind`` it has printed so far (those :meth:`expect` skipped too)."""
        return sum(1 for event in self.events if event["event"] == kind)

    def log(self, last: int = 2000) -> str:
        """The end of what it wrote on stderr so far."""
        return "".join(self.stderr.seen)[-last:]

    def command(self, cmd: str, **fields: object) -> None:
        """Send one command (``{"cmd": cmd, **fields}``); its reply, if any, is an event to :meth:`expect`."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"cmd": cmd, **fields}) + "\n")
        self.process.stdin.flush()

    def expect(self, kind: str, timeout: float = 30) -> dict[str, Any]:
        """The next event of ``kind`` (skipping others); TimeoutError after ``timeout``, or when the
        process ends first (with the end of its stderr)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self.stdout.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{self.process_id}: no {kind!r} event within {timeout:g} s") from None
            if event is None:
                self.stdout.lines.put(None)  # the stream stays ended for later calls
                raise TimeoutError(
                    f"{self.process_id} exited ({self.process.poll()}) before a {kind!r} event: {self.log()}"
                )
            if event["event"] == kind:
                return event

    def metrics(self, samples: dict[str, tuple[str, dict[str, str]]], timeout: float = 30) -> dict[str, float | None]:
        """The values of these samples (``{key: (sample name, labels)}``) in the process's agent's metrics."""
        self.command("metrics", samples={key: [name, labels] for key, (name, labels) in samples.items()})
        return self.expect("metrics", timeout)["values"]

    def kill(self) -> None:
        """End the process at once (SIGKILL): no goodbye to its peers or the detector."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)

    def stop(self, timeout: float = 30) -> int:
        """End the process politely (``exit``: its agent stops), killing it if it lingers; its exit status."""
        if self.process.poll() is None:
            with contextlib.suppress(BrokenPipeError, OSError):
                self.command("exit")
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode
