"""Resolving a run: recipe + regions -> a RunSpec, checked before anything starts.

Everything a user can get wrong is checked here, and reported with the file and key or
the bucket it concerns: the learner count, the data source, every bucket (a probe object
is written, read and deleted).  Only then is the run directory created.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco_cli.codec import RunSecret
from diloco_cli.config.chaos import ChaosPlan
from diloco_cli.config.errors import ConfigError
from diloco_cli.config.recipe import Recipe
from diloco_cli.config.regions import RegionsFile, SyncerPlacement
from diloco_cli.core.types import RegionName
from diloco_cli.data.corpora import BUILTIN_CORPORA, BUILTIN_PREFIX
from diloco_cli.data.tokens.index import DatasetError
from diloco_cli.data.tokens.storage import Location, read_index
from diloco_cli.launch.runs import write_run_record
from diloco_cli.models.context import model_context, model_vocabulary
from diloco_cli.store.filesystem import StorageError, absolute_path, absolute_url, open_filesystem
from diloco_cli.store.objects import ObjectStore
from diloco_cli.store.run_spec import LearnerSpec, ReducerSpec, RegionSpec, RunSpec, SyncerShardSpec, SyncerSpec

RUN_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


@dataclass(frozen=True)
class Sources:
    """Where the configuration came from, for error messages."""

    recipe: str = "the default recipe"
    regions: str = "the default regions (regions/local.yaml)"


def new_run_name(recipe: Recipe) -> str:
    return f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def resolve_run(
    recipe: Recipe, regions: RegionsFile, run: str, runs_dir: Path, sources: Sources = Sources()
) -> RunSpec:
    """Resolve a run; raises ConfigError naming the file and key of any inconsistency."""
    if not RUN_NAME.match(run):
        raise ConfigError(f"run name {run!r}: use lowercase letters, digits and dashes (at most 63)")
    placements = regions.learner_placements()
    if len(placements) != recipe.training.num_learners:
        raise ConfigError(
            f"{sources.regions}: the regions place {len(placements)} learners (sum of hosts[].learners), "
            f"but {sources.recipe} sets training.num_learners: {recipe.training.num_learners}; make them equal"
        )
    hosts = {host.name for region in regions.regions for host in region.hosts}
    syncer_host = regions.syncer_host()
    if syncer_host != "local" and syncer_host not in hosts:
        raise ConfigError(f"{sources.regions}: syncer.host {syncer_host!r} is not 'local' nor a host of any region")
    learners = tuple(
        LearnerSpec(
            id=learner,
            region=RegionName(region.name),
            host=host.name,
            shard=index,
            processes=host.processes_per_learner,
        )
        for index, (learner, region, host) in enumerate(placements)
    )
    region_specs = tuple(
        RegionSpec(
            name=RegionName(region.name),
            root=absolute_url(region.run_root(run, str(runs_dir))),
            storage_options=region.storage_options,
            data_source=region.data_source and absolute_path(region.data_source),
            data_storage_options=region.data_storage_options,
        )
        for region in regions.regions
    )
    syncer_region = regions.syncer_region()
    home, home_options = _syncer_home(regions, syncer_host, syncer_region, run, runs_dir)
    syncer = SyncerSpec(
        host=syncer_host,
        home=home,
        storage_options=home_options,
        region=syncer_region,
        shards=_syncer_shards(recipe, regions, run, runs_dir, sources),
    )
    reducers = tuple(ReducerSpec(region=RegionName(region.name), host=region.reducer) for region in regions.regions)
    return RunSpec(
        run=run,
        created=time.time(),
        recipe=recipe,
        learners=learners,
        regions=region_specs,
        syncer=syncer,
        reducers=reducers,
    )


def _syncer_home(
    regions: RegionsFile, host: str, region: str | None, run: str, runs_dir: Path
) -> tuple[str, dict[str, Any]]:
    """The home (URL, storage options) of a syncer on ``host`` in ``region``."""
    if host != "local" and region and regions.syncer.home == SyncerPlacement.model_fields["home"].default:
        # the syncer runs on a region's host: its home is beside the run in that region's
        # bucket (in the region, and readable wherever the bucket is: scale, rm, audits)
        config = regions.region(region)
        return f"{config.run_root(run, str(runs_dir))}/syncer", config.storage_options
    home = absolute_url(regions.syncer.home.replace("{runs_dir}", str(runs_dir)).replace("{run}", run))
    return home, regions.syncer.storage_options


def _syncer_shards(
    recipe: Recipe, regions: RegionsFile, run: str, runs_dir: Path, sources: Sources
) -> tuple[SyncerShardSpec, ...]:
    """Each syncer shard's place and home (none with one syncer)."""
    count, named = recipe.sync.shards, regions.syncer.shard_hosts
    if named is not None and len(named) != count:
        raise ConfigError(
            f"{sources.regions}: syncer.shard_hosts names {len(named)} host(s), but {sources.recipe} sets "
            f"sync.shards: {count}; name one host per shard"
        )
    if count == 1:
        return ()
    hosts = {host.name for region in regions.regions for host in region.hosts}
    for host in named or ():
        if host != "local" and host not in hosts:
            raise ConfigError(
                f"{sources.regions}: syncer.shard_hosts: {host!r} is not 'local' nor a host of any region"
            )
    shards = []
    for index, (host, region) in enumerate(regions.syncer_shard_places(count)):
        home, options = _syncer_home(regions, host, region, run, runs_dir)
        shards.append(
            SyncerShardSpec(
                index=index,
                name=f"syncer-{index}",
                host=host,
                home=f"{home.rstrip('/')}/shard-{index}",
                storage_options=options,
                region=region,
            )
        )
    return tuple(shards)


