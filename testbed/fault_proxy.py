"""A fault-injecting, delaying HTTP/1.1 reverse proxy to put in front of a real S3 server.

Object storage in production is slow, sometimes refuses work (``503 Slow Down``), sometimes
loses a response after it has acted (the PUT happened, the client saw a reset connection), and
sometimes hangs for seconds. This proxy emulates all of that in front of a test server (moto, see
:func:`testbed.servers.moto_s3_server`), so real learners and syncers, talking to S3 through
s3fs/aiobotocore with keep-alive connections, can be run against flaky storage::

    with moto_s3_server() as s3, fault_proxy(s3.endpoint_url, FaultRules(refuse=0.2)) as proxy:
        fs = s3fs.S3FileSystem(endpoint_url=proxy.url, key="testing", secret="testing")
        ...                                           # some requests get 503 Slow Down
        proxy.set_rules(FaultRules(outage=True))      # a regional outage starts
        ...
        proxy.set_rules(FaultRules())                 # and ends
        print(proxy.stats.snapshot())                 # {"refused": {"GET": 3}, ...}

The proxy runs its own asyncio loop in a background thread of the test process. Each client
connection gets its own upstream connection; each request is read fully, a fault is decided
(:meth:`FaultProxy.decide`, reproducible from ``seed``) and the request is refused, or delayed
and forwarded, its response read fully and sent back (or dropped, for ``reset``). An upstream
that cannot be reached closes the client's connection, as a reset does. The upstream's
``Connection: close`` (moto sends it on every response) is not passed on: the proxy reconnects.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

_SLOW_DOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
)
# A peer going away shows up as one of these; none of them is a bug of the proxy.
_DISCONNECTS = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, EOFError)


@dataclass(frozen=True)
class FaultRules:
    """What the proxy does to requests; swap them at run time with :meth:`FaultProxy.set_rules`."""

    refuse: float = 0.0
    """Probability that a request is answered ``503 Slow Down`` without being forwarded."""
    reset: float = 0.0
    """Probability that a request is forwarded, but the connection is aborted instead of answered."""
    stall: float = 0.0
    """Probability that a request is held for ``stall_seconds`` before being forwarded."""
    stall_seconds: float = 2.0
    """How long a stalled request is held."""
    delay_seconds: float = 0.0
    """Latency added to every request (that matches the two filters below) before it is handled."""
    delay_methods: frozenset[str] = frozenset()
    """HTTP methods that get ``delay_seconds``, e.g. ``{"GET"}``; empty means all methods."""
    delay_path_contains: str = ""
    """Only requests whose target (path and query) contains this get the delay; empty means all."""
    fault_path_contains: str = ""
    """Only requests whose target contains this can get a fault (refuse/reset/stall); empty: all."""
    outage: bool = False
    """Every request is refused with ``503 Slow Down``, as during a regional outage."""


class ProxyStats:
    """Thread-safe counts of requests per kind and HTTP method.

    Kinds: ``forwarded`` (sent to the upstream, including reset and stalled ones), ``refused``,
    ``reset``, ``stalled`` and ``delayed``.
    """

    KINDS = ("forwarded", "refused", "reset", "stalled", "delayed")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, Counter[str]] = {kind: Counter() for kind in self.KINDS}
        self._bytes: Counter[str] = Counter()

    def record(self, kind: str, method: str) -> None:
        with self._lock:
            self._counts[kind][method] += 1

    def record_bytes(self, method: str, head_up: int, body_up: int, head_down: int, body_down: int) -> None:
        """The sizes of a forwarded request and of its response as the client got them."""
        with self._lock:
            for part, size in (("head_up", head_up), ("body_up", body_up), ("head_down", head_down)):
                self._bytes[part] += size
                self._bytes[f"{part}:{method}"] += size
            self._bytes["body_down"] += body_down
            self._bytes[f"body_down:{method}"] += body_down

    def byte_counts(self) -> dict[str, int]:
        """Bytes of forwarded requests and responses: ``head_up``, ``body_up``, ``head_down``
        and ``body_down`` (HTTP heads: start line, fields and the blank line), and each also
        per method, as ``head_up:GET``..."""
        with self._lock:
            return dict(self._bytes)

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{kind: {method: count}}`` for every kind (an empty dict where nothing happened)."""
        with self._lock:
            return {kind: dict(counts) for kind, counts in self._counts.items()}

    def total(self, kind: str) -> int:
        with self._lock:
            return sum(self._counts[kind].values())


