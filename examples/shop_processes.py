"""Start the whole shop (``stablewatch.examples.shop``) as OS processes, read its books, stop it.

Used by the shop's tests, ``bench/rpc_phantom.py`` and the demo. Each process logs to
``FOLDER/<service>.log``; the services find each other through ``FOLDER/peers`` (so every
port is picked by the operating system), and each one's admin address comes from the JSON line it
prints once serving.
"""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from stablewatch.examples.shop import ROLES, read_status

__all__ = ["ShopProcesses"]

STARTUP = 60.0  # seconds for every process to serve (slow shared machines)


class ShopProcesses:
    """The shop's four processes (three services and the client), started together."""

    def __init__(self, folder: Path, workload: str, detector: str | None = None, extra: tuple[str, ...] = ()) -> None:
        self.folder = folder
        self.workload = workload
        self.detector = detector
        self.extra = extra
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.ready: dict[str, dict[str, str | None]] = {}

    def __enter__(self) -> ShopProcesses:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self, timeout: float = STARTUP) -> None:
        """Start every process and wait for each one's ready line; fail early if one dies."""
        self.folder.mkdir(parents=True, exist_ok=True)
        options = ["--workload", self.workload, "--peers-dir", str(self.folder / "peers"), *self.extra]
        if self.detector is not None:
            options += ["--detector", self.detector]
        try:
            for role in ROLES:
                with (self.folder / f"{role}.log").open("wb") as log:
                    self.processes[role] = subprocess.Popen(
                        [sys.executable, "-m", "stablewatch.examples.shop", "--service", role, *options],
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=log,
                    )
            deadline = time.monotonic() + timeout
            for role, process in self.processes.items():
                self.ready[role] = self._ready_line(role, process, deadline)
        except BaseException:
            self.stop()
            raise

    def _ready_line(self, role: str, process: subprocess.Popen[bytes], deadline: float) -> dict[str, str | None]:
        assert process.stdout is not None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{role} did not start serving in time:\n{self.log(role)[-2000:]}")
            readable, _, _ = select.select([process.stdout], [], [], min(remaining, 0.5))
            if readable:
                line = process.stdout.readline()
                if not line:
                    raise RuntimeError(f"{role} exited with {process.wait()}:\n{self.log(role)[-2000:]}")
                return json.loads(line)

    def admin(self, role: str) -> str:
        address = self.ready[role]["admin"]
        assert address is not None
        return address

    def status(self, role: str, timeout: float = 5.0) -> dict[str, object]:
        """`role`'s books now: outstanding calls, busy handlers, counts of finished calls."""
        return read_status(self.admin(role), timeout)

    def placed(self) -> int:
        """Places the client has seen complete."""
        counts = self.status("client")["counts"]
        assert isinstance(counts, dict)
        return int(counts.get("/shop.Orders/Place", 0))

    def log(self, role: str) -> str:
        path = self.folder / f"{role}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def check_running(self) -> None:
        for role, process in self.processes.items():
            if process.poll() is not None:
                raise AssertionError(f"{role} exited with {process.returncode}:\n{self.log(role)[-3000:]}")

    def stop(self, timeout: float = 15.0) -> dict[str, int | None]:
        """SIGTERM every process, kill any still there after `timeout`; the exit codes (None: killed)."""
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        deadline = time.monotonic() + timeout
        for role, process in self.processes.items():
            try:
                codes[role] = process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
                codes[role] = None
            if process.stdout is not None:
                process.stdout.close()
        return codes
