"""Commands that launchers start on each machine (hidden from ``--help``)."""

from __future__ import annotations

import copy
import json
import logging
import sys

import typer

MANIFEST_HELP = "URL of the run's manifest (a bucket's manifest.json, or a local run.json)."


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stdout)


def learner(
    manifest: str = typer.Option(..., help=MANIFEST_HELP),
    learner_id: str = typer.Option(..., "--learner", help="This learner's id in the run."),
    secret_file: str = typer.Option(..., help="File holding the run's secret."),
    storage_options: str = typer.Option("{}", help="JSON storage options to read the manifest."),
) -> None:
    """Run one learner (one rank of it under torchrun): the built-in loop, or the
    recipe's ``training.entry_point`` script."""
    from diloco_cli.runtime.entry_point import run_entry_point
    from diloco_cli.runtime.learner.loop import Learner
    from diloco_cli.runtime.membership import ManifestWatch
    from diloco_cli.store.run_spec import read_run_spec, read_secret

    _logging()
    options = json.loads(storage_options)
    watch = ManifestWatch(manifest, options)  # before the read: a change in between is seen
    spec = read_run_spec(manifest, options)
    if spec.recipe.training.entry_point:
        raise typer.Exit(run_entry_point(spec, manifest, learner_id, secret_file, options))
    raise typer.Exit(Learner(spec, learner_id, read_secret(secret_file), watch).run())


def syncer(
    manifest: str = typer.Option(..., help=MANIFEST_HELP),
    secret_file: str = typer.Option(..., help="File holding the run's secret."),
    storage_options: str = typer.Option("{}", help="JSON storage options to read the manifest."),
    shard: int = typer.Option(0, min=0, help="The syncer shard this process is (sync.shards)."),
) -> None:
    """Run the syncer (one shard of it)."""
    from diloco_cli.runtime.membership import ManifestWatch
    from diloco_cli.runtime.syncer.loop import Syncer
    from diloco_cli.store.run_spec import read_run_spec, read_secret

    _logging()
    options = json.loads(storage_options)
    watch = ManifestWatch(manifest, options)  # before the read: a change in between is seen
    spec = read_run_spec(manifest, options)
    raise typer.Exit(Syncer(spec, read_secret(secret_file), manifest=watch, syncer_shard=shard).run())


def reducer(
    manifest: str = typer.Option(..., help=MANIFEST_HELP),
    region: str = typer.Option(..., help="The region whose sends this reducer merges."),
    secret_file: str = typer.Option(..., help="File holding the run's secret."),
    storage_options: str = typer.Option("{}", help="JSON storage options to read the manifest."),
) -> None:
    """Run a region's reducer (for each syncer shard)."""
    from diloco_cli.runtime.membership import ManifestWatch
    from diloco_cli.runtime.reducer.loop import Reducer, run_reducers
    from diloco_cli.store.run_spec import read_run_spec, read_secret

    _logging()
    options = json.loads(storage_options)
    watch = ManifestWatch(manifest, options)  # before the read: a change in between is seen
    spec = read_run_spec(manifest, options)
    secret = read_secret(secret_file)
    reducers = [  # one per syncer shard, each following the manifest with a watch of its own
        Reducer(spec, region, secret, manifest=copy.copy(watch), syncer_shard=shard.index)
        for shard in spec.syncer_shards
    ]
    raise typer.Exit(run_reducers(reducers))


def chaos(
    run: str = typer.Option(..., help="The run."),
    runs_dir: str = typer.Option(..., help="Where the run's record is."),
) -> None:
    """Inject the process faults of a run's chaos plan (``diloco up --chaos``)."""
    from pathlib import Path

    from diloco_cli.launch.chaos import ChaosDriver
    from diloco_cli.launch.runs import load_run

    _logging()
    raise typer.Exit(ChaosDriver(load_run(Path(runs_dir), run)).run())


def probe(
    url: str = typer.Option(..., help="Bucket URL (a run's root)."),
    storage_options: str = typer.Option("{}", help="JSON storage options."),
) -> None:
    """Write, read and delete a probe object (preflight runs this on each host)."""
    from diloco_cli.store.filesystem import StorageError
    from diloco_cli.store.objects import ObjectStore

    try:
        ObjectStore(url, json.loads(storage_options)).probe()
    except StorageError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    typer.echo("ok")


def register(app: typer.Typer) -> None:
    app.command("_learner", hidden=True)(learner)
    app.command("_syncer", hidden=True)(syncer)
    app.command("_reducer", hidden=True)(reducer)
    app.command("_probe", hidden=True)(probe)
    app.command("_chaos", hidden=True)(chaos)
