"""``diloco plan`` beside a measured run, for ``bench.wan``'s race and its sweep: the
plan's prediction for a scenario (through the CLI, as a user runs it) and its figures
against the measured ones."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.wan_diloco import REPOSITORY, process_env


def plan_prediction(
    regions_path: Path | None,
    overrides: Sequence[str],
    step_seconds: float,
    link_mbit: float,
    latency_ms: float,
    timeout: float = 300.0,
    startup_seconds: float | None = None,
) -> dict:
    """HOOK: ``diloco plan``'s prediction for this scenario (``python -m diloco_cli plan --output
    json``).  Returns {"command", "prediction" (the plan's JSON, or None), "error" (why not)}:
    a plan command that is missing or fails is recorded as null, not raised."""
    command = [
        sys.executable,
        "-m",
        "diloco_cli",
        "plan",
        "--output",
        "json",
        "--step-seconds",
        f"{step_seconds:.6g}",
        "--link-mbit",
        f"{link_mbit:.6g}",
        "--latency-ms",
        f"{latency_ms:.6g}",
    ]
    command += ["--regions", str(regions_path)] if regions_path else []
    command += ["--startup-seconds", f"{startup_seconds:.6g}"] if startup_seconds is not None else []
    command += [item for override in overrides for item in ("--set", override)]
    try:
        proc = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, cwd=REPOSITORY, env=process_env()
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return {"command": command, "prediction": None, "error": str(error)}
    if proc.returncode != 0:
        return {
            "command": command,
            "prediction": None,
            "error": (proc.stderr or proc.stdout).strip()[-2000:] or f"exit {proc.returncode}",
        }
    try:
        return {"command": command, "prediction": json.loads(proc.stdout), "error": None}
    except ValueError as error:
        return {"command": command, "prediction": None, "error": f"not JSON: {error}: {proc.stdout[:500]}"}


def plan_vs_measured(plan: dict | None, diloco: dict, dp: dict, data_parallel_plan: dict | None = None) -> dict | None:
    """The plan's figures beside the measured ones: DiLoCo's from ``plan``, data-parallel's
    from ``data_parallel_plan`` (default: the same plan)."""
    if plan is None:
        return None
    try:
        predicted_wan = plan["diloco"]["run_wan_bytes"]  # the run's sends, its end's flush included
        # the plan's cpu share is t / T over the training loop: the learners' share measured over
        # their loops (from training_since) where the heartbeats have it, else over their lives
        loop_share = diloco.get("compute_share_over_loop") or diloco["compute_share"]
        launch_share = diloco.get("compute_share_from_launch") or diloco["compute_share"]
        dpp = (data_parallel_plan or plan)["data_parallel"]
        return {
            "diloco_compute_share": {  # over all wall time from the launch, start-up included
                "predicted": plan["diloco"]["compute_share_with_startup"],
                "measured": launch_share,
                "points": 100 * (plan["diloco"]["compute_share_with_startup"] - launch_share),
            },
            "diloco_cpu_share": {
                "predicted": plan["diloco"]["cpu_share"],
                "measured": loop_share,
                "points": 100 * (plan["diloco"]["cpu_share"] - loop_share),
            },
            "diloco_bottleneck": plan["diloco"].get("bottleneck"),
            "diloco_network_factor": plan["diloco"].get("network_factor"),
            "suggestion": {
                key: plan["suggestion"].get(key)
                for key in (
                    "target_compute_share",
                    "reached",
                    "sync_interval",
                    "upload_codec",
                    "update_codec",
                    "compute_share",
                )
            }
            if isinstance(plan.get("suggestion"), dict)
            else None,
            "diloco_syncer_busy": plan["diloco"].get("syncer_busy"),
            "diloco_wan_bytes": {
                "predicted": predicted_wan,
                "measured": diloco["wan_bytes"],
                "percent": 100 * (predicted_wan / diloco["wan_bytes"] - 1),
            },
            "diloco_time_to_budget_seconds": {
                "predicted": plan["time_to_budget_seconds"],
                "measured": diloco["wall_seconds"],
                "percent": 100 * (plan["time_to_budget_seconds"] / diloco["wall_seconds"] - 1),
            },
            "dp_step_seconds": {
                "predicted": dpp["step_seconds"],
                "measured": dp["wan"]["medians"]["step_seconds"],
                "percent": 100 * (dpp["step_seconds"] / dp["wan"]["medians"]["step_seconds"] - 1),
            },
            "dp_compute_share": {
                "predicted": dpp["compute_share"],
                "measured": dp["compute_share"],
                "points": 100 * (dpp["compute_share"] - dp["compute_share"]),
            },
            "dp_wan_bytes_per_token": {
                "predicted": dpp["wan_bytes_per_token"],
                "measured": dp["wan_bytes_per_token"],
                "percent": 100 * (dpp["wan_bytes_per_token"] / dp["wan_bytes_per_token"] - 1),
            },
        }
    except (KeyError, TypeError, ZeroDivisionError) as error:
        return {"error": f"the plan's JSON lacks a figure: {error!r}"}
