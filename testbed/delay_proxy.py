"""A delaying, byte-counting TCP proxy: the latency half of an emulated WAN (see testbed/wan.py).

The kernel here has no ``netem``, so ``tc`` can limit a link's rate (tbf, testbed/netns.py) but not
add latency. This proxy does: every chunk of data read from one side is written to the other side
``delay`` seconds after it arrived, in each direction, in order. A request and its response so
gain ``2 * delay`` (one round trip). It knows nothing of HTTP; it counts bytes each way and
connections::

    python -m testbed.delay_proxy --listen 0.0.0.0:9001 --upstream 127.0.0.1:9000 \\
        --delay-ms 40 --stats /tmp/east.json

prints ``listening 0.0.0.0:9001`` once it accepts connections and (re)writes ``--stats`` as
``{"bytes_to_upstream": .., "bytes_to_client": .., "connections": ..}`` then, every 0.1 s, and on
SIGTERM or SIGINT before it exits. In a test process::

    with delay_proxy(("127.0.0.1", 9000), delay_s=0.04) as proxy:
        ...                           # connect to proxy.host, proxy.port
        proxy.counts.bytes_to_upstream

What it does not emulate: the TCP handshake is answered by the proxy at once (a new connection
costs no extra round trip), and each side's TCP sees only its own short hop, so throughput is not
limited by window / round trip as on a real long link (the link's rate, from tbf, still is).
A half-close (EOF) is passed on after the delay too; a reset closes both sides at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

_CHUNK = 1 << 16
_QUEUE_CHUNKS = 256  # at most 16 MiB in flight per direction before the proxy stops reading
STATS_INTERVAL_S = 0.1
# A peer going away shows up as one of these; none of them is a bug of the proxy.
_DISCONNECTS = (OSError, asyncio.IncompleteReadError, EOFError)


@dataclass
class Counts:
    """What went through the proxy since it started (bytes as read from each side)."""

    bytes_to_upstream: int = 0
    bytes_to_client: int = 0
    connections: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def parse_address(text: str) -> tuple[str, int]:
    """``"HOST:PORT"`` (the last colon splits) as ``(host, port)``."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def write_stats(path: str | Path, counts: Counts) -> None:
    """Replace ``path`` atomically with the counts as JSON (a reader never sees half a file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(counts.as_dict()))
    os.replace(tmp, path)


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float, count: Callable[[int], None]
) -> None:
    """Copy ``reader`` to ``writer`` until EOF, each chunk ``delay_s`` after it was read."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=_QUEUE_CHUNKS)

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            if not data:  # EOF: half-close the other side
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    delivery = loop.create_task(deliver())
    try:
        while True:
            data = await reader.read(_CHUNK)
            count(len(data))
            await queue.put((loop.time() + delay_s, data))
            if not data:
                break
        await delivery
    finally:
        delivery.cancel()


