"""Benchmark: a run under chaos against the same run without faults, and the simulator.

The default recipe (4 learners in two regions on this machine) twice with the same seed:
once without faults, once with learners and the syncer SIGKILLed and one region's
storage down for a while (``diloco up --chaos``).  Reported:

* goodput: the learner-time that ended in a merge over wall time x M (merged tokens at
  the fault-free run's tokens per learner-second), and merged tokens over the fault-free
  run's.  A killed learner redoes the steps since its checkpoint and sends them again, so
  its merged tokens exceed the budget; *progress goodput* counts the budget once: the
  fault-free run's goodput scaled by the ratio of the two wall times; and that relative to
  the fault-free run's goodput, the figure the simulator predicts (it models faults only);
* held-out loss of both at the end, when every learner has trained its budget (equal
  merged tokens when no work is lost);
* the simulator's prediction for the same rates (``diloco simulate``'s model with M
  learners of one chip each, a learner's failure rate the kill rate / M, its restart
  the restart measured here, the work lost at a kill the steps since its checkpoint);
* from the ledger: no payload merged twice, and every learner's last send merged.

    python -m bench.chaos           # the default recipe, ~10 minutes
    python -m bench.chaos --quick   # a tiny model (the test suite)
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

from bench._common import benchmark_parser, print_table, wait_until_every_learner_trained, write_and_report
from diloco_cli.config.chaos import parse_chaos
from diloco_cli.config.recipe import Recipe
from diloco_cli.launch.operations import stop_run
from diloco_cli.launch.runs import load_run
from diloco_cli.launch.up import launch
from diloco_cli.simulate.constants import GoodputConstants
from diloco_cli.simulate.grid import Strategy, simulate_once
from diloco_cli.store.home import tokens_merged
from diloco_cli.views.run_state import collect_status

TARGETS = {"loss_gap": 0.02, "goodput_vs_simulator_points": 5.0}
FINISH_TIMEOUT_SECONDS = 3600.0


def chaos_spec(quick: bool) -> str:
    if quick:
        return "seed=1,kill-learner=6/min,kill-syncer=2/min,outage=local-b@15s+8s"
    return "seed=1,kill-learner=1/min,kill-syncer=0.25/min,outage=local-b@90s+45s"


def recipe_for(quick: bool) -> Recipe:
    document: dict = {"name": "chaos-bench", "training": {"heartbeat_seconds": 1.0}}
    if quick:
        document["model"] = {"kwargs": {"num_layers": 2, "width": 64, "num_heads": 2, "context": 64}}
        document["data"] = {"sequence_length": 64}
        document["training"].update(
            {"batch_size": 8, "inner_steps": 400, "warmup_steps": 5, "poll_seconds": 0.3, "checkpoint_every_steps": 50}
        )
        document["sync"] = {"sync_interval": 10, "evaluation_batches": 2, "evaluate_every": 2}
    return Recipe.model_validate(document)


def run(recipe: Recipe, name: str, workdir: Path, chaos: str | None) -> dict:
    path = workdir / f"{name}.json"
    path.write_text(recipe.model_dump_json())
    launched = launch(path, None, [], name, workdir / "runs", dry_run=False, chaos=chaos)
    wait_until_every_learner_trained(workdir / "runs", name)
    started = time.time()
    deadline = time.monotonic() + FINISH_TIMEOUT_SECONDS
    while (status := collect_status(launched.spec)).state != "finished":
        if time.monotonic() > deadline:
            stop_run(load_run(workdir / "runs", name))
            raise RuntimeError(f"run {name} did not finish within {FINISH_TIMEOUT_SECONDS:.0f} s of its start")
        time.sleep(2.0)
    wall = time.time() - started
    record = load_run(workdir / "runs", name)
    stop_run(record)  # every process down (a reducer may still be finishing) before its folder goes
    secret = record.secret()
    spec = launched.spec
    beats = {learner.id: spec.bucket(learner.region, secret).read_heartbeat(learner.id) for learner in spec.learners}
    history = spec.home(secret).history()
    keys = [merged.key for commit in history for merged in commit.merged]
    fragments = range(spec.recipe.sync.num_fragments)
    merged = sum(tokens_merged(history, learner, fragment) for learner in beats for fragment in fragments) / len(
        fragments
    )
    return {
        "run": name,
        "wall_seconds": wall,
        "merged_tokens": merged,
        "trained_tokens": sum(beat.tokens for beat in beats.values()),
        "loss": status.evaluations[-1]["loss"],
        "versions": status.version,
        "restarts": sum(beat.restarts for beat in beats.values()),
        "restart_seconds": [
            beat.training_since - beat.started_at for beat in beats.values() if beat.restarts and beat.training_since
        ],
        "step_seconds": sorted(beat.step_seconds or 0.0 for beat in beats.values())[len(beats) // 2],
        "merged_twice": len(keys) - len(set(keys)),
        "last_sends_merged": all(beat.unsent == 0 for beat in beats.values()),
    }


def predicted_goodput(
    recipe: Recipe, spec: str, restart_seconds: float, step_seconds: float, horizon_seconds: float
) -> float:
    """The simulator's DiLoCo goodput for M one-chip learners under the same kill rate."""
    learners = recipe.training.num_learners
    per_learner_per_hour = parse_chaos(spec).kill_learner_per_minute * 60 / learners
    constants = GoodputConstants(
        mtbi_chip_hours=1 / per_learner_per_hour,
        slice_chips=1,
        repair_hours=0.0,
        spare_fraction=0.0,
        learner_restart_seconds=restart_seconds,
        send_interval_seconds=recipe.training.checkpoint_every_steps * step_seconds,
        horizon_days=max(horizon_seconds, 3600.0) * 50 / 86400,
        replicas=4,
    )
    strategy = Strategy("diloco", learners)
    outcomes = [
        simulate_once(learners, strategy, constants, random.Random(f"chaos/{replica}"))
        for replica in range(constants.replicas)
    ]
    return sum(outcome.goodput for outcome in outcomes) / len(outcomes)


