"""The WAN race (bench/wan.py) in its quick mode, and the per-place endpoint names it relies on.

Speeds are not asserted (shared machines); what is: every figure is reported, and the
relations that hold on any machine and that a broken measurement gets wrong (bytes that must
cross a link do, in the right proxy; data-parallel on the shaped link communicates longer than
it computes; DiLoCo moves fewer WAN bytes per token; the target is data-parallel's own final
loss, and the token overhead and the floor's verdict follow from the curves; everything it
set up is gone).

Needs root and iproute2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.wan import emulated_wan

pytestmark = pytest.mark.slow

REPOSITORY = Path(__file__).resolve().parents[2]

RESOLVE_AND_WRITE = """
import socket, sys, s3fs
fs = s3fs.S3FileSystem(endpoint_url=sys.argv[1], key="testing", secret="testing",
                       use_listings_cache=False, skip_instance_cache=True)
fs.pipe("named/" + sys.argv[2], b"x" * 1000)
print(socket.gethostbyname(sys.argv[3]), sorted(fs.ls("named")))
"""


def test_region_names_resolve_per_place():
    """s3-<region> is the local zero-delay proxy inside the region and the delaying proxy on the
    region's WAN address everywhere else; the hosts files go when the WAN does."""
    with emulated_wan(["east", "west"], extra_places=["syncer"], rate_mbit=None, latency_ms=30, hostnames=True) as wan:
        east = wan.regions["east"]
        assert east.url == "http://s3-east:9001"
        east.store("setup").create_bucket("named")
        files = dict(wan.hosts_files)
        assert "127.0.0.1 s3-east" in files["east"].read_text()
        assert f"{east.place.wan_address} s3-east" in files["syncer"].read_text()
        assert f"{east.place.wan_address} s3-east" in files["west"].read_text()
        seen = {}
        for place in ("east", "syncer"):
            before = {kind: east.counters(kind)["bytes_to_upstream"] for kind in ("local", "remote")}
            out = wan.python(place, RESOLVE_AND_WRITE, east.url, f"from-{place}", east.hostname, timeout=120).split(
                " ", 1
            )
            after = {kind: east.counters(kind)["bytes_to_upstream"] for kind in ("local", "remote")}
            seen[place] = (out[0], {kind: after[kind] - before[kind] for kind in after})
            assert f"named/from-{place}" in out[1]
        assert seen["east"][0] == "127.0.0.1" and seen["east"][1]["local"] >= 1000 and seen["east"][1]["remote"] == 0
        assert seen["syncer"][0] == east.place.wan_address
        assert seen["syncer"][1]["remote"] >= 1000 and seen["syncer"][1]["local"] == 0
        assert east.store("setup").filesystem().size("named/from-syncer") == 1000
        with open("/etc/hosts") as handle:
            assert "s3-east" not in handle.read()  # the root namespace's is untouched
    assert not any(path.exists() for path in files.values())
    assert not any(path.parent.exists() for path in files.values())


def reach(points, target):
    """Where a curve of (x, loss) first gets to ``target``, linear between the two points
    that straddle it; None where it never does."""
    for (x_before, loss_before), (x, loss) in zip([(None, None), *points], points):
        if loss <= target:
            if x_before is None or loss_before == loss:
                return x
            return x_before + (x - x_before) * (loss_before - target) / (loss_before - loss)
    return None


