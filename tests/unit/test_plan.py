"""``diloco plan``: the traffic model against hand calculations, the suggested H, prices."""

import math

import pytest
from click.testing import CliRunner

from diloco_cli.bandwidth import document_sizes
from diloco_cli.bandwidth.model import predict, smallest_sync_interval
from diloco_cli.bandwidth.prices import GB
from diloco_cli.bandwidth.ring import data_parallel_bytes_per_step, ring_region_crossings
from diloco_cli.bandwidth.shapes import RunShape
from diloco_cli.bandwidth.traffic_plan import TrafficPlan
from diloco_cli.cli.app import app
from diloco_cli.views.traffic_plan import render_traffic_plan
from tests.support.plans import ARGS, plan_of

runner = CliRunner()

# The default recipe: M=4 learners (two regions of two), K=4, H=25, P=2, batch 16 x 128
# bytes, 300 inner steps; its model has 842,496 parameters.
M, K, H, P = 4, 4, 25, 2
PARAMETERS = 842_496
TOKENS_PER_STEP = 16 * 128
BUDGET = M * 300 * TOKENS_PER_STEP  # 2,457,600
STEP = 1.0  # --step-seconds
RATE = 10e6 / 8  # --link-mbit 10, in bytes per second
LATENCY = 0.040  # --latency-ms 40, one way
APART = "syncer:\n  host: local\n"
"""A region file of the default regions with the syncer in a place of its own."""


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """``diloco plan`` on the default recipe with the syncer in a place of its own (every
    link over the WAN)."""
    regions = tmp_path_factory.mktemp("regions") / "apart.yaml"
    regions.write_text(APART)
    return plan_of([*ARGS, "--regions", str(regions)])


@pytest.fixture(scope="module")
def planned_default():
    """``diloco plan`` on the default recipe and regions as they are: the syncer in the
    first region (local-a), a reducer in each region."""
    return plan_of(ARGS)


def test_the_default_recipe_matches_a_hand_calculation(planned):
    """The syncer apart: every link carries its region's aggregates and what the syncer publishes."""
    plan, _ = planned
    shape, d = plan["shape"], plan["diloco"]
    assert plan["placement"]["syncer_region"] is None
    assert all(link["wan"] for link in d["links"])
    assert plan["parameters"] == PARAMETERS and sum(plan["fragment_parameters"]) == PARAMETERS
    assert plan["tokens_budget"] == BUDGET and plan["tokens_per_step"] == TOKENS_PER_STEP

    # Payload sizes are the real encoder's: int4 packs two values a byte plus a 2-byte
    # scale per block of 64, then zstd shrinks that a little; updates are int8.
    for parameters, upload, update in zip(
        plan["fragment_parameters"], shape["uploads"]["bytes"], shape["updates"]["bytes"]
    ):
        int4, int8 = parameters / 2 + parameters / 32, parameters + parameters / 32
        assert 0.6 * int4 < upload < int4 + 4096
        assert 0.6 * int8 < update < int8 + 4096

    # The training thread: T = t + o, o = (sum encode + M/K sum install) / H + checkpoint / 100.
    overhead = (sum(shape["uploads"]["seconds"]) + M / K * sum(shape["updates"]["seconds"])) / H + shape[
        "checkpoint_seconds"
    ] / 100
    period = STEP + overhead
    assert d["overhead_seconds"] == pytest.approx(overhead)
    assert d["period_seconds"] == pytest.approx(period)

    # Each link carries its region's aggregate of each fragment every H steps (one payload's size).
    aggregate_per_second = sum(shape["uploads"]["bytes"]) / (H * period)
    merges_per_second = M / K * P / (H * period)
    update_per_second = merges_per_second * sum(shape["updates"]["bytes"]) / P
    for link in d["links"]:
        flows = {(f["kind"], f["direction"]): f for f in link["flows"]}
        assert flows["aggregate", "down"]["bytes_per_second"] == pytest.approx(aggregate_per_second)
        assert flows["aggregate", "down"]["get_per_second"] == pytest.approx(P / (H * period))
        assert flows["update", "up"]["bytes_per_second"] == pytest.approx(update_per_second)
        assert ("payload", "down") not in flows and ("snapshot", "up") not in flows  # they stay in the region
        assert flows["status", "up"]["put_per_second"] == pytest.approx(1 / 2.0)  # every sync.status_seconds
        assert flows["heartbeat", "down"]["get_per_second"] == pytest.approx(2 / 2.0)  # each learner's, as often
        assert link["utilization"] == pytest.approx(
            max(link["up_bytes_per_second"], link["down_bytes_per_second"]) / RATE
        )

    # Not saturated at 1 s a step: the compute share is t / T and tokens flow at M x 2048 / T.
    assert d["syncer_busy"] < 1 and d["network_factor"] == 1.0 and d["bottleneck"] == "none"
    assert d["compute_share"] == pytest.approx(STEP / period)
    # and before the first step, the default start-up of 10 s
    assert shape["startup_seconds"] == 10
    assert plan["time_to_budget_seconds"] == pytest.approx(10 + BUDGET / (M * TOKENS_PER_STEP / period))

    # Data-parallel: 2(M-1)/M x 2 bytes x N per worker per step, over the 10 Mbit/s link,
    # plus 2(M-1) latencies, after the step's compute.
    dp = plan["data_parallel"]
    per_step = 2 * (M - 1) / M * 2 * PARAMETERS
    assert per_step == 2_527_488 == dp["bytes_per_step"] == data_parallel_bytes_per_step(PARAMETERS, M)
    allreduce = per_step / RATE + 2 * (M - 1) * LATENCY  # 2.0219904 + 0.24
    assert dp["allreduce_seconds"] == pytest.approx(2.2619904)
    assert dp["step_seconds"] == pytest.approx(STEP + allreduce)
    assert dp["compute_share"] == pytest.approx(STEP / (STEP + allreduce))  # 30.7%
    assert plan["data_parallel_time_to_budget_seconds"] == pytest.approx(
        BUDGET / (M * TOKENS_PER_STEP) * (STEP + allreduce)
    )
    # The ring visits local-a's two workers, then local-b's: 2 of its 4 hops cross
    # between the regions, each carrying one worker's share (half of 1234 B per token).
    assert dp["region_crossings"] == 2
    assert dp["wan_bytes_per_token"] == pytest.approx(2 * per_step / (M * TOKENS_PER_STEP))
    assert plan["bytes_ratio"] == pytest.approx(dp["wan_bytes_per_token"] / d["wan_bytes_per_token"])
    assert plan["bytes_ratio"] > 10  # what Decoupled DiLoCo saves


