"""A learner's uploads: payloads delivered in order (the outbox), and uploads of which
only the newest matters (:class:`LatestUpload`: checkpoints, heartbeats).

One thread uploads the payloads strictly in the order they were made, and keeps trying
the oldest (each try under the store's retry policy, then a pause) before anything newer:
so the syncer sees a learner's sends in sequence order, which its exactly-once ledger
relies on, and a payload whose upload keeps failing is never dropped.  The only payloads
that leave the outbox unsent are superseded ones: a newer payload of the same fragment
made from the same install of it holds everything the older one held (a delta is all
the learner did since its base), so the older one need not travel.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.region import RegionBucket

log = logging.getLogger("diloco.learner")

RETRY_PAUSE_SECONDS = 5.0
"""Pause after a payload's upload used up the retry policy, before it is tried again."""


@dataclass(frozen=True)
class OutgoingPayload:
    fragment: FragmentIndex
    sequence: int
    base_version: Version
    install_serial: int
    """How many times the learner had installed this fragment when it made the payload."""
    payload: bytes
    meta: dict[str, Any]


class _UploadThread:
    """A thread that uploads what its owner hands it, and stops when closed."""

    def __init__(self, name: str, retry_pause: float) -> None:
        self.retry_pause = retry_pause
        self._changed = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def close(self) -> None:
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join(timeout=5)

    def _pause(self) -> None:
        """After a failed upload (with the lock held): wait, unless closing."""
        self._changed.wait_for(lambda: self._closing, self.retry_pause)

    def _run(self) -> None:
        raise NotImplementedError


class Outbox(_UploadThread):
    """Payloads waiting for the bucket, and the thread that uploads them."""

    def __init__(self, bucket: RegionBucket, learner: LearnerId, retry_pause: float = RETRY_PAUSE_SECONDS) -> None:
        super().__init__("outbox", retry_pause)
        self.bucket = bucket
        self.learner = learner
        self.delivered = 0
        self.superseded = 0
        self.failed_tries = 0
        self._queue: deque[OutgoingPayload] = deque()
        self._in_flight: OutgoingPayload | None = None
        self._thread.start()

    def put(self, item: OutgoingPayload) -> None:
        """Queue a payload, dropping waiting ones it supersedes."""
        with self._changed:
            kept = [old for old in self._queue if not _supersedes(item, old)]
            self.superseded += len(self._queue) - len(kept)
            self._queue = deque([*kept, item])
            self._changed.notify_all()

    @property
    def waiting(self) -> int:
        """Payloads not delivered yet (the one in flight included)."""
        with self._changed:
            return len(self._queue) + (self._in_flight is not None)

    def wait_empty(self, timeout: float) -> bool:
        """Wait until every payload is delivered; False if ``timeout`` passed first."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._queue and self._in_flight is None, timeout)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._queue or self._closing)
                if self._closing:
                    return
                item = self._in_flight = self._queue.popleft()
            try:
                self.bucket.send_payload(self.learner, item.fragment, item.sequence, item.payload, item.meta)
            except StorageError as error:
                with self._changed:
                    self._in_flight = None
                    self.failed_tries += 1
                    if any(_supersedes(newer, item) for newer in self._queue):
                        self.superseded += 1
                    else:
                        self._queue.appendleft(item)  # still the oldest: it goes first
                    log.warning(
                        "payload #%d of fragment %d not delivered (%s); trying again in %.0f s",
                        item.sequence,
                        item.fragment,
                        error,
                        self.retry_pause,
                    )
                    self._pause()
                continue
            with self._changed:
                self._in_flight = None
                self.delivered += 1
                self._changed.notify_all()


def _supersedes(newer: OutgoingPayload, older: OutgoingPayload) -> bool:
    return newer.fragment == older.fragment and newer.install_serial == older.install_serial


class LatestUpload(_UploadThread):
    """An upload of which only the newest matters (a checkpoint, a heartbeat): one in
    flight at most, a newer one waiting replaces the one waiting before it (slow storage
    never builds a queue of stale uploads), and a failed one is tried again after a pause
    unless a newer one has come."""

    def __init__(self, name: str, retry_pause: float = RETRY_PAUSE_SECONDS) -> None:
        super().__init__(name, retry_pause)
        self.name = name
        self.failures = 0
        self._waiting: tuple | None = None
        self._busy = False
        self._thread.start()

    def submit(self, call, *arguments) -> None:
        with self._changed:
            self._waiting = (call, arguments)
            self._changed.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until the newest upload is written; False if ``timeout`` passed first."""
        with self._changed:
            return self._changed.wait_for(lambda: self._waiting is None and not self._busy, timeout)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._waiting is not None or self._closing)
                if self._closing:
                    return
                upload, self._waiting, self._busy = self._waiting, None, True
            call, arguments = upload
            try:
                call(*arguments)
                failed = False
            except StorageError as error:
                failed = True
                log.warning("%s upload failed (%s); trying again in %.0f s", self.name, error, self.retry_pause)
            with self._changed:
                self._busy = False
                if failed:
                    self.failures += 1
                    if self._waiting is None:
                        self._waiting = upload
                    self._pause()
                self._changed.notify_all()
