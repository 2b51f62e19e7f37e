"""``stablewatch detector`` as an OS process, for end-to-end tests and benchmarks.

    detector = DetectorProcess(tmp / "data", "--interval", "0.2", "--replica", "1")
    agent = Agent("P", detector=detector.address)    # attach agents to it as usual
    detector.members()                               # ask it over its query API, as an operator would
    assert detector.stop() == 0                      # SIGTERM (or another signal); its exit status

It runs with ``--json`` on a free gRPC port and a free /metrics port (options given after the data
directory override those), and starting returns once its ready line says where it serves. Its
stderr is drained on a thread into ``stderr.seen``, so that its logging never blocks on a full pipe
and a test can show it when it fails.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc

from stablewatch.testing.json_process import LineReader
from stablewatch.v1 import query_pb2, query_pb2_grpc

__all__ = ["STABLEWATCH", "DetectorProcess"]

_SCRIPT = Path(sys.executable).with_name("stablewatch")
#: The ``stablewatch`` command of this interpreter's environment (its script, or the module).
STABLEWATCH = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "stablewatch.cli.main"]


class DetectorProcess:
    """``stablewatch detector --json`` with a free gRPC port and a free /metrics port.

    ``address`` and ``metrics`` (the /metrics URL, None when off) come from its ready line
    (``ready``); ``listen`` gives another address (e.g. the port of one that was killed, to start it
    again there). The query methods open one channel to it on first use; :meth:`stop` closes it.
    """

    def __init__(self, data_dir: Path, *args: str, listen: str = "127.0.0.1:0", timeout: float = 60) -> None:
        command = [*STABLEWATCH, "detector", "--json", "--listen", listen, "--metrics-port", "0"]
        self.process = subprocess.Popen(
            [*command, "--data-dir", str(data_dir), *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stdout = LineReader(self.process.stdout)
        self.stderr = LineReader(self.process.stderr)  # drained, so logging never blocks on a full pipe
        self._channel: grpc.Channel | None = None
        try:
            try:
                self.ready: dict[str, Any] = json.loads(self.stdout.next(timeout, self.log))
            except queue.Empty:
                raise TimeoutError(f"the detector was not ready within {timeout:g} s: {self.log()}") from None
            assert self.ready["event"] == "ready", self.ready
        except BaseException:
            self.kill()
            raise
        self.address: str = self.ready["address"]
        self.metrics: str | None = self.ready.get("metrics")

    def log(self, last: int = 3000) -> str:
        """The end of what it wrote on stderr so far."""
        return "".join(self.stderr.seen)[-last:]

    # -- its query API ---------------------------------------------------------------------------

    @property
    def query(self) -> query_pb2_grpc.QueryStub:
        """A stub of its query API (plaintext), on a channel kept until :meth:`stop`."""
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.address)
        return query_pb2_grpc.QueryStub(self._channel)

    def members(self) -> set[str]:
        """The processes attached to it (none while it cannot be reached: killed, or not back yet)."""
        try:
            reply = self.query.ListMembers(query_pb2.ListMembersRequest(), timeout=5)
        except grpc.RpcError:
            return set()
        return {member.process_id for member in reply.members}

    def latest(self) -> query_pb2.SnapshotResults | None:
        """Its newest completed snapshot's results (None before the first)."""
        try:
            return self.query.GetLatestResults(query_pb2.GetLatestResultsRequest(), timeout=10)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    def resolutions(self) -> list[query_pb2.Resolution]:
        """Its breaks of proven deadlocks, oldest first."""
        reply = self.query.ListResolutions(query_pb2.ListResolutionsRequest(page_size=1000), timeout=10)
        return list(reply.resolutions)[::-1]

    # -- ending it -------------------------------------------------------------------------------

    def kill(self) -> int:
        """SIGKILL: no goodbye to the agents, nothing flushed; its exit status."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        self._close()
        return self.process.returncode

    def stop(self, signum: int = signal.SIGTERM) -> int:
        """Signal the detector and return its exit status (SIGKILL if it does not stop in 15 s)."""
        if self.process.poll() is None:
            self.process.send_signal(signum)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._close()
        return self.process.returncode

    def _close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