def test_the_default_placement_matches_a_hand_calculation(planned_default):
    """The syncer in local-a, a reducer in each region: local-b's link carries one
    aggregate per fragment round down (not its two learners' payloads), the update and
    head per merge up, and no snapshot; local-a's link is local."""
    plan, _ = planned_default
    shape, d = plan["shape"], plan["diloco"]
    assert plan["placement"]["syncer_region"] == "local-a"
    period = d["period_seconds"]
    round_every = H * period  # each fragment is sent, and merged, once per H steps (K = M)
    samples = document_sizes.history_samples(300 * period)  # 15: one per 20 s of the run
    learner_id, region_name = len("local-a-0"), len("local-a")
    prefix = shape["key_prefix_bytes"]
    assert (shape["learner_id_bytes"], shape["region_name_bytes"]) == (learner_id, region_name)

    def listing(keys: float, key_bytes: float) -> float:  # one page: 300 B, then 210 B and the key per key
        return 300 + keys * (210 + key_bytes)

    # an aggregate per fragment round, a learner payload's size; its marker lists the 2 sends it holds
    aggregate = sum(shape["uploads"]["bytes"]) / round_every
    marker_down = (P * shape["aggregate_marker_bytes"] + 2 * P * shape["aggregate_marker_bytes_per_send"]) / round_every
    assert 50 < shape["aggregate_marker_bytes_per_send"] < 120  # a send listed: key, learner, numbers
    # every 2 s (sync.status_seconds) the 2 heartbeats and the reducer's status
    heartbeats = 2 * document_sizes.heartbeat_bytes(P, samples) / 2
    reducer = document_sizes.reducer_status_bytes(P, 2, samples, learner_id) / 2
    # aggregates/ every poll (0.5 s): one aggregate and marker per fragment in flight; relays/ (empty under K = M)
    poll = (listing(2 * P, prefix + len("aggregates/000-000001000001.dlc.ready")) + listing(0, 0)) / 0.5
    # the whole run every 900/4 s: 3 documents, 8 keys per learner, 1.5 S updates and 2
    # snapshots with markers, 2 keys per fragment in flight, 4 of error feedback, 2 reducer documents
    run_keys = 3 + 2 * 8 + 2 * 1.5 * 20 + 2 * 2 + 2 * P * 3 + 2
    sweep = listing(run_keys, prefix + 40) / 225
    down = aggregate + marker_down + heartbeats + reducer + poll + sweep
    # per merge (P per round) an update and its marker, the head; the status every 2 s
    versions = M / K * P * 300 / H  # published over the run: 24, an evaluation every 4
    up = (
        sum(shape["updates"]["bytes"]) / round_every
        + P * (shape["update_marker_bytes"] + document_sizes.head_bytes(P, 1.5 * 20)) / round_every
        + document_sizes.status_bytes(M, 2, P, versions / 4 / 2, samples, learner_id, region_name) / 2
    )
    links = {link["region"]: link for link in d["links"]}
    for link in links.values():
        flows = {(f["kind"], f["direction"]) for f in link["flows"]}
        assert ("payload", "down") not in flows and ("snapshot", "up") not in flows  # they stay in the region
        assert link["delete_per_second"] == 0  # the reducer deletes what was merged, in its region
        assert link["down_bytes_per_second"] == pytest.approx(down)
        assert link["up_bytes_per_second"] == pytest.approx(up)
    assert (
        not links["local-a"]["wan"]
        and links["local-a"]["rate_mbit"] is None
        and links["local-a"]["utilization"] is None
    )
    assert links["local-b"]["wan"] and links["local-b"]["utilization"] == pytest.approx(max(up, down) / RATE)
    # only local-b's link crosses the WAN
    assert d["wan_bytes_per_second"] == pytest.approx(up + down)
    assert d["wan_bytes_per_token"] == pytest.approx((up + down) / (M * TOKENS_PER_STEP / period))


