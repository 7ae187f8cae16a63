"""The syncer's home store: the initial weights, one commit per published version, and a
compacted ledger so that a restart reads a bounded number of objects.

::

    initial.dlc                          Theta at version 0 (all fragments)  (+ .ready)
    commits/<version>.update.dlc         the update published as this version
    commits/<version>.state.dlc          the fragment's Theta, momentum and carry after it
    commits/<version>.ready              the commit record (authenticated): fragment,
                                         merged and retired payloads, digest, evaluation
    ledger/<version>.dlc                 the compacted state through that version
    history/<first>-<last>.dlc           the commit records of compacted versions (audits)

A version exists once its record exists; the record is written after both files and
before the update is published to any region.  Every ``checkpoint_every`` versions the
syncer writes a ledger checkpoint (the exactly-once ledger, recent commits, evaluations,
counters) and archives the records older than the previous checkpoint into one history
object.  A restart reads the newest checkpoint that verifies, the records after it
(fewer than two intervals) and one state file per fragment, however long the run.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from diloco_cli.codec import CodecSpec, PayloadError, RunSecret, encode_payload, read_header
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.store.documents import Evaluation
from diloco_cli.store.objects import MARKER_SUFFIX, ObjectStore

MARKER_SPEC = CodecSpec(zstd_level=0)
RECORD_SPEC = CodecSpec(zstd_level=1)
COMMIT_MARKER = re.compile(r"^commits/(?P<version>\d{10})\.ready$")
CHECKPOINT_KEY = re.compile(r"^ledger/(?P<version>\d{10})\.dlc$")
HISTORY_KEY = re.compile(r"^history/(?P<first>\d{10})-(?P<last>\d{10})\.dlc$")
CHECKPOINT_EVERY = 50
"""Versions between two ledger checkpoints."""

RECORD = ConfigDict(frozen=True, extra="forbid")


class MergedPayload(BaseModel):
    """A learner payload merged into a version (its key is ``<region>:<key>``)."""

    model_config = RECORD

    key: str
    learner: LearnerId
    sequence: int
    base_version: Version
    c_steps: int
    c_tokens: int
    aggregate: str | None = None
    """The region's aggregate it came in (its key), when a reducer forwarded it."""


class MergedAggregate(BaseModel):
    """A region's aggregate merged into a version (its key is ``<region>:<key>``); the
    learner sends it held are in the record's ``merged``."""

    model_config = RECORD

    key: str
    region: str
    serial: int
    anchor: Version
    made_at: float = 0.0
    """When its reducer read the sends it holds."""


class RetiredPayload(BaseModel):
    """A payload consumed without a merge (superseded, refused, or its learner must resync)."""

    model_config = RECORD

    key: str
    learner: LearnerId
    fragment: FragmentIndex
    sequence: int


class UnanchoredSend(BaseModel):
    """A send refused because its base could not be anchored (older than the window of
    updates kept, or newer than the syncer's version; its learner was told to resync):
    its tokens are not merged."""

    model_config = RECORD

    key: str
    learner: LearnerId
    fragment: FragmentIndex
    sequence: int
    base_version: Version
    c_tokens: int


class CommitRecord(BaseModel):
    """What one committed version is: the ledger entry of its merge."""

    model_config = RECORD

    version: Version
    fragment: FragmentIndex
    previous_version: Version
    """The fragment's version the update was made on."""
    merged: tuple[MergedPayload, ...]
    retired: tuple[RetiredPayload, ...]
    unanchored: tuple[UnanchoredSend, ...] = ()
    """The sends among ``retired`` refused because their base could not be anchored (any
    fragment of the shard; their learners were told to resync)."""
    aggregates: tuple[MergedAggregate, ...] = ()
    """The regions' aggregates whose sends are in ``merged`` (through reducers)."""
    digest: str
    """BLAKE2b of the fragment's weights at this version (what every holder must have)."""
    time: float
    seconds: float
    """Time to pull, merge and commit."""
    merges: int
    snapshot_version: Version
    quorum_seconds: float | None
    sync_seconds: float | None
    evaluation: Evaluation | None = None
    """The global model's held-out loss at this version, when it was evaluated."""


class LedgerCheckpoint(BaseModel):
    """Everything a restart needs that the commit records through ``version`` said."""

    model_config = RECORD

    version: Version
    ledger: dict[str, Any]
    """:meth:`Ledger.to_json` of every payload consumed through ``version``."""
    index: tuple[tuple[Version, FragmentIndex], ...]
    """Recent commits (version, fragment), oldest first: each fragment's newest, its
    update window and the updates the head lists."""
    evaluations: tuple[Evaluation, ...] = ()
    """The most recent held-out losses (all of them are in the commit records)."""
    merges: int
    snapshot_version: Version
    quorum_seconds: float | None
    sync_seconds: float | None


class History(BaseModel):
    model_config = RECORD

    records: tuple[CommitRecord, ...] = Field(default_factory=tuple)


class HomeDamaged(RuntimeError):
    """The syncer's own state cannot be read back: restoring it would risk merging a
    payload twice, so the syncer refuses to start."""


