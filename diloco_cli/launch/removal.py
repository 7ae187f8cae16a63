"""Removing runs: their record here, their objects in every region's bucket, the
syncer's home and their folders on SSH hosts.

Only what is the run's own is removed: a region's run root and the syncer's home are
deleted only when their URL names the run (a shared prefix is never emptied), and a
run whose processes still run here is refused (stop it first).
"""

from __future__ import annotations

import shlex
import shutil
import time
from dataclasses import dataclass, field

from diloco_cli.config.errors import ConfigError
from diloco_cli.launch.processes import belongs_to, is_running
from diloco_cli.launch.runs import RunRecord, list_runs, summarize_run


@dataclass
class Removal:
    """What removing a run deletes (and, once done, what could not be)."""

    run: str
    directory: str
    stores: list[tuple[str, dict]] = field(default_factory=list)
    """Object store URLs (with their storage options) that are the run's own."""
    hosts: list[str] = field(default_factory=list)
    """SSH hosts holding the run's folder."""
    skipped: list[str] = field(default_factory=list)
    """What is left alone or could not be removed, with why."""

    @property
    def places(self) -> list[str]:
        return [
            self.directory,
            *(url for url, _ in self.stores),
            *(f"host {name}: the run's folder" for name in self.hosts),
        ]


def runs_to_prune(runs_dir, older_than_days: float) -> list[RunRecord]:
    """Runs that finished (or were stopped) more than ``older_than_days`` ago."""
    cutoff = time.time() - older_than_days * 86400
    return [
        record
        for record in list_runs(runs_dir)
        if record.created < cutoff and summarize_run(record).state in ("finished", "stopped")
    ]


def plan_removal(record: RunRecord) -> Removal:
    if any(
        process.get("host", "local") == "local"
        and is_running(process["pid"])
        and belongs_to(process["pid"], record.directory)
        for process in record.processes
    ):
        raise ConfigError(f"run {record.name} is running here; stop it first with `diloco down {record.name}`")
    spec = record.spec
    removal = Removal(record.name, str(record.directory), hosts=sorted(record.hosts))
    places = [(region.root, region.storage_options, f"region {region.name}'s objects") for region in spec.regions]
    places += [(shard.home, shard.storage_options, f"the {shard.name}'s home") for shard in spec.syncer_shards]
    for url, options, what in places:
        if f"/{record.name}" in url:
            removal.stores.append((url, options))
        else:
            removal.skipped.append(f"{what} at {url}: its URL does not name the run, so it may hold other runs")
    return removal


def remove_run(record: RunRecord, removal: Removal) -> Removal:
    """Delete every place of ``removal``; what cannot be reached goes to ``skipped``, and
    the run's record here stays until everything else is gone (to try again)."""
    from diloco_cli.store.objects import ObjectStore

    failed = False
    for url, options in removal.stores:
        try:
            ObjectStore(url, options).remove_everything()
        except Exception as error:
            removal.skipped.append(f"{url}: {type(error).__name__}: {error}")
            failed = True
    for host_name in removal.hosts:
        try:
            _remove_on_host(record, host_name)
        except Exception as error:
            removal.skipped.append(f"host {host_name}: {type(error).__name__}: {error}")
            failed = True
    if not failed:
        shutil.rmtree(record.directory)
    return removal


def _remove_on_host(record: RunRecord, host_name: str) -> None:
    from diloco_cli.launch.remote import connect_recorded_host, remote_paths
    from diloco_cli.launch.ssh import run

    client, host = connect_recorded_host(record.hosts, record.ssh, host_name)
    try:
        run_dir = remote_paths(client, host, record.name).run_dir
        result = run(client, f"rm -rf -- {shlex.quote(run_dir)}")
        if result.code != 0:
            raise ConfigError(f"host {host_name}: {result.stderr.strip()[-300:]}")
    finally:
        client.close()
