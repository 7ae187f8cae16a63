"""The link rate each method needs for 90% computing (``diloco plan``), against hand
calculations: data-parallel's from its all-reduce, Decoupled DiLoCo's as the lowest rate
at which the traffic model keeps the target."""

import json

import pytest
from click.testing import CliRunner

from diloco_cli.bandwidth.link_rate import allreduce_rate_mbit, diloco_rate_mbit
from diloco_cli.bandwidth.model import predict
from diloco_cli.bandwidth.shapes import RunShape
from diloco_cli.cli.app import app

runner = CliRunner()
PARAMETERS = 842_496  # the default recipe's model
STEP, LATENCY = 5.0, 0.040  # --step-seconds 5, --latency-ms 40


def test_an_all_reduce_may_take_a_ninth_of_compute_at_90_percent():
    # 1 MB per member, 6 latencies of 10 ms: 0.9 x (1/0.9 - 1) = 0.1 s, less 0.06 s -> 1 MB in 0.04 s
    assert allreduce_rate_mbit(1e6, 6, 0.9, 0.010, 0.9) == pytest.approx(200.0)
    assert allreduce_rate_mbit(1e6, 6, 0.9, 0.020, 0.9) is None  # latency alone takes more than the budget
    assert allreduce_rate_mbit(0.0, 0, 0.9, 0.010, 0.9) == 0.0


def test_the_plan_names_each_methods_rate_and_diloco_s_is_where_the_model_crosses_90_percent():
    result = runner.invoke(
        app, ["plan", "--step-seconds", "5", "--link-mbit", "10", "--latency-ms", "40", "--output", "json"]
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    rates = plan["link_rates"]
    assert rates["target_compute_share"] == 0.9
    budget = STEP * (1 / 0.9 - 1)
    # flat ring of 4: 2 x 3/4 x 2 bytes x N per worker, 6 latencies
    flat = 2 * 3 / 4 * 2 * PARAMETERS / (budget - 6 * LATENCY) * 8 / 1e6
    # two region leaders: 2 x 1/2 x 2 bytes x N each, 2 latencies
    hierarchical = 2 * 1 / 2 * 2 * PARAMETERS / (budget - 2 * LATENCY) * 8 / 1e6
    assert rates["flat_ring_mbit"] == pytest.approx(flat) and rates["hierarchical_mbit"] == pytest.approx(hierarchical)
    shape = RunShape.model_validate(plan["shape"])

    def share(rate):
        links = tuple(link if not link.wan else link.model_copy(update={"rate_mbit": rate}) for link in shape.links)
        return predict(shape.model_copy(update={"links": links})).compute_share

    diloco = rates["diloco_mbit"]
    assert diloco == pytest.approx(diloco_rate_mbit(shape)) and share(diloco) >= 0.9
    # the lowest rate the model allows, unless the largest update needs more to cross in one request
    floor = rates["diloco_object_mbit"]
    assert share(0.99 * diloco) < 0.9 or (diloco == pytest.approx(floor) and share(0.99 * floor) >= 0.9)
    assert flat / diloco > 10  # the point of the tool, at these settings

    text = runner.invoke(app, ["plan", "--step-seconds", "5", "--link-mbit", "10", "--latency-ms", "40"]).output
    assert "Link rate for 90.0% computing" in text
    assert f"{flat:.3g} Mbit/s flat ring ({flat / diloco:,.0f}x Decoupled DiLoCo's)" in text


def test_diloco_s_rate_carries_its_largest_update_in_one_request_within_the_client_timeout():
    """At a long step, H=200 and reports every 30 s, the traffic model alone would let the
    links go very slow;
    but a 200 KB update written at a few kB/s outlasts s3fs's 15-s read timeout and fails
    every try (seen in bench.wan at 0.049 Mbit/s): the rate is at least the largest update
    over 15 s, and the plan says why."""
    from diloco_cli.bandwidth.link_rate import OBJECT_SECONDS

    args = ["plan", "--step-seconds", "600", "--link-mbit", "10", "--latency-ms", "40"]
    args += ["--set", "sync.sync_interval=200", "--set", "sync.update_codec.codec=int2"]
    args += ["--set", "sync.status_seconds=30", "--set", "training.heartbeat_seconds=30"]  # recipes/wan.yaml's
    plan = json.loads(runner.invoke(app, [*args, "--output", "json"]).output)
    rates, updates = plan["link_rates"], plan["shape"]["updates"]["bytes"]
    floor = max(updates) * 8 / OBJECT_SECONDS / 1e6
    assert rates["diloco_object_mbit"] == pytest.approx(floor)
    assert rates["diloco_mbit"] == pytest.approx(floor)  # the traffic model alone asks for less
    shape = RunShape.model_validate(plan["shape"])
    links = tuple(link if not link.wan else link.model_copy(update={"rate_mbit": floor / 2}) for link in shape.links)
    assert predict(shape.model_copy(update={"links": links})).compute_share >= 0.9  # enough, by the model alone
    text = runner.invoke(app, args).output
    assert "the largest update must cross in one request within 15 s, s3fs's read timeout" in text