def test_under_k_below_m_every_send_crosses_as_a_relay_by_hand():
    """K = 1: local-b's reducer relays each of its two learners' sends as it is (a payload
    and its marker, deleted by the syncer once merged); nothing is combined, so the
    link's down bytes are the sends', and M/K times as many versions go up."""
    plan, _ = plan_of([*ARGS, "--set", "sync.quorum=1"])
    shape, d = plan["shape"], plan["diloco"]
    period = d["period_seconds"]
    samples = document_sizes.history_samples(300 * period)
    learner_id, prefix = len("local-a-0"), shape["key_prefix_bytes"]

    def listing(keys: float, key_bytes: float) -> float:
        return 300 + keys * (210 + key_bytes)

    sends = 2 * P / (H * period)
    relay_key = prefix + len("relays//000-000001000001.dlc.ready") + learner_id
    down = (
        sends * sum(shape["uploads"]["bytes"]) / P
        + sends * shape["payload_marker_bytes"]
        + 2 * document_sizes.heartbeat_bytes(P, samples) / 2
        + document_sizes.reducer_status_bytes(P, 2, samples, learner_id) / 2
        # aggregates/ (none) and relays/ (a send and its marker per learner) every poll
        + (listing(0, 0) + listing(2 * 2, relay_key)) / 0.5
        # the whole run every 900/4 s: 8 keys and 2 relay keys per learner besides the rest
        + listing(3 + 2 * 10 + 2 * 1.5 * 20 + 2 * 2 + 2 * P * 3 + 2, prefix + 40) / 225
    )
    link = next(link for link in d["links"] if link["region"] == "local-b")
    flows = {(f["kind"], f["direction"]): f for f in link["flows"]}
    assert flows["aggregate", "down"]["get_per_second"] == pytest.approx(sends)
    assert flows["aggregate", "down"]["delete_per_second"] == pytest.approx(2 * sends)  # the relay and its marker
    assert ("payload", "down") not in flows
    assert link["down_bytes_per_second"] == pytest.approx(down)
    assert d["merges_per_second"] == pytest.approx(M * P / (H * period))
    assert flows["update", "up"]["put_per_second"] == pytest.approx(M * P / (H * period))


