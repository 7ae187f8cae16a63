"""The equal-loss rule of ``bench.wan`` and its sweep, in one place.

The target is data-parallel's final held-out loss at the budget, measured in the same
run: the question is whether DiLoCo's model gets as good as data-parallel's, and what it
costs to get there.  Each side's tokens to the target are read off its curve, linear
between the two evaluations that straddle it (``bench.quality_runs.tokens_to_reach``):
data-parallel reaches its own final loss at its last step, or earlier where its curve
dips below it before.  Data-parallel's WAN bytes and time are its bytes and seconds per
step on the WAN times its steps to the target.  Decoupled DiLoCo's time runs from its
launch to the first syncer evaluation at or below the target, in the first of its runs
that reaches it (the budget's, then the one on a longer schedule, stopped there); its
bytes are that run's: counted to the target when the run ended there, else the whole
run's (an upper bound, never in its favour).  The floor is one learner alone on its
share of the tokens: a DiLoCo run whose final loss is not below it is failing.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from bench.quality_runs import loss_at, tokens_to_reach

TARGET_SOURCE = "data-parallel's final loss"
"""Where the target comes from (``results.equal_loss.target_source``)."""


REFERENCE_ROWS = ("data-parallel", "floor: one learner alone")
"""The rows of a ``bench.quality`` result the race takes with ``--reference``."""


def quality_reference(result: dict, source: str, recipe: Any) -> dict[str, Any]:
    """Data-parallel's curve and the floor from a ``bench.quality`` result (``--reference``):
    the curve is the mean of its data-parallel seeds' (each read at the first seed's
    evaluations), labelled by step of the race's global batch, so its final point is the
    seeds' mean final loss, the harness's figure; the floor is the mean of its floor
    seeds' final losses.  Refused, naming what differs, unless its data-parallel trained
    the race's model, sequence length, tokens (within 1%), global batch and learning rate."""
    dp_name, floor_name = REFERENCE_ROWS
    rows = result["results"]["rows"]
    dp_rows = [row for row in rows if row["row"] == dp_name]
    floor_rows = [row for row in rows if row["row"] == floor_name]
    if not dp_rows or not floor_rows:
        raise SystemExit(f"--reference {source}: no {dp_name!r} or {floor_name!r} row; run bench.quality first")
    training, settings = recipe.training, result["settings"]
    tokens_per_step = training.num_learners * training.batch_size * recipe.data.sequence_length
    tokens = training.inner_steps * tokens_per_step
    model = recipe.model.model_dump(mode="json")
    found = {
        "model": (settings["model"], {key: model.get(key) for key in settings["model"]}),
        "sequence length": (settings["sequence_length"], recipe.data.sequence_length),
        "global batch": (dp_rows[0]["setting"]["dp_batch"], training.num_learners * training.batch_size),
        "learning rate": (dp_rows[0]["setting"]["dp_learning_rate"], training.learning_rate),
    }
    differences = [f"{what} {theirs} there, {ours} here" for what, (theirs, ours) in found.items() if theirs != ours]
    if abs(dp_rows[0]["tokens"] - tokens) > 0.01 * tokens:
        differences.append(f"tokens {dp_rows[0]['tokens']:,} there, {tokens:,} here")
    if differences:
        raise SystemExit(
            f"--reference {source}: its data-parallel is not this race's: {'; '.join(differences)}; "
            "give the recipe it measured (--recipe), or race without --reference"
        )
    points = [at for at, _ in dp_rows[0]["evaluations"]]
    curve = [
        {"step": at / tokens_per_step, "loss": statistics.fmean(loss_at(row["evaluations"], at) for row in dp_rows)}
        for at in points
    ]
    return {
        "source": source,
        "dp_seeds": [row["seed"] for row in dp_rows],
        "dp_final_losses": [row["evaluations"][-1][1] for row in dp_rows],
        "evaluations": curve,
        "floor": {
            "learners_share": f"1/{training.num_learners}",
            "how": f"bench.quality's floor row, seeds {[row['seed'] for row in floor_rows]}, in {source}",
            "seeds": [row["seed"] for row in floor_rows],
            "final_loss": statistics.fmean(row["evaluations"][-1][1] for row in floor_rows),
            "evaluations": floor_rows[0]["evaluations"],
        },
    }


def target_loss(dp_evaluations: Sequence[dict]) -> float:
    """Data-parallel's final held-out evaluation: the loss DiLoCo must reach."""
    return dp_evaluations[-1]["loss"]


def first_at_or_below(evaluations: Sequence[dict], target: float) -> dict | None:
    return next((e for e in evaluations if e["loss"] <= target), None)


def dp_steps_to_target(evaluations: Sequence[dict], target: float) -> float | None:
    """Data-parallel's steps to ``target`` from its evaluations (labelled by step)."""
    return tokens_to_reach([[e["step"], e["loss"]] for e in evaluations], target)


def diloco_tokens_to_target(evaluations: Sequence[dict], target: float) -> float | None:
    """DiLoCo's learner tokens (summed) to ``target`` from the syncer's evaluations."""
    return tokens_to_reach([[e["tokens"], e["loss"]] for e in evaluations], target)