class _Head:
    """The start line and header fields of a request or response, kept verbatim."""

    def __init__(self, raw: bytes) -> None:
        self.raw_size = len(raw)
        lines = raw.decode("latin-1").split("\r\n")
        self.start = lines[0]
        self.fields = [tuple(s.strip() for s in line.split(":", 1)) for line in lines[1:] if line]

    def get(self, name: str) -> str:
        return ", ".join(v for k, v in self.fields if k.lower() == name)

    def drop(self, name: str) -> None:
        self.fields = [(k, v) for k, v in self.fields if k.lower() != name]

    def encode(self) -> bytes:
        lines = [self.start, *(f"{k}: {v}" for k, v in self.fields), "", ""]
        return "\r\n".join(lines).encode("latin-1")


async def _read_head(reader: asyncio.StreamReader) -> _Head | None:
    """The next message head, or None if the peer closed the connection cleanly before it."""
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as error:
        if error.partial.strip():
            raise
        return None
    return _Head(raw.lstrip(b"\r\n"))  # a stray CRLF before a request line is allowed


async def _read_body(reader: asyncio.StreamReader, head: _Head, until_eof: bool) -> bytes:
    """The body framed by Content-Length or chunked (verbatim, trailer included), else EOF."""
    if "chunked" in head.get("transfer-encoding").lower():
        parts = []
        while True:
            line = await reader.readuntil(b"\r\n")
            parts.append(line)
            size = int(line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                break
            parts.append(await reader.readexactly(size + 2))  # the data and its CRLF
        while parts[-1] != b"\r\n":  # trailer fields, up to an empty line
            parts.append(await reader.readuntil(b"\r\n"))
        return b"".join(parts)
    if length := head.get("content-length"):
        return await reader.readexactly(int(length.split(",")[0]))
    return await reader.read() if until_eof else b""


def _wants_close(head: _Head) -> bool:
    connection = head.get("connection").lower()
    return "close" in connection or ("HTTP/1.0" in head.start and "keep-alive" not in connection)


class _Upstream:
    """One keep-alive connection to the upstream server, opened when first needed."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def exchange(self, request: _Head, body: bytes, method: str) -> tuple[_Head, bytes, bool]:
        """Send a request; return the response head, its body and whether the body was delimited
        by the upstream closing the connection (so the client's must be closed too)."""
        while True:
            fresh = self.writer is None
            if fresh:
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=2**20)
            try:
                self.writer.write(request.encode() + body)
                await self.writer.drain()
                response = await _read_head(self.reader)
                if response is None:
                    raise ConnectionResetError("upstream closed the connection without answering")
            except _DISCONNECTS:
                self.close()
                if fresh:
                    raise
                continue  # the server closed an idle kept-alive connection: retry on a new one
            break
        # Interim 1xx responses are dropped: Expect is never forwarded, so none is awaited.
        while (status := int(response.start.split(" ")[1])) < 200:
            response = await _read_head(self.reader)
            if response is None:
                raise ConnectionResetError("upstream closed the connection after a 1xx response")
        delimited = False  # by the upstream closing the connection
        if method == "HEAD" or status in (204, 304):
            response_body = b""
        else:
            chunked = "chunked" in response.get("transfer-encoding").lower()
            delimited = not chunked and not response.get("content-length")
            response_body = await _read_body(self.reader, response, until_eof=True)
        if delimited or _wants_close(response):
            self.close()  # a new connection for the next request (moto closes after every one)
        return response, response_body, delimited

    def close(self) -> None:
        if self.writer is not None:
            self.writer.transport.abort()
        self.reader = self.writer = None


class FaultProxy:
    """The proxy; start it with :func:`fault_proxy` (or :meth:`start` and :meth:`stop`)."""

    def __init__(self, upstream_url: str, rules: FaultRules, seed: int = 0) -> None:
        parts = urlsplit(upstream_url)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.rules = rules
        self.stats = ProxyStats()
        self.url = ""
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._clients: dict[asyncio.Task, asyncio.StreamWriter] = {}  # open client connections
        self._closing = False

    def set_rules(self, rules: FaultRules) -> None:
        """Apply ``rules`` to every request from now on (also on open connections)."""
        self.rules = rules

    def decide(self, method: str, path: str) -> str | None:
        """The fault for a request: "refuse", "reset", "stall" or None (forward as is).

        Every request that may get a fault draws one number from the seeded generator, so the
        same seed and the same sequence of requests give the same sequence of decisions.
        """
        rules = self.rules
        if rules.outage:
            return "refuse"
        if rules.fault_path_contains not in path:
            return None
        with self._lock:
            draw = self._rng.random()
        for fault, probability in (("refuse", rules.refuse), ("reset", rules.reset), ("stall", rules.stall)):
            if draw < probability:
                return fault
            draw -= probability
        return None

    def _delays(self, rules: FaultRules, method: str, path: str) -> bool:
        return (
            rules.delay_seconds > 0
            and (not rules.delay_methods or method in rules.delay_methods)
            and rules.delay_path_contains in path
        )

    def _accept(self, client_reader: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        """Serve a new connection in a task of our own, registered before it first runs."""
        if self._closing:
            client.transport.abort()
            return
        task = asyncio.get_running_loop().create_task(self._serve(client_reader, client))
        self._clients[task] = client
        task.add_done_callback(lambda done: self._clients.pop(done, None))

    async def _serve(self, client_reader: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        upstream = _Upstream(*self._upstream)
        try:
            while (request := await _read_head(client_reader)) is not None:
                method, path = request.start.split(" ")[:2]
                # Expect: 100-continue is answered here, at once, and stripped before forwarding:
                # the client sends its body without waiting on the upstream, and a refused request
                # is refused after its body was read, so the connection stays in sync.
                if "100-continue" in request.get("expect").lower():
                    request.drop("expect")
                    client.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = await _read_body(client_reader, request, until_eof=False)
                rules = self.rules
                fault = self.decide(method, path)
                if self._delays(rules, method, path):
                    self.stats.record("delayed", method)
                    await asyncio.sleep(rules.delay_seconds)
                if fault == "refuse":
                    self.stats.record("refused", method)
                    close = _wants_close(request)
                    head = (
                        "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                        f"Content-Length: {len(_SLOW_DOWN_BODY)}\r\n"
                        f"Connection: {'close' if close else 'keep-alive'}\r\n\r\n"
                    ).encode()
                    client.write(head if method == "HEAD" else head + _SLOW_DOWN_BODY)
                    await client.drain()
                    if close:
                        return
                    continue
                if fault == "stall":
                    self.stats.record("stalled", method)
                    await asyncio.sleep(rules.stall_seconds)
                response, response_body, delimited = await upstream.exchange(request, body, method)
                self.stats.record("forwarded", method)
                if fault == "reset":
                    self.stats.record("reset", method)
                    client.transport.abort()  # the server acted, but its answer is lost
                    return
                # Connection is hop-by-hop: the client's connection stays open unless it asked
                # otherwise or the body's end is marked by closing it.
                close = delimited or _wants_close(request)
                response.drop("connection")
                if close:
                    response.fields.append(("Connection", "close"))
                response_head = response.encode()
                self.stats.record_bytes(method, request.raw_size, len(body), len(response_head), len(response_body))
                client.write(response_head + response_body)
                await client.drain()
                if close:
                    return
        except _DISCONNECTS:
            pass  # the client or the upstream went away
        except Exception:
            logger.exception("fault proxy: unexpected error while serving a connection")
        finally:
            upstream.close()
            client.close()  # a no-op after abort()

    def start(self) -> None:
        """Listen on a free loopback port, serving from a background thread; sets ``url``."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._thread.start()

        async def listen() -> asyncio.AbstractServer:
            return await asyncio.start_server(self._accept, "127.0.0.1", 0, limit=2**20)

        self._server = asyncio.run_coroutine_threadsafe(listen(), self._loop).result(timeout=10)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        """Stop listening, close every connection and end the background thread."""
        assert self._loop is not None and self._thread is not None and self._server is not None

        async def shutdown() -> None:
            # Stop accepting first, and let connections being accepted reach _accept (which
            # refuses them): asyncio 3.11 leaks one whose acceptance ends after Server.close().
            self._closing = True
            for sock in self._server.sockets:
                asyncio.get_running_loop().remove_reader(sock.fileno())
            await asyncio.sleep(0)  # accept callbacks already queued run now
            for task, client in list(self._clients.items()):
                client.transport.abort()
                task.cancel()
            while others := asyncio.all_tasks() - {asyncio.current_task()}:
                await asyncio.wait(others)
            self._server.close()

        with suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


@contextmanager
def fault_proxy(upstream_url: str, rules: FaultRules, seed: int = 0) -> Iterator[FaultProxy]:
    """Run a :class:`FaultProxy` in front of ``upstream_url`` until the context exits."""
    proxy = FaultProxy(upstream_url, rules, seed)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()
