"""The retry policy (its logic; tests/integration/test_retry_s3.py shows it against a real S3
server behind the fault proxy)."""

import pytest

from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.metering import StorageMeter
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
