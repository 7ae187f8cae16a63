"""Reading the exact global weights from a region's bucket: snapshots plus updates.

The syncer publishes each merged fragment as an update payload and, every S versions, a
full snapshot.  ``global/head.json`` names the newest version of every fragment, the
newest snapshot and the recent updates; a reader applies, in order, the updates it is
missing with :func:`~diloco_cli.codec.exact.apply_update`, which gives it bit for bit the
syncer's weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from diloco_cli.codec import CodecSpec, RunSecret, decode_payload, encode_payload
from diloco_cli.codec.exact import apply_update
from diloco_cli.core.types import FragmentIndex, Version
from diloco_cli.store.region import RegionBucket

SNAPSHOT_SPEC = CodecSpec(codec="fp32", zstd_level=1)


@dataclass(frozen=True)
class Head:
    """``global/head.json``: where the global weights stand."""

    version: Version
    fragment_versions: dict[FragmentIndex, Version]
    snapshot_version: Version
    recent: tuple[tuple[Version, FragmentIndex], ...]
    """Every update published after ``recent_from``, oldest first."""
    recent_from: Version
    finished: bool = False

    @classmethod
    def from_json(cls, document: Mapping) -> Head:
        return cls(
            version=Version(int(document["version"])),
            fragment_versions={FragmentIndex(int(p)): Version(int(v)) for p, v in document["fragment_versions"].items()},
            snapshot_version=Version(int(document["snapshot_version"])),
            recent=tuple((Version(int(v)), FragmentIndex(int(p))) for v, p in document["recent"]),
            recent_from=Version(int(document["recent_from"])),
            finished=bool(document.get("finished", False)),
        )

    def to_json(self) -> dict:
        return {
            "version": self.version,
            "fragment_versions": {str(p): v for p, v in sorted(self.fragment_versions.items())},
            "snapshot_version": self.snapshot_version,
            "recent": [[v, p] for v, p in self.recent],
            "recent_from": self.recent_from,
            "finished": self.finished,
        }

    def updates_after(self, fragment: FragmentIndex, base_version: Version) -> list[Version] | None:
        """The versions of ``fragment`` newer than ``base_version``, or None when some of
        them are no longer listed (the reader must start again from a snapshot)."""
        if base_version < self.recent_from:
            return None
        return [version for version, p in self.recent if p == fragment and version > base_version]


def encode_snapshot(parameters: Mapping[str, torch.Tensor], secret: RunSecret, version: Version, fragment_versions: Mapping[FragmentIndex, Version]) -> bytes:
    meta = {"version": version, "fragment_versions": {str(p): v for p, v in fragment_versions.items()}}
    return encode_payload(parameters.items(), SNAPSHOT_SPEC, secret, meta)


class GlobalWeights:
    """Reads the global weights of a run from one region's bucket."""

    def __init__(self, bucket: RegionBucket, secret: RunSecret) -> None:
        self.bucket = bucket
        self._secret = secret

    def head(self) -> Head | None:
        document = self.bucket.read_head()
        return Head.from_json(document) if document else None

    def snapshot(self, version: Version) -> dict[str, torch.Tensor]:
        return decode_payload(self.bucket.read_snapshot(version), self._secret).tensors

    def apply_updates(self, parameters: Mapping[str, torch.Tensor], fragment: FragmentIndex, versions: list[Version]) -> None:
        """Add the updates of ``fragment`` at ``versions`` (in order) to ``parameters``."""
        for version in versions:
            apply_update(parameters, self.bucket.read_update(version, fragment), self._secret)

    def latest(self, fragment_names: Mapping[FragmentIndex, tuple[str, ...]]) -> tuple[dict[str, torch.Tensor], Head]:
        """The newest global weights of every parameter, reconstructed exactly."""
        head = self.head()
        if head is None:
            raise FileNotFoundError(f"{self.bucket.store.root} has no global weights yet (no global/head.json)")
        parameters = self.snapshot(head.snapshot_version)
        for fragment, names in fragment_names.items():
            versions = head.updates_after(fragment, head.snapshot_version)
            if versions is None:
                raise FileNotFoundError(f"updates after snapshot {head.snapshot_version} are missing in {self.bucket.store.root}")
            self.apply_updates({name: parameters[name] for name in names}, fragment, versions)
        return parameters, head
