"""Data-parallel's side of ``bench.wan``: its runs (on loopback, then on the shaped WAN
as a flat ring and as a hierarchical all-reduce), the link rate its loopback step
calibrates, and its time and WAN bytes to the target."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

from bench.ddp_launch import launch_local
from bench.wan_diloco import REGIONS, device_bytes, device_deltas
from bench.wan_equal_loss import baseline, dp_steps_to_target


def crossings(places: Sequence[str]) -> int:
    """Hops of the ring 0 -> 1 -> ... -> W-1 -> 0 between ranks in different places."""
    return sum(places[r] != places[(r + 1) % len(places)] for r in range(len(places)))


def dp_summary(result: dict) -> dict:
    """What a ``bench.ddp_worker`` run measured, without its per-rank details."""
    return {
        "steps_done": result["steps_done"],
        "stopped_by_time": result["stopped_by_time"],
        "world_size": result["settings"]["world_size"],
        "tokens_per_step": result["settings"]["tokens_per_step"],
        "bytes_per_step_per_rank": result["bytes_per_step_per_rank"],
        "all_reduce": result["settings"]["all_reduce"],
        "leader_ring_bytes_per_step": result["leader_ring_bytes_per_step"],
        "parameters": result["parameters"],
        "medians": result["medians"],
        "totals": result["totals"],
        "per_step": {key: result["per_step"][key] for key in ("compute_seconds", "comm_seconds", "step_seconds")},
        "evaluations": result["evaluations"],
        "final_digests_equal": result["final_digests_equal"],
    }


def dp_on_wan(
    wan,
    world: int,
    overrides: Sequence[str],
    steps: int,
    max_seconds: float | None,
    timeout: float,
    hierarchical: bool = False,
) -> dict:
    """W ranks, the first half in east and the rest in west, gloo on each place's WAN device;
    a flat ring all-reduce, or a hierarchical one (a ring of one leader per region)."""
    per_region = world // len(REGIONS)
    places = [REGIONS[min(rank // per_region, len(REGIONS) - 1)] for rank in range(world)]
    before = {label: device_bytes(wan[label]) for label in wan.places}
    started = time.monotonic()
    result = launch_local(
        world,
        steps,
        overrides=overrides,
        max_seconds=max_seconds,
        master_addr=wan.address(places[0]),
        prefixes=[wan[p].exec_prefix() for p in places],
        interfaces=[wan[p].wan_veth for p in places],
        timeout=timeout,
        extra_args=["--groups", str(len(REGIONS))] if hierarchical else (),
    )
    wall = time.monotonic() - started
    moved = device_deltas(before, {label: device_bytes(wan[label]) for label in wan.places})
    summary = dp_summary(result)
    medians = summary["medians"]
    hops = crossings(places)
    bytes_per_rank = summary["bytes_per_step_per_rank"]
    region_tx = sum(moved[region]["tx"] for region in REGIONS)  # every crossing byte leaves one region once
    summary.update(
        placement=places,
        wall_seconds=wall,
        ring_crossings=hops,
        comm_to_compute=medians["comm_seconds"] / medians["compute_seconds"],
        compute_share=medians["compute_seconds"] / medians["step_seconds"],
        app_wan_bytes_per_step=summary["leader_ring_bytes_per_step"] if hierarchical else hops * bytes_per_rank,
        wire_wan_bytes=region_tx,
        wire_wan_bytes_per_step=region_tx / summary["steps_done"],
        devices=moved,
    )
    return summary


def print_dp_wan(measured: dict) -> None:
    medians = measured["medians"]
    print(
        f"  {measured['steps_done']} steps, median {medians['step_seconds']:.2f} s "
        f"(compute {medians['compute_seconds']:.3f} s, comm {medians['comm_seconds']:.2f} s: "
        f"{measured['comm_to_compute']:.1f}x), {measured['app_wan_bytes_per_step']:,} WAN bytes per step",
        flush=True,
    )


def calibration(args: argparse.Namespace, loopback: dict) -> dict[str, Any]:
    """The link rate R from data-parallel's step on loopback: a step on the WAN then
    communicates ``--comm-ratio`` times longer than it computes (or ``--link-mbit``)."""
    c = loopback["medians"]["compute_seconds"]
    b = loopback["bytes_per_step_per_rank"]
    rate = args.link_mbit or b * 8 / (args.comm_ratio * c) / 1e6
    syncer_rate = rate * len(REGIONS)
    print(
        f"  c = {c * 1000:.1f} ms compute per step, B = {b:,} bytes per step per rank -> R = {rate:.3f} Mbit/s "
        f"(syncer's link {syncer_rate:.3f})",
        flush=True,
    )
    return {
        "dp_compute_seconds_per_step": c,
        "dp_bytes_per_step_per_rank": b,
        "link_mbit": rate,
        "syncer_link_mbit": syncer_rate,
        "formula": (
            f"R = B x 8 / ({args.comm_ratio:g} x c) / 1e6 Mbit/s; "
            f"the syncer's link carries every region's traffic: R x {len(REGIONS)}"
        ),
        "given": args.link_mbit is not None,
    }


def dp_result(args: argparse.Namespace, loopback: dict, on_wan: dict, target: float, eval_every: int) -> dict:
    """Data-parallel's side of the race: its time and WAN bytes to the target loss, and
    its two baselines (flat ring, hierarchical)."""
    dp_wan, world = on_wan["dp_wan"], loopback["world_size"]
    steps = dp_steps_to_target(loopback["evaluations"], target)
    step_seconds = dp_wan["medians"]["step_seconds"]
    latency_per_step = 2 * (world - 1) * args.latency_ms / 1000
    tokens_per_step = loopback["tokens_per_step"]
    dp = {
        "loopback": loopback,
        "wan": dp_wan,
        "final_loss": loopback["evaluations"][-1]["loss"],
        "target": target,
        "tokens_per_step": tokens_per_step,
        "steps_to_target": steps,
        "wan_step_seconds": step_seconds,
        "time_to_target_seconds": steps * step_seconds if steps is not None else None,
        "method": (
            "time to target = (steps to reach the target on loopback, evaluated every "
            f"{eval_every} steps, linear between the two evaluations that straddle it) x "
            f"(median wall seconds per step on the shaped WAN, {dp_wan['steps_done']} steps measured)"
        ),
        "latency_not_emulated_seconds_per_step": latency_per_step,
        "time_to_target_seconds_with_latency": steps * (step_seconds + latency_per_step) if steps is not None else None,
        "compute_share": dp_wan["compute_share"],
        "comm_to_compute": dp_wan["comm_to_compute"],
        "wan_bytes_per_token": dp_wan["app_wan_bytes_per_step"] / tokens_per_step,
        "wan_bytes_per_token_wire": dp_wan["wire_wan_bytes_per_step"] / tokens_per_step,
        "wan_bytes_per_token_model": loopback["bytes_per_step_per_rank"] / (tokens_per_step / world),
        "wan_bytes_note": (
            f"app: {dp_wan['ring_crossings']} ring hops of {world} cross a link, each B bytes per step; wire: "
            "the regions' WAN devices' tx per step (TCP/IP headers included); "
            "model: every worker in a place of its own "
            "(docs/bandwidth.md, what `diloco report` and `diloco plan` compare with)"
        ),
    }
    dp["wan_bytes_to_target"] = dp["wan_bytes_per_token"] * tokens_per_step * steps if steps is not None else None
    dp["baselines"] = {
        "flat_ring": baseline(dp_wan, steps, tokens_per_step),
        "hierarchical": baseline(on_wan["hierarchical_wan"], steps, tokens_per_step),
    }
    return dp
