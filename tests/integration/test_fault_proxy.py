"""The fault proxy (testbed/fault_proxy.py) is transparent, delays, injects faults s3fs sees, and is
reproducible: real s3fs clients against a real moto S3 server through it."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterator

import pytest
import s3fs
from botocore.exceptions import ConnectionClosedError

from testbed.fault_proxy import FaultRules, fault_proxy
from testbed.servers import ObjectStore, moto_s3_server

# botocore's own retries, minimized. Note "max_attempts" counts *retries* (1 would mean two
# attempts); "total_max_attempts" counts attempts.
_ONE_ATTEMPT = {"retries": {"total_max_attempts": 1, "mode": "standard"}}


@pytest.fixture(scope="module")
def s3() -> Iterator[ObjectStore]:
    with moto_s3_server() as running:
        yield running


@pytest.fixture(autouse=True)
def region(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def filesystem(url: str, minimal_retries: bool = False) -> s3fs.S3FileSystem:
    """An s3fs client of ``url``; with ``minimal_retries``, each call is one attempt of botocore
    and of s3fs (aiohttp still resends an idempotent request once on a dropped connection)."""
    fs = s3fs.S3FileSystem(
        endpoint_url=url,
        key="testing",
        secret="testing",
        skip_instance_cache=True,
        use_listings_cache=False,
        config_kwargs=_ONE_ATTEMPT if minimal_retries else None,
    )
    if minimal_retries:
        # Not a constructor argument: S3FileSystem(retries=1) would hand it on to AioSession.
        fs.retries = 1
    return fs


def new_bucket(fs: s3fs.S3FileSystem) -> str:
    name = f"proxy-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    return name


def timed(call) -> float:
    start = time.monotonic()
    call()
    return time.monotonic() - start


def test_transparent_without_faults(s3: ObjectStore) -> None:
    with fault_proxy(s3.endpoint_url, FaultRules()) as proxy:
        fs = filesystem(proxy.url)
        bucket = new_bucket(fs)
        payloads = {f"{bucket}/dir/{n}": os.urandom(n) for n in (0, 10, 5 * 2**20)}
        for path, data in payloads.items():
            fs.pipe_file(path, data)
        for path, data in payloads.items():
            assert fs.cat_file(path) == data
        assert sorted(fs.find(bucket)) == sorted(payloads)
        fs.rm_file(f"{bucket}/dir/10")
        assert not fs.exists(f"{bucket}/dir/10")
        assert fs.exists(f"{bucket}/dir/0")
        stats = proxy.stats.snapshot()
    assert stats["forwarded"]["PUT"] == 4  # the bucket and three objects
    assert stats["forwarded"]["GET"] >= 4  # three reads and a listing
    assert stats["forwarded"]["DELETE"] == 1
    assert not any(stats[kind] for kind in ("refused", "reset", "stalled", "delayed"))
    assert s3.filesystem().cat_file(f"{bucket}/dir/{5 * 2**20}") == payloads[f"{bucket}/dir/{5 * 2**20}"]


# moto checks no signature, but answers 403 to a request without credentials.
_AUTH = "AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=0"


def _request(method: str, path: str, extra: str = "", body: bytes = b"") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: {_AUTH}\r\n{extra}\r\n".encode() + body


def _read_response(stream, head: bool = False) -> tuple[int, dict[str, str], bytes]:
    status = int(stream.readline().split()[1])
    headers = {}
    while (line := stream.readline()) != b"\r\n":
        name, value = line.decode().split(":", 1)
        headers[name.lower()] = value.strip()
    return status, headers, b"" if head else stream.read(int(headers.get("content-length", 0)))


def test_keep_alive_expect_continue_chunked_and_head_on_one_connection(s3: ObjectStore) -> None:
    bucket = s3.create_bucket(f"raw-{uuid.uuid4().hex[:12]}").removeprefix("s3://")
    with fault_proxy(s3.endpoint_url, FaultRules()) as proxy:
        port = int(proxy.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            stream = sock.makefile("rb")
            # Expect: 100-continue is answered by the proxy before the body is sent.
            sock.sendall(_request("PUT", f"/{bucket}/e", "Content-Length: 5\r\nExpect: 100-continue\r\n"))
            assert stream.readline() == b"HTTP/1.1 100 Continue\r\n" and stream.readline() == b"\r\n"
            sock.sendall(b"hello")
            status, headers, _ = _read_response(stream)
            assert status == 200 and "connection" not in headers  # moto's "close" is not passed on
            # Keep-alive: more requests on the same connection, HEADs (no body) among them.
            sock.sendall(_request("HEAD", f"/{bucket}/e"))
            status, headers, _ = _read_response(stream, head=True)
            assert status == 200 and headers["content-length"] == "5"
            proxy.set_rules(FaultRules(outage=True))
            sock.sendall(_request("HEAD", f"/{bucket}/e"))
            status, headers, _ = _read_response(stream, head=True)
            assert status == 503 and headers["content-type"] == "application/xml"
            sock.sendall(_request("GET", f"/{bucket}/e"))
            status, headers, body = _read_response(stream)
            assert status == 503 and b"<Code>SlowDown</Code>" in body
            proxy.set_rules(FaultRules())
            sock.sendall(_request("GET", f"/{bucket}/e"))
            assert _read_response(stream)[::2] == (200, b"hello")
            # A chunked body (moto takes neither chunk extensions nor trailers: see below).
            chunks = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
            sock.sendall(_request("PUT", f"/{bucket}/c", "Transfer-Encoding: chunked\r\n", chunks))
            assert _read_response(stream)[0] == 200
            sock.sendall(_request("GET", f"/{bucket}/c"))
            assert _read_response(stream)[::2] == (200, b"hello world")
            assert proxy.stats.snapshot()["forwarded"] == {"PUT": 2, "HEAD": 1, "GET": 2}
            # Stopping the proxy closes every connection.
            open_connection = socket.create_connection(("127.0.0.1", port), timeout=10)
    with open_connection:
        try:
            assert open_connection.recv(1) == b""
        except ConnectionResetError:
            pass


def test_delay_and_stall(s3: ObjectStore) -> None:
    with fault_proxy(s3.endpoint_url, FaultRules(delay_seconds=0.5, delay_methods=frozenset({"GET"}))) as proxy:
        fs = filesystem(proxy.url)
        bucket = new_bucket(fs)
        put_seconds = min(timed(lambda: fs.pipe_file(f"{bucket}/a", b"x" * 100)) for _ in range(3))
        delayed = proxy.stats.snapshot()["delayed"]
        assert "PUT" not in delayed
        get_seconds = timed(lambda: fs.cat_file(f"{bucket}/a"))
        assert get_seconds >= 0.5
        assert put_seconds < 0.4  # not delayed (a PUT takes a few ms)
        # cat_file asks for the size (HEAD, not delayed), then reads (GET, delayed).
        assert proxy.stats.snapshot()["delayed"] == {"GET": delayed.get("GET", 0) + 1}

        proxy.set_rules(FaultRules(delay_seconds=0.3, delay_path_contains="/slow/"))
        fs.pipe_file(f"{bucket}/fast/a", b"x")
        assert "PUT" not in proxy.stats.snapshot()["delayed"]
        assert timed(lambda: fs.pipe_file(f"{bucket}/slow/a", b"x")) >= 0.3
        assert proxy.stats.snapshot()["delayed"]["PUT"] == 1

        proxy.set_rules(FaultRules(stall=1.0, stall_seconds=0.3, fault_path_contains="/stalled"))
        assert timed(lambda: fs.pipe_file(f"{bucket}/stalled", b"x")) >= 0.3
        fs.pipe_file(f"{bucket}/other", b"x")
        assert proxy.stats.snapshot()["stalled"] == {"PUT": 1}
        assert fs.cat_file(f"{bucket}/stalled") == b"x"


def test_outage_is_seen_by_s3fs_and_ends(s3: ObjectStore) -> None:
    with fault_proxy(s3.endpoint_url, FaultRules()) as proxy:
        fs = filesystem(proxy.url, minimal_retries=True)
        bucket = new_bucket(fs)
        fs.pipe_file(f"{bucket}/a", b"data")
        proxy.set_rules(FaultRules(outage=True))
        # s3fs turns the 503 into a plain OSError(errno.EBUSY, ...) with the
        # botocore.exceptions.ClientError as its __cause__ (for a GET/PUT the message is "Please
        # reduce your request rate.", for a HEAD, which has no body, "Service Unavailable").
        # With default retries the same error comes, later: botocore (legacy mode) tries 5
        # times, and s3fs 5 times that where the error says SlowDown (25 requests, ~30 s for a
        # GET or PUT; a HEAD, as in exists() or cat_file's size, 5 requests, 2-8 s).
        with pytest.raises(OSError) as raised:
            fs.cat_file(f"{bucket}/a")
        assert "ClientError" in type(raised.value.__cause__).__name__
        assert proxy.stats.snapshot()["refused"] == {"HEAD": 1}  # cat_file asks for the size first
        proxy.set_rules(FaultRules())
        assert fs.cat_file(f"{bucket}/a") == b"data"


def test_reset_loses_the_answer_but_not_the_write(s3: ObjectStore) -> None:
    with fault_proxy(s3.endpoint_url, FaultRules()) as proxy:
        fs = filesystem(proxy.url, minimal_retries=True)
        bucket = new_bucket(fs)
        proxy.set_rules(FaultRules(reset=1.0))
        # A reset connection raises botocore.exceptions.ConnectionClosedError (a botocore
        # HTTPClientError, not an OSError; s3fs does not translate it), caused by aiohttp's
        # ServerDisconnectedError; exists() raises it too. aiohttp itself resends an idempotent
        # request (GET, HEAD, PUT, DELETE) once on a dropped connection, so one attempt is two
        # requests here. With default retries a PUT or HEAD is tried 50 times (s3fs 5 x botocore
        # 5 x aiohttp 2, ~45 s), and cat_file's GET 250 times (its read is wrapped in a second
        # s3fs retry loop, ~210 s) before the error comes.
        with pytest.raises(ConnectionClosedError):
            fs.pipe_file(f"{bucket}/lost-answer", b"written")
        assert proxy.stats.snapshot()["reset"] == {"PUT": 2}
    assert s3.filesystem().cat_file(f"{bucket}/lost-answer") == b"written"


def test_same_seed_same_faults_through_s3fs(s3: ObjectStore) -> None:
    def run(seed: int) -> tuple[list[bool], dict]:
        with fault_proxy(s3.endpoint_url, FaultRules(), seed=seed) as proxy:
            fs = filesystem(proxy.url, minimal_retries=True)
            bucket = new_bucket(fs)
            proxy.set_rules(FaultRules(refuse=0.5))
            failed = []
            for i in range(12):
                try:
                    fs.pipe_file(f"{bucket}/{i}", b"x")
                    failed.append(False)
                except OSError:
                    failed.append(True)
            return failed, proxy.stats.snapshot()

    first = run(seed=5)
    assert run(seed=5) == first
    assert any(first[0]) and not all(first[0])
