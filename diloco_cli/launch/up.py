"""``diloco up``: plan, check, create the run, start its processes."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from diloco_cli.config.loading import ConfigError, load_model
from diloco_cli.config.recipe import Recipe
from diloco_cli.config.regions import RegionsFile
from diloco_cli.launch.local import process_records_json, start_local
from diloco_cli.launch.processes import ProcessRecord, is_running, stop_supervised
from diloco_cli.launch.plan import (
    Sources,
    check_buckets,
    check_data_source,
    create_run_directory,
    new_run_name,
    plan_run,
    write_manifests,
    write_run_record,
)
from diloco_cli.runtime.run_spec import RunSpec


@dataclass(frozen=True)
class Launch:
    spec: RunSpec
    run_dir: Path | None
    started: list[str]


def resolve(recipe_path: Path | None, regions_path: Path | None, overrides: list[str], name: str | None, runs_dir: Path) -> tuple[RunSpec, Sources]:
    """The run as it would start: configuration loaded, validated and placed."""
    sources = Sources(
        recipe=str(recipe_path) if recipe_path else Sources.recipe,
        regions=str(regions_path) if regions_path else Sources.regions,
    )
    recipe = load_model(Recipe, recipe_path, overrides, default_name="the default recipe")
    regions = load_model(RegionsFile, regions_path, default_name="the default regions")
    check_data_source(recipe, sources)
    return plan_run(recipe, regions, name or new_run_name(recipe), runs_dir, sources), sources


def launch(recipe_path: Path | None, regions_path: Path | None, overrides: list[str], name: str | None, runs_dir: Path, dry_run: bool) -> Launch:
    runs_dir = runs_dir.resolve()  # processes start elsewhere: every path they get is absolute
    spec, sources = resolve(recipe_path, regions_path, overrides, name, runs_dir)
    if dry_run:
        return Launch(spec, None, [])
    run_dir, _ = create_run_directory(runs_dir, spec, launcher="local")
    try:
        check_buckets(spec, sources)
    except BaseException:
        shutil.rmtree(run_dir)  # nothing started, nothing half-made left behind
        raise
    write_manifests(spec)
    records = start_local(spec, run_dir)
    write_run_record(run_dir, {"spec": json.loads(spec.to_json()), "launcher": "local", "processes": process_records_json(records)})
    check_started(records, run_dir)
    return Launch(spec, run_dir, [record.name for record in records])


def check_started(records: list[ProcessRecord], run_dir: Path, grace_seconds: float = 1.5) -> None:
    """Fail loudly if a supervisor dies at once (a broken environment), with its log."""
    time.sleep(grace_seconds)
    dead = [record for record in records if not is_running(record.pid)]
    if dead:
        stop_supervised(records, run_dir, timeout=5)
        log = (run_dir / "logs" / f"{dead[0].name}.log").read_text(errors="replace")[-2000:]
        raise StartError(f"{', '.join(r.name for r in dead)} exited right after starting; the run is stopped. "
                         f"End of {run_dir}/logs/{dead[0].name}.log:\n{log}")


class StartError(ConfigError):
    """A process of the run could not start."""