class SyncerHome:
    def __init__(self, root: str, storage_options: dict[str, Any] | None, secret: RunSecret, retry=None) -> None:
        self.store = ObjectStore(root, storage_options, retry, kind_of=lambda key: "home")
        self._secret = secret

    def _frame(self, meta: dict[str, Any], spec: CodecSpec = MARKER_SPEC) -> bytes:
        return encode_payload([], spec, self._secret, meta)

    def _meta(self, key: str) -> dict[str, Any]:
        return read_header(self.store.get(key), self._secret).meta

    def write_initial(self, payload: bytes) -> None:
        self.store.put_marked("initial.dlc", payload, self._frame({"version": 0}))

    def read_initial(self) -> bytes | None:
        if not self.store.exists("initial.dlc" + MARKER_SUFFIX):
            return None
        return self.store.get("initial.dlc")

    # ------------------------------------------------------------------- commits

    def commit(self, record: CommitRecord, update: bytes, state: bytes) -> None:
        """Make a version durable: both payloads first, the record (the ledger entry) last."""
        stem = f"commits/{record.version:010d}"
        self.store.put(f"{stem}.update.dlc", update)
        self.store.put(f"{stem}.state.dlc", state)
        self.store.put(f"{stem}{MARKER_SUFFIX}", self._frame(record.model_dump(mode="json"), RECORD_SPEC))

    def records_after(self, version: Version) -> list[CommitRecord]:
        """The commit records newer than ``version``, oldest first (verified)."""
        found = []
        for key in self.store.list("commits"):
            match = COMMIT_MARKER.match(key)
            if match and int(match["version"]) > version:
                try:
                    found.append(CommitRecord.model_validate(self._meta(key)))
                except (PayloadError, ValueError) as error:
                    raise HomeDamaged(
                        f"{self.store.root}/{key} cannot be read ({error}); restore the syncer's home from a backup"
                    ) from None
        return found

    def read_update(self, version: Version) -> bytes:
        return self.store.get(f"commits/{version:010d}.update.dlc")

    def read_state(self, version: Version) -> bytes:
        return self.store.get(f"commits/{version:010d}.state.dlc")

    def delete_state(self, version: Version) -> None:
        """Drop a superseded fragment state (the update stays while the window needs it)."""
        self.store.delete(f"commits/{version:010d}.state.dlc")

    def delete_update(self, version: Version) -> None:
        self.store.delete(f"commits/{version:010d}.update.dlc")

    # --------------------------------------------------------- ledger compaction

    def write_checkpoint(self, checkpoint: LedgerCheckpoint) -> None:
        """Write a ledger checkpoint, then archive and drop what the previous one made
        redundant: the records through it go into one history object, and older
        checkpoints go (the previous one stays, in case the newest cannot be read)."""
        self.store.put(
            f"ledger/{checkpoint.version:010d}.dlc", self._frame(checkpoint.model_dump(mode="json"), RECORD_SPEC)
        )
        versions = self.checkpoint_versions()
        if len(versions) < 2:
            return
        previous = versions[-2]
        stale = [
            key
            for key in self.store.list("commits")
            if (m := COMMIT_MARKER.match(key)) and int(m["version"]) <= previous
        ]
        records = [CommitRecord.model_validate(self._meta(key)) for key in stale]
        if records:
            first, last = records[0].version, records[-1].version
            self.store.put(
                f"history/{first:010d}-{last:010d}.dlc",
                self._frame(History(records=tuple(records)).model_dump(mode="json"), RECORD_SPEC),
            )
        for key in stale:
            self.store.delete(key)
        for version in versions[:-2]:
            self.store.delete(f"ledger/{version:010d}.dlc")

    def checkpoint_versions(self) -> list[Version]:
        return [Version(int(m["version"])) for key in self.store.list("ledger") if (m := CHECKPOINT_KEY.match(key))]

    def latest_checkpoint(self) -> LedgerCheckpoint | None:
        """The newest checkpoint that verifies (the one before it if the newest is damaged)."""
        for version in reversed(self.checkpoint_versions()):
            try:
                return LedgerCheckpoint.model_validate(self._meta(f"ledger/{version:010d}.dlc"))
            except (PayloadError, ValueError):
                continue
        return None

    def history(self) -> list[CommitRecord]:
        """Every commit record of the run, archived or not, oldest first (for audits)."""
        records: dict[Version, CommitRecord] = {}
        for key in self.store.list("history"):
            if HISTORY_KEY.match(key):
                for record in History.model_validate(self._meta(key)).records:
                    records[record.version] = record
        for record in self.records_after(Version(0)):
            records[record.version] = record
        return [records[version] for version in sorted(records)]


def tokens_merged(history: list[CommitRecord], learner: LearnerId, fragment: FragmentIndex) -> int:
    """The tokens of ``learner``'s training on ``fragment`` that ended in a merge.

    Every payload holds all the learner's tokens since its base, so per base version the
    newest merged payload counts (earlier ones from the same base hold fewer of the same
    tokens); the sum over bases is what was merged.  A learner's tokens are each merged
    this way, refused unanchored (:func:`tokens_unanchored`), or overwritten by an
    install before a send (its heartbeat counts those)."""
    return sum(_newest_merged_per_base(history, learner, fragment).values())


def tokens_unanchored(history: list[CommitRecord], learner: LearnerId, fragment: FragmentIndex) -> int:
    """The tokens of ``learner``'s training on ``fragment`` that were sent but refused
    because their base could not be anchored (older than the window: a learner long cut
    off sends so): per base version, what its newest refused send holds beyond its newest
    merged one (an earlier send from that base may have merged before the window moved
    past it)."""
    merged = _newest_merged_per_base(history, learner, fragment)
    refused: dict[Version, int] = {}
    for commit in history:
        for send in commit.unanchored:
            if send.learner == learner and send.fragment == fragment:
                refused[send.base_version] = max(refused.get(send.base_version, 0), send.c_tokens)
    return sum(max(0, tokens - merged.get(base, 0)) for base, tokens in refused.items())


def _newest_merged_per_base(
    history: list[CommitRecord], learner: LearnerId, fragment: FragmentIndex
) -> dict[Version, int]:
    newest: dict[Version, int] = {}
    for commit in history:
        if commit.fragment != fragment:
            continue
        for merged in commit.merged:
            if merged.learner == learner:
                newest[merged.base_version] = max(newest.get(merged.base_version, 0), merged.c_tokens)
    return newest