def main(argv: list[str] | None = None) -> dict:
    args = benchmark_parser(__doc__, "a tiny model (the test suite)").parse_args(argv)
    recipe, spec = recipe_for(args.quick), chaos_spec(args.quick)
    with tempfile.TemporaryDirectory(prefix="diloco-chaos-") as directory:
        calm = run(recipe, "calm", Path(directory), None)
        print(f"  without faults: loss {calm['loss']:.4f} in {calm['wall_seconds']:.0f} s", flush=True)
        stormy = run(recipe, "chaos", Path(directory), spec)
        print(
            f"  with faults: loss {stormy['loss']:.4f} in {stormy['wall_seconds']:.0f} s, "
            f"{stormy['restarts']} restarts",
            flush=True,
        )
    learners = recipe.training.num_learners
    rate = calm["trained_tokens"] / (calm["wall_seconds"] * learners)  # tokens per learner-second without faults
    goodput = stormy["merged_tokens"] / rate / (stormy["wall_seconds"] * learners)
    calm_goodput = calm["merged_tokens"] / rate / (calm["wall_seconds"] * learners)
    # work redone after a kill (from the learner's checkpoint) is merged again: the progress
    # made is the fault-free run's, in the longer wall time (what the simulator models)
    progress = calm_goodput * calm["wall_seconds"] / stormy["wall_seconds"]
    # the simulator models faults only: against it, goodput relative to the fault-free run's
    # (without faults some learner-time also never lands: work an install overwrites)
    relative = progress / calm_goodput
    restart = sum(stormy["restart_seconds"]) / len(stormy["restart_seconds"]) if stormy["restart_seconds"] else 5.0
    predicted = predicted_goodput(recipe, spec, restart, calm["step_seconds"], stormy["wall_seconds"])
    loss_gap = stormy["loss"] / calm["loss"] - 1
    results = {
        "runs": [calm, stormy],
        "chaos": spec,
        "goodput": goodput,
        "goodput_without_faults": calm_goodput,
        "progress_goodput": progress,
        "relative_goodput": relative,
        "merged_tokens_vs_fault_free": stormy["merged_tokens"] / calm["merged_tokens"],
        "predicted_goodput": predicted,
        "loss_gap": loss_gap,
        "targets": {
            "loss_gap": {
                "target": f"<= {TARGETS['loss_gap']}",
                "measured": loss_gap,
                "met": abs(loss_gap) <= TARGETS["loss_gap"],
            },
            "goodput_vs_simulator": {
                "target": (
                    "goodput relative to the fault-free run's within "
                    f"{TARGETS['goodput_vs_simulator_points']} points of the simulator's"
                ),
                "measured": 100 * (relative - predicted),
                "met": abs(100 * (relative - predicted)) <= TARGETS["goodput_vs_simulator_points"],
            },
            "ledger": {
                "target": "no payload merged twice, every last send merged",
                "met": stormy["merged_twice"] == 0 and stormy["last_sends_merged"],
            },
        },
    }
    print_table(
        [
            {
                "run": r["run"],
                "loss": r["loss"],
                "wall_seconds": r["wall_seconds"],
                "restarts": r["restarts"],
                "merged_tokens": r["merged_tokens"],
            }
            for r in (calm, stormy)
        ],
        ["run", "loss", "wall_seconds", "restarts", "merged_tokens"],
    )
    print(
        f"goodput {goodput:.1%}, progress goodput {progress:.1%}, {relative:.1%} of the fault-free run's "
        f"{calm_goodput:.1%} (simulator {predicted:.1%}); loss gap {loss_gap:+.2%}"
    )
    write_and_report("chaos", args, {"recipe": recipe.model_dump(mode="json"), "chaos": spec}, results)
    return results


if __name__ == "__main__":
    main()
