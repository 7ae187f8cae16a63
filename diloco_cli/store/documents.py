"""The small mutable documents of a run's buckets, typed and sealed with the run's key.

Heartbeats, the head, the syncer's status, control notes and learner epochs cross
process (and region) boundaries as JSON.  Each is a pydantic model here, and each is
stored *sealed*::

    {"document": {...}, "tag": "<BLAKE2b of the object's key and the document, keyed
                                with the run's secret>"}

so that a reader holding the secret refuses a document that was damaged, forged, or
copied to another key (another learner's control note, say).  A replayed old document
is authentic; what reads the head refuses one older than a head it has already seen.
A reader without the secret (``diloco status --manifest``) reads documents unverified:
it only displays them.  The head's tag is what makes it safe for learners to act on it;
the heartbeats' tags let the syncer trust a learner's "finished".
"""

from __future__ import annotations

import hashlib
import hmac
import json
from enum import Enum
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from diloco_cli.codec import CorruptPayload, RunSecret
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.store.metering import StorageCounters

RECENT_REFUSALS = 10
"""Refusals a report keeps by name (the newest); counts are kept for all."""


class DamagedDocument(CorruptPayload):
    """A stored document is not the JSON it should be: damaged, or written by something else."""


class ForgedDocument(CorruptPayload):
    """A stored document's tag does not verify: forged, damaged, or moved to another key."""


class Document(BaseModel):
    model_config = ConfigDict(extra="forbid")


DocumentType = TypeVar("DocumentType", bound=Document)


def _tag(key: str, canonical: bytes, secret: RunSecret) -> str:
    digest = hashlib.blake2b(key=secret.key, digest_size=32, person=b"diloco document")
    digest.update(key.encode())
    digest.update(b"\0")
    digest.update(canonical)
    return digest.hexdigest()


def _canonical(document: object) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def seal(document: Document, key: str, secret: RunSecret) -> bytes:
    """The stored form of ``document`` at ``key``."""
    body = document.model_dump(mode="json")
    return json.dumps({"document": body, "tag": _tag(key, _canonical(body), secret)}, sort_keys=True).encode()


def unseal(data: bytes, key: str, model: type[DocumentType], secret: RunSecret | None) -> DocumentType:
    """Read the document stored at ``key``, verified when ``secret`` is given."""
    try:
        envelope = json.loads(data)
        body, tag = envelope["document"], envelope["tag"]
        canonical = _canonical(body)
    except (ValueError, TypeError, KeyError, RecursionError) as error:  # json.loads: RecursionError on deep nesting
        raise DamagedDocument(f"{key} is not a sealed diloco document ({type(error).__name__}: {error})") from None
    # compare_digest raises TypeError on a non-ASCII str: such a tag is simply wrong
    if secret is not None and not (
        isinstance(tag, str) and tag.isascii() and hmac.compare_digest(tag, _tag(key, canonical, secret))
    ):
        raise ForgedDocument(f"{key}: tag mismatch, the document was damaged, forged or moved from another key")
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise DamagedDocument(f"{key} does not hold a valid {model.__name__}: {error.errors()[0]['msg']}") from None


# ----------------------------------------------------------------------- refusals


class RefusalNote(Document):
    """One object refused: what, where, why, when."""

    kind: str
    """payload, update, snapshot, checkpoint, marker, head, control, epoch, heartbeat."""
    key: str
    reason: str
    time: float


class Refusals(Document):
    """Objects a process refused, counted by kind, the newest by name."""

    counts: dict[str, int] = Field(default_factory=dict)
    recent: list[RefusalNote] = Field(default_factory=list)
    """Oldest first, at most RECENT_REFUSALS."""

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def latest(self) -> RefusalNote | None:
        return self.recent[-1] if self.recent else None

    def record(self, kind: str, key: str, reason: str, now: float) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.recent = [*self.recent, RefusalNote(kind=kind, key=key, reason=reason[:300], time=now)][-RECENT_REFUSALS:]

    def plus(self, other: Refusals) -> Refusals:
        counts = dict(self.counts)
        for kind, count in other.counts.items():
            counts[kind] = counts.get(kind, 0) + count
        recent = sorted([*self.recent, *other.recent], key=lambda note: note.time)[-RECENT_REFUSALS:]
        return Refusals(counts=counts, recent=recent)


# ---------------------------------------------------------------------- learners


class LearnerState(str, Enum):
    STARTING = "starting"
    WAITING = "waiting"
    """For the first global weights (no checkpoint to resume from)."""
    TRAINING = "training"
    FINISHED = "finished"
    STOPPED = "stopped"
    """Asked to stop (``diloco down``); not finished."""
    FAILED = "failed"
    """Crashed; its supervisor restarts it unless it gave up."""


