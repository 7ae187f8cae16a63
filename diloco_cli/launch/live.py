"""Changing a running run: check that it runs, and publish its manifest anew.

``diloco scale`` (learners added or drained) and ``diloco chaos`` (a chaos plan given
to a running run) change the run's manifest.  Every process that must act on a change
follows the manifest (:class:`diloco_cli.runtime.membership.ManifestWatch`): the syncer
for learners and outages, each learner for its region's outages.
"""

from __future__ import annotations

from diloco_cli.config.errors import ConfigError
from diloco_cli.launch.resolve import write_manifests
from diloco_cli.launch.runs import RunRecord
from diloco_cli.store.documents import SyncerPhase
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.run_spec import RunSpec


def check_running(record: RunRecord, verb: str) -> None:
    """A run can be changed while its syncer runs (it is the one that follows)."""
    phases = []
    for bucket in record.spec.buckets(record.secret()):
        try:
            status = bucket.read_syncer_status()
        except (StorageError, ValueError):
            continue
        if status is not None:
            phases.append(status.state)
    if SyncerPhase.FINISHED in phases:
        raise ConfigError(f"run {record.name} has finished; there is nothing to {verb}")
    if phases and all(phase == SyncerPhase.STOPPED for phase in phases):
        raise ConfigError(f"run {record.name} is stopped; `diloco resume {record.name}` first, then {verb} it")


def publish_spec(record: RunRecord, spec: RunSpec) -> None:
    """The run as it is now, everywhere a process or a view reads it: every bucket's
    manifest, each SSH host's copy, and (last, since the syncer of a local run follows
    it) the run record here."""
    write_manifests(spec)
    hosts = sorted(({learner.host for learner in spec.learners} | {spec.syncer.host}) - {"local"})
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