def test_wan_benchmark_quick(tmp_path):
    """The syncer in a place of its own, behind its own link, so that every byte it moves
    with either region crosses a WAN link the test can account for (the default places it
    in east, as a run does; bench.topology tests that placement)."""
    output = tmp_path / "wan.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.wan", "--quick", "--syncer-in", "syncer", "--output", str(output)],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    document = json.loads(output.read_text())
    assert document["benchmark"] == "wan" and document["quick"] and document["machine"]["torch"]
    settings, results = document["settings"], document["results"]
    learners = settings["learners"]
    assert learners == 2 and settings["regions"] == ["east", "west"]

    # the link rate came from data-parallel's own compute time and bytes
    calibration = results["calibration"]
    c, b = calibration["dp_compute_seconds_per_step"], calibration["dp_bytes_per_step_per_rank"]
    assert calibration["link_mbit"] == pytest.approx(b * 8 / (settings["comm_ratio_target"] * c) / 1e6)
    assert calibration["syncer_link_mbit"] == pytest.approx(2 * calibration["link_mbit"])

    # data-parallel: the whole budget on loopback, a few steps on the shaped WAN
    dp = results["dp"]
    loopback, wan = dp["loopback"], dp["wan"]
    assert loopback["steps_done"] == settings["inner_steps"] and loopback["final_digests_equal"]
    assert [e["step"] for e in loopback["evaluations"]][:2] == [0, settings["dp_eval_every"]]
    assert wan["steps_done"] == 3 and wan["final_digests_equal"] and wan["placement"] == ["east", "west"]
    # on the shaped link a step communicates longer than it computes
    assert wan["medians"]["comm_seconds"] > wan["medians"]["compute_seconds"]
    assert dp["comm_to_compute"] > 1 and dp["compute_share"] < 0.5
    # both ring hops cross the WAN, each carrying B per step: the devices saw at least that
    assert wan["ring_crossings"] == 2 and wan["app_wan_bytes_per_step"] == 2 * b
    assert wan["wire_wan_bytes_per_step"] >= 0.95 * wan["app_wan_bytes_per_step"]
    assert wan["devices"]["syncer"]["tx"] < 0.01 * wan["wire_wan_bytes"]  # the syncer's place is not on the ring
    assert dp["steps_to_target"] is not None and dp["time_to_target_seconds"] == pytest.approx(
        dp["steps_to_target"] * dp["wan_step_seconds"]
    )
    assert dp["steps_to_target"] <= settings["inner_steps"] and "median" in dp["method"]

    # the hierarchical baseline ran on the same links: with one learner per region the
    # leaders' ring is the whole ring, so it sends what the flat ring sends
    flat_ring, hierarchical = dp["baselines"]["flat_ring"], dp["baselines"]["hierarchical"]
    assert flat_ring["all_reduce"] == "ring" and hierarchical["all_reduce"] == "hierarchical"
    assert hierarchical["wan"]["steps_done"] == 3 and hierarchical["wan"]["final_digests_equal"]
    assert hierarchical["wan_bytes_per_step"] == hierarchical["wan"]["leader_ring_bytes_per_step"] == 2 * b
    assert hierarchical["wan"]["wire_wan_bytes_per_step"] >= 0.95 * hierarchical["wan_bytes_per_step"]

    # the target is data-parallel's own final loss, which it reaches at its last step (or
    # earlier, where its curve dips below it before), by hand from its curve
    equal, target = results["equal_loss"], results["target"]["loss"]
    assert equal["target_source"] == "data-parallel's final loss" == results["target"]["source"]
    assert equal["target"] == target == loopback["evaluations"][-1]["loss"] == dp["final_loss"]
    steps = reach([(e["step"], e["loss"]) for e in loopback["evaluations"]], target)
    assert steps is not None and dp["steps_to_target"] == pytest.approx(steps)
    dp_tokens = steps * loopback["tokens_per_step"]
    assert equal["dp_tokens_to_target"] == pytest.approx(dp_tokens)
    for baseline in (flat_ring, hierarchical):
        assert baseline["time_to_target_seconds"] == pytest.approx(steps * baseline["wan_step_seconds"])

    # DiLoCo: the budget's run, and where that never reached the target, the one on twice
    # the budget's inner steps, stopped at its first evaluation at or below it
    budget_run, longer = results["diloco"], results["diloco_longer"]
    budget_tokens = reach([(e["tokens"], e["loss"]) for e in budget_run["evaluations"]], target)
    if budget_tokens is not None:
        assert longer is None and equal["diloco_schedule_at_target"] == "the budget"
        reached_run, diloco_tokens = budget_run, budget_tokens
    else:
        assert equal["diloco_schedule_at_target"] in (None, "2x the budget")
        assert 0 < longer["tokens"] <= 2 * settings["tokens"]
        reached_run, diloco_tokens = longer, reach([(e["tokens"], e["loss"]) for e in longer["evaluations"]], target)
        assert diloco_tokens is not None or not longer["stopped_at_target"]  # stopped only at the target
    if diloco_tokens is None:
        assert not equal["diloco_reached"] and equal["diloco_token_overhead"] is None
    else:
        first = next(e for e in reached_run["evaluations"] if e["loss"] <= target)
        assert equal["diloco_reached"] and equal["diloco_tokens_to_target"] == pytest.approx(diloco_tokens)
        assert equal["diloco_token_overhead"] == pytest.approx(diloco_tokens / dp_tokens)
        assert equal["diloco_time_to_target_seconds"] == pytest.approx(first["time"] - reached_run["launched"])
        assert 0 < equal["diloco_time_to_target_seconds"] <= reached_run["wall_seconds"] + 1
        diloco_bytes = reached_run["wan_bytes"]
        assert equal["diloco_wan_bytes"] == diloco_bytes > 0 and equal["diloco_bytes_counted"] in equal["rule"]
        for name, baseline in (("flat_ring", flat_ring), ("hierarchical", hierarchical)):
            assert equal[f"{name}_wan_bytes_to_target"] == pytest.approx(baseline["wan_bytes_per_step"] * steps)
            assert equal[f"wan_bytes_{name}_over_diloco"] == pytest.approx(
                baseline["wan_bytes_per_step"] * steps / diloco_bytes
            )

    # the floor: one learner alone on its share of the tokens; DiLoCo fails unless its final
    # loss at the budget is below the floor's
    floor = results["floor"]
    assert floor["tokens"] == settings["tokens"] // learners and floor["batch"] == settings["batch_per_learner"]
    assert floor["final_loss"] == floor["evaluations"][-1][1] == equal["floor_loss"]
    assert equal["diloco_final_loss"] == budget_run["final_loss"]
    assert equal["diloco_beats_floor"] == (budget_run["final_loss"] < floor["final_loss"])
    assert "floor: one learner alone" in proc.stdout
    assert ("FAILING" in proc.stdout) == (not equal["diloco_beats_floor"])

    # the link rate for 90% computing: data-parallel's from its step on the shaped link (the
    # rate at which it would communicate a ninth of its compute), the plan's beside it
    rates = results["link_rates"]
    for name, baseline in (("flat_ring", flat_ring), ("hierarchical", hierarchical)):
        medians = baseline["wan"]["medians"]
        by_hand = calibration["link_mbit"] * medians["comm_seconds"] / (medians["compute_seconds"] / 9)
        assert rates["dp_measured_mbit"][name] == pytest.approx(by_hand)
    # the plan's, as `diloco plan` printed them (the quick run's 40 ms round trips against
    # steps of milliseconds leave no rate for either method: None, not a number)
    assert rates["plan"] == results["plan"]["prediction"]["link_rates"]
    assert rates["plan"]["target_compute_share"] == 0.9 and "diloco_mbit" in rates["plan"]
    assert rates["diloco_runs"] == []  # the shaped check runs in the full mode only (--check-link-rate)

    # DiLoCo: the whole run on the WAN, by names, with the right proxies
    diloco = results["diloco"]
    assert all(code == 0 for code in diloco["exit_codes"].values())
    assert len(diloco["exit_codes"]) == learners + 1 + 2  # the learners, the syncer, two reducers
    assert {r["storage_options"]["endpoint_url"] for r in diloco["spec_regions"]} == {
        "http://s3-east:9001",
        "http://s3-west:9001",
    }
    assert sorted((p["place"], p["region"], p["via"]) for p in diloco["probes"]) == [
        ("east", "east", "local"),
        ("syncer", "east", "remote"),
        ("syncer", "west", "remote"),
        ("west", "west", "local"),
    ]
    tokens = settings["tokens"]
    assert diloco["tokens"] == tokens
    assert 0 < diloco["compute_share"] <= 1
    assert diloco["versions"] > 0 and diloco["evaluations"][-1]["loss"] == diloco["final_loss"] < 5.0
    assert not diloco["stopped_at_target"]  # the budget's run runs to its end
    links = {(link["source"], link["bucket"]): link for link in diloco["links"]}
    assert set(links) == {("east", "east"), ("west", "west"), ("syncer", "east"), ("syncer", "west")}
    for region in ("east", "west"):
        remote, local = diloco["proxies"][region]["remote"], diloco["proxies"][region]["local"]
        syncer_link, learners_link = links[("syncer", region)], links[(region, region)]
        assert syncer_link["wan"] and not learners_link["wan"]
        # the proxies carried the bodies the processes counted, plus HTTP headers
        assert remote["bytes_to_upstream"] >= syncer_link["bytes_up"] > 0
        kinds = diloco["syncer_kinds"][region]
        read = sum(
            traffic["bytes_down"] for kind, traffic in kinds.items() if kind != "listing"
        )  # listings are estimates
        assert remote["bytes_to_client"] >= read > 0
        assert local["bytes_to_upstream"] >= learners_link["bytes_up"] > 0
        # learners stay in their region: the delaying proxy saw only the syncer's requests
        assert remote["connections"] > 0 and local["connections"] > 0
    assert diloco["wan_bytes"] == sum(link["bytes_up"] + link["bytes_down"] for link in diloco["links"] if link["wan"])
    # the metered bytes hold estimated heads and listings: within 2% they are at most what
    # the proxies passed (which also carried diloco up's probes and the benchmark's reads)
    assert diloco["proxy_wan_bytes"] >= 0.98 * diloco["wan_bytes"]
    assert diloco["metered_over_proxy"] == pytest.approx(diloco["wan_bytes"] / diloco["proxy_wan_bytes"] - 1)
    # every byte the syncer moved crossed its link (TCP/IP on top)
    assert diloco["wire_wan_bytes"] >= 0.9 * diloco["proxy_wan_bytes"]

    # the race's figures
    assert diloco["wan_bytes_per_token"] < dp["wan_bytes_per_token"]
    assert diloco["wan_bytes_per_token_wire"] < dp["wan_bytes_per_token_wire"]
    ratios = results["ratios"]
    if equal["diloco_reached"]:
        assert ratios["time_to_target_dp_over_diloco"] == pytest.approx(
            dp["time_to_target_seconds"] / diloco["time_to_target_seconds"]
        )
    assert ratios["wan_bytes_per_token_dp_over_diloco"] > 1
    assert dp["latency_not_emulated_seconds_per_step"] == pytest.approx(
        2 * (learners - 1) * settings["latency_ms"] / 1000
    )

    # the plan beside it, or a recorded reason why not
    plan = results["plan"]
    if plan["prediction"] is None:
        assert plan["error"]
    else:
        comparison = results["plan_vs_measured"]
        assert "error" not in comparison, comparison
        # DiLoCo's figures from the plan given the run's step and start-up, data-parallel's at c
        at_run = results["plan_at_run_step"]["prediction"]
        command = results["plan_at_run_step"]["command"]
        step = command[command.index("--step-seconds") + 1]
        assert float(step) == pytest.approx(diloco["median_learner_step_seconds"], rel=1e-5)
        startup = command[command.index("--startup-seconds") + 1]
        assert float(startup) == pytest.approx(diloco["startup_seconds"], rel=1e-5)
        assert 0 < diloco["compute_share_from_launch"] < diloco["compute_share"]
        assert comparison["diloco_compute_share"] == {
            "predicted": at_run["diloco"]["compute_share_with_startup"],
            "measured": diloco["compute_share_from_launch"],
            "points": pytest.approx(
                100 * (at_run["diloco"]["compute_share_with_startup"] - diloco["compute_share_from_launch"])
            ),
        }
        assert comparison["diloco_wan_bytes"]["predicted"] == at_run["diloco"]["run_wan_bytes"]
        assert comparison["diloco_wan_bytes"]["measured"] == diloco["wan_bytes"]
        dp_plan = plan["prediction"]["data_parallel"]
        assert comparison["dp_wan_bytes_per_token"]["predicted"] == dp_plan["wan_bytes_per_token"]
    assert "sweep" not in results

    # nothing is left behind: namespaces, hosts files
    emulation = results["emulation"]
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in namespaces for name in emulation["namespaces"].values())
    assert not any(os.path.exists(path) for path in emulation["hosts_files"].values())
    assert set(emulation["hosts_files"]) == {"east", "west", "syncer"}
    assert "s3-east" not in Path("/etc/hosts").read_text()
    assert "wrote" in proc.stdout and "time to target" in proc.stdout