class Heartbeat(Document):
    """``heartbeats/<learner>.json``: a learner's report, rewritten every few seconds."""

    learner: LearnerId
    region: str
    host: str
    pid: int
    processes: int = 1
    state: LearnerState
    step: int
    total_steps: int
    tokens: int
    loss: float | None = None
    step_seconds: float | None = None
    compute_seconds: float = 0.0
    """Time spent in inner steps since ``started_at`` (this start): against the time
    since then, the share of wall time the learner computed."""
    base_versions: dict[FragmentIndex, Version] = Field(default_factory=dict)
    sends: int = 0
    """Payloads made."""
    delivered: int = 0
    """Payloads that reached the bucket (the rest wait in the outbox or were superseded)."""
    unsent: int = 0
    """Payloads waiting to be uploaded."""
    installs: int = 0
    install_lag_steps: float | None = None
    """The median, over its latest installs, of the steps the learner trained between a
    send of a fragment and the install that followed it: how stale the global weights it
    trains on are, in its own steps (the lockstep yardsticks' delay, docs/benchmarks.md)."""
    tokens_overwritten: dict[FragmentIndex, int] = Field(default_factory=dict)
    """Per fragment, tokens trained after its last send that an install then overwrote
    (installing overwrites the fragment; Decoupled DiLoCo's learner step 3)."""
    checkpoint_step: int | None = None
    restarts: int = 0
    """Starts of this learner after its first (from its epoch)."""
    epoch: int = 0
    storage: StorageCounters = Field(default_factory=StorageCounters)
    refusals: Refusals = Field(default_factory=Refusals)
    started_at: float
    training_since: float | None = None
    """When this start's first inner step began (after setup and the first install):
    ``compute_seconds`` over the time since is the share of the loop spent computing."""
    time: float

    def as_heard(self, heard: HeartbeatHeard) -> Heartbeat:
        """This heartbeat (a replay) standing where ``heard``, a newer one taken in before,
        stood: its epoch, time, state and step."""
        return self.model_copy(update=heard.model_dump())


class HeartbeatHeard(Document):
    """Where a reader's newest heartbeat of a learner stands (:mod:`diloco_cli.core.heartbeats`)."""

    epoch: int
    time: float
    state: LearnerState
    step: int

    @classmethod
    def of(cls, heartbeats: dict[LearnerId, Heartbeat]) -> dict[LearnerId, HeartbeatHeard]:
        """Where each of these heartbeats stands, for a reader's status."""
        return {
            learner: cls(epoch=beat.epoch, time=beat.time, state=beat.state, step=beat.step)
            for learner, beat in heartbeats.items()
        }


class EpochRecord(Document):
    """``control/<learner>.epoch``: how often the learner has started."""

    epoch: int


class ControlNote(Document):
    """``control/<learner>.json``: the syncer's notes to one learner."""

    resync_serial: int = 0
    """When it grows, the learner reinstalls the newest global weights."""
    fragment: FragmentIndex | None = None
    reason: str = ""
    time: float = 0.0
    drain: bool = False
    """Leave the run (``diloco scale``): send what is trained, deliver it, stop."""
    data_slice: int | None = None
    """The slice of the data to train on now that the run was scaled (None: as at start)."""
    data_slices: int | None = None
    """How many slices the data is cut into now (the active learners)."""
    sync_interval: int | None = None
    """This learner's H under dynamic local updates (None: the recipe's H)."""


