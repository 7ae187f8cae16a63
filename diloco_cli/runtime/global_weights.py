"""Reading the exact global weights from a region's bucket: snapshots plus updates.

The syncer publishes each merged fragment as an update payload and, every S versions, a
full snapshot.  ``global/head.json`` (sealed) names the newest version of every
fragment with its digest, the newest snapshot and the recent updates.  Reading is split
in two so that the learner's training thread alone touches its weights:

* :meth:`GlobalReader.fetch` (I/O, any thread) reads and verifies what a reader misses:
  for each fragment, the updates after its base, each checked to be made for exactly
  the version before it (``previous_version`` in its authenticated metadata), or, when
  an update is missing or damaged, a snapshot and the updates after it (the newest
  snapshot first, then an older one).  It never touches anyone's tensors.
* :func:`apply_fetch` (the owner's thread) adds the updates, in order, to a copy of the
  base with :func:`~diloco_cli.codec.exact.apply_update` (the syncer's own function, so
  every holder computes the same bits) and checks the result against the head's digest.

With syncer shards each shard publishes its own fragments under its own head, with its
own version numbers: a reader reads each fragment from its shard
(:class:`GlobalReader` for one shard, :class:`GlobalCopy` for several).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from diloco_cli.codec import CorruptPayload, PayloadError, RunSecret, decode_payload, encode_payload, read_header
from diloco_cli.codec.exact import apply_update, fragment_digest
from diloco_cli.core.fragments import Fragment, SyncerShard
from diloco_cli.core.types import FragmentIndex, Version
from diloco_cli.store.documents import Head
from diloco_cli.store.region import SNAPSHOT_SPEC, RegionBucket


def encode_snapshot(
    parameters: Mapping[str, torch.Tensor],
    secret: RunSecret,
    version: Version,
    fragment_versions: Mapping[FragmentIndex, Version],
) -> bytes:
    meta = {"version": version, "fragment_versions": {str(p): v for p, v in fragment_versions.items()}}
    return encode_payload(parameters.items(), SNAPSHOT_SPEC, secret, meta)


@dataclass
class FragmentFetch:
    """What a reader must do to hold one fragment at ``version``."""

    fragment: FragmentIndex
    version: Version
    start: dict[str, torch.Tensor] | None
    """Values to start from (from a snapshot), or None to start from the reader's base."""
    updates: list[tuple[Version, bytes]]
    """Verified update payloads to add in this order."""
    digest: str | None
    """What the fragment's digest must be at ``version`` (from the head)."""


@dataclass
class Refusal:
    kind: str
    key: str
    reason: str


@dataclass
class Fetched:
    head: Head
    fragments: list[FragmentFetch] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    shard: int = 0
    """The syncer shard whose head this is."""