class DelayProxy:
    """The proxy's state; serve it with :meth:`listen` in a running loop, or use
    :func:`delay_proxy` (a background thread) or ``python -m testbed.delay_proxy``."""

    def __init__(self, upstream: tuple[str, int], delay_s: float) -> None:
        self.upstream = upstream
        self.delay_s = delay_s
        self.counts = Counts()
        self.host = ""
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def listen(self, host: str, port: int) -> None:
        """Start accepting on ``host:port`` (0: a free port); sets ``host`` and ``port``."""
        self._server = await asyncio.start_server(self._accept, host, port)
        self.host, self.port = host, self._server.sockets[0].getsockname()[1]
        self._loop = asyncio.get_running_loop()

    def settled_counts(self, timeout: float = 10.0) -> Counts:
        """The counts once the proxy's loop has handled everything that reached it before
        this call (a barrier run on that loop, from another thread).  A byte is counted
        when the proxy reads it, before passing it on: once a request's response has
        arrived, every byte of both has been counted."""
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self._loop).result(timeout)
        return self.counts

    async def aclose(self) -> None:
        """Stop accepting and drop every open connection."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.counts.connections += 1
        task = asyncio.get_running_loop().create_task(self._serve(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _to_upstream(self, n: int) -> None:
        self.counts.bytes_to_upstream += n

    def _to_client(self, n: int) -> None:
        self.counts.bytes_to_client += n

    async def _serve(self, client_reader: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        upstream: asyncio.StreamWriter | None = None
        pipes: list[asyncio.Task] = []
        clean = False
        try:
            upstream_reader, upstream = await asyncio.open_connection(*self.upstream)
            loop = asyncio.get_running_loop()
            pipes = [
                loop.create_task(_pipe(client_reader, upstream, self.delay_s, self._to_upstream)),
                loop.create_task(_pipe(upstream_reader, client, self.delay_s, self._to_client)),
            ]
            await asyncio.gather(*pipes)
            clean = True
        except _DISCONNECTS:
            pass  # a reset (or an unreachable upstream): close both sides at once
        finally:
            for pipe in pipes:
                pipe.cancel()
            for writer in (client, upstream):
                if writer is None:
                    continue
                if clean:
                    writer.close()
                else:
                    writer.transport.abort()


async def serve(
    listen: tuple[str, int],
    upstream: tuple[str, int],
    delay_s: float,
    stats_path: str | Path | None = None,
    stop: asyncio.Event | None = None,
    on_listening: Callable[[DelayProxy], None] | None = None,
) -> Counts:
    """Run a proxy until ``stop`` is set (or forever), writing ``stats_path`` every
    :data:`STATS_INTERVAL_S` and once more at the end; return the final counts."""
    proxy = DelayProxy(upstream, delay_s)
    stop = stop or asyncio.Event()
    await proxy.listen(*listen)
    try:
        if stats_path is not None:
            write_stats(stats_path, proxy.counts)
        if on_listening is not None:
            on_listening(proxy)
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), STATS_INTERVAL_S)
            if stats_path is not None:
                write_stats(stats_path, proxy.counts)
    finally:
        await proxy.aclose()
        if stats_path is not None:
            write_stats(stats_path, proxy.counts)
    return proxy.counts


@contextlib.contextmanager
def delay_proxy(
    upstream: tuple[str, int],
    delay_s: float,
    listen: tuple[str, int] = ("127.0.0.1", 0),
    stats_path: str | Path | None = None,
) -> Iterator[DelayProxy]:
    """Run a :class:`DelayProxy` in a background thread of this process until the context exits."""
    loop = asyncio.new_event_loop()
    started: list[DelayProxy] = []
    ready = threading.Event()
    stop = asyncio.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(
                serve(listen, upstream, delay_s, stats_path, stop, lambda proxy: (started.append(proxy), ready.set()))
            )
        finally:
            ready.set()
            loop.close()

    thread = threading.Thread(target=run, name="delay-proxy", daemon=True)
    thread.start()
    ready.wait(10)
    if not started:
        thread.join(1)
        raise RuntimeError(f"delay proxy could not listen on {listen}")
    try:
        yield started[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)


def main(argv: Sequence[str] | None = None) -> int:
    description = __doc__.split("\n")[0]
    parser = argparse.ArgumentParser(prog="python -m testbed.delay_proxy", description=description)
    parser.add_argument("--listen", required=True, type=parse_address, help="HOST:PORT (PORT 0: any free one)")
    parser.add_argument("--upstream", required=True, type=parse_address, help="HOST:PORT")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added to each direction")
    parser.add_argument("--stats", help="JSON file of the counts, rewritten every 0.1 s and on exit")
    args = parser.parse_args(argv)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)

        def announce(proxy: DelayProxy) -> None:
            print(f"listening {proxy.host}:{proxy.port}", flush=True)

        await serve(args.listen, args.upstream, args.delay_ms / 1000, args.stats, stop, announce)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