def test_the_plan_names_its_placement_and_what_it_saves(planned_default):
    plan, text = planned_default
    placement, shape = plan["placement"], RunShape.model_validate(plan["shape"])
    assert placement["wan_bytes_per_token"] == plan["diloco"]["wan_bytes_per_token"]
    # the same shape with local-a's link over the WAN too
    apart = tuple(link.model_copy(update={"rate_mbit": 10.0, "latency_ms": 40.0}) for link in shape.links)
    assert placement["apart_wan_bytes_per_token"] == pytest.approx(
        predict(shape.model_copy(update={"links": apart})).wan_bytes_per_token
    )
    # a local link saves half (two regions alike)
    assert placement["apart_wan_bytes_per_token"] == pytest.approx(2 * placement["wan_bytes_per_token"])
    assert "placement: the syncer in region local-a (its link is local), a reducer beside each region's bucket" in text
    apart_bytes = placement["apart_wan_bytes_per_token"]
    assert f"placed otherwise {apart_bytes:.1f} B with the syncer in its own place (2.0x)" in text
    assert "local-a                   2   local     0" in text


def test_with_reducers_more_learners_per_region_send_no_more_over_the_wan():
    """K = M: a region forwards one aggregate per fragment round whatever its M_r, so
    twice the learners per region train twice the tokens for about the same WAN bytes."""
    from diloco_cli.bandwidth.traffic_plan import build_traffic_plan
    from diloco_cli.config.recipe import Recipe

    def plan(learners: int):
        return build_traffic_plan(
            Recipe(), num_learners=learners, num_regions=2, parameters=1_000_000, step_seconds=1.0, link_mbit=10
        )

    two, four = plan(4), plan(8)  # 2 x 2 and 2 x 4 learners
    for each in (two, four):
        assert each.placement.syncer_region == "region-0"  # the default placement without a region file
        assert [link.wan for link in each.diloco.links] == [False, True]

    def aggregates(each) -> float:
        wan = each.diloco.links[1]
        return next(f.bytes_per_second for f in wan.flows if f.kind == "aggregate")

    # the same aggregates per second from a region of 2 as from a region of 4 (equal step times)
    assert aggregates(two) == pytest.approx(aggregates(four), rel=0.02)
    assert four.diloco.trained_tokens_per_second == pytest.approx(2 * two.diloco.trained_tokens_per_second, rel=0.02)
    assert four.diloco.wan_bytes_per_token < 0.75 * two.diloco.wan_bytes_per_token
    # under K = 1 the reducers relay every send: the WAN bytes grow with M_r
    relayed = [
        build_traffic_plan(
            Recipe.model_validate({"sync": {"quorum": 1}}),
            num_learners=learners,
            num_regions=2,
            parameters=1_000_000,
            step_seconds=1.0,
            link_mbit=10,
        )
        for learners in (4, 8)
    ]
    assert aggregates(relayed[1]) == pytest.approx(2 * aggregates(relayed[0]), rel=0.02)
    assert aggregates(relayed[0]) == pytest.approx(2 * aggregates(two), rel=0.02)  # each of 2 sends, not one aggregate


def test_text_shows_the_same_numbers_as_json(planned):
    plan, _ = planned
    # the same plan (a second one would time its encodes anew)
    text = render_traffic_plan(TrafficPlan.model_validate(plan))
    d, dp = plan["diloco"], plan["data_parallel"]
    assert "local-a" in text and "local-b" in text
    assert "placement: the syncer in a place of its own" in text and "a reducer beside each region's bucket" in text
    assert "placed otherwise" not in text  # the placement all others are measured against
    assert (
        f"useful share     {100 * d['compute_share']:.1f}%" in text
        and f"computing        {100 * d['cpu_share']:.1f}%" in text
    )
    assert f"{d['links'][0]['up_bytes_per_second'] / 1e6:.3f}" in text
    assert "2(W-1)/W x 2 B x N" in text and "2.5 MB per worker" in text
    assert f"{dp['allreduce_seconds']:.3f} s all-reduce" in text
    assert f"compute share    {100 * dp['compute_share']:.1f}%" in text
    assert f"{plan['bytes_ratio']:.1f}x" in text and "(2 of the ring's 4 hops between regions)" in text
    s = plan["suggestion"]
    assert f"smallest H       H={s['sync_interval']} keeps {100 * s['compute_share']:.1f}% useful" in text
    recipe = f"(the recipe's H={d['sync_interval']}: {100 * d['compute_share']:.1f}%)"
    assert f"the smallest H these links carry; any larger one does too {recipe}" in text  # why both are there


