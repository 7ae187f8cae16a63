"""``diloco up``: plan, check (preflight on every host), install, start."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from diloco_cli.config.chaos import parse_chaos
from diloco_cli.config.errors import ConfigError
from diloco_cli.config.files import load_recipe, load_regions
from diloco_cli.config.regions import RegionsFile
from diloco_cli.launch.bootstrap import bootstrap_host, build_distribution
from diloco_cli.launch.devices import found_gpus, with_devices
from diloco_cli.launch.interrupts import NOTHING_STARTED, Interrupted, held_back
from diloco_cli.launch.local import process_records_json, start_chaos_driver, start_local
from diloco_cli.launch.preflight import HostReport, preflight, probe_buckets_from_hosts
from diloco_cli.launch.processes import ProcessRecord, is_running, stop_supervised
from diloco_cli.launch.remote import install_run_files, remote_paths, start_services
from diloco_cli.launch.resolve import (
    Sources,
    check_buckets,
    check_data_source,
    check_new_run,
    check_region_data_sources,
    check_sequence_length,
    create_run_directory,
    new_run_name,
    remove_manifests,
    resolve_data_source,
    resolve_entry_point,
    resolve_run,
    syncer_here,
    with_chaos,
    write_manifests,
)
from diloco_cli.launch.runs import write_run_record
from diloco_cli.launch.services import services
from diloco_cli.store.filesystem import protocol_of
from diloco_cli.store.run_spec import RunSpec

Emit = Callable[[str], None]
"""Receives a line of progress to show."""
ShowPreflight = Callable[[list[HostReport]], None]
"""Receives the preflight reports to show (the CLI renders them)."""


class StartError(ConfigError):
    """A host failed preflight, or a process of the run could not start."""


@dataclass
class Launch:
    spec: RunSpec
    run_dir: Path | None
    started: list[str]
    preflight: list[HostReport] = field(default_factory=list)
    interrupted: bool = False
    """Ctrl-C came while the processes were being started: the start was finished (and
    announced) instead of leaving them half-started; the run goes on."""


Announce = Callable[[RunSpec], None]
"""Receives the run as soon as it is started, to say so (its name, how to stop it)."""


def resolve(
    recipe_path: Path | None,
    regions_path: Path | None,
    overrides: list[str],
    name: str | None,
    runs_dir: Path,
    chaos: str | None = None,
) -> tuple[RunSpec, RegionsFile, Sources]:
    """The run as it would start: configuration loaded, validated and placed."""
    sources = Sources(
        recipe=str(recipe_path) if recipe_path else Sources.recipe,
        regions=str(regions_path) if regions_path else Sources.regions,
    )
    recipe = load_recipe(recipe_path, overrides)
    regions = load_regions(regions_path)
    recipe = resolve_data_source(recipe)
    check_data_source(recipe, sources)
    check_region_data_sources(recipe, regions, sources)
    check_sequence_length(recipe, sources)
    recipe = resolve_entry_point(recipe, sources)
    spec = resolve_run(recipe, regions, name or new_run_name(recipe), runs_dir, sources)
    if chaos:
        spec = with_chaos(spec, parse_chaos(chaos))
    return spec, regions, sources


def _extras(spec: RunSpec) -> list[str]:
    """The package extras every host needs for this run: its storage backends, and
    ``transformers`` for a Hugging Face model."""
    protocols = {protocol_of(region.root) for region in spec.regions} | {
        protocol_of(shard.home) for shard in spec.syncer_shards
    }
    extras = {"s3" for p in protocols if p in ("s3", "s3a")} | {"gcs" for p in protocols if p in ("gs", "gcs")}
    if spec.recipe.model.factory.startswith("diloco_cli.models.hf:"):
        extras.add("hf")
    return sorted(extras)


def launch(
    recipe_path: Path | None,
    regions_path: Path | None,
    overrides: list[str],
    name: str | None,
    runs_dir: Path,
    dry_run: bool,
    accept_new_host_keys: bool = False,
    emit: Emit = lambda line: None,
    show_preflight: ShowPreflight = lambda reports: None,
    chaos: str | None = None,
    announce: Announce = lambda spec: None,
) -> Launch:
    """Check, install and start a run (or, ``dry_run``, only check it).  A Ctrl-C before
    the first process starts removes what was made and raises :class:`Interrupted`; one
    after it is held back until every process is started, recorded and ``announce``d."""
    announced: list[RunSpec] = []

    def announce_once(spec: RunSpec) -> None:
        announce(spec)
        announced.append(spec)

    try:
        return _launch(
            recipe_path,
            regions_path,
            overrides,
            name,
            runs_dir.resolve(),  # processes start elsewhere: every path they get is absolute
            dry_run,
            accept_new_host_keys,
            emit,
            show_preflight,
            chaos,
            announce_once,
        )
    except KeyboardInterrupt:
        if announced:  # a Ctrl-C right after the start was said: the run goes on, as said
            run = announced[0].run
            raise Interrupted(f"interrupted: run {run} goes on; `diloco down {run}` stops it") from None
        raise Interrupted(NOTHING_STARTED) from None


def _launch(
    recipe_path: Path | None,
    regions_path: Path | None,
    overrides: list[str],
    name: str | None,
    runs_dir: Path,
    dry_run: bool,
    accept_new_host_keys: bool,
    emit: Emit,
    show_preflight: ShowPreflight,
    chaos: str | None,
    announce: Announce,
) -> Launch:
    spec, regions, sources = resolve(recipe_path, regions_path, overrides, name, runs_dir, chaos)
    check_new_run(runs_dir, spec.run)
    reports = preflight(regions, accept_new_host_keys)
    try:
        if reports:
            show_preflight(reports)
        if any(report.problem for report in reports):
            raise StartError(f"preflight failed on {sum(1 for r in reports if r.problem)} host(s); nothing was started")
        spec = with_devices(spec, regions, found_gpus(regions, {report.host.name: report.facts for report in reports}))
        if dry_run:  # what the real one checks before it starts anything (hosts probe theirs in preflight)
            if syncer_here(spec):
                check_buckets(spec, sources)
            return Launch(spec, None, [], reports)
        note = (
            f"\ninterrupted: run {spec.run} is starting; it finishes starting, so that nothing runs unnamed, "
            f"and goes on (`diloco down {spec.run}` stops it)\n"
        )
        with ExitStack() as starting:
            run_dir, secret = create_run_directory(runs_dir, spec, launcher="ssh" if reports else "local")
            try:
                if reports:
                    _install_everywhere(reports, spec, runs_dir, emit, show_preflight)
                if syncer_here(spec):
                    check_buckets(spec, sources)
                write_manifests(spec)
                interruption = starting.enter_context(held_back(note))  # from here on, a Ctrl-C waits
            except KeyboardInterrupt:  # nothing started: nothing of the run is left
                remove_manifests(spec)  # the buckets answered: they were just probed
                shutil.rmtree(run_dir)
                raise
            except BaseException:  # nothing started, nothing half-made left behind
                shutil.rmtree(run_dir)
                raise
            records: list[ProcessRecord] = []
            try:
                records += start_local(spec, run_dir, [s.name for s in services(spec) if s.host == "local"])
                check_started(records, run_dir)
                _start_on_hosts(reports, spec, secret, emit, records)
                if spec.chaos is not None and spec.chaos.has_process_faults:
                    records.append(start_chaos_driver(run_dir))
            finally:
                write_run_record(
                    run_dir,
                    {
                        "spec": json.loads(spec.to_json()),
                        "launcher": "ssh" if reports else "local",
                        "processes": process_records_json(records),
                        "hosts": {host.name: host.model_dump(mode="json") for host in regions.remote_hosts()},
                        "ssh": regions.ssh.model_dump(mode="json"),
                    },
                )
            announce(spec)
        return Launch(spec, run_dir, [record.name for record in records], reports, interruption.happened)
    finally:
        for report in reports:
            if report.client is not None:
                report.client.close()


def _install_everywhere(
    reports: list[HostReport], spec: RunSpec, runs_dir: Path, emit: Emit, show_preflight: ShowPreflight
) -> None:
    """Build (once), copy and install the project on every host, then probe each host's
    buckets from the host itself."""
    distribution = build_distribution(runs_dir / ".wheels")
    extras = _extras(spec)

    def install(report: HostReport) -> str:
        started = time.monotonic()
        outcome = bootstrap_host(report.client, report.host, distribution, extras)
        emit(f"  {report.host.name}: diloco {outcome} ({time.monotonic() - started:.1f} s)")
        return outcome

    emit(f"installing diloco ({distribution.source_hash}) on {len(reports)} host(s)")
    with ThreadPoolExecutor(max_workers=min(16, len(reports))) as pool:
        list(pool.map(install, reports))
    roots = {region.name: (region.root, region.storage_options) for region in spec.regions}
    paths = {report.host.name: remote_paths(report.client, report.host, spec.run) for report in reports}
    probe_buckets_from_hosts(
        reports, roots, {name: p.venv for name, p in paths.items()}, {name: p.run_dir for name, p in paths.items()}
    )
    if any(report.problem for report in reports):
        show_preflight(reports)
        raise StartError("a bucket cannot be used from a host; nothing was started")
    for report in reports:  # a cluster's bucket was probed in a job: say which
        if report.host.slurm is not None:
            emit(f"  {report.host.name}: bucket {report.checks['bucket']}")


def _start_on_hosts(reports: list[HostReport], spec: RunSpec, secret, emit: Emit, records: list[ProcessRecord]) -> None:
    """Start the run's processes on its SSH hosts, each appended to ``records`` as soon as
    it runs (so that a host failing half-way leaves the others recorded)."""
    for report in reports:
        host, client = report.host, report.client
        paths = remote_paths(client, host, spec.run)
        install_run_files(client, paths, spec, secret)
        names = [service.name for service in services(spec) if service.host == host.name]
        for name in names:
            records += start_services(client, host, paths, spec, [name], int(report.facts.get("cores", 1)))
        emit(f"  {host.name}: started {', '.join(names) or 'nothing'}")


def check_started(records: list[ProcessRecord], run_dir: Path, grace_seconds: float = 1.5) -> None:
    """Fail loudly if a local process dies at once (a broken environment), with its log.
    A process that already finished (a very short run) is not a failure."""
    time.sleep(grace_seconds)
    dead = []
    for record in records:
        state = run_dir / "processes" / f"{record.name}.json"
        finished = state.exists() and json.loads(state.read_text()).get("state") == "finished"
        if not finished and not is_running(record.pid):
            dead.append(record)
    if dead:
        stop_supervised(records, run_dir, timeout=5)
        log = (run_dir / "logs" / f"{dead[0].name}.log").read_text(errors="replace")[-2000:]
        raise StartError(
            f"{', '.join(r.name for r in dead)} exited right after starting; the run is stopped. "
            f"End of {run_dir}/logs/{dead[0].name}.log:\n{log}"
        )
