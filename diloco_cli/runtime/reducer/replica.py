"""A region's exact copy of the global weights, kept by its reducer from in-region objects.

Every update the syncer publishes lands in every region's bucket, so a region can hold
the global weights itself: it builds version 0 from the recipe's seed (checked against
the head's ``initial_digests``: the syncer's version 0, bit for bit) or starts from a
snapshot it wrote before, and adds every published update in version order with
:func:`~diloco_cli.codec.exact.apply_update` (the function every holder uses).  From this
copy the reducer anchors its learners' sends (the window of the last W updates of each
fragment, as the syncer keeps it) and writes the region's snapshots, so neither the
initial weights nor any snapshot ever crosses the WAN.  With syncer shards the region
keeps one copy per shard, of that shard's fragments, from that shard's updates.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from diloco_cli.codec import CorruptPayload, PayloadError, RunSecret, decode_payload, read_header
from diloco_cli.codec.exact import apply_update, fragment_digest
from diloco_cli.core.anchor import UpdateWindow
from diloco_cli.core.fragments import Fragment
from diloco_cli.core.types import FragmentIndex, Version
from diloco_cli.runtime.global_weights import encode_snapshot
from diloco_cli.store.documents import Head
from diloco_cli.store.region import RegionBucket

log = logging.getLogger("diloco.reducer")


class ReplicaGap(Exception):
    """The next update of a fragment is not in the region (yet): the copy waits there."""


class DamagedWindowUpdate(CorruptPayload):
    """An update of a fragment's window that can no longer be read back (damaged or
    deleted at rest since it was added): the aggregate that needed it waits for its repair."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"an update of the window cannot be read back: {reason}")
        self.key = key


@dataclass(frozen=True)
class ReplicaSource:
    """Where a replica reads the updates it adds and its windows from."""

    bucket: RegionBucket
    """The region's bucket (the updates the syncer published there)."""
    secret: RunSecret
    window_versions: int
    """How many updates of each fragment a window keeps (``sync.window_versions``)."""