def test_a_ring_crosses_between_regions_once_per_region_that_holds_workers():
    assert ring_region_crossings([4]) == 0  # one region: nothing crosses the WAN
    assert ring_region_crossings([2, 2]) == 2
    assert ring_region_crossings([1, 0, 3, 2]) == 3  # a region without workers is not on the ring


def test_the_suggested_interval_reaches_the_target_and_half_of_it_does_not(planned):
    plan, _ = planned
    s = plan["suggestion"]
    assert s["reached"] and s["compute_share"] >= s["target_compute_share"] == 0.9
    assert s["sync_interval"] > 1 and s["half_interval"] == s["sync_interval"] // 2
    assert s["half_interval_compute_share"] < 0.9
    # the smallest H with the recipe's codecs, checked on the model itself: H reaches it, H-1 does not
    shape = RunShape.model_validate(plan["shape"])
    ours = next(o for o in s["options"] if (o["upload_codec"], o["update_codec"]) == ("int4", "int8"))
    at = lambda interval: predict(shape.model_copy(update={"sync_interval": interval})).compute_share  # noqa: E731
    assert at(ours["sync_interval"]) >= 0.9 > at(ours["sync_interval"] - 1)
    assert min(o["sync_interval"] for o in s["options"]) == s["sync_interval"]
    # on a link too slow for even the status documents, no H reaches it
    slow = shape.model_copy(
        update={"links": tuple(link.model_copy(update={"rate_mbit": 0.01}) for link in shape.links)}
    )
    assert smallest_sync_interval(slow, 0.9, shape.inner_steps) is None


def test_an_unreachable_target_reports_the_best_it_found():
    from diloco_cli.bandwidth.traffic_plan import build_traffic_plan
    from diloco_cli.config.recipe import Recipe

    plan = build_traffic_plan(Recipe(), parameters=10_000, step_seconds=0.5, link_mbit=0.005, latency_ms=300)
    s = plan.suggestion
    assert not s.reached and s.sync_interval == 300 and (s.upload_codec, s.update_codec) == ("int4", "int4")
    assert s.compute_share < 0.9 and plan.diloco.network_factor < 1
    assert plan.model == "not built (--parameters)" and plan.fragment_parameters == (5_000, 5_000)
    assert plan.diloco.bottleneck in ("syncer I/O", "link region-0 (up)", "link local-a (up)")


def test_a_saturated_run_keeps_only_what_the_network_carries():
    """Learners never wait: a syncer busy b > 1 leaves 1/b of their work useful."""
    from diloco_cli.bandwidth.shapes import CodecCost, Link

    cost = CodecCost(codec="int4", bytes=(1_000_000,), seconds=(0.0,))
    shape = RunShape(
        links=(Link(region="a", learners=1, rate_mbit=8.0, latency_ms=0.0, protocol="file"),),  # 1 MB/s, no heads
        quorum=1,
        sync_interval=1,
        num_fragments=1,
        inner_steps=100,
        step_seconds=0.5,
        tokens_per_step=100,
        uploads=cost,
        updates=cost,
        payload_marker_bytes=0,
        aggregate_marker_bytes=0,
        aggregate_marker_bytes_per_send=0,
        update_marker_bytes=0,
        snapshot_bytes=0,
        snapshot_marker_bytes=0,
    )
    d = predict(shape)
    # 2 MB/s of payloads down and 2 MB/s of updates up, one after another: busy about 4
    assert d.links[0].utilization == pytest.approx(2.0, rel=0.01)
    assert d.syncer_busy == pytest.approx(4.0, rel=0.02) and d.bottleneck == "syncer I/O"
    assert d.compute_share == pytest.approx(1 / d.syncer_busy)