class GlobalReader:
    """Reads and verifies the global weights of a run from one region's bucket: those
    of syncer shard ``shard`` (the fragments it syncs, under its head), every fragment
    with one syncer."""

    def __init__(
        self,
        bucket: RegionBucket,
        secret: RunSecret,
        fragments: tuple[Fragment, ...],
        initial: Mapping[str, torch.Tensor] | None = None,
        shard: SyncerShard = SyncerShard(),
    ) -> None:
        self.bucket = bucket.for_syncer_shard(shard)
        self.shard = shard
        self._secret = secret
        self.fragments = fragments
        self.initial = initial
        """The reader's own version 0 (the recipe's model built from its seed), if it has
        one: a fragment whose head still lists every update since version 0 starts from
        it when its digest is the head's ``initial_digests`` (nothing read but updates)."""

    def head(self) -> Head | None:
        return self.bucket.read_head()

    def fetch(self, head: Head, bases: Mapping[FragmentIndex, Version]) -> Fetched:
        """Fetch what brings each fragment of ``bases`` (fragment -> the version the reader
        holds, -1 for none) to the head's version.  A fragment that cannot be brought
        there now (every path refused) is left out, with the refusals that say why."""
        fetched = Fetched(head, shard=self.shard.index)
        snapshots: dict[Version, tuple | Exception] = {}
        refused: set[str] = set()
        for fragment, base in sorted(bases.items()):
            target = head.fragment_versions.get(fragment, Version(0))
            digest = head.fragment_digests.get(fragment)
            start = None
            if base < 0 and self._own_version_zero(head, fragment):
                base, start = Version(0), self._fragment_values(self.initial, fragment)
            versions = head.updates_after(fragment, base) if base >= 0 else None
            if versions is not None and start is not None:
                try:
                    updates = self._chain(fragment, base, versions, target)
                    fetched.fragments.append(FragmentFetch(fragment, target, start, updates, digest))
                    continue
                except (PayloadError, FileNotFoundError) as error:
                    fetched.refusals.append(_refusal(error, "update"))
            elif versions is not None:
                try:
                    updates = self._chain(fragment, base, versions, target)
                    fetched.fragments.append(FragmentFetch(fragment, target, None, updates, digest))
                    continue
                except (PayloadError, FileNotFoundError) as error:
                    fetched.refusals.append(_refusal(error, "update"))
            for snapshot_version in self._snapshot_versions(head):
                try:
                    values, fragment_versions = self._snapshot(snapshot_version, snapshots)
                    held = fragment_versions.get(fragment, Version(0))
                    after = head.updates_after(fragment, snapshot_version)
                    if after is None:  # the head no longer lists what follows it: an older snapshot won't do
                        continue
                    updates = self._chain(fragment, held, after, target)
                    names = self.fragments[fragment].parameter_names
                    fetched.fragments.append(
                        FragmentFetch(fragment, target, {n: values[n] for n in names}, updates, digest)
                    )
                    break
                except SnapshotRemoved:  # the clean-up took it: not a refusal, the next look reads the newer one
                    continue
                except (PayloadError, FileNotFoundError) as error:
                    if getattr(error, "key", None) not in refused:  # a snapshot fails once for every fragment
                        fetched.refusals.append(
                            _refusal(error, "snapshot" if isinstance(error, SnapshotRefused) else "update")
                        )
                        refused.add(getattr(error, "key", None))
        return fetched

    def _own_version_zero(self, head: Head, fragment: FragmentIndex) -> bool:
        expected = head.initial_digests.get(fragment)
        if self.initial is None or expected is None or head.updates_after(fragment, Version(0)) is None:
            return False
        return fragment_digest(self.initial, self.fragments[fragment].parameter_names) == expected

    def _fragment_values(self, tensors: Mapping[str, torch.Tensor], fragment: FragmentIndex) -> dict[str, torch.Tensor]:
        return {name: tensors[name] for name in self.fragments[fragment].parameter_names}

    def _snapshot_versions(self, head: Head) -> list[Version]:
        """The head's snapshot first, then every other the bucket holds that the head's
        updates can bring up to it, newest first: a region's reducer may have written one
        of a later version than the head names (over one a learner found damaged), and an
        older one is a fallback."""
        others = sorted(
            (
                v
                for v in self.bucket.snapshot_versions()
                if head.recent_from <= v <= head.version and v != head.snapshot_version
            ),
            reverse=True,
        )
        return [head.snapshot_version, *others]

    def _snapshot(self, version: Version, cache: dict) -> tuple[dict[str, torch.Tensor], dict[FragmentIndex, Version]]:
        if version not in cache:
            key = self.bucket.layout.snapshot_key(version)
            try:
                decoded = decode_payload(self.bucket.read_snapshot(version), self._secret)
                if decoded.meta.get("version") != version:
                    raise CorruptPayload(f"it holds version {decoded.meta.get('version')}")
                versions = {
                    FragmentIndex(int(p)): Version(int(v)) for p, v in decoded.meta["fragment_versions"].items()
                }
                cache[version] = (decoded.tensors, versions)
            except FileNotFoundError as error:
                removed = self._replaced(version)
                cache[version] = SnapshotRemoved(key) if removed else SnapshotRefused(key, error)
            except (PayloadError, KeyError, ValueError) as error:
                cache[version] = SnapshotRefused(key, error)
        if isinstance(cache[version], Exception):
            raise cache[version]
        return cache[version]

    def _replaced(self, version: Version) -> bool:
        """Whether snapshot ``version``, not found, was removed by the normal clean-up
        after a newer one: the head names another snapshot now.  One the head still
        names is missing, and refused (reported, so that the syncer rewrites it)."""
        try:
            head = self.bucket.read_head()
        except (PayloadError, FileNotFoundError):
            return False
        return head is not None and head.snapshot_version != version

    def _chain(
        self, fragment: FragmentIndex, base: Version, versions: list[Version], target: Version
    ) -> list[tuple[Version, bytes]]:
        """The update payloads of ``versions``, verified to lead from ``base`` to ``target``
        one after another: each made for the fragment's previous version, in order."""
        updates, previous = [], base
        for version in versions:
            key = self.bucket.layout.update_key(version, fragment)
            try:
                payload = self.bucket.read_update(version, fragment)
                meta = read_header(payload, self._secret).meta
            except (PayloadError, FileNotFoundError) as error:
                raise UpdateRefused(key, error) from None
            found = (meta.get("fragment"), meta.get("version"), meta.get("previous_version"))
            if found != (fragment, version, previous):
                raise UpdateRefused(
                    key,
                    CorruptPayload(
                        f"it is the update of fragment {found[0]} from version {found[2]} to {found[1]}, "
                        f"not {previous} to {version}"
                    ),
                )
            updates.append((version, payload))
            previous = version
        if previous != target:
            raise UpdateRefused(
                self.bucket.layout.update_key(target, fragment),
                CorruptPayload(f"the head lists updates up to version {previous}, not to {target}"),
            )
        return updates


