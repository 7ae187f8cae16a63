"""A learner's sends: numbered, encoded from its fragments' bookkeeping, queued in its outbox.

Every send has a sequence number ``epoch * SEQUENCE_PER_EPOCH + n``: the epoch counts the
learner's starts (:func:`resume_epoch`), so a restarted learner never repeats a sequence
number, and the syncer's exactly-once ledger can tell every send apart.  A payload holds
``delta = base - theta + e`` of one fragment (docs/algorithm.md, "A learner", step 2);
its marker repeats what the syncer decides on without reading the payload.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import torch

from diloco_cli.codec import CodecSpec, PayloadError, RunSecret
from diloco_cli.core.types import FragmentIndex, LearnerId
from diloco_cli.runtime.learner.fragments import LearnerFragments
from diloco_cli.runtime.learner.outbox import Outbox, OutgoingPayload
from diloco_cli.store.documents import Heartbeat
from diloco_cli.store.region import PAYLOAD_KEY, SEQUENCE_PER_EPOCH, RegionBucket, heartbeat_key

log = logging.getLogger("diloco.learner")


def resume_epoch(
    bucket: RegionBucket, learner: LearnerId, refused: Callable[[str, str, str], None]
) -> tuple[int, Heartbeat | None]:
    """Count this start, above every epoch this learner may have used before (its epoch
    record, its last heartbeat, the payloads it left), and record it.  Returns the epoch
    and the last heartbeat (whose counts this start continues); what was refused is
    reported through ``refused`` and skipped."""
    seen = [0]
    try:
        seen.append(bucket.read_epoch(learner))
    except PayloadError as error:
        refused("epoch", f"control/{learner}.epoch", str(error))
    try:
        previous = bucket.read_heartbeat(learner)
    except PayloadError as error:
        refused("heartbeat", heartbeat_key(learner), str(error))
        previous = None
    if previous is not None:
        seen.append(previous.epoch)
    keys = [k for k in bucket.store.list_marked(f"payloads/{learner}") if PAYLOAD_KEY.match(k)]
    keys.sort(key=lambda k: int(PAYLOAD_KEY.match(k)["sequence"]), reverse=True)
    for key in keys:  # the newest payload whose marker verifies (junk and forgeries skipped)
        try:
            seen.append(bucket.payload_record(key).sequence // SEQUENCE_PER_EPOCH)
            break
        except PayloadError as error:
            refused("marker", key, str(error))
        except FileNotFoundError:
            continue
    epoch = max(seen) + 1
    bucket.write_epoch(learner, epoch)
    return epoch, previous


class Sends:
    """The storage rank's sends of one learner, and the outbox that delivers them."""

    def __init__(
        self,
        bucket: RegionBucket,
        learner: LearnerId,
        epoch: int,
        fragments: LearnerFragments,
        codec: CodecSpec,
        secret: RunSecret,
    ) -> None:
        self.learner, self.epoch = learner, epoch
        self.fragments, self.codec, self.secret = fragments, codec, secret
        self.made = 0
        """Sends made since this start."""
        self.outbox = Outbox(bucket, learner)

    def send(self, fragment: FragmentIndex, theta: Mapping[str, torch.Tensor], step: int, loss: float | None) -> None:
        """Encode the fragment's delta from ``theta`` (its full values now) and queue it."""
        self.made += 1
        sequence = self.epoch * SEQUENCE_PER_EPOCH + self.made
        f = self.fragments
        meta = {"learner": self.learner, "step": step, "loss": loss, "sent_at": time.time()}
        base_version, c_steps, c_tokens = f.base_version[fragment], f.c_steps[fragment], f.c_tokens[fragment]
        payload = f.encode_delta(fragment, theta, self.codec, self.secret, meta)
        marker = {
            "step": step,
            "loss": loss,
            "sent_at": meta["sent_at"],
            "base_version": base_version,
            "c_steps": c_steps,
            "c_tokens": c_tokens,
        }
        self.outbox.put(OutgoingPayload(fragment, sequence, base_version, f.install_serial[fragment], payload, marker))

    def close(self) -> None:
        self.outbox.close()
