"""The retry policy (its logic; the fault-proxy tests show it against a real S3 server)."""

import time

import pytest

from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.metering import StorageMeter
from diloco_cli.store.objects import ObjectStore
from diloco_cli.store.retry import RetryPolicy, call_with_retries, is_transient

FAST = RetryPolicy(attempts=4, first_backoff_seconds=0.001, max_backoff_seconds=0.01)


def failing(times, error):
    calls = []

    def call():
        calls.append(1)
        if len(calls) <= times:
            raise error
        return "done"

    return call, calls


def test_transient_failures_are_retried_and_counted():
    meter = StorageMeter()
    call, calls = failing(2, ConnectionResetError("reset by peer"))
    assert call_with_retries(call, FAST, meter, "reading b/k") == "done"
    counters = meter.snapshot()
    assert len(calls) == 3 and counters.requests == 3 and counters.retries == 2 and counters.failures == 0


def test_a_call_that_keeps_failing_ends_as_a_storage_error_naming_the_object():
    meter = StorageMeter()
    call, calls = failing(99, TimeoutError("timed out"))
    with pytest.raises(StorageError, match="reading s3://bucket/run/key failed after 4 tries: TimeoutError"):
        call_with_retries(call, FAST, meter, "reading s3://bucket/run/key")
    counters = meter.snapshot()
    assert (
        len(calls) == 4 and counters.retries == 3 and counters.failures == 1 and "TimeoutError" in counters.last_error
    )


def test_answers_are_not_retried():
    meter = StorageMeter()
    call, calls = failing(99, FileNotFoundError("no such key"))
    with pytest.raises(FileNotFoundError):
        call_with_retries(call, FAST, meter, "reading b/k")
    assert len(calls) == 1 and meter.snapshot().retries == 0
    call, calls = failing(99, PermissionError("403 Forbidden"))
    with pytest.raises(StorageError, match="access denied .* check the credentials"):
        call_with_retries(call, FAST, meter, "writing b/k")
    assert len(calls) == 1


def test_what_counts_as_transient():
    class ClientError(Exception):  # what botocore or aiohttp raise is not always an OSError
        pass

    assert is_transient(ConnectionError()) and is_transient(TimeoutError()) and is_transient(OSError(5, "I/O error"))
    assert is_transient(ClientError("503 SlowDown"))
    for error in (FileNotFoundError(), PermissionError(), StorageError("gave up"), TypeError(), KeyError("x")):
        assert not is_transient(error), error


# ------------------------------------------------- against a real S3 server, faults injected

S3_POLICY = RetryPolicy(attempts=6, first_backoff_seconds=0.05, max_backoff_seconds=0.5)


@pytest.fixture(scope="module")
def s3():
    from tests.support.servers import moto_s3_server

    with moto_s3_server() as running:
        yield running


@pytest.fixture
def flaky(s3, monkeypatch):
    """An ObjectStore of a fresh bucket, reached through the fault proxy."""
    from tests.support.fault_proxy import FaultRules, fault_proxy

    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    bucket = s3.create_bucket(f"retry-{time.monotonic_ns()}")
    with fault_proxy(s3.endpoint_url, FaultRules(), seed=4) as proxy:
        options = {"endpoint_url": proxy.url, "key": "testing", "secret": "testing"}
        yield ObjectStore(f"{bucket}/run", options, S3_POLICY), proxy


def test_an_s3_store_rides_out_refusals_resets_and_stalls(flaky):
    from tests.support.fault_proxy import FaultRules

    store, proxy = flaky
    proxy.set_rules(FaultRules(refuse=0.25, reset=0.1, stall=0.05, stall_seconds=0.5))
    for index in range(15):
        store.put(f"objects/{index}", bytes([index]) * 1000)
        assert store.get(f"objects/{index}") == bytes([index]) * 1000
    assert store.list("objects") == sorted(f"objects/{index}" for index in range(15))
    counters = store.meter.snapshot()
    assert counters.retries > 0 and counters.failures == 0
    assert proxy.stats.total("refused") > 0 and proxy.stats.total("reset") > 0


def test_an_outage_ends_in_one_bounded_storage_error(flaky):
    from tests.support.fault_proxy import FaultRules

    store, proxy = flaky
    proxy.set_rules(FaultRules(outage=True))
    started = time.monotonic()
    with pytest.raises(StorageError, match=r"writing s3://.*/run/key failed after 6 tries"):
        store.put("key", b"data")
    # diloco's policy is the only loop: 6 requests (s3fs and botocore retry nothing)
    assert proxy.stats.total("refused") == 6 and store.meter.snapshot().failures == 1
    assert time.monotonic() - started < 10
