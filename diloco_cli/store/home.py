"""The syncer's home store: the initial weights and one commit per published version.

::

    initial.dlc                          Theta at version 0 (all fragments)  (+ .ready)
    commits/<version>.update.dlc         the update published as this version
    commits/<version>.state.dlc          the fragment's Theta, momentum and carry after it
    commits/<version>.ready              marker: fragment, merged and retired payload keys

A version exists once its marker exists; the marker is written after both files, and
before the update is published to any region.  The markers together are the ledger of
consumed payloads, so a syncer killed at any instant restarts from its commits with no
arrival lost and none merged twice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from diloco_cli.codec import CodecSpec, RunSecret, encode_payload, read_header
from diloco_cli.core.types import FragmentIndex, Version
from diloco_cli.store.objects import MARKER_SUFFIX, ObjectStore

MARKER_SPEC = CodecSpec(zstd_level=0)
COMMIT_MARKER = re.compile(r"^commits/(?P<version>\d{10})\.ready$")


@dataclass(frozen=True)
class Commit:
    """A committed version, as its marker records it."""

    version: Version
    fragment: FragmentIndex
    merged: tuple[str, ...]
    """Payload keys (``<region>:<key>``) merged into this version."""
    retired: tuple[str, ...]
    """Payload keys superseded by a newer one of the same learner, consumed unmerged."""
    meta: dict[str, Any]


class SyncerHome:
    def __init__(self, root: str, storage_options: dict[str, Any] | None, secret: RunSecret) -> None:
        self.store = ObjectStore(root, storage_options)
        self._secret = secret

    def _marker(self, meta: dict[str, Any]) -> bytes:
        return encode_payload([], MARKER_SPEC, self._secret, meta)

    def write_initial(self, payload: bytes) -> None:
        self.store.put_marked("initial.dlc", payload, self._marker({"version": 0}))

    def read_initial(self) -> bytes | None:
        if not self.store.exists("initial.dlc" + MARKER_SUFFIX):
            return None
        return self.store.get("initial.dlc")

    def commit(self, version: Version, fragment: FragmentIndex, update: bytes, state: bytes, merged: list[str], retired: list[str], meta: dict[str, Any]) -> None:
        """Make a version durable: both payloads first, the marker (the ledger entry) last."""
        stem = f"commits/{version:010d}"
        self.store.put(f"{stem}.update.dlc", update)
        self.store.put(f"{stem}.state.dlc", state)
        record = {**meta, "version": version, "fragment": fragment, "merged": merged, "retired": retired}
        self.store.put(f"{stem}{MARKER_SUFFIX}", self._marker(record))

    def commits(self) -> list[Commit]:
        """Every committed version, oldest first (markers verified)."""
        found = []
        for key in self.store.list("commits"):
            match = COMMIT_MARKER.match(key)
            if not match:
                continue
            meta = read_header(self.store.get(key), self._secret).meta
            found.append(
                Commit(
                    version=Version(int(meta["version"])),
                    fragment=FragmentIndex(int(meta["fragment"])),
                    merged=tuple(meta["merged"]),
                    retired=tuple(meta["retired"]),
                    meta=meta,
                )
            )
        return found

    def read_update(self, version: Version) -> bytes:
        return self.store.get(f"commits/{version:010d}.update.dlc")

    def read_state(self, version: Version) -> bytes:
        return self.store.get(f"commits/{version:010d}.state.dlc")

    def delete_state(self, version: Version) -> None:
        """Drop a superseded fragment state (the marker and update stay: ledger, window)."""
        self.store.delete(f"commits/{version:010d}.state.dlc")

    def delete_update(self, version: Version) -> None:
        self.store.delete(f"commits/{version:010d}.update.dlc")