def resolve_data_source(recipe: Recipe) -> Recipe:
    """The recipe with a local ``data.source`` (a path, or a ``file://`` URL, relative or
    not) made absolute against the directory ``diloco up`` runs in, where the user meant
    it: every process of the run starts in ``runs/<run>/``."""
    source = recipe.data.source
    if source.startswith(BUILTIN_PREFIX):
        return recipe
    return recipe.model_copy(update={"data": recipe.data.model_copy(update={"source": absolute_path(source)})})


def check_data_source(recipe: Recipe, sources: Sources = Sources()) -> None:
    """The data source exists (a built-in corpus, or a file its URL names); a token
    dataset's index is read as every process of the run reads it."""
    source = recipe.data.source
    if source.startswith(BUILTIN_PREFIX):
        if source[len(BUILTIN_PREFIX) :] not in BUILTIN_CORPORA:
            raise ConfigError(
                f"{sources.recipe}: data.source {source!r}: unknown built-in corpus (available: builtin:shakespeare)"
            )
        return
    if recipe.data.is_tokens:
        check_token_dataset(recipe, source, recipe.data.storage_options, f"{sources.recipe}: data.source")
        return
    try:
        filesystem, path = open_filesystem(source, recipe.data.storage_options)
        exists = filesystem.exists(path)
    except StorageError as error:
        raise ConfigError(f"{sources.recipe}: data.source: {error}") from None
    if not exists:
        raise ConfigError(
            f"{sources.recipe}: data.source {source!r}: no such file; "
            "point it at a text file, a token dataset's index.json (diloco prepare) or builtin:shakespeare"
        )


def check_region_data_sources(recipe: Recipe, regions: RegionsFile, sources: Sources = Sources()) -> None:
    """Each region's own copy of a token dataset (its ``data_source``), read as its
    learners read it, where they run on this machine (an SSH host reads its own)."""
    if not recipe.data.is_tokens:
        return
    for region in regions.regions:
        if region.data_source and all(host.is_local for host in region.hosts):
            where = f"{sources.regions}: region {region.name!r} data_source"
            check_token_dataset(recipe, absolute_path(region.data_source), region.data_storage_options, where)


def check_token_dataset(recipe: Recipe, index_url: str, storage_options: dict[str, Any], where: str) -> None:
    """The token dataset's index reads as every process of the run reads it, and its
    token ids fit the model's vocabulary."""
    try:
        index = read_index(Location.of_index(index_url, storage_options))
    except (DatasetError, StorageError) as error:
        raise ConfigError(f"{where}: {error}") from None
    vocabulary = model_vocabulary(recipe.model.factory, recipe.model.kwargs)
    if vocabulary is not None and index.vocab_size > vocabulary.size:
        raise ConfigError(
            f"{where}: the token dataset {index_url} has a vocabulary of {index.vocab_size:,} tokens, "
            f"but the model embeds {vocabulary.size:,} ({vocabulary.setting}); set it to {index.vocab_size} "
            "or more, or prepare the dataset with a smaller --vocab-size"
        )