class UpdateRefused(CorruptPayload):
    def __init__(self, key: str, error: Exception) -> None:
        self.key = key
        super().__init__(f"{key}: {error}")


class SnapshotRemoved(FileNotFoundError):
    """A snapshot the clean-up removed while a reader was getting to it (not damage)."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"{key} was removed after a newer snapshot was published")


class SnapshotRefused(CorruptPayload):
    def __init__(self, key: str, error: Exception) -> None:
        self.key = key
        super().__init__(f"{key}: {error}")


def _refusal(error: Exception, kind: str) -> Refusal:
    return Refusal(kind, getattr(error, "key", "?"), str(error))


def apply_fetch(
    fetch: FragmentFetch, names: tuple[str, ...], base: Mapping[str, torch.Tensor] | None, secret: RunSecret
) -> dict[str, torch.Tensor]:
    """The fragment's tensors at ``fetch.version``: the start (or a copy of ``base``) plus
    every update, checked against the head's digest.  Raises CorruptPayload when the
    result is not what the syncer holds (nothing of ``base`` is changed)."""
    source = fetch.start if fetch.start is not None else base
    if source is None:
        raise ValueError("a fetch without a snapshot needs the reader's base")
    tensors = {name: source[name].detach().to(torch.float32).clone() for name in names}
    for _, payload in fetch.updates:
        apply_update(tensors, payload, secret)
    if fetch.digest is not None and fragment_digest(tensors, names) != fetch.digest:
        raise CorruptPayload(f"fragment {fetch.fragment} at version {fetch.version} does not match the head's digest")
    return tensors


class GlobalCopy:
    """An exact copy of the fragments of some syncer shards, kept from one region's
    bucket: each fragment read from its shard and checked against its shard's head.  Export
    reads every shard's once; syncer shard 0 keeps the others' to evaluate the whole
    model."""

    def __init__(
        self,
        bucket: RegionBucket,
        secret: RunSecret,
        fragments: tuple[Fragment, ...],
        shards: list[SyncerShard],
        initial: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.readers = [GlobalReader(bucket, secret, fragments, initial, shard) for shard in shards]
        self.fragments, self._secret = fragments, secret
        self.theta: dict[str, torch.Tensor] = {}
        """The copy's tensors (of the shards' fragments)."""
        self.versions: dict[FragmentIndex, Version] = {}
        """Each fragment's version in the copy (in its shard's numbering)."""

    def refresh(self) -> list[Head]:
        """Bring every fragment of the shards to its shard's newest head; returns the
        heads read, in shard order.  FileNotFoundError when a shard has no head yet,
        CorruptPayload (with every reason) when a fragment cannot be brought there now;
        what was brought up before that stays."""
        heads = []
        for reader in self.readers:
            head = reader.head()
            if head is None:
                raise FileNotFoundError(f"{reader.bucket.store.root} has no {reader.bucket.layout.head_key} yet")
            owned = [f.index for f in reader.shard.of(self.fragments)]
            due = {
                p: self.versions.get(p, Version(-1))
                for p in owned
                if head.fragment_versions.get(p, Version(0)) != self.versions.get(p)
            }
            fetched = reader.fetch(head, due)
            for fetch in fetched.fragments:
                names = self.fragments[fetch.fragment].parameter_names
                self.theta.update(apply_fetch(fetch, names, self.theta, self._secret))
                self.versions[fetch.fragment] = fetch.version
            if len(fetched.fragments) != len(due):
                reasons = "; ".join(r.reason for r in fetched.refusals) or "unknown"
                raise CorruptPayload(f"the global weights in {reader.bucket.store.root} cannot be read back: {reasons}")
            heads.append(head)
        return heads


def latest_weights(
    bucket: RegionBucket,
    secret: RunSecret,
    fragments: tuple[Fragment, ...],
    initial: Mapping[str, torch.Tensor] | None = None,
    shards: int = 1,
) -> tuple[dict[str, torch.Tensor], list[Head]]:
    """The newest global weights of every parameter, reconstructed exactly (for export),
    and the head of each of the run's ``shards`` syncer shards they were read at;
    ``initial``: the reader's own version 0, if it has one (see :class:`GlobalReader`)."""
    copy = GlobalCopy(bucket, secret, fragments, [SyncerShard(s, shards) for s in range(shards)], initial)
    try:
        heads = copy.refresh()
    except FileNotFoundError:
        raise FileNotFoundError(f"{bucket.store.root} has no global weights yet (no head)") from None
    return copy.theta, heads
