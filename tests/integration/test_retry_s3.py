"""The retry policy against a real S3 server (moto) behind the fault proxy: refusals, resets
and stalls ridden out, an outage ended in one bounded storage error."""

import time

import pytest

from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.objects import ObjectStore
from diloco_cli.store.retry import RetryPolicy

S3_POLICY = RetryPolicy(attempts=6, first_backoff_seconds=0.05, max_backoff_seconds=0.5)


@pytest.fixture(scope="module")
def s3():
    from testbed.servers import moto_s3_server

    with moto_s3_server() as running:
        yield running


@pytest.fixture
def flaky(s3, monkeypatch):
    """An ObjectStore of a fresh bucket, reached through the fault proxy."""
    from testbed.fault_proxy import FaultRules, fault_proxy

    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    bucket = s3.create_bucket(f"retry-{time.monotonic_ns()}")
    with fault_proxy(s3.endpoint_url, FaultRules(), seed=4) as proxy:
        options = {"endpoint_url": proxy.url, "key": "testing", "secret": "testing"}
        yield ObjectStore(f"{bucket}/run", options, S3_POLICY), proxy


def test_an_s3_store_rides_out_refusals_resets_and_stalls(flaky):
    from testbed.fault_proxy import FaultRules

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
    from testbed.fault_proxy import FaultRules

    store, proxy = flaky
    proxy.set_rules(FaultRules(outage=True))
    started = time.monotonic()
    with pytest.raises(StorageError, match=r"writing s3://.*/run/key failed after 6 tries"):
        store.put("key", b"data")
    # diloco's policy is the only loop: 6 requests (s3fs and botocore retry nothing)
    assert proxy.stats.total("refused") == 6 and store.meter.snapshot().failures == 1
    assert time.monotonic() - started < 10


def test_each_storage_call_is_one_request_as_the_server_counts_them(flaky):
    """What the metering counts is what S3 receives: a read is one GET (no HEAD first), a
    missing object one GET answered 404 (no LIST after it), a write one PUT."""
    store, proxy = flaky
    store.put("documents/present.json", b"{}")
    for _ in range(3):
        assert store.get("documents/present.json") == b"{}"
        with pytest.raises(FileNotFoundError):
            store.get("documents/missing.json")
    forwarded = proxy.stats.snapshot()["forwarded"]
    assert forwarded == {"PUT": 1, "GET": 6}
    assert store.meter.snapshot().requests == sum(forwarded.values())
