"""A TCP proxy on its own event-loop thread, for injecting connection faults into gRPC streams.

    proxy = TcpProxy("127.0.0.1:5000")   # listens on 127.0.0.1:<free port>, forwards to the target
    TcpProxy(target, rate=100_000)       # the same, at most 100 kB/s each way per connection
    proxy.address                        # give this to the client instead of the target
    proxy.break_all()                    # abort every current connection, both directions
    proxy.pause(); proxy.resume()        # stop / restart forwarding bytes (connections stay open)
    proxy.refuse(True)                   # abort every new connection at once (a peer that is down)
    proxy.stop()

Every method is synchronous and returns once the proxy's loop has done it, so a test controls the
faults deterministically. Counters (``accepted``, ``upstream_bytes``, ``downstream_bytes``,
``accept_times``) let a test poll for progress (a reconnect, data flowing again) instead of
sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from stablewatch.agents.loop_thread import LoopThread

__all__ = ["TcpProxy"]

T = TypeVar("T")
_CHUNK = 64 * 1024
_TIMEOUT = 10.0


class _Pair:
    """One proxied connection: the client's side and the target's side."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.target: asyncio.StreamWriter | None = None  # None while still connecting
        self.tasks: list[asyncio.Task[None]] = []
        self.upstream = self.downstream = 0  # bytes forwarded each way

    def abort(self) -> None:
        for writer in (self.client, self.target):
            if writer is not None:
                writer.transport.abort()
        for task in self.tasks:
            task.cancel()


