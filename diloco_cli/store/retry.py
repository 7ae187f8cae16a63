"""One retry policy for every storage call, and the counters that make it visible.

Across regions a request fails now and then: a 503 "slow down", a connection reset, a
timeout.  Every call an :class:`~diloco_cli.store.objects.ObjectStore` makes goes through
:func:`call_with_retries`: transient failures are retried with exponential backoff and
full jitter (tenacity's ``wait_random_exponential``, so many learners that failed at
once do not retry in lockstep), up to ``attempts`` tries; what still fails raises
:class:`~diloco_cli.store.filesystem.StorageError` naming the object.  Answers that are
not failures of the link (the object does not exist, access is denied) are never
retried.  The backends (s3fs, gcsfs) retry a few errors themselves first; this policy is
the one that bounds how long any call may keep trying.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from diloco_cli.config.recipe import RetryPolicy
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.metering import StorageMeter

if TYPE_CHECKING:
    from tenacity import RetryCallState

log = logging.getLogger("diloco.storage")

Result = TypeVar("Result")

ANSWERS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
"""Errors that are the storage's answer, not a failure of the link: never retried."""

BUGS = (TypeError, AttributeError, NameError, NotImplementedError, AssertionError, ImportError, KeyError)
"""Errors of the program, not of the storage: never retried."""


def is_transient(error: BaseException) -> bool:
    """Whether a failed call may succeed if tried again."""
    if isinstance(error, (StorageError, *ANSWERS, *BUGS)):
        return False
    return isinstance(error, Exception)


def call_with_retries(
    call: Callable[[], Result],
    policy: RetryPolicy,
    meter: StorageMeter,
    what: str,
    kind: str = "other",
    op: str = "read",
    overhead: Callable[[bool], tuple[int, int]] | None = None,
) -> Result:
    """Run ``call`` under ``policy``; ``what`` names the operation and object in messages,
    ``kind`` and ``op`` how each try is counted in ``meter`` (a request and its seconds),
    ``overhead(missing)`` the (up, down) bytes each try carries besides objects (``missing``:
    answered that the object does not exist).

    Raises the call's own error for answers (``FileNotFoundError``...), and
    :class:`StorageError` once a transient failure has used up every attempt."""
    # here, not at the top: what imports the store without calling it (`diloco plan`) skips it
    from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

    def counted() -> Result:
        start = time.perf_counter()
        missing = False
        try:
            return call()
        except FileNotFoundError:
            missing = True
            raise
        finally:
            wire = overhead(missing) if overhead is not None else (0, 0)
            meter.count(kind, requests=1, op=op, seconds=time.perf_counter() - start, overhead=wire)

    def before_sleep(state: RetryCallState) -> None:
        meter.retried()
        error = state.outcome.exception() if state.outcome else None
        wait = state.next_action.sleep if state.next_action else 0.0
        log.warning(
            "%s failed (%s: %s); try %d of %d in %.1f s",
            what,
            type(error).__name__,
            error,
            state.attempt_number + 1,
            policy.attempts,
            wait,
        )

    retrying = Retrying(
        stop=stop_after_attempt(policy.attempts),
        wait=wait_random_exponential(multiplier=policy.first_backoff_seconds, max=policy.max_backoff_seconds),
        retry=retry_if_exception(is_transient),
        before_sleep=before_sleep,
        reraise=True,
    )
    try:
        return retrying(counted)
    except PermissionError as error:
        meter.failed(error)
        raise StorageError(
            f"{what}: access denied ({error}); check the credentials in the environment and the bucket's permissions"
        ) from error
    except Exception as error:
        if not is_transient(error):
            raise
        meter.failed(error)
        raise StorageError(f"{what} failed after {policy.attempts} tries: {type(error).__name__}: {error}") from error