def test_document_size_estimates_match_real_sealed_documents():
    import time

    from diloco_cli.codec import RunSecret
    from diloco_cli.store import metering
    from diloco_cli.store.documents import (
        Evaluation,
        Head,
        Heartbeat,
        LastMerge,
        LearnerState,
        ReducerStatus,
        Refusals,
        SyncerPhase,
        SyncerStatus,
        seal,
    )

    secret, now = RunSecret(b"k" * 32), time.time()

    def counters(kinds):
        meter = metering.StorageMeter()
        for kind in kinds:
            meter.count(kind, requests=12345, up=123456789, down=123456789, seconds=1234.5678)
        return meter.snapshot()

    region_counters = counters(("payload", "marker", "heartbeat", "update", "snapshot", "head", "status", "listing"))
    samples = len(region_counters.history)
    head = Head(
        version=12345,
        fragment_versions={0: 12344, 1: 12345},
        fragment_digests={0: "a" * 32, 1: "b" * 32},
        snapshot_version=12340,
        recent=tuple((12310 + i, i % 2) for i in range(30)),
        recent_from=12310,
    )
    assert len(seal(head, "global/head.json", secret)) == pytest.approx(document_sizes.head_bytes(2, 30), rel=0.05)
    beat = Heartbeat(
        learner="local-a-0",
        region="local-a",
        host="local",
        pid=12345,
        state=LearnerState.TRAINING,
        step=1234,
        total_steps=3000,
        tokens=12345678,
        loss=1.2345678,
        step_seconds=0.123456789,
        base_versions={0: 1234, 1: 1235},
        sends=123,
        delivered=123,
        installs=123,
        tokens_overwritten={0: 1234, 1: 1234},
        checkpoint_step=1200,
        storage=region_counters,
        started_at=now,
        time=now,
    )
    assert len(seal(beat, "heartbeats/local-a-0.json", secret)) == pytest.approx(
        document_sizes.heartbeat_bytes(2, samples), rel=0.1
    )
    learners = [f"region-{i % 4}-{i // 4}" for i in range(16)]
    status = SyncerStatus(
        state=SyncerPhase.RUNNING,
        run="shakespeare-gpt-20260101-120000",
        version=1234,
        fragment_versions={0: 1233, 1: 1234},
        snapshot_version=1220,
        merges=1234,
        merges_per_minute=30,
        last_merge=LastMerge(fragment=1, version=1234, learners=learners, seconds=0.123456, time=now),
        quorum=16,
        effective_quorum=16,
        grace_seconds=1.23456,
        live_learners=learners,
        pending={p: learners[:8] for p in range(2)},
        reasons={p: "waiting for 8 of 16 learners (quorum 16)" for p in range(2)},
        evaluations=[Evaluation(version=4 * i, loss=2.345678, tokens=1234567, time=now) for i in range(50)],
        storage={f"region-{r}": region_counters for r in range(4)},
        home_storage=counters(("home", "listing")),
        refusals={f"region-{r}": Refusals() for r in range(4)},
        started_at=now,
        time=now,
    )
    estimate = document_sizes.status_bytes(16, 4, 2, 50, samples, learner_id_bytes=10, region_name_bytes=8)
    assert len(seal(status, "global/syncer.json", secret)) == pytest.approx(estimate, rel=0.1)
    reducer_names = [f"local-a-{i}" for i in range(4)]
    reducer = ReducerStatus(
        region="local-a",
        version=12345,
        fragment_versions={0: 12344, 1: 12345},
        aggregates=1234,
        sends=2468,
        voided=12,
        in_flight={p: reducer_names[:2] for p in range(2)},
        waiting={p: reducer_names[2:] for p in range(2)},
        snapshot_version=12340,
        initial_weights="match",
        heartbeats_seen=dict.fromkeys(reducer_names, now),
        storage=counters(
            ("payload", "marker", "aggregate", "reducer", "heartbeat", "head", "update", "snapshot", "listing")
            + ("control",)
        ),
        started_at=now,
        time=now,
    )
    assert len(seal(reducer, "reducer/status.json", secret)) == pytest.approx(
        document_sizes.reducer_status_bytes(2, 4, samples, learner_id_bytes=9), rel=0.1
    )
    # a history sample's size, sealed
    longer = beat.model_copy(
        update={"storage": region_counters.model_copy(update={"history": region_counters.history * 90})}
    )
    grown = len(seal(longer, "heartbeats/local-a-0.json", secret)) - len(
        seal(beat, "heartbeats/local-a-0.json", secret)
    )
    assert grown / (89 * samples) == pytest.approx(document_sizes.COUNTERS_BYTES_PER_SAMPLE, rel=0.1)