class TcpProxy:
    """Forwards connections from ``127.0.0.1:<port>`` (port chosen by the OS) to ``target``."""

    def __init__(self, target: str, *, rate: float | None = None, connect_retry: float = 1.0) -> None:
        """``rate`` caps each connection's bytes per second in each direction (None: no cap).

        When the target refuses a connection (it is restarting), the proxy tries again for
        ``connect_retry`` seconds before giving up on the client's connection, as a listen backlog
        would; :meth:`refuse` is the way to make connections fail.
        """
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._rate = rate
        self._chunk = _CHUNK if rate is None else max(512, min(_CHUNK, int(rate / 100)))
        self._connect_retry = connect_retry
        self._loop_thread = LoopThread(f"tcp-proxy-{target}")
        self._loop_thread.start()
        self._pairs: set[_Pair] = set()
        self._accepting: set[asyncio.Task[None]] = set()  # accepts waiting for a pause to end
        self._accepts: set[asyncio.Task[None]] = set()  # every accept still setting up its connection
        self._flowing: asyncio.Event | None = None
        self._server: asyncio.Server | None = None
        self._refusing = False
        self.accepted = 0  # connections accepted from clients, ever
        self.accept_times: list[float] = []  # time.monotonic() of each accepted connection
        self.upstream_bytes = 0  # forwarded client -> target
        self.downstream_bytes = 0  # forwarded target -> client
        self.breaks = 0  # connections aborted by break_all
        try:
            self.port = self._call(self._listen())
        except BaseException:
            self._shutdown_loop()
            raise

    @property
    def address(self) -> str:
        """Where the proxy listens: give this to the client instead of the target."""
        return f"127.0.0.1:{self.port}"

    @property
    def connections(self) -> int:
        """Connections open right now."""
        return self._call(self._count())

    def break_all(self) -> int:
        """Abort every current connection (both sides, unflushed data dropped); returns how many."""
        return self._call(self._break_all())

    def pause(self) -> None:
        """Stop forwarding bytes in both directions; connections stay open, data waits."""
        self._call(self._set_flowing(False))

    def resume(self) -> None:
        """Forward bytes again."""
        self._call(self._set_flowing(True))

    def refuse(self, refusing: bool = True) -> None:
        """While refusing, every new connection is aborted as soon as it is accepted."""
        self._call(self._set_refusing(refusing))

    @property
    def established(self) -> int:
        """Connections open right now that have carried bytes in both directions."""
        return self._call(self._count_established())

    @property
    def all_established(self) -> bool:
        """Whether there are connections and every one has carried bytes in both directions.

        Breaking a gRPC connection before its HTTP/2 handshake has completed counts as a failed
        connection attempt for gRPC, which then backs off for a second or more; tests that want
        quick reconnects break only established connections.
        """
        return self._call(self._all_established())

    def stop(self) -> None:
        """Stop listening, abort every connection and end the proxy's thread."""
        if not self._loop_thread.is_alive():
            return
        try:
            self._call(self._close())
        finally:
            self._shutdown_loop()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- on the proxy's loop ----------------------------------------------------------------------

    async def _listen(self) -> int:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _count(self) -> int:
        return len(self._pairs)

    async def _count_established(self) -> int:
        return sum(1 for pair in self._pairs if pair.upstream and pair.downstream)

    async def _all_established(self) -> bool:
        return bool(self._pairs) and all(pair.upstream and pair.downstream for pair in self._pairs)

    async def _set_refusing(self, refusing: bool) -> None:
        self._refusing = refusing

    async def _break_all(self) -> int:
        pairs = list(self._pairs)
        self._pairs.clear()
        for pair in pairs:
            pair.abort()
        self.breaks += len(pairs)
        tasks = [task for pair in pairs for task in pair.tasks]
        if tasks:  # let the pumps see the abort before anything else happens on the loop
            await asyncio.wait(tasks, timeout=_TIMEOUT)
        return len(pairs)

    async def _set_flowing(self, flowing: bool) -> None:
        assert self._flowing is not None
        if flowing:
            self._flowing.set()
        else:
            self._flowing.clear()

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._refusing = True
        accepting = list(self._accepting)
        await self._break_all()
        assert self._flowing is not None
        self._flowing.set()  # let accepts held by a pause see that their connection is gone
        if accepting:
            await asyncio.wait(accepting, timeout=_TIMEOUT)
        for task in list(self._accepts):  # accepts still retrying a target that is gone
            task.cancel()
        await asyncio.gather(*self._accepts, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), _TIMEOUT)

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._accepts.add(task)
        try:
            await self._connect(client_reader, client_writer, task)
        except asyncio.CancelledError:
            # Only stop() cancels an accept. Ending quietly matters: Python 3.11's stream server
            # asks a cancelled handler task for its exception and logs the CancelledError it gets.
            client_writer.transport.abort()
        finally:
            self._accepts.discard(task)

    async def _connect(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter, task: asyncio.Task[None]
    ) -> None:
        self.accepted += 1
        self.accept_times.append(time.monotonic())
        if self._refusing:
            client_writer.transport.abort()
            return
        pair = _Pair(client_writer)
        self._pairs.add(pair)  # a break while connecting to the target ends this connection too
        assert self._flowing is not None
        self._accepting.add(task)
        try:
            await self._flowing.wait()  # while paused, nothing reaches the target
        finally:
            self._accepting.discard(task)
        if pair not in self._pairs:
            pair.abort()
            return
        deadline = time.monotonic() + self._connect_retry
        while True:
            try:
                target_reader, pair.target = await asyncio.wait_for(asyncio.open_connection(*self._target), _TIMEOUT)
                break
            except (OSError, TimeoutError):
                if time.monotonic() > deadline or pair not in self._pairs:
                    self._pairs.discard(pair)
                    pair.abort()
                    return
                await asyncio.sleep(0.01)
        if pair not in self._pairs:
            pair.abort()
            return
        target_writer = pair.target
        pair.tasks = [
            asyncio.ensure_future(self._pump(pair, client_reader, target_writer, upstream=True)),
            asyncio.ensure_future(self._pump(pair, target_reader, client_writer, upstream=False)),
        ]

    async def _pump(
        self, pair: _Pair, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, upstream: bool
    ) -> None:
        assert self._flowing is not None
        try:
            while True:
                await self._flowing.wait()
                data = await reader.read(self._chunk)
                if not data:
                    break
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
                if upstream:
                    self.upstream_bytes += len(data)
                    pair.upstream += len(data)
                else:
                    self.downstream_bytes += len(data)
                    pair.downstream += len(data)
                if self._rate is not None:
                    await asyncio.sleep(len(data) / self._rate)
        except (OSError, asyncio.CancelledError):
            pass
        # One side ended (or failed): end the whole connection, so the other side sees it too.
        if pair in self._pairs:
            self._pairs.discard(pair)
            pair.abort()

    # -- plumbing ---------------------------------------------------------------------------------

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self._loop_thread.run(coroutine, _TIMEOUT)

    def _shutdown_loop(self) -> None:
        self._loop_thread.stop(_TIMEOUT)
