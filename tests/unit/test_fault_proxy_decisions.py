"""The fault proxy (testbed/fault_proxy.py) without a server: it reads chunked bodies
verbatim and its seeded decisions are reproducible (through s3fs against moto:
tests/integration/test_fault_proxy.py)."""

from __future__ import annotations

import asyncio

from testbed.fault_proxy import FaultProxy, FaultRules, _Head, _read_body


def test_chunked_bodies_are_read_verbatim() -> None:
    chunked = b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\nX-Other: u\r\n\r\n"
    plain = b"0\r\n\r\n"

    async def read(data: bytes) -> tuple[bytes, bytes]:
        reader = asyncio.StreamReader()
        reader.feed_data(data + b"GET /next HTTP/1.1\r\n\r\n")
        reader.feed_eof()
        head = _Head(b"PUT /b/k HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
        return await _read_body(reader, head, until_eof=False), await reader.read()

    assert asyncio.run(read(chunked)) == (chunked, b"GET /next HTTP/1.1\r\n\r\n")
    assert asyncio.run(read(plain)) == (plain, b"GET /next HTTP/1.1\r\n\r\n")


def test_decisions_are_reproducible() -> None:
    rules = FaultRules(refuse=0.2, reset=0.1, stall=0.1)

    def decisions(seed: int) -> list[str | None]:
        proxy = FaultProxy("http://127.0.0.1:9", rules, seed)  # never started
        return [proxy.decide("GET", f"/b/{i}") for i in range(1000)]

    first = decisions(seed=1)
    assert decisions(seed=1) == first
    assert decisions(seed=2) != first
    assert 150 < first.count("refuse") < 250
    assert 50 < first.count("reset") < 150 and 50 < first.count("stall") < 150

    proxy = FaultProxy("http://127.0.0.1:9", FaultRules(refuse=1.0, fault_path_contains="/hot/"))
    assert proxy.decide("PUT", "/b/cold/x") is None and proxy.decide("PUT", "/b/hot/x") == "refuse"
    proxy.set_rules(FaultRules(outage=True))
    assert {proxy.decide(method, "/b/x") for method in ("GET", "PUT", "HEAD")} == {"refuse"}
