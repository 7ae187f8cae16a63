"""Commands that launchers start on each machine (hidden from ``--help``); each imports
what it runs on its own, so that ``diloco --help`` does not pay for it."""

from __future__ import annotations

import sys

import click

from diloco_cli.cli.parameters import Whole, command, option

MANIFEST_HELP = "URL of the run's manifest (a bucket's manifest.json, or a local run.json)."


def _logging() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stdout)


def _json_options(text: str) -> dict:
    import json

    return json.loads(text)


@command(name="_learner", hidden=True)
@option("--manifest", required=True, help=MANIFEST_HELP)
@option("--learner", "learner_id", required=True, help="This learner's id in the run.")
@option("--secret-file", required=True, help="File holding the run's secret.")
@option("--storage-options", default="{}", help="JSON storage options to read the manifest.")
def learner(manifest: str, learner_id: str, secret_file: str, storage_options: str) -> None:
    """Run one learner (one rank of it under torchrun): the built-in loop, or the
    recipe's ``training.entry_point`` script."""
    from diloco_cli.runtime.entry_point import run_entry_point
    from diloco_cli.runtime.learner.loop import Learner
    from diloco_cli.runtime.membership import ManifestWatch
    from diloco_cli.store.run_spec import read_run_spec, read_secret

    _logging()
    options = _json_options(storage_options)
    watch = ManifestWatch(manifest, options)  # before the read: a change in between is seen
    spec = read_run_spec(manifest, options)
    if spec.recipe.training.entry_point:
        raise click.exceptions.Exit(run_entry_point(spec, manifest, learner_id, secret_file, options))
    raise click.exceptions.Exit(Learner(spec, learner_id, read_secret(secret_file), watch).run())


@command(name="_syncer", hidden=True)
@option("--manifest", required=True, help=MANIFEST_HELP)
@option("--secret-file", required=True, help="File holding the run's secret.")
@option("--storage-options", default="{}", help="JSON storage options to read the manifest.")
@option("--shard", type=Whole(0), default=0, help="The syncer shard this process is (sync.shards).")
def syncer(manifest: str, secret_file: str, storage_options: str, shard: int) -> None:
    """Run the syncer (one shard of it)."""
    from diloco_cli.runtime.membership import ManifestWatch
    from diloco_cli.runtime.syncer.loop import Syncer
    from diloco_cli.store.run_spec import read_run_spec, read_secret

    _logging()
    options = _json_options(storage_options)
    watch = ManifestWatch(manifest, options)  # before the read: a change in between is seen
    spec = read_run_spec(manifest, options)
    raise click.exceptions.Exit(Syncer(spec, read_secret(secret_file), manifest=watch, syncer_shard=shard).run())


@command(name="_reducer", hidden=True)
@option("--manifest", required=True, help=MANIFEST_HELP)
@option("--region", required=True, help="The region whose sends this reducer merges.")
@option("--secret-file", required=True, help="File holding the run's secret.")
@option("--storage-options", default="{}", help="JSON storage options to read the manifest.")
def reducer(manifest: str, region: str, secret_file: str, storage_options: str) -> None:
    """Run a region's reducer (for each syncer shard)."""
    from copy import copy

    from diloco_cli.runtime.membership import ManifestWatch
    from diloco_cli.runtime.reducer.loop import Reducer, run_reducers
    from diloco_cli.store.run_spec import read_run_spec, read_secret

    _logging()
    options = _json_options(storage_options)
    watch = ManifestWatch(manifest, options)  # before the read: a change in between is seen
    spec = read_run_spec(manifest, options)
    secret = read_secret(secret_file)
    reducers = [  # one per syncer shard, each following the manifest with a watch of its own
        Reducer(spec, region, secret, manifest=copy(watch), syncer_shard=shard.index) for shard in spec.syncer_shards
    ]
    raise click.exceptions.Exit(run_reducers(reducers))


@command(name="_chaos", hidden=True)
@option("--run", required=True, help="The run.")
@option("--runs-dir", required=True, help="Where the run's record is.")
def chaos(run: str, runs_dir: str) -> None:
    """Inject the process faults of a run's chaos plan (``diloco up --chaos``)."""
    from pathlib import Path

    from diloco_cli.launch.chaos import ChaosDriver
    from diloco_cli.launch.runs import load_run

    _logging()
    raise click.exceptions.Exit(ChaosDriver(load_run(Path(runs_dir), run)).run())


@command(name="_probe", hidden=True)
@option("--url", required=True, help="Bucket URL (a run's root).")
@option("--storage-options", default="{}", help="JSON storage options.")
def probe(url: str, storage_options: str) -> None:
    """Write, read and delete a probe object (preflight runs this on each host)."""
    from diloco_cli.store.filesystem import StorageError
    from diloco_cli.store.objects import ObjectStore

    try:
        ObjectStore(url, _json_options(storage_options)).probe()
    except StorageError as error:
        click.echo(f"error: {error}", err=True)
        raise click.exceptions.Exit(2) from None
    click.echo("ok")


def register(app: click.Group) -> None:
    for each in (learner, syncer, reducer, probe, chaos):
        app.add_command(each)
