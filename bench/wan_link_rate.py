"""``bench.wan --check-link-rate``: the link rate each method needs for 90% computing,
as ``diloco plan`` predicts it and as shaped runs measure it.

Data-parallel's all-reduce time on a rate-shaped link is its bytes over the rate (gloo's
traffic gets no emulated latency here), so the rate at which a step communicates a ninth
of its compute follows from the one measured step: ``R x comm / (compute x (1/0.9 - 1))``.
Decoupled DiLoCo's learners never wait for the network, so its rate is checked by whole
runs: every WAN link shaped to the plan's rate, then to half of it; at the rate the
learners must compute at least 90% of all wall time (start-up included) and the syncer
publish the versions expected, below it they need not.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.wan_diloco import REGIONS, SYNCER, diloco_on_wan

TARGET = 0.9
FACTORS = (1.0, 0.5)
"""The plan's DiLoCo rate, and half of it."""


def dp_rate_for_target(measured: dict, link_mbit: float, target: float = TARGET) -> float:
    """The rate at which this data-parallel step would communicate ``1/target - 1`` of its
    compute, from its median step on links of ``link_mbit``."""
    medians = measured["medians"]
    return link_mbit * medians["comm_seconds"] / (medians["compute_seconds"] * (1 / target - 1))


def check_diloco_rate(
    wan, predicted_mbit: float, overrides: Sequence[str], workdir: Path, timeout: float, syncer_place: str
) -> list[dict]:
    """Whole DiLoCo runs with every region's link at the predicted rate and at half of it
    (the syncer's own place, when it has one, at that times the regions); the links are
    put back as they were."""
    from testbed.netns import shape_wan

    before = dict(wan.net.rates)
    rows = []
    try:
        for factor in FACTORS:
            rate = predicted_mbit * factor
            for region in REGIONS:
                shape_wan(wan[region], rate)
            if syncer_place == SYNCER:
                shape_wan(wan[SYNCER], rate * len(REGIONS))
            run = diloco_on_wan(wan, overrides, workdir, timeout, syncer_place)
            rows.append(
                {
                    "factor": factor,
                    "link_mbit": rate,
                    "compute_share": run["compute_share"],
                    "versions": run["versions"],
                    "versions_expected": run["versions_expected"],
                    "wan_bytes_per_token": run["wan_bytes_per_token"],
                    "final_loss": run["final_loss"],
                    "reaches_target": run["compute_share"] >= TARGET and run["versions"] >= run["versions_expected"],
                }
            )
            print(
                f"  at {rate:.3f} Mbit/s ({factor:g}x the plan's): computing {run['compute_share']:.1%}, "
                f"{run['versions']} of {run['versions_expected']} versions",
                flush=True,
            )
    finally:
        for label, rate in before.items():
            shape_wan(wan[label], rate)
    return rows


def summarize(plan_rates: dict, dp_measured: dict[str, float], runs: list[dict]) -> dict:
    """The plan's rates beside the measured ones, and whether the shaped runs confirm DiLoCo's."""
    at_rate = next((row for row in runs if row["factor"] == 1.0), None)
    below = next((row for row in runs if row["factor"] < 1.0), None)
    diloco = plan_rates.get("diloco_mbit")
    return {
        "target_compute_share": TARGET,
        "plan": plan_rates,
        "dp_measured_mbit": dp_measured,
        "dp_plan_vs_measured": {
            name: plan_rates.get(f"{name}_mbit") / rate - 1 if plan_rates.get(f"{name}_mbit") else None
            for name, rate in dp_measured.items()
        },
        "diloco_runs": runs,
        "diloco_confirmed_at_rate": bool(at_rate and at_rate["reaches_target"]),
        "diloco_falls_short_below": bool(below and not below["reaches_target"]),
        "measured_ratios": {name: rate / diloco if diloco else None for name, rate in dp_measured.items()},
    }
