"""The equal-loss rule of ``bench.wan`` and its sweep, in one place.

The target held-out loss is 1.01 x the worse of the two final losses, a value both
methods reach.  Data-parallel's WAN bytes and time are counted to its first evaluation at
or below the target (bytes per step x steps); Decoupled DiLoCo's bytes are its whole
run's (it may reach the target before its end: an upper bound, never in its favour).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

TARGET_MARGIN = 0.01
"""The target loss: this fraction above the worse of the two final losses."""


def target_loss(diloco_final: float, dp_final: float) -> float:
    return max(diloco_final, dp_final) * (1 + TARGET_MARGIN)


def first_at_or_below(evaluations: Sequence[dict], target: float) -> dict | None:
    return next((e for e in evaluations if e["loss"] <= target), None)


def baseline(measured: dict, hit: dict | None, tokens_per_step: int) -> dict:
    """One data-parallel all-reduce on the WAN, counted to the step where data-parallel
    (on loopback, the same arithmetic) first reaches the target loss."""
    per_step = measured["app_wan_bytes_per_step"]
    step_seconds = measured["medians"]["step_seconds"]
    return {
        "all_reduce": measured["all_reduce"],
        "wan": measured,
        "wan_bytes_per_step": per_step,
        "wan_bytes_per_token": per_step / tokens_per_step,
        "wire_wan_bytes_per_step": measured["wire_wan_bytes_per_step"],
        "wan_step_seconds": step_seconds,
        "wan_bytes_to_target": per_step * hit["step"] if hit else None,
        "wire_wan_bytes_to_target": measured["wire_wan_bytes_per_step"] * hit["step"] if hit else None,
        "time_to_target_seconds": step_seconds * hit["step"] if hit else None,
    }


def equal_loss(dp: dict, diloco: dict, diloco_hit: dict | None) -> dict:
    """WAN bytes and time to the same held-out loss.  Data-parallel's are counted to the
    first evaluation at or below the target; DiLoCo's bytes are the whole run's (it may
    reach the target before its end: an upper bound, never in its favour), its time the
    first syncer evaluation at or below the target."""
    result: dict[str, Any] = {
        "dp_steps_to_target": dp["steps_to_target"],
        "dp_tokens_to_target": dp["steps_to_target"] * dp["loopback"]["tokens_per_step"]
        if dp["steps_to_target"] is not None
        else None,
        "diloco_tokens_at_target": diloco_hit.get("tokens") if diloco_hit else None,
        "diloco_wan_bytes": diloco["wan_bytes"],
        "diloco_wire_wan_bytes": diloco["wire_wan_bytes"],
        "diloco_time_to_target_seconds": diloco["time_to_target_seconds"],
        "rule": "data-parallel: bytes per step x steps to the target; DiLoCo: the whole run's WAN bytes",
    }
    for name, measured in dp["baselines"].items():
        to_target = measured["wan_bytes_to_target"]
        time_to_target = measured["time_to_target_seconds"]
        result[f"{name}_wan_bytes_to_target"] = to_target
        result[f"wan_bytes_{name}_over_diloco"] = to_target / diloco["wan_bytes"] if to_target else None
        wire = measured["wire_wan_bytes_to_target"]
        result[f"wire_wan_bytes_{name}_over_diloco"] = wire / diloco["wire_wan_bytes"] if wire else None
        result[f"time_to_target_{name}_over_diloco"] = (
            time_to_target / diloco["time_to_target_seconds"]
            if time_to_target and diloco["time_to_target_seconds"]
            else None
        )
    return result