class ChaosEvent(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    time: float
    action: str
    """``kill``, ``stop`` or ``continue``."""
    target: str
    outcome: str
    """What happened: ``done``, or why not (the process was not running...)."""


class ChaosLog(Document):
    """``chaos.json``: the faults the chaos driver injected so far (``diloco up --chaos``)."""

    events: list[ChaosEvent] = Field(default_factory=list)
    """The newest :data:`CHAOS_EVENTS_KEPT`; ``count`` counts them all."""
    count: int = 0


CHAOS_EVENTS_KEPT = 50


# ------------------------------------------------------------------------- global


class Head(Document):
    """``global/head.json``: where the global weights stand."""

    version: Version
    fragment_versions: dict[FragmentIndex, Version]
    fragment_digests: dict[FragmentIndex, str] = Field(default_factory=dict)
    """BLAKE2b of each fragment's weights at its version (fp32, in parameter order):
    a learner checks what it installed against it, bit for bit."""
    snapshot_version: Version
    recent: tuple[tuple[Version, FragmentIndex], ...]
    """Every update published after ``recent_from``, oldest first."""
    recent_from: Version
    finished: bool = False
    initial_digests: dict[FragmentIndex, str] = Field(default_factory=dict)
    """Each fragment's digest at version 0 (the recipe's model built from its seed): a
    region or a learner that builds version 0 itself checks it against these, so the
    initial weights never cross the WAN."""
    merged: dict[LearnerId, dict[FragmentIndex, int]] = Field(default_factory=dict)
    """The syncer's ledger: per learner (and per region's reducer) and fragment, the
    newest send merged; every send at or below it is consumed.  Reducers delete what it
    covers and tell merged aggregates from discarded ones with it."""

    def merged_sequence(self, learner: LearnerId, fragment: FragmentIndex) -> int:
        """The newest send of ``learner``'s fragment merged so far (-1: none)."""
        return self.merged.get(learner, {}).get(fragment, -1)

    def updates_after(self, fragment: FragmentIndex, base_version: Version) -> list[Version] | None:
        """The versions of ``fragment`` newer than ``base_version``, or None when some of
        them are no longer listed (the reader must start again from a snapshot)."""
        if base_version < self.recent_from:
            return None
        return [version for version, p in self.recent if p == fragment and version > base_version]


class SyncerPhase(str, Enum):
    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    STOPPED = "stopped"


class Evaluation(Document):
    """The global model's held-out loss at one version."""

    version: Version
    loss: float
    tokens: int
    """Learner tokens trained when it was measured (summed over learners)."""
    time: float


class LastMerge(Document):
    fragment: FragmentIndex
    version: Version
    learners: list[LearnerId]
    seconds: float
    time: float


class ReducerStatus(Document):
    """``reducer/status.json`` in a region's bucket: what its reducer is doing."""

    region: str
    version: Version
    """The newest global version the region's copy of the weights holds."""
    fragment_versions: dict[FragmentIndex, Version] = Field(default_factory=dict)
    aggregates: int = 0
    """Aggregates forwarded since the reducer's first start."""
    sends: int = 0
    """Learner sends those aggregates held."""
    voided: int = 0
    """Aggregates the syncer could no longer merge (anchored before a newer version):
    their sends went out again."""
    in_flight: dict[FragmentIndex, list[LearnerId]] = Field(default_factory=dict)
    """Per fragment, the learners whose sends wait in forwarded aggregates."""
    waiting: dict[FragmentIndex, list[LearnerId]] = Field(default_factory=dict)
    """Per fragment, the learners whose sends wait to be forwarded."""
    snapshot_version: Version = Version(0)
    """The newest snapshot this reducer wrote in the region."""
    initial_weights: str = "unchecked"
    """``match`` (version 0 built here equals the syncer's), ``differ`` (refused), or
    ``unchecked`` (no head yet)."""
    heartbeats_seen: dict[LearnerId, float] = Field(default_factory=dict)
    """The time of each region learner's heartbeat as the reducer last read it: the
    syncer ends the run only once the reducer has seen their last ones."""
    heartbeats: dict[LearnerId, HeartbeatHeard] = Field(default_factory=dict)
    """Where those heartbeats stand: a restarted reducer refuses older ones (replays)."""
    needs_snapshot: bool = False
    """The region's copy cannot catch up from the updates the region holds (it missed
    some that are no longer kept): the syncer gives the region a snapshot."""
    finished: bool = False
    storage: StorageCounters = Field(default_factory=StorageCounters)
    refusals: Refusals = Field(default_factory=Refusals)
    """What the reducer refused (since its first start, as its storage counts)."""
    refused_payloads: list[str] = Field(default_factory=list)
    """Payloads of the region the reducer refused (their marker or their body) and
    removed: the syncer's ledger retires each, as it does those it refuses itself."""
    started_at: float
    time: float


class SyncerStatus(Document):
    """``global/syncer.json``: what ``diloco status`` shows about the syncer."""

    state: SyncerPhase
    run: str
    version: Version
    fragment_versions: dict[FragmentIndex, Version]
    snapshot_version: Version
    merges: int
    merges_per_minute: int
    last_merge: LastMerge | None = None
    quorum: int
    effective_quorum: int
    grace_seconds: float
    live_learners: list[LearnerId]
    pending: dict[FragmentIndex, list[LearnerId]] = Field(default_factory=dict)
    reasons: dict[FragmentIndex, str] = Field(default_factory=dict)
    """Per fragment, why it is not merging now."""
    evaluations: list[Evaluation] = Field(default_factory=list)
    parameters: int = 0
    """Trainable parameters of the model (for bandwidth reports)."""
    place: str = "syncer"
    """The region whose network the syncer is in, or ``syncer``: a place of its own."""
    storage: dict[str, StorageCounters] = Field(default_factory=dict)
    """The syncer's calls to each region's bucket (since its first start)."""
    home_storage: StorageCounters = Field(default_factory=StorageCounters)
    """The syncer's calls to its own store (state, commits, ledger)."""
    refusals: dict[str, Refusals] = Field(default_factory=dict)
    """What the syncer refused in each region's bucket (since its first start)."""
    repairs: int = 0
    """Damaged or missing published objects the syncer rewrote (since its first start)."""
    leftovers_removed: int = 0
    """Partial writes, unmarked payloads and stray keys removed (since its first start)."""
    unreachable: dict[str, str] = Field(default_factory=dict)
    """Regions the syncer cannot reach now (an outage), with the last error: skipped,
    probed now and then, caught up when they return."""
    outages: int = 0
    """Regions that went unreachable since this syncer started."""
    given_up: dict[LearnerId, str] = Field(default_factory=dict)
    """Learners the syncer no longer waits for, and why."""
    heartbeats: dict[LearnerId, HeartbeatHeard] = Field(default_factory=dict)
    """Each learner's newest heartbeat the syncer took in: ``diloco status`` and the
    syncer's next start refuse an older one they read (a replay); status shows the
    learner as the syncer heard it."""
    ending: str | None = None
    """Why the run has not ended though every learner is done (a region's reducer still
    holds sends), and when it ends anyway."""
    started_at: float
    time: float
