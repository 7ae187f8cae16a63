"""A learner's outbox delivers in order, retries the oldest first, drops only what a newer
send of the same install holds."""

import threading
import time

from diloco_cli.runtime.learner.outbox import Outbox, OutgoingPayload
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.region import PAYLOAD_KEY, RegionBucket


class FailingBucket(RegionBucket):
    """A real file:// bucket whose uploads fail while ``failing`` is set."""

    def __init__(self, root, secret):
        super().__init__("east", root, None, secret)
        self.failing = threading.Event()
        self.tries = []

    def send_payload(self, learner, fragment, sequence, payload, meta):
        self.tries.append(sequence)
        if self.failing.is_set():
            raise StorageError(f"writing payload {sequence} failed after 6 tries: outage")
        return super().send_payload(learner, fragment, sequence, payload, meta)


def item(fragment, sequence, install_serial=0):
    meta = {"base_version": install_serial, "c_steps": 1, "c_tokens": 10}
    return OutgoingPayload(fragment, sequence, install_serial, install_serial, b"payload %d" % sequence, meta)


def delivered(bucket):
    return [int(PAYLOAD_KEY.match(key)["sequence"]) for key in bucket.payload_keys()]


def test_payloads_wait_out_an_outage_and_arrive_in_order(tmp_path, secret):
    bucket = FailingBucket(f"file://{tmp_path}/east", secret)
    bucket.failing.set()
    outbox = Outbox(bucket, "east-0", retry_pause=0.05)
    try:
        outbox.put(item(0, 1, install_serial=0))
        outbox.put(item(1, 2, install_serial=0))
        outbox.put(item(0, 3, install_serial=1))  # made after an install: holds other work than #1
        outbox.put(item(1, 4, install_serial=0))  # same install as #2: holds all of #2
        assert not outbox.wait_empty(0.5) and outbox.waiting >= 3
        assert outbox.failed_tries >= 2 and set(bucket.tries) == {1}  # the oldest is retried, nothing overtakes it
        bucket.failing.clear()
        assert outbox.wait_empty(5)
        assert sorted(delivered(bucket)) == [1, 3, 4] and outbox.superseded == 1
        sequences = [s for s in bucket.tries if s != 1]
        assert sequences == sorted(sequences)  # uploaded strictly in the order made
    finally:
        outbox.close()


def test_a_failed_payload_superseded_meanwhile_is_dropped_not_sent(tmp_path, secret):
    bucket = FailingBucket(f"file://{tmp_path}/east", secret)
    bucket.failing.set()
    outbox = Outbox(bucket, "east-0", retry_pause=0.2)
    try:
        outbox.put(item(0, 1))
        while not bucket.tries:
            time.sleep(0.01)
        outbox.put(item(0, 2))  # queued while #1 is being tried
        bucket.failing.clear()
        assert outbox.wait_empty(5)
        assert delivered(bucket) == [2] and outbox.superseded == 1 and outbox.delivered == 1
    finally:
        outbox.close()
