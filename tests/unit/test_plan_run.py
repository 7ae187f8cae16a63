"""``diloco plan`` over a whole run: the requests' HTTP heads, the sends the schedule
makes (staggered, the end's flush, an H schedule) and the rounds a bottleneck folds
(figures by hand)."""

import re

import pytest

from tests.support.plans import ARGS, plan_of


def test_requests_to_s3_carry_their_http_heads_and_local_files_none(tmp_path):
    """The same regions as S3 buckets and as local folders: a link's bytes are its flows'
    and, over S3, its requests' heads as the meter estimates them (a PUT or LIST 860 B and
    its path up, 385 B down; a GET 750 B and its path up, 525 B down); local files none."""
    for scheme, bucket in (("s3", "s3://diloco-{name}/runs"), ("file", f"file://{tmp_path}/{{name}}")):
        regions = tmp_path / f"{scheme}.yaml"
        regions.write_text(
            "regions:\n" + "".join(f"  - name: {n}\n    bucket: {bucket.format(name=n)}\n" for n in ("east", "west"))
        )
        plan, _ = plan_of([*ARGS, "--regions", str(regions)])
        path = plan["shape"]["key_prefix_bytes"] + 40
        for link in plan["diloco"]["links"]:
            puts, gets = link["put_per_second"], link["get_per_second"]
            assert puts > 0 and gets > 0
            heads_up, heads_down = puts * (860 + path) + gets * (750 + path), puts * 385 + gets * 525
            if scheme == "file":
                heads_up = heads_down = 0.0
            flows = {
                d: sum(f["bytes_per_second"] for f in link["flows"] if f["direction"] == d) for d in ("up", "down")
            }
            assert link["up_bytes_per_second"] == pytest.approx(flows["up"] + heads_up)
            assert link["down_bytes_per_second"] == pytest.approx(flows["down"] + heads_down)


def test_the_runs_wan_bytes_count_the_staggered_sends_and_the_ends_flush():
    """300 steps at H=100 with 2 fragments: fragment 0 goes at steps 100, 200, 300,
    fragment 1 at 50, 150, 250 and once more at the end (it trained after 250): 7 sends
    per learner where the steady rate counts 6; the per-round flows of the run's WAN bytes
    grow by 7/6, the others (heartbeats, status, listings) run at their rates, through the
    start-up too."""
    from diloco_cli.bandwidth.flows import PER_ROUND_KINDS
    from diloco_cli.core.fragments import sends_per_learner

    assert sends_per_learner(300, 100, 2) == 7
    assert sends_per_learner(300, 25, 2) == 25  # 12 + 12 and fragment 1's flush after step 287
    assert sends_per_learner(300, 100, 1) == 3 and sends_per_learner(10, 25, 2) == 2  # only the flush

    def by_hand(plan: dict, startup: float) -> float:
        d = plan["diloco"]
        loop = 300 * d["period_seconds"]
        total = 0.0
        for link in (link for link in d["links"] if link["wan"]):
            per_round = sum(f["bytes_per_second"] for f in link["flows"] if f["kind"] in PER_ROUND_KINDS)
            clock = link["up_bytes_per_second"] + link["down_bytes_per_second"] - per_round
            total += loop * per_round * 7 / 6 + (startup + loop) * clock
        return total

    settings = ["--set", "sync.sync_interval=100", "--set", "training.inner_steps=300"]
    plan, text = plan_of([*ARGS, *settings, "--startup-seconds", "0"])
    d = plan["diloco"]
    assert d["rounds_per_learner"] == 7 and d["run_wan_bytes"] == pytest.approx(by_hand(plan, 0))
    assert d["run_wan_bytes"] > d["wan_bytes_per_second"] * 300 * d["period_seconds"]
    assert "7 sends per learner, the end's flush included; 6 at the steady rate" in text
    # 20 s of start-up: no learner computes, the syncer already polls
    started, text = plan_of([*ARGS, *settings, "--startup-seconds", "20"])
    late, loop = started["diloco"], 300 * started["diloco"]["period_seconds"]
    assert late["run_wan_bytes"] == pytest.approx(by_hand(started, 20))
    assert late["compute_share_with_startup"] == pytest.approx(late["compute_share"] * loop / (loop + 20))
    budget = started["tokens_budget"]
    assert started["time_to_budget_seconds"] == pytest.approx(20 + budget / late["useful_tokens_per_second"])
    assert "of all wall time with 20 s of start-up" in text


