"""What the syncer holds, and how it is made durable and restored.

The global weights Theta, the outer momentum, the carried publication error and the
window of recent updates, per fragment, plus the exactly-once ledger of consumed
payloads.  Each merge is committed to the home store
(:class:`~diloco_cli.store.home.SyncerHome`) before it is published; a restarted syncer
rebuilds everything from the initial weights, the newest ledger checkpoint, the commit
records after it and the newest state of each fragment: a bounded number of objects
however many versions the run has.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from diloco_cli.codec import CodecSpec, RunSecret, decode_payload, encode_payload
from diloco_cli.codec.exact import ExactPublisher, fragment_digest
from diloco_cli.core.anchor import UpdateWindow
from diloco_cli.core.fragments import Fragment
from diloco_cli.core.ledger import Ledger, PayloadId
from diloco_cli.core.outer import NesterovOuterOptimizer
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.store.aggregates import reducer_of
from diloco_cli.store.documents import Evaluation, Head
from diloco_cli.store.home import CHECKPOINT_EVERY, CommitRecord, LedgerCheckpoint, SyncerHome

STATE_SPEC = CodecSpec(codec="fp32", zstd_level=0)
INITIAL_SPEC = CodecSpec(codec="fp32", zstd_level=1)
RECENT_EVALUATIONS = 200
"""Evaluations the syncer holds, checkpoints and shows; every one also stays in the
commit record of its version (and so in the home store's history)."""


@dataclass
class SyncerState:
    """The syncer's tensors and bookkeeping for every fragment it syncs (a syncer shard's
    own; Theta holds the whole model, the others' fragments at version 0)."""

    fragments: tuple[Fragment, ...]
    """Every fragment of the model, by index."""
    theta: dict[str, torch.Tensor]
    optimizer: NesterovOuterOptimizer
    publisher: ExactPublisher
    windows: dict[FragmentIndex, UpdateWindow]
    fragment_versions: dict[FragmentIndex, Version]
    version: Version = Version(0)
    ledger: Ledger = field(default_factory=Ledger)
    index: list[tuple[Version, FragmentIndex]] = field(default_factory=list)
    """Recent commits (version, fragment), oldest first (see LedgerCheckpoint.index)."""
    evaluations: list[Evaluation] = field(default_factory=list)
    """The most recent RECENT_EVALUATIONS held-out losses, oldest first."""
    merges: int = 0
    snapshot_version: Version = Version(0)
    quorum_seconds: float | None = None
    sync_seconds: float | None = None
    update_files: set[Version] = field(default_factory=set)
    """Versions whose update file is in the home store (to delete each once)."""
    digests: dict[FragmentIndex, str] = field(default_factory=dict)
    """Each fragment's digest at its version (the head lists them; readers check them)."""
    initial_digests: dict[FragmentIndex, str] = field(default_factory=dict)
    """Each fragment's digest at version 0."""

    def fragment_theta(self, fragment: FragmentIndex) -> dict[str, torch.Tensor]:
        return {name: self.theta[name] for name in self.fragments[fragment].parameter_names}

    def digest(self, fragment: FragmentIndex) -> str:
        return fragment_digest(self.theta, self.fragments[fragment].parameter_names)

    def recent_commits(self, after: Version) -> tuple[tuple[Version, FragmentIndex], ...]:
        return tuple((version, fragment) for version, fragment in self.index if version > after)

    def snapshot_due(self, version: Version, snapshot_every: int) -> bool:
        """Whether ``version`` comes with a snapshot (one every ``snapshot_every``)."""
        return version - self.snapshot_version >= snapshot_every

    def note_snapshot(self, version: Version) -> None:
        """A snapshot of ``version`` is (being) published: the head names it from now on."""
        self.snapshot_version = version

    def head(self, snapshot_every: int, finished: bool) -> Head:
        """The head every region's readers start from: each fragment's version and digest,
        the newest snapshot, and the updates since the snapshot before it."""
        recent_from = Version(max(0, self.snapshot_version - snapshot_every))
        return Head(
            version=self.version,
            fragment_versions=dict(self.fragment_versions),
            fragment_digests=dict(self.digests),
            snapshot_version=self.snapshot_version,
            recent=self.recent_commits(recent_from),
            recent_from=recent_from,
            finished=finished,
            initial_digests=dict(self.initial_digests),
            merged=self.merged_marks(),
        )

    def merged_marks(self) -> dict[LearnerId, dict[FragmentIndex, int]]:
        """The ledger's newest merged send per learner (and region's reducer) and fragment."""
        marks: dict[LearnerId, dict[FragmentIndex, int]] = {}
        for (learner, fragment), sequence in sorted(self.ledger.merged.items()):
            marks.setdefault(learner, {})[fragment] = sequence
        return marks

    def _absorb(self, record: CommitRecord) -> None:
        """Fold one commit record into the bookkeeping (not the tensors)."""
        merged = [PayloadId(m.key, m.learner, record.fragment, m.sequence) for m in record.merged]
        merged += [PayloadId(a.key, reducer_of(a.region), record.fragment, a.serial) for a in record.aggregates]
        self.ledger.record(merged, (PayloadId(r.key, r.learner, r.fragment, r.sequence) for r in record.retired))
        self.index.append((record.version, record.fragment))
        self.digests[record.fragment] = record.digest
        self.update_files.add(record.version)
        self.fragment_versions[record.fragment] = record.version
        self.version = record.version
        if record.evaluation is not None:
            self.evaluations = [*self.evaluations, record.evaluation][-RECENT_EVALUATIONS:]
        self.merges, self.snapshot_version = record.merges, record.snapshot_version
        self.quorum_seconds, self.sync_seconds = record.quorum_seconds, record.sync_seconds

    def _trim_index(self, keep_after: Version) -> None:
        """Keep what restarts need: per fragment its last W+1 commits (the window, and the
        one before it that sets the oldest anchorable base) and every commit after
        ``keep_after`` (the updates the head lists)."""
        kept = []
        seen: dict[FragmentIndex, int] = {}
        for version, fragment in reversed(self.index):
            seen[fragment] = seen.get(fragment, 0) + 1
            if version > keep_after or seen[fragment] <= self.windows[fragment].size + 1:
                kept.append((version, fragment))
        self.index = kept[::-1]

    def checkpoint(self) -> LedgerCheckpoint:
        return LedgerCheckpoint(
            version=self.version,
            ledger=self.ledger.to_json(),
            index=tuple(self.index),
            evaluations=tuple(self.evaluations),
            merges=self.merges,
            snapshot_version=self.snapshot_version,
            quorum_seconds=self.quorum_seconds,
            sync_seconds=self.sync_seconds,
        )


def _update_loader(home: SyncerHome, version: Version, secret: RunSecret):
    return lambda drift: decode_payload(home.read_update(version), secret, into=drift, accumulate=True)


def encode_fragment_state(state: SyncerState, fragment: FragmentIndex, secret: RunSecret) -> bytes:
    names = state.fragments[fragment].parameter_names
    momentum = state.optimizer.state_tensors()
    carries = state.publisher.carry_tensors()
    tensors = [(f"theta/{name}", state.theta[name]) for name in names]
    tensors += [
        (f"momentum/{name}", momentum[f"{fragment}/{name}"]) for name in names if f"{fragment}/{name}" in momentum
    ]
    tensors += [(f"carry/{name}", carries[f"{fragment}/{name}"]) for name in names if f"{fragment}/{name}" in carries]
    return encode_payload(tensors, STATE_SPEC, secret, {"fragment": fragment})


def restore_state(
    home: SyncerHome,
    secret: RunSecret,
    fragments: tuple[Fragment, ...],
    initial_theta: dict[str, torch.Tensor],
    optimizer: NesterovOuterOptimizer,
    publisher: ExactPublisher,
    window_versions: int,
    evaluate: Callable[[Mapping[str, torch.Tensor], Version], Evaluation | None],
    owned: tuple[Fragment, ...] | None = None,
) -> SyncerState:
    """Rebuild the syncer's state from its home store (initial weights with their
    held-out loss, the newest ledger checkpoint, the commit records after it, each
    fragment's newest state).  ``evaluate`` measures the initial weights, once (None:
    not measured, by a syncer shard that does not evaluate).  ``owned``: the fragments
    this syncer syncs (a syncer shard's), every one by default."""
    owned = fragments if owned is None else owned
    initial = home.read_initial()
    if initial is None:
        theta = {name: tensor.detach().to(torch.float32).clone() for name, tensor in initial_theta.items()}
        evaluation = evaluate(theta, Version(0))
        meta: dict = {"version": 0}
        if evaluation is not None:
            meta["evaluation"] = evaluation.model_dump()
        home.write_initial(encode_payload(theta.items(), INITIAL_SPEC, secret, meta))
    else:
        decoded = decode_payload(initial, secret)
        theta, measured = decoded.tensors, decoded.meta.get("evaluation")
        evaluation = Evaluation.model_validate(measured) if measured is not None else None
    initial_digests = {f.index: fragment_digest(theta, f.parameter_names) for f in owned}
    state = SyncerState(
        fragments=fragments,
        initial_digests=initial_digests,
        theta=theta,
        optimizer=optimizer,
        publisher=publisher,
        windows={f.index: UpdateWindow(window_versions) for f in owned},
        fragment_versions={f.index: Version(0) for f in owned},
        evaluations=[evaluation] if evaluation is not None else [],
    )
    checkpoint = home.latest_checkpoint()
    if checkpoint is not None:
        state.ledger = Ledger.from_json(checkpoint.ledger)
        state.index = list(checkpoint.index)
        state.evaluations = list(checkpoint.evaluations)
        state.version = checkpoint.version
        state.merges, state.snapshot_version = checkpoint.merges, checkpoint.snapshot_version
        state.quorum_seconds, state.sync_seconds = checkpoint.quorum_seconds, checkpoint.sync_seconds
        for version, fragment in state.index:
            state.fragment_versions[fragment] = version
    for record in home.records_after(state.version):
        state._absorb(record)
    for version, fragment in state.index:
        state.windows[fragment].record(version, _update_loader(home, version, secret))
    state.update_files = {version for version, _ in state.index}
    momentum, carries = {}, {}
    for fragment, version in state.fragment_versions.items():
        if version == 0:
            continue
        for key, tensor in decode_payload(home.read_state(version), secret).tensors.items():
            kind, _, name = key.partition("/")
            if kind == "theta":
                theta[name].copy_(tensor)
            elif kind == "momentum":
                momentum[f"{fragment}/{name}"] = tensor
            elif kind == "carry":
                carries[f"{fragment}/{name}"] = tensor
    optimizer.load_state_tensors(momentum)
    publisher.load_carry_tensors(carries)
    state.digests = {f.index: state.digest(f.index) for f in owned}
    return state


def commit_merge(
    home: SyncerHome,
    state: SyncerState,
    secret: RunSecret,
    record: CommitRecord,
    update: bytes,
    keep_updates_after: Version,
) -> None:
    """Make a merged version durable, then drop what no restart needs.

    The merge round has already advanced ``state``'s tensors (Theta, momentum, carry,
    window).  Update files stay while the window needs them or while they are newer
    than ``keep_updates_after`` (regions may still have to be given them after a
    restart).  Every CHECKPOINT_EVERY versions the ledger is checkpointed and compacted."""
    previous = state.fragment_versions[record.fragment]
    home.commit(record, update, encode_fragment_state(state, record.fragment, secret))
    state._absorb(record)
    if previous:
        home.delete_state(previous)
    needed = {v for window in state.windows.values() for v in window.versions} | {
        v for v, _ in state.index if v > keep_updates_after
    }
    for version in sorted(state.update_files - needed):
        home.delete_update(version)
    state.update_files &= needed
    state._trim_index(keep_updates_after)
    if record.version % CHECKPOINT_EVERY == 0:
        home.write_checkpoint(state.checkpoint())