def baseline(measured: dict, steps_to_target: float | None, tokens_per_step: int) -> dict:
    """One data-parallel all-reduce on the WAN, counted to the steps data-parallel (on
    loopback, the same arithmetic) needs to reach the target loss."""
    per_step = measured["app_wan_bytes_per_step"]
    step_seconds = measured["medians"]["step_seconds"]
    reached = steps_to_target is not None
    return {
        "all_reduce": measured["all_reduce"],
        "wan": measured,
        "wan_bytes_per_step": per_step,
        "wan_bytes_per_token": per_step / tokens_per_step,
        "wire_wan_bytes_per_step": measured["wire_wan_bytes_per_step"],
        "wan_step_seconds": step_seconds,
        "wan_bytes_to_target": per_step * steps_to_target if reached else None,
        "wire_wan_bytes_to_target": measured["wire_wan_bytes_per_step"] * steps_to_target if reached else None,
        "time_to_target_seconds": step_seconds * steps_to_target if reached else None,
    }


def diloco_to_target(runs: Mapping[str, dict | None], target: float) -> dict[str, Any]:
    """Where DiLoCo reaches ``target``: the first of ``runs`` (by schedule name, the
    budget's first) whose syncer evaluations get there; its tokens (interpolated), its
    time from that run's launch to the first evaluation at or below, and its WAN bytes."""
    for schedule, run in runs.items():
        hit = run and first_at_or_below(run["evaluations"], target)
        if not hit:
            continue
        return {
            "reached": True,
            "schedule": schedule,
            "tokens_to_target": diloco_tokens_to_target(run["evaluations"], target),
            "version_at_target": hit["version"],
            "time_to_target_seconds": hit["time"] - run["launched"],
            "wan_bytes_to_target": run["wan_bytes"],
            "wire_wan_bytes_to_target": run["wire_wan_bytes"],
            "bytes_counted": bytes_counted(run, hit),
        }
    empty = ("schedule", "tokens_to_target", "version_at_target", "time_to_target_seconds", "bytes_counted")
    trained = max(
        (run["evaluations"][-1]["tokens"] for run in runs.values() if run and run["evaluations"]), default=None
    )
    return {
        "reached": False,
        **dict.fromkeys(empty),
        "wan_bytes_to_target": None,
        "wire_wan_bytes_to_target": None,
        "tokens_without_reaching": trained,
    }


def bytes_counted(run: dict, hit: dict) -> str:
    """How far ``run``'s WAN bytes count, given its first evaluation at or below the target."""
    if run.get("stopped_at_target"):
        return (
            "to the target: the run was stopped once the syncer's status showed its first evaluation at or "
            "below it (up to a status period and a poll past it)"
        )
    if hit is run["evaluations"][-1]:
        return "to the target: the run's last evaluation was its first at or below it"
    return "the whole run: it reached the target before its end (an upper bound)"


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def equal_loss(dp: dict, diloco: dict, diloco_final: float, floor_final: float) -> dict[str, Any]:
    """Both sides at data-parallel's final loss: data-parallel's tokens, each baseline's
    WAN bytes and time to it (``dp``: :func:`baseline` per all-reduce, its steps to the
    target), DiLoCo's (``diloco``: :func:`diloco_to_target`), DiLoCo's token overhead
    (its tokens over data-parallel's) and whether its final loss at the budget beats the
    floor's (one learner alone on its share of the tokens)."""
    dp_tokens = dp["steps_to_target"] * dp["tokens_per_step"] if dp["steps_to_target"] is not None else None
    result: dict[str, Any] = {
        "target_source": TARGET_SOURCE,
        "target": dp["target"],
        "dp_steps_to_target": dp["steps_to_target"],
        "dp_tokens_to_target": dp_tokens,
        "diloco_reached": diloco["reached"],
        "diloco_schedule_at_target": diloco["schedule"],
        "diloco_tokens_to_target": diloco["tokens_to_target"],
        "diloco_token_overhead": ratio(diloco["tokens_to_target"], dp_tokens),
        "diloco_token_overhead_above": None
        if diloco["reached"]
        else ratio(diloco["tokens_without_reaching"], dp_tokens),
        "diloco_version_at_target": diloco["version_at_target"],
        "diloco_wan_bytes": diloco["wan_bytes_to_target"],
        "diloco_wire_wan_bytes": diloco["wire_wan_bytes_to_target"],
        "diloco_bytes_counted": diloco["bytes_counted"],
        "diloco_time_to_target_seconds": diloco["time_to_target_seconds"],
        "diloco_final_loss": diloco_final,
        "floor_loss": floor_final,
        "diloco_beats_floor": diloco_final < floor_final,
        "rule": (
            "target: data-parallel's final held-out loss at the budget; tokens: interpolated between the "
            "evaluations that straddle it; data-parallel: bytes and seconds per step on the WAN x steps to "
            f"the target; DiLoCo: the launch to its first evaluation at or below it, bytes counted "
            f"{diloco['bytes_counted'] if diloco['reached'] else 'nowhere: it never reached the target'}"
        ),
    }
    for name, measured in dp["baselines"].items():
        result[f"{name}_wan_bytes_to_target"] = measured["wan_bytes_to_target"]
        result[f"wan_bytes_{name}_over_diloco"] = ratio(measured["wan_bytes_to_target"], diloco["wan_bytes_to_target"])
        result[f"wire_wan_bytes_{name}_over_diloco"] = ratio(
            measured["wire_wan_bytes_to_target"], diloco["wire_wan_bytes_to_target"]
        )
        result[f"time_to_target_{name}_over_diloco"] = ratio(
            measured["time_to_target_seconds"], diloco["time_to_target_seconds"]
        )
    return result
