"""One benchmark child process: a script run with the running interpreter, spoken to by lines on
its stdin and answering JSON lines on its stdout (:func:`emit`)."""

from __future__ import annotations

import asyncio
import json
import sys

__all__ = ["Child", "emit"]


def emit(**fields: object) -> None:
    """In the child: one JSON line of ``fields`` on stdout, for the parent to read."""
    print(json.dumps(fields), flush=True)


class Child:
    """A child process of a benchmark, started with :meth:`start` and ended with :meth:`close`."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, script: str, role: str, *extra: str) -> Child:
        """Run ``script --role role *extra`` with the running interpreter."""
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            script,
            "--role",
            role,
            *extra,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        return cls(process)

    async def read(self, timeout: float = 120) -> dict[str, object]:
        """The child's next JSON line; an error if it exits first."""
        assert self.process.stdout is not None
        line = await asyncio.wait_for(self.process.stdout.readline(), timeout)
        if not line:
            raise RuntimeError(f"child exited with {await self.process.wait()}")
        return json.loads(line)

    def write(self, text: str) -> None:
        """Send ``text`` as it is."""
        assert self.process.stdin is not None
        self.process.stdin.write(text.encode())

    def send(self, **fields: object) -> None:
        """Send one JSON line of ``fields``."""
        self.write(json.dumps(fields) + "\n")

    async def close(self) -> None:
        """Close its stdin (its cue to finish) and wait for it; killed after 30 s."""
        assert self.process.stdin is not None
        if not self.process.stdin.is_closing():
            self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), 30)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()