class GlobalReplica:
    """The global weights at ``version`` (each fragment at ``versions[p]``), exact: of
    the fragments ``versions`` names (a syncer shard's), ``fragments`` being every
    fragment of the model, by index."""

    def __init__(
        self,
        fragments: tuple[Fragment, ...],
        theta: dict[str, torch.Tensor],
        versions: Mapping[FragmentIndex, Version],
        version: Version,
        source: ReplicaSource,
    ) -> None:
        self.fragments, self.theta = fragments, theta
        self.bucket, self.secret, self.window_versions = source.bucket, source.secret, source.window_versions
        self.versions = dict(versions)
        self.version = version
        self.windows = self._windows_from_bucket()

    @classmethod
    def initial(
        cls,
        fragments: tuple[Fragment, ...],
        initial: Mapping[str, torch.Tensor],
        head: Head,
        bucket: RegionBucket,
        secret: RunSecret,
        window_versions: int,
        owned: tuple[Fragment, ...] | None = None,
    ) -> GlobalReplica:
        """Version 0 of the ``owned`` fragments (every one by default) from ``initial``
        (the recipe's model built from its seed), refused with CorruptPayload when it is
        not the syncer's version 0 bit for bit."""
        theta = {name: tensor.detach().to(torch.float32).clone() for name, tensor in initial.items()}
        if owned is not None:  # a syncer shard's copy holds its fragments alone
            names = {name for fragment in owned for name in fragment.parameter_names}
            theta = {name: tensor for name, tensor in theta.items() if name in names}
        owned = fragments if owned is None else owned
        for fragment in owned:
            expected = head.initial_digests.get(fragment.index)
            if expected is not None and fragment_digest(theta, fragment.parameter_names) != expected:
                raise CorruptPayload(
                    f"fragment {fragment.index} of the model built here from the recipe's seed differs from the "
                    "syncer's version 0; install the same torch (and model code) on this host as on the syncer's"
                )
        versions = {fragment.index: Version(0) for fragment in owned}
        return cls(fragments, theta, versions, Version(0), ReplicaSource(bucket, secret, window_versions))

    @classmethod
    def from_snapshot(
        cls,
        fragments: tuple[Fragment, ...],
        payload: bytes,
        bucket: RegionBucket,
        secret: RunSecret,
        window_versions: int,
    ) -> GlobalReplica:
        """The copy a snapshot holds (verified): the fragments it names."""
        decoded = decode_payload(payload, secret)
        try:
            version = Version(int(decoded.meta["version"]))
            versions = {FragmentIndex(int(p)): Version(int(v)) for p, v in decoded.meta["fragment_versions"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise CorruptPayload(f"a snapshot's metadata lacks its versions: {error}") from None
        source = ReplicaSource(bucket, secret, window_versions)
        return cls(fragments, dict(decoded.tensors), versions, version, source)

    def _windows_from_bucket(self) -> dict[FragmentIndex, UpdateWindow]:
        """Each fragment's window of its last W updates up to its version, from those the
        region still holds (so a restarted reducer anchors what the syncer anchors)."""
        listed = sorted(self.bucket.update_versions())
        windows = {}
        for p in self.versions:
            kept = [v for v, q in listed if q == p and v <= self.versions[p]][-self.window_versions :]
            oldest = self.versions[p]
            if kept:
                try:
                    oldest = Version(
                        int(read_header(self.bucket.read_update(kept[0], p), self.secret).meta["previous_version"])
                    )
                except (CorruptPayload, FileNotFoundError, KeyError, ValueError):
                    kept = []
            window = UpdateWindow(self.window_versions, oldest_anchorable=oldest)
            for version in kept:
                window.record(version, self._loader(version, p))
            windows[p] = window
        return windows

    def _loader(self, version: Version, fragment: FragmentIndex):
        def add_to(drift: dict[str, torch.Tensor]) -> None:
            key = self.bucket.layout.update_key(version, fragment)
            try:
                decode_payload(self.bucket.read_update(version, fragment), self.secret, into=drift, accumulate=True)
            except FileNotFoundError:
                raise DamagedWindowUpdate(key, "it is gone from the region") from None
            except PayloadError as error:
                raise DamagedWindowUpdate(key, str(error)) from None

        return add_to

    def pending(self, head: Head) -> list[tuple[Version, FragmentIndex]]:
        """The updates the head names that this copy has not added yet, in version order."""
        listed = set(self.bucket.update_versions())
        wanted = [(v, p) for v, p in listed if v > self.versions.get(p, Version(0)) and v <= head.version]
        return sorted(wanted)

    def add(self, version: Version, fragment: FragmentIndex) -> None:
        """Add the update published as ``version`` (it must follow the fragment's version)."""
        try:
            payload = self.bucket.read_update(version, fragment)
        except FileNotFoundError:
            raise ReplicaGap(f"update {version} of fragment {fragment} is not in the region yet") from None
        previous = read_header(payload, self.secret).meta.get("previous_version")
        if previous != self.versions[fragment]:
            raise ReplicaGap(
                f"update {version} of fragment {fragment} follows version {previous}, "
                f"the region holds {self.versions[fragment]}: an update between them is missing"
            )
        names = self.fragments[fragment].parameter_names
        apply_update({name: self.theta[name] for name in names}, payload, self.secret)
        self.versions[fragment] = version
        self.version = version
        self.windows[fragment].record(version, self._loader(version, fragment))

    def digest(self, fragment: FragmentIndex) -> str:
        return fragment_digest(self.theta, self.fragments[fragment].parameter_names)

    def check(self, head: Head) -> None:
        """Every fragment the head names at this copy's version has the head's digest
        (CorruptPayload otherwise)."""
        for fragment, version in head.fragment_versions.items():
            expected = head.fragment_digests.get(fragment)
            if version == self.versions.get(fragment) and expected is not None and self.digest(fragment) != expected:
                raise CorruptPayload(
                    f"the region's copy of fragment {fragment} at version {version} is not the syncer's"
                )

    def fragment_theta(self, fragment: FragmentIndex) -> dict[str, torch.Tensor]:
        return {name: self.theta[name] for name in self.fragments[fragment].parameter_names}

    def snapshot(self) -> bytes:
        return encode_snapshot(self.theta, self.secret, self.version, self.versions)
