"""Benchmark: what the topology sends across the WAN, per token.

The same run (the default recipe, K = M) on ``testbed.wan.emulated_wan`` (two
regions, each its own namespace and moto S3, shaped links, a delaying proxy that counts
every byte crossing into the region), in three settings of the one topology (a reducer in
every region, the region builds its own version 0 and snapshots, the syncer in the first
region), each a whole run:

* **relays, K=1**: under K < M each send is relayed as it is: one payload crosses per send;
* **default**: K = M, one aggregate per region and fragment round crosses;
* **default, 2 x 4**: the same with four learners per region.

WAN bytes are what the regions' delaying proxies passed (requests and answers, both
ways), over the tokens the learners trained.  Targets: 2 x 4 no more WAN bytes per token
than 2 x 2, and K = M's aggregates fewer WAN bytes per token than K = 1's relays.  (The
topology before reducers, every payload and snapshot across the WAN with the syncer in a
place of its own, moved 3.19x the default's bytes per token: bench/results/topology.json
of commit 827fcad; it can no longer be run.)  One run per setting (a run is several
minutes on 2 cores).

    python -m bench.topology            # the default recipe (~20 min on 2 cores; needs root, iproute2)
    python -m bench.topology --quick    # a tiny model and budget (the test suite)
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from bench._common import benchmark_parser, print_table, write_and_report
from bench.wan_diloco import MEASURE, QUICK_RUN, REGIONS, SYNCER, diloco_on_wan

QUICK = [*QUICK_RUN, "training.inner_steps=40"]
TOPOLOGIES = (
    ("relays K=1", 2, REGIONS[0], ["sync.quorum=1"]),
    ("default", 2, REGIONS[0], []),
    ("default 2x4", 4, REGIONS[0], []),
)


def run_topology(wan, label: str, per_region: int, syncer_place: str, extra: list[str], args, workdir: Path) -> dict:
    """One whole run on the emulated WAN (shared by the topologies: each run has its own
    name and buckets' prefix, and counts the proxies' bytes from its own start)."""
    overrides = [*MEASURE, *(QUICK if args.quick else []), f"training.num_learners={per_region * len(REGIONS)}", *extra]
    rundir = workdir / label.replace(" ", "-")
    rundir.mkdir(parents=True)
    result = diloco_on_wan(wan, overrides, rundir, args.timeout, syncer_place)
    kinds: dict[str, int] = {}
    for link in result["links"]:
        if link["wan"]:
            kinds[link["source"]] = kinds.get(link["source"], 0) + link["bytes_up"] + link["bytes_down"]
    return {
        "topology": label,
        "learners_per_region": per_region,
        "syncer_place": syncer_place,
        "overrides": overrides,
        "tokens": result["tokens"],
        "wan_bytes_proxy": result["proxy_wan_bytes"],
        "wan_bytes_per_token": result["wan_bytes_per_token_proxy"],
        "wan_bytes_per_token_metered": result["wan_bytes_per_token"],
        "final_loss": result["final_loss"],
        "versions": result["versions"],
        "wall_seconds": result["wall_seconds"],
        "learners_started_after_seconds": result["learners_started_after_seconds"],
        "compute_share": result["compute_share"],
        "metered_wan_bytes_by_source": kinds,
        "syncer_kinds": result["syncer_kinds"],
    }


def verdicts(rows: dict[str, dict]) -> dict:
    relays, default, wide = rows["relays K=1"], rows["default"], rows["default 2x4"]
    ratio = relays["wan_bytes_per_token"] / default["wan_bytes_per_token"]
    return {
        "aggregates_fewer_than_relays": {"measured": ratio, "target": 1.0, "met": ratio > 1.0},
        "2x4_not_above_2x2": {
            "measured": wide["wan_bytes_per_token"] / default["wan_bytes_per_token"],
            "target": 1.0,
            "met": wide["wan_bytes_per_token"] <= default["wan_bytes_per_token"],
        },
    }


def main(argv: list[str] | None = None) -> dict:
    parser = benchmark_parser(__doc__, "a tiny model and budget (~2 minutes)")
    parser.add_argument("--link-mbit", type=float, default=200.0, help="every link's rate (bytes do not depend on it)")
    parser.add_argument("--latency-ms", type=float, default=40.0, help="one-way latency added by the proxies")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a run may take")
    args = parser.parse_args(argv)
    from testbed.wan import S3_ENV, emulated_wan

    os.environ.update(S3_ENV)  # this process prepares and reads the buckets (moto takes any key)
    rows: dict[str, dict] = {}
    with (
        tempfile.TemporaryDirectory(prefix="diloco-topology-") as directory,
        emulated_wan(REGIONS, [SYNCER], rate_mbit=args.link_mbit, latency_ms=args.latency_ms, hostnames=True) as wan,
    ):
        for label, per_region, syncer_place, extra in TOPOLOGIES:
            started = time.monotonic()
            print(f"{label}: {per_region} learners per region, syncer in {syncer_place}", flush=True)
            rows[label] = run_topology(wan, label, per_region, syncer_place, extra, args, Path(directory))
            row = rows[label]
            print(
                f"  {row['wan_bytes_per_token']:.2f} WAN B/token, final loss {row['final_loss']:.4f} "
                f"({time.monotonic() - started:.0f} s)",
                flush=True,
            )
    results = {"rows": list(rows.values()), "targets": verdicts(rows)}
    print_table(
        results["rows"], ["topology", "learners_per_region", "syncer_place", "wan_bytes_per_token", "final_loss"]
    )
    for name, verdict in results["targets"].items():
        print(f"{name}: {verdict['measured']:.3f} (target {verdict['target']}) {'met' if verdict['met'] else 'MISSED'}")
    settings = {"link_mbit": args.link_mbit, "latency_ms": args.latency_ms, "regions": list(REGIONS)}
    write_and_report("topology", args, settings, results)
    return results


if __name__ == "__main__":
    main()
