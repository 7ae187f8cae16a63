"""Changing a running run: check that it runs, and publish its manifest anew.

``diloco scale`` (learners added or drained) and ``diloco chaos`` (a chaos plan given
to a running run) change the run's manifest.  Every process that must act on a change
follows the manifest (:class:`diloco_cli.runtime.membership.ManifestWatch`): the syncer
for learners and outages, each learner for its region's outages.
"""

from __future__ import annotations

import time

from diloco_cli.config.errors import ConfigError
from diloco_cli.launch.processes import belongs_to, is_running
from diloco_cli.launch.resolve import write_manifests
from diloco_cli.launch.runs import SYNCER_SILENT_SECONDS, RunRecord
from diloco_cli.store.documents import SyncerPhase
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.run_spec import RunSpec


def check_running(record: RunRecord, verb: str) -> None:
    """A run can be changed while its syncer runs: it is the one that follows the
    manifest, tells drained learners to leave and merges the new ones.  A change made
    while it is down would wait, unsaid, until ``resume``; it is refused instead."""
    spec, name = record.spec, record.name
    for shard in spec.syncer_shards:  # every shard follows the manifest: each must be up
        statuses = []
        for bucket in spec.buckets(record.secret()):
            try:
                status = bucket.for_syncer_shard(spec.syncer_shard(shard.index)).read_syncer_status()
            except (StorageError, ValueError):
                continue
            if status is not None:
                statuses.append(status)
        phases = [status.state for status in statuses]
        if SyncerPhase.FINISHED in phases:
            raise ConfigError(f"run {name} has finished; there is nothing to {verb}")
        if phases and all(phase == SyncerPhase.STOPPED for phase in phases):
            raise ConfigError(f"run {name} is stopped; `diloco resume {name}` first, then {verb} it")
        down = _syncer_down(record, shard.name, max((status.time for status in statuses), default=None))
        if down:
            who, role = ("the syncer", "the one") if shard.name == "syncer" else (shard.name, "one of those")
            raise ConfigError(
                f"{who} of run {name} is down ({down}), and it is {role} that carries a {verb} out; "
                f"`diloco resume {name}` starts it again, then {verb} the run"
            )


def _syncer_down(record: RunRecord, syncer: str, reported_at: float | None) -> str | None:
    """Why the run's syncer (shard) ``syncer`` is down, or None: its supervisor here gave
    up or is gone (or it never started), or, on an SSH host, it has not reported for a while."""
    if record.placement()[syncer] == "local":
        process = next((p for p in record.processes if p["name"] == syncer), None)
        if process is None:
            return "it was never started"
        state = (record.process_state(syncer) or {}).get("state", "unknown")
        if state == "failed":
            return "its supervisor gave up after repeated crashes"
        if not (is_running(process["pid"]) and belongs_to(process["pid"], record.directory)):
            return "its supervisor is gone"
        return None
    if reported_at is not None and time.time() - reported_at > SYNCER_SILENT_SECONDS:
        return f"it has not reported for {time.time() - reported_at:.0f} s"
    return None


def publish_spec(record: RunRecord, spec: RunSpec) -> None:
    """The run as it is now, everywhere a process or a view reads it: every bucket's
    manifest, each SSH host's copy, and (last, since the syncer of a local run follows
    it) the run record here."""
    write_manifests(spec)
    hosts = sorted(({learner.host for learner in spec.learners} | {s.host for s in spec.syncer_shards}) - {"local"})
    if hosts:
        from diloco_cli.launch.remote import connect_recorded_host, install_run_files, remote_paths

        for name in hosts:
            client, host = connect_recorded_host(record.hosts, record.ssh, name)
            try:
                install_run_files(client, remote_paths(client, host, spec.run), spec, record.secret())
            finally:
                client.close()
    record.document["spec"] = spec.model_dump(mode="json")
    record.__dict__.pop("spec", None)  # the cached, validated spec of before
    record.save()
