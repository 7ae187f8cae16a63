"""What ``diloco up --dry-run`` prints: the resolved run, who runs what where, its recipe
and its chaos plan (``--chaos``)."""

from __future__ import annotations

import yaml

from diloco_cli.store.run_spec import RunSpec


def render_dry_run(spec: RunSpec) -> str:
    """The run ``spec`` as ``diloco up`` would start it: its syncer, regions, learners, recipe
    and chaos plan."""
    recipe = spec.recipe
    count = len(spec.syncer_shards)
    syncers = [
        f"  {shard.name} on {shard.host}, home {shard.home}"
        + (
            f", fragments {', '.join(str(p) for p in range(shard.index, recipe.sync.num_fragments, count))}"
            if count > 1
            else ""
        )
        for shard in spec.syncer_shards
    ]
    lines = [
        f"run {spec.run} (dry run: nothing started)",
        *syncers,
        f"  K={recipe.quorum} of M={len(spec.learners)}, H={recipe.sync.sync_interval}, P={recipe.sync.num_fragments}, "
        f"outer lr {recipe.outer_learning_rate:g}, momentum {recipe.sync.outer_momentum:g}",
    ]
    for region in spec.regions:
        lines.append(f"  region {region.name}: bucket {region.root}")
        for learner in (spec_learner for spec_learner in spec.learners if spec_learner.region == region.name):
            processes = f", {learner.processes} processes (torchrun)" if learner.processes > 1 else ""
            devices = f", GPU{'s' if len(learner.devices) > 1 else ''} {','.join(map(str, learner.devices))}"
            devices = devices if learner.devices else ""
            speed = spec.speed_of(learner.id)
            slowed = f", at {speed:g} of full speed (--chaos slow-learner)" if speed < 1 else ""
            where = f"on {learner.host}, shard {learner.shard}"
            lines.append(f"    learner {learner.id} {where}{processes}{devices}{slowed}")
    lines.append("resolved recipe:")
    document = yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
    lines.extend("  " + line for line in document.splitlines())
    if spec.chaos is not None:
        lines.append("chaos plan:")
        document = yaml.safe_dump(spec.chaos.model_dump(mode="json"), sort_keys=False)
        lines.extend("  " + line for line in document.splitlines())
    return "\n".join(lines)
