"""The syncer's side of a run's membership: who counts in M, and its notes to learners.

``diloco scale`` changes a running run by rewriting its manifest (the file the syncer
was started with, and every bucket's copy): learners added, learners told to drain.
The syncer follows the manifest (:class:`ManifestWatch`), and tells each learner what
concerns it through its control note (``control/<learner>.json``, sealed with the run's
key, read by the learner at every poll): drain now, and which slice of the data to train
on now that the number of active learners changed.  The syncer is the only writer of
control notes (resync requests go through them too, :class:`ControlNotes`), so a note
never loses another's field.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from diloco_cli.codec import PayloadError
from diloco_cli.core.fragments import dynamic_sync_intervals
from diloco_cli.core.types import FragmentIndex, LearnerId
from diloco_cli.store.documents import ControlNote
from diloco_cli.store.filesystem import StorageError, absolute_url
from diloco_cli.store.region import RegionBucket
from diloco_cli.store.run_spec import ManifestError, RunSpec, read_run_spec

log = logging.getLogger("diloco.syncer")

REMOTE_MANIFEST_SECONDS = 15.0
"""How often a manifest in a bucket is read again (a local file: when it changes)."""


class ManifestWatch:
    """Reads the run's manifest again when it changed (a local file: its modification
    time; a URL: every :data:`REMOTE_MANIFEST_SECONDS`)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url, self.storage_options = url, storage_options or {}
        self.local = "://" not in url or url.startswith("file://")
        self.path = url.removeprefix("file://")
        self.seen: float | None = self._modified() if self.local else time.monotonic()

    def _modified(self) -> float | None:
        try:
            return os.stat(self.path).st_mtime_ns / 1e9
        except OSError:
            return None

    def changed(self) -> RunSpec | None:
        """The manifest as it is now when it may have changed since the last look, else
        None.  A manifest that cannot be read now is logged and looked at again later."""
        if self.local:
            modified = self._modified()
            if modified is None or modified == self.seen:
                return None
        else:
            modified = time.monotonic()
            if self.seen is not None and modified - self.seen < REMOTE_MANIFEST_SECONDS:
                return None
        try:
            spec = read_run_spec(absolute_url(self.url), self.storage_options)
        except (ManifestError, StorageError, OSError) as error:
            log.warning("could not read the run's manifest again (%s); keeping the learners as they are", error)
            return None
        self.seen = modified
        return spec


class ControlNotes:
    """Every learner's control note as last written, and the notes still to deliver."""

    def __init__(self, buckets: dict[str, RegionBucket], refused) -> None:
        self.buckets = buckets
        self.refused = refused
        """Called with (region, kind, key, error) for a note that fails verification."""
        self.notes: dict[LearnerId, ControlNote] = {}
        self.due: dict[LearnerId, str] = {}
        """Learner -> its region, for notes written here but not delivered yet."""

    def note(self, learner: LearnerId, region: str) -> ControlNote:
        """The learner's note as the syncer wrote it last (read once from its bucket)."""
        if learner not in self.notes:
            try:
                self.notes[learner] = self.buckets[region].read_control(learner)
            except PayloadError as error:
                self.refused(region, "control", f"control/{learner}.json", error)
                self.notes[learner] = ControlNote()
        return self.notes[learner]

    def update(self, learner: LearnerId, region: str, deliver_now: bool = True, **changes: Any) -> None:
        """Change the learner's note and deliver it (now, or at a later :meth:`deliver`)."""
        note = self.note(learner, region)
        self.notes[learner] = note.model_copy(update={**changes, "time": time.time()})
        self.due[learner] = region
        if deliver_now:
            self.deliver([learner])

    def resync(self, learner: LearnerId, region: str, fragment: FragmentIndex, reason: str) -> None:
        serial = self.note(learner, region).resync_serial + 1
        self.update(learner, region, resync_serial=serial, fragment=fragment, reason=reason)

    def deliver(self, learners: list[LearnerId] | None = None, skip: set[str] = frozenset()) -> None:
        """Write the notes still due (those given, or all) but to the regions in
        ``skip`` (unreachable now); what fails stays due."""
        for learner in list(self.due if learners is None else learners):
            region = self.due[learner]
            if region in skip:
                continue
            try:
                self.buckets[region].write_control(learner, self.notes[learner])
            except StorageError as error:
                log.warning(
                    "could not write the note to %s in region %s (tried again later): %s", learner, region, error
                )
                continue
            del self.due[learner]

    def follow_speeds(self, spec: RunSpec, step_seconds: dict[LearnerId, float], skip: set[str] = frozenset()) -> None:
        """Under dynamic local updates, each live learner's H_m from its step time; a
        note is written when H_m moved by more than a tenth of H (step times jitter)."""
        H = spec.recipe.sync.sync_interval
        for learner, interval in dynamic_sync_intervals(H, step_seconds).items():
            region = spec.learner(learner).region
            if region in skip:
                continue
            try:
                current = self.note(learner, region).sync_interval or H
            except StorageError:
                continue
            if abs(interval - current) >= max(1, H // 10):
                self.update(learner, region, deliver_now=False, sync_interval=interval)

    def follow(self, spec: RunSpec, skip: set[str] = frozenset()) -> None:
        """Bring every learner's note in line with the run's membership: drain for the
        learners told to, and each active learner's slice of the data once the run was
        scaled (before that, every learner keeps the slice it started with)."""
        for learner in spec.learners:
            if learner.region in skip and learner.id not in self.notes:
                continue  # its note is read once the region is back
            try:
                note = self.note(learner.id, learner.region)
            except StorageError as error:
                log.warning("could not read the note to %s (tried again later): %s", learner.id, error)
                continue
            wanted: dict[str, Any] = {"drain": learner.drain}
            if spec.scaling and not learner.drain:
                wanted["data_slice"], wanted["data_slices"] = spec.data_partition(learner.id)
            if any(getattr(note, key) != value for key, value in wanted.items()):
                self.update(learner.id, learner.region, deliver_now=False, **wanted)
