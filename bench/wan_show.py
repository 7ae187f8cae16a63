"""``bench.wan``'s results as tables and lines on the terminal: the race, its equal-loss
ratios, the plan beside the measurement, the link rates and the settings sweep."""

from __future__ import annotations

from bench._common import print_table


def _fmt(value: float | None, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


def show(results: dict) -> None:
    """The whole result: the race, bytes per link, the plan, the link rates and the sweep."""
    show_race(results)
    show_links(results["dp"], results["diloco"])
    show_plan(results)
    if results.get("link_rates"):
        show_link_rates(results["link_rates"])
    if results.get("sweep"):
        show_sweep(results["sweep"])


def show_race(results: dict) -> None:
    """Each side's time, tokens and WAN bytes to data-parallel's final loss, the floor,
    and their ratios; FAILING where DiLoCo's final loss is not below the floor's."""
    dp, diloco, calibration = results["dp"], results["diloco"], results["calibration"]
    equal = results["equal_loss"]
    print(
        f"\nlinks: {calibration['link_mbit']:.3f} Mbit/s per region (syncer's {calibration['syncer_link_mbit']:.3f}), "
        f"measured data-parallel comm/compute {dp['comm_to_compute']:.1f}x; "
        f"target loss {equal['target']:.4f}: {equal['target_source']} at the budget "
        "(DiLoCo trains until its published model reaches it, up to the longer schedule)"
    )
    rows = [
        {
            "method": f"data-parallel, {name.replace('_', ' ')}",
            "time to target s": baseline["time_to_target_seconds"],
            "tokens to target": equal["dp_tokens_to_target"],
            "compute share": baseline["wan"]["compute_share"],
            "WAN B/token": baseline["wan_bytes_per_token"],
            "WAN bytes to target": baseline["wan_bytes_to_target"],
            "final loss": dp["final_loss"],
            "how": f"{_fmt(dp['steps_to_target'], '.4g')} steps x {baseline['wan_step_seconds']:.2f} s",
        }
        for name, baseline in dp["baselines"].items()
    ]
    reached = equal["diloco_reached"]
    rows.append(
        {
            "method": "Decoupled DiLoCo",
            "time to target s": equal["diloco_time_to_target_seconds"],
            "tokens to target": equal["diloco_tokens_to_target"],
            "compute share": diloco["compute_share"],
            "WAN B/token": diloco["wan_bytes_per_token"],
            "WAN bytes to target": equal["diloco_wan_bytes"],
            "final loss": diloco["final_loss"],
            "how": f"measured, version {equal['diloco_version_at_target']} of the run on "
            f"{equal['diloco_schedule_at_target']}"
            if reached
            else "never reached the target, on the longer schedule either",
        }
    )
    floor = results["floor"]
    rows.append(
        {
            "method": f"floor: one learner alone ({floor['learners_share']} of the tokens)",
            "final loss": floor["final_loss"],
            "how": floor["how"],
        }
    )
    columns = ["method", "time to target s", "tokens to target", "compute share", "WAN B/token"]
    print_table(rows, [*columns, "WAN bytes to target", "final loss", "how"])
    _print_overhead_and_floor(equal)
    ratios = results["ratios"]
    for name in dp["baselines"]:
        print(
            f"{name.replace('_', ' ')} / DiLoCo at data-parallel's final loss: "
            f"WAN bytes {_fmt(equal[f'wan_bytes_{name}_over_diloco'], '.1f')}x "
            f"(wire {_fmt(equal[f'wire_wan_bytes_{name}_over_diloco'], '.1f')}x), "
            f"time {_fmt(equal[f'time_to_target_{name}_over_diloco'], '.1f')}x"
        )
    print(
        f"at equal tokens (flat ring / DiLoCo): WAN bytes {_fmt(ratios['wan_bytes_per_token_dp_over_diloco'], '.1f')}x "
        f"(wire {_fmt(ratios['wan_bytes_per_token_wire_dp_over_diloco'], '.1f')}x)"
    )
    print(
        "data-parallel's gloo traffic gets no emulated latency: "
        f"+ {dp['latency_not_emulated_seconds_per_step']:.2f} s per step "
        f"would make its time to target {_fmt(dp['time_to_target_seconds_with_latency'], '.4g')} s"
    )


def _print_overhead_and_floor(equal: dict) -> None:
    """DiLoCo's token overhead (a lower bound where it never reached the target) and
    the floor's verdict: FAILING where DiLoCo's final loss is not below the floor's."""
    overhead = (
        f"{_fmt(equal['diloco_token_overhead'], '.3f')}x"
        if equal["diloco_reached"]
        else f"above {_fmt(equal.get('diloco_token_overhead_above'), '.3f')}x (never reached)"
    )
    print(
        f"DiLoCo's token overhead: {overhead} data-parallel's tokens to its "
        f"final loss; DiLoCo's WAN bytes counted {equal['diloco_bytes_counted'] or '-'}"
    )
    if not equal["diloco_beats_floor"]:
        print(
            f"FAILING: DiLoCo's final loss {equal['diloco_final_loss']:.4f} is not below the floor's "
            f"{equal['floor_loss']:.4f} (one learner alone), whatever its ratios"
        )
    else:
        print(f"DiLoCo's final loss {equal['diloco_final_loss']:.4f} beats the floor's {equal['floor_loss']:.4f}")


def show_links(dp: dict, diloco: dict) -> None:
    """Bytes per link of the DiLoCo run (the report's, the proxies', the devices'), and
    data-parallel's per step."""
    print(
        "\nbytes per link, DiLoCo (app: the run's report, objects and estimated heads; proxy: HTTP through the "
        "proxies; wire: the WAN devices)"
    )
    link_rows = []
    for link in diloco["links"]:
        proxy = diloco["proxies"][link["bucket"]]["remote" if link["wan"] else "local"]
        link_rows.append(
            {
                "link": f"{link['source']} -> {link['bucket']}",
                "WAN": "yes" if link["wan"] else "no",
                "app up": link["bytes_up"],
                "app down": link["bytes_down"],
                "proxy up": proxy["bytes_to_upstream"],
                "proxy down": proxy["bytes_to_client"],
            }
        )
    print_table(link_rows, ["link", "WAN", "app up", "app down", "proxy up", "proxy down"])
    if diloco.get("metered_over_proxy") is not None:
        metered = diloco["metered_over_proxy"]
        print(f"WAN bytes metered (objects and estimated heads) against the proxies: {metered:+.2%}")
    device_rows = [{"place": label, "tx": moved["tx"], "rx": moved["rx"]} for label, moved in diloco["devices"].items()]
    print(
        "wire bytes per place's link, DiLoCo run:",
        ", ".join(f"{r['place']} tx {r['tx']:,} rx {r['rx']:,}" for r in device_rows),
    )
    wan = dp["wan"]
    print(
        "wire bytes per place's link per step, data-parallel:",
        ", ".join(
            f"{label} tx {moved['tx'] / wan['steps_done']:,.0f} rx {moved['rx'] / wan['steps_done']:,.0f}"
            for label, moved in wan["devices"].items()
        ),
    )


def show_plan(results: dict) -> None:
    """``diloco plan``'s prediction beside what the run measured."""
    diloco = results["diloco"]
    comparison = results.get("plan_vs_measured")
    if comparison and "error" not in comparison:
        print("\ndiloco plan against the measurement")
        plan_rows = []
        for key, value in comparison.items():
            if isinstance(value, dict) and "predicted" in value:
                unit = "points" if "points" in value else "percent"
                plan_rows.append(
                    {
                        "figure": key,
                        "predicted": value["predicted"],
                        "measured": value["measured"],
                        "difference": f"{value[unit]:+.1f} {'pt' if unit == 'points' else '%'}",
                    }
                )
        print_table(plan_rows, ["figure", "predicted", "measured", "difference"])
        print(
            f"plan's bottleneck: {comparison['diloco_bottleneck']}, "
            f"syncer busy {_fmt(comparison['diloco_syncer_busy'], '.2f')}; "
            f"DiLoCo published {diloco['versions']} versions"
            f"{' of ' + str(diloco['versions_expected']) if 'versions_expected' in diloco else ''}"
        )
        if comparison.get("suggestion"):
            hint = comparison["suggestion"]
            print(
                f"plan's suggestion for a {hint['target_compute_share']:.0%} compute share: H={hint['sync_interval']}, "
                f"{hint['upload_codec']}/{hint['update_codec']} ({hint['compute_share']:.1%}"
                f"{'' if hint['reached'] else ', not reached'})"
            )
    else:
        plan = results.get("plan") or {}
        print(
            "\ndiloco plan: no prediction "
            f"({(plan.get('error') or (comparison or {}).get('error') or 'not run')[:300]})"
        )


def show_link_rates(rates: dict) -> None:
    """The link rate for the target compute share: planned, measured, and DiLoCo's runs at it."""
    plan_rates, measured = rates["plan"], rates["dp_measured_mbit"]
    print(f"\nlink rate for {rates['target_compute_share']:.0%} computing (Mbit/s, every WAN link)")
    print(
        f"  plan: DiLoCo {_fmt(plan_rates.get('diloco_mbit'), '.3g')}, flat ring "
        f"{_fmt(plan_rates.get('flat_ring_mbit'), '.3g')}, "
        f"hierarchical {_fmt(plan_rates.get('hierarchical_mbit'), '.3g')} "
        "(with the links' latency)"
    )
    print(
        f"  data-parallel measured (its step on the shaped links, no latency): flat ring "
        f"{_fmt(measured['flat_ring'], '.3g')}, hierarchical {_fmt(measured['hierarchical'], '.3g')}; "
        f"over the plan's DiLoCo rate: {_fmt(rates['measured_ratios']['flat_ring'], '.0f')}x, "
        f"{_fmt(rates['measured_ratios']['hierarchical'], '.0f')}x"
    )
    for run in rates["diloco_runs"]:
        print(
            f"  DiLoCo at {run['link_mbit']:.3g} ({run['factor']:g}x the plan's): "
            f"computing {run['compute_share']:.1%}, "
            f"{run['versions']} of {run['versions_expected']} versions: "
            f"{'reaches' if run['reaches_target'] else 'misses'} the target"
        )


def show_sweep(sweep_result: dict) -> None:
    print(
        "\nsettings sweep: WAN bytes against data-parallel's, counted to data-parallel's final loss (and at equal "
        "tokens); whether and at how many tokens each setting reached that loss"
    )
    rows = []
    for row in sweep_result["rows"]:
        equal = row.get("equal_loss") or {}
        rows.append(
            {
                **row,
                "loss vs default": "-" if row["loss_vs_default"] is None else f"{row['loss_vs_default']:+.2%}",
                "reached dp loss": equal.get("reached"),
                "tokens to it": equal.get("tokens_to_target"),
                "flat ring x": equal.get("flat_ring_over_diloco"),
                "hierarchical x": equal.get("hierarchical_over_diloco"),
                "flat ring x, equal tokens": equal.get("flat_ring_over_diloco_equal_tokens"),
                "plan bytes %": (row.get("plan_vs_measured") or {}).get("wan_bytes", {}).get("percent"),
                "plan share pts": (row.get("plan_vs_measured") or {}).get("compute_share", {}).get("points"),
            }
        )
    print_table(
        rows,
        [
            "setting",
            "final_loss",
            "loss vs default",
            "reached dp loss",
            "tokens to it",
            "wan_bytes_per_token",
            "flat ring x",
            "hierarchical x",
            "flat ring x, equal tokens",
            "meets_target",
            "plan bytes %",
            "plan share pts",
        ],
    )
    print(sweep_result["verdict"])
    plan = sweep_result.get("plan") or {}
    if plan.get("planned"):
        print(
            f"diloco plan, {plan['planned']} settings planned ({plan['unplanned']} from before): at worst "
            f"{plan['worst_wan_bytes_percent']:+.1f}% of the WAN bytes ({plan['worst_wan_bytes_setting']}) and "
            f"{plan['worst_compute_share_points']:+.1f} points of the compute share "
            f"({plan['worst_compute_share_setting']}); within 10% and 10 points: {plan['within_target']}"
        )