def test_mistakes_are_one_line_errors():
    result = runner.invoke(app, ["plan", "--parameters", "1000000"])
    assert result.exit_code == 2 and "give --step-seconds too" in result.output
    result = runner.invoke(app, ["plan", "--step-seconds", "1", "--link-mbit", "nowhere=fast"])
    assert result.exit_code == 2 and "--link-mbit 'nowhere=fast'" in result.output
    result = runner.invoke(app, ["plan", "--parameters", "1000", "--step-seconds", "1", "--link-mbit", "mars=10"])
    assert result.exit_code == 2 and "region(s) mars" in result.output


LOSS_CALLS: list[tuple[int, bool]] = []


def counting_loss(model, inputs, targets):
    """A ``training.loss`` that records each call: its micro-batch's size, and whether it
    ran under bf16 autocast."""
    import torch

    from diloco_cli.training.inner import language_model_loss

    LOSS_CALLS.append((inputs.shape[0], torch.is_autocast_enabled("cpu")))
    return language_model_loss(model, inputs, targets)


def test_the_timed_step_is_the_learners_step_with_the_recipes_loss_precision_and_micro_batches():
    from diloco_cli.bandwidth.measure import measure_step_seconds
    from diloco_cli.config.recipe import Recipe

    recipe = Recipe.model_validate(
        {
            "model": {"kwargs": {"num_layers": 1, "width": 32, "num_heads": 2, "context": 16}},
            "data": {"sequence_length": 16},
            "training": {
                "batch_size": 4,
                "micro_batch_size": 2,
                "precision": "bf16",
                "loss": f"{__name__}:counting_loss",
                "device": "cpu",
            },
        }
    )
    LOSS_CALLS.clear()
    timing = measure_step_seconds(recipe, warm_steps=1, timed_steps=2)
    assert len(timing.steps) == 2 and timing.median > 0 and timing.device == "cpu"
    assert LOSS_CALLS == [(2, True)] * 6  # 3 steps of 2 micro-batches of 2 sequences, under bf16 autocast


TINY_MODEL = {"model": {"kwargs": {"num_layers": 1, "width": 32, "num_heads": 2, "context": 16}}}


def test_a_measured_step_is_said_on_stderr_with_its_device_and_spread():
    """Without --step-seconds the plan says what it times and on which device before it
    starts, then the median and range of the timed steps; the plan shows the range."""
    from diloco_cli.bandwidth.traffic_plan import build_traffic_plan
    from diloco_cli.config.recipe import Recipe

    recipe = Recipe.model_validate({**TINY_MODEL, "data": {"sequence_length": 16}, "training": {"batch_size": 4}})
    said: list[str] = []
    plan = build_traffic_plan(recipe, say=said.append)
    assert said[0].startswith("measuring the inner step of diloco_cli.models.gpt:byte_gpt (")
    assert " on cpu with " in said[0] and "warm-up and 5 timed steps (--step-seconds S skips this)" in said[0]
    fastest, slowest = plan.step_range_seconds
    assert said[1] == f"inner step: median {plan.step_seconds:.3f} s of 5 timed steps ({fastest:.3f}-{slowest:.3f} s)"
    assert fastest <= plan.step_seconds <= slowest and plan.step_measured_on == "cpu"
    assert len(said) == 2 + plan.step_measurement_noisy
    assert f"measured on cpu: the median, {fastest:.3f}-{slowest:.3f} s" in render_traffic_plan(plan)


def test_timed_steps_that_differ_by_more_than_a_quarter_are_noisy():
    from diloco_cli.bandwidth.measure import StepTiming

    steady = StepTiming(steps=(2.0, 2.1, 2.05, 1.98, 2.2), device="cpu", threads=2)
    busy = StepTiming(steps=(2.0, 18.8, 2.1, 2.0, 3.7), device="cpu", threads=2)
    assert steady.median == 2.05 and not steady.noisy
    assert busy.median == 2.1 and busy.noisy and busy.summary() == "median 2.100 s of 5 timed steps (2.000-18.800 s)"


def test_given_a_step_time_the_plan_times_no_step():
    LOSS_CALLS.clear()
    result = runner.invoke(app, [*ARGS, "--set", f"training.loss={__name__}:counting_loss"])
    assert result.exit_code == 0, result.output
    assert LOSS_CALLS == [] and "inner step 1.000 s (given)" in result.output