def test_on_a_link_too_thin_for_every_round_the_run_carries_the_rounds_it_can():
    """At 0.02 Mbit/s the syncer's calls over the link are the bottleneck (the syncer is busy
    more than all of its time): learners go on computing, waiting sends
    fold into newer ones, and only network_factor of the rounds cross; the per-round flows
    of the run's bytes shrink by that factor, the clock's flows do not."""
    from diloco_cli.bandwidth.flows import PER_ROUND_KINDS

    settings = ["--set", "sync.sync_interval=100", "--set", "training.inner_steps=300", "--startup-seconds", "0"]
    thin, text = plan_of(["plan", "--step-seconds", "1", "--link-mbit", "0.02", "--latency-ms", "40", *settings])
    d = thin["diloco"]
    assert d["bottleneck"] == "syncer I/O" and 0 < d["network_factor"] < 1
    assert d["rounds_per_learner"] == 7 and d["rounds_crossing_per_learner"] == pytest.approx(7 * d["network_factor"])
    loop = 300 * d["period_seconds"]
    by_hand = 0.0
    for link in (link for link in d["links"] if link["wan"]):
        per_round = sum(f["bytes_per_second"] for f in link["flows"] if f["kind"] in PER_ROUND_KINDS)
        clock = link["up_bytes_per_second"] + link["down_bytes_per_second"] - per_round
        by_hand += loop * per_round * d["network_factor"] * 7 / 6 + loop * clock
    assert d["run_wan_bytes"] == pytest.approx(by_hand)
    # the text comes from a second plan, whose codecs' speed is measured again (a loaded
    # machine moves the syncer's time, and with it the share of rounds that cross, a little)
    said = re.search(r"([\d.]+) reach a merge, the rest folded into later sends by the syncer I/O", text)
    assert said is not None, text
    assert float(said.group(1)) == pytest.approx(d["rounds_crossing_per_learner"], rel=0.25)
    wide, text = plan_of([*ARGS, *settings])
    assert wide["diloco"]["network_factor"] == 1 and wide["diloco"]["rounds_crossing_per_learner"] == 7
    assert "reach a merge" not in text


def test_the_plan_sizes_top_k_uploads_with_the_values_the_recipe_keeps():
    """Keeping 4 of 256 instead of 8: each block's record is 5 bytes instead of 9, and its
    scale 2 more: the plan's uploads shrink by about (2 + 5) / (2 + 9)."""
    topk = ["--set", "sync.learner_codec.codec=topk", "--set", "sync.learner_codec.block_size=256"]
    sizes = {}
    for keep in (8, 4):
        plan, _ = plan_of([*ARGS, *topk, "--set", f"sync.learner_codec.keep_per_block={keep}"])
        sizes[keep] = max(plan["shape"]["uploads"]["bytes"])
    assert sizes[4] / sizes[8] == pytest.approx(7 / 11, rel=0.1)


def test_updates_merged_from_top_k_sends_are_sized_as_sparse_as_they_are():
    """Two regions' top-k aggregates keep at most 2 x 8 of each 256 values: the merged
    update is that sparse (6%) and compresses to a fraction of a dense one, unless outer
    momentum spreads it over every value (about 64% here, int2 without a zero level)."""
    from diloco_cli.bandwidth.traffic_plan import update_density
    from diloco_cli.config.recipe import Recipe

    topk = ["--set", "sync.learner_codec.codec=topk", "--set", "sync.learner_codec.block_size=256"]
    updates = ["--set", "sync.update_codec.codec=int2"]
    sizes = {}
    for name, extra in (("dense", []), ("sparse", topk), ("momentum", [*topk, "--set", "sync.outer_momentum=0.5"])):
        plan, _ = plan_of([*ARGS, *updates, *extra])
        sizes[name] = max(plan["shape"]["updates"]["bytes"])
    assert sizes["sparse"] < 0.7 * sizes["dense"] and sizes["momentum"] == pytest.approx(sizes["dense"], rel=0.02)
    recipe = Recipe.model_validate({"sync": {"learner_codec": {"codec": "topk", "block_size": 256}}})
    assert update_density(recipe, regions=2, learners=4) == 2 * 8 / 256
    relayed = recipe.model_copy(update={"sync": recipe.sync.model_copy(update={"quorum": 1})})
    assert update_density(relayed, regions=2, learners=4) == 4 * 8 / 256  # K < M: each send relayed
    assert update_density(Recipe(), regions=2, learners=4) == 1.0