def check_sequence_length(recipe: Recipe, sources: Sources = Sources()) -> None:
    """``data.sequence_length`` fits the model's context (its positions)."""
    context = model_context(recipe.model.factory, recipe.model.kwargs)
    length = recipe.data.sequence_length
    if context is not None and length > context.positions:
        raise ConfigError(
            f"{sources.recipe}: data.sequence_length {length} exceeds the model's {context.positions} positions "
            f"({context.setting}); lower data.sequence_length to {context.positions} or less, or give the model "
            "more positions"
        )


def resolve_entry_point(recipe: Recipe, sources: Sources = Sources()) -> Recipe:
    """The recipe with ``training.entry_point`` made absolute (learner processes start in
    other directories); a script that is not here is an error now, not in every learner."""
    script = recipe.training.entry_point
    if not script:
        return recipe
    path = Path(script).expanduser().absolute()
    if not path.is_file():
        raise ConfigError(
            f"{sources.recipe}: training.entry_point {script!r}: no such file (the path is relative to {Path.cwd()})"
        )
    return recipe.model_copy(update={"training": recipe.training.model_copy(update={"entry_point": str(path)})})


def with_chaos(spec: RunSpec, plan: ChaosPlan) -> RunSpec:
    """The run with faults to inject (``--chaos``), its outages naming regions it has and
    its slow learners learners it has."""
    regions = [region.name for region in spec.regions]
    unknown = sorted({outage.region for outage in plan.outages} - set(regions))
    if unknown:
        raise ConfigError(
            f"--chaos: outage of {', '.join(unknown)}, not a region of this run (its regions: {', '.join(regions)})"
        )
    learners = [learner.id for learner in spec.learners]
    unknown = sorted(set(plan.slow_learners) - set(learners))
    if unknown:
        raise ConfigError(
            f"--chaos: slow-learner of {', '.join(unknown)}, not a learner of this run "
            f"(its learners: {', '.join(learners)})"
        )
    return spec.model_copy(update={"chaos": plan})


def check_buckets(spec: RunSpec, sources: Sources = Sources()) -> None:
    """Every region's bucket and the home of each syncer (shard) on this machine can be
    written, read and deleted."""
    for region in spec.regions:
        try:
            ObjectStore(region.root, region.storage_options).probe()
        except StorageError as error:
            raise StorageError(f"{sources.regions}: region {region.name!r} bucket: {error}") from None
    for shard in spec.syncer_shards:
        if shard.host != "local":
            continue
        try:
            ObjectStore(shard.home, shard.storage_options).probe()
        except StorageError as error:
            which = "syncer.home" if shard.name == "syncer" else f"syncer.home of {shard.name}"
            raise StorageError(f"{sources.regions}: {which}: {error}") from None


def syncer_here(spec: RunSpec) -> bool:
    """Whether a syncer (shard) of the run runs on this machine (its home is checked here)."""
    return any(shard.host == "local" for shard in spec.syncer_shards)


def check_new_run(runs_dir: Path, run: str) -> None:
    """No run of that name was started here (``up`` and ``up --dry-run`` alike)."""
    if (runs_dir / run).exists():
        raise ConfigError(
            f"run {run} already exists in {runs_dir}; "
            f"pick another --name, or `diloco resume {run}` to restart what of it is down"
        )


def create_run_directory(runs_dir: Path, spec: RunSpec, launcher: str) -> tuple[Path, RunSecret]:
    """``runs/<run>/`` with the run record and the secret (readable by its owner only)."""
    run_dir = runs_dir / spec.run
    check_new_run(runs_dir, spec.run)
    (run_dir / "logs").mkdir(parents=True)
    try:
        (run_dir / "processes").mkdir()
        secret = RunSecret.generate()
        secret_path = run_dir / "secret"
        descriptor = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(secret.to_hex())
        write_run_record(run_dir, {"spec": json.loads(spec.to_json()), "launcher": launcher, "processes": []})
    except BaseException:  # a Ctrl-C half-way: no half-made run
        shutil.rmtree(run_dir)
        raise
    return run_dir, secret


def write_manifests(spec: RunSpec) -> None:
    """The manifest into every region's bucket (no secret, no credential in it)."""
    for bucket in spec.buckets(None):
        bucket.write_manifest(spec.to_json())


def remove_manifests(spec: RunSpec) -> None:
    """Take back what :func:`write_manifests` wrote, as far as it got (a run interrupted
    before it started leaves nothing)."""
    for bucket in spec.buckets(None):
        try:
            bucket.delete_manifest()
        except Exception:  # as far as it gets: the run is being given up anyway
            continue