def test_the_suggestion_says_when_it_changes_the_recipes_codecs():
    """fp32 payloads on a 1 Mbit/s link: the suggestion's codecs are lighter, and it says
    which settings follow it; with the recipe's own codecs it says nothing of them."""
    fp32 = ["--set", "sync.learner_codec.codec=fp32", "--set", "sync.update_codec.codec=fp32"]
    plan, text = plan_of([*ARGS, "--link-mbit", "1", *fp32])
    s = plan["suggestion"]
    assert (s["upload_codec"], s["update_codec"]) != ("fp32", "fp32")
    assert (
        "this changes the recipe's codecs (uploads fp32, updates fp32): "
        f"--set sync.learner_codec.codec={s['upload_codec']} --set sync.update_codec.codec={s['update_codec']}"
    ) in text
    plan, text = plan_of([*ARGS, "--link-mbit", "10000"])  # every codec reaches the target at H=1: the recipe's
    assert (plan["suggestion"]["upload_codec"], plan["suggestion"]["update_codec"]) == ("int4", "int8")
    assert "changes the recipe's codecs" not in text


# ------------------------------------------------------------------------- prices


def test_a_two_cloud_plan_prices_its_links():
    from pathlib import Path

    from diloco_cli.bandwidth.traffic_plan import build_traffic_plan
    from diloco_cli.config.loading import load_model
    from diloco_cli.config.recipe import Recipe
    from diloco_cli.config.regions import RegionsFile, SyncerPlacement

    regions = load_model(RegionsFile, Path(__file__).resolve().parents[2] / "regions" / "two-cloud.yaml")
    regions = regions.model_copy(update={"syncer": SyncerPlacement(host="local")})  # outside any cloud
    plan = build_traffic_plan(Recipe(), regions, parameters=1_000_000, step_seconds=1.0, link_mbit=100, latency_ms=20)
    costs = plan.costs
    assert costs is not None and costs.syncer_provider is None  # the syncer runs here, outside any cloud
    by_region = {link.region: link for link in costs.links}
    assert by_region["aws-use1"].provider == "aws" and by_region["gcp-euw4"].provider == "gcp"
    link = next(link for link in plan.diloco.links if link.region == "aws-use1")
    # read by a syncer outside the cloud: internet egress; writes into the bucket are free
    assert by_region["aws-use1"].egress_dollars_per_hour == pytest.approx(3600 * link.down_bytes_per_second / GB * 0.09)
    assert by_region["aws-use1"].request_dollars_per_hour == pytest.approx(
        3600 * (link.put_per_second * 0.005 + link.get_per_second * 0.0004) / 1000
    )
    assert math.isclose(
        costs.diloco_dollars_per_hour, sum(c.egress_dollars_per_hour + c.request_dollars_per_hour for c in costs.links)
    )


def test_a_two_cloud_plan_with_the_syncer_in_its_first_region():
    """regions/two-cloud.yaml as written: the syncer on gpu-a, in aws-use1."""
    from pathlib import Path

    from diloco_cli.bandwidth.traffic_plan import build_traffic_plan
    from diloco_cli.config.loading import load_model
    from diloco_cli.config.recipe import Recipe
    from diloco_cli.config.regions import RegionsFile

    regions = load_model(RegionsFile, Path(__file__).resolve().parents[2] / "regions" / "two-cloud.yaml")
    plan = build_traffic_plan(Recipe(), regions, parameters=1_000_000, step_seconds=1.0, link_mbit=100, latency_ms=20)
    costs = plan.costs
    assert plan.placement.syncer_region == costs.syncer_region == "aws-use1" and costs.syncer_provider == "aws"
    by_region = {link.region: link for link in costs.links}
    links = {link.region: link for link in plan.diloco.links}
    assert not links["aws-use1"].wan and by_region["aws-use1"].egress_dollars_per_hour == 0  # in its own region
    gcp = links["gcp-euw4"]
    # read from GCS by a syncer in AWS (GCP's internet egress), written to it from AWS (AWS's)
    assert by_region["gcp-euw4"].egress_dollars_per_hour == pytest.approx(
        3600 * (gcp.down_bytes_per_second * 0.12 + gcp.up_bytes_per_second * 0.09) / GB
    )
    assert plan.diloco.wan_bytes_per_second == pytest.approx(gcp.up_bytes_per_second + gcp.down_bytes_per_second)
