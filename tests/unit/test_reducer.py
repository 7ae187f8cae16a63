"""A region's reducer, driven step by step beside a real syncer and real learners over
file:// buckets (tests/support/harness.py): what crosses the WAN
is one aggregate per fragment, the region builds its own version 0 and snapshots, and
every send is merged exactly once, also when a region misses a publication or its
reducer is killed."""

import pytest
import torch

from diloco_cli.codec import CodecSpec, RunSecret, encode_payload
from diloco_cli.codec.aggregate import decode_aggregate, encode_aggregate
from diloco_cli.codec.exact import ExactPublisher, apply_update
from diloco_cli.config.recipe import Recipe
from diloco_cli.config.regions import RegionsFile
from diloco_cli.core.anchor import UpdateWindow
from diloco_cli.core.merge import MergeAccumulator
from diloco_cli.core.outer import NesterovOuterOptimizer
from diloco_cli.core.types import FragmentIndex, LearnerId, Version
from diloco_cli.launch.resolve import resolve_run
from diloco_cli.runtime.outer_gradients import accumulate_arrivals
from diloco_cli.runtime.reducer.loop import Reducer
from diloco_cli.runtime.syncer.merge_round import AggregateInput, RoundInput, merge_round
from diloco_cli.store import aggregates
from diloco_cli.store.documents import SyncerPhase
from diloco_cli.store.filesystem import StorageError
from diloco_cli.store.home import tokens_merged
from diloco_cli.store.region import snapshot_key
from tests.support.harness import Harness
from tests.support.runs import TINY_RECIPE, deep_update


@pytest.fixture
def reduced(tmp_path, secret):
    """K=1 of 2: the region's reducer relays each send for the syncer to anchor."""
    made = Harness(tmp_path, secret)
    yield made
    made.close()


@pytest.fixture
def aggregating(tmp_path, secret):
    """K=M=2: the region's reducer forwards one aggregate per fragment and round."""
    made = Harness(tmp_path, secret, quorum=2)
    yield made
    made.close()


def syncer_turns_until(harness, condition, turns=20):
    """Syncer turns (each when it asks to be woken: a grace window may run) until ``condition()``."""
    import time

    for _ in range(turns):
        wake = harness.syncer.turn()
        if condition():
            return
        time.sleep(min(1.0, max(0.0, wake - harness.syncer.clock())))
    raise AssertionError("the syncer never got there")


def assert_every_token_merged_once(harness):
    """Each learner's trained tokens are in merged sends or were overwritten by installs,
    per fragment, and no send is in two commits."""
    history = harness.syncer.home.history()
    keys = [m.key for commit in history for m in commit.merged]
    assert len(keys) == len(set(keys)), "a send was merged twice"
    for learner in harness.learners:
        learner.heartbeats.beat(wait=10)
        beat = harness.bucket.read_heartbeat(learner.me.id)
        for fragment in range(len(learner.fragment_list)):
            accounted = tokens_merged(history, learner.me.id, fragment) + beat.tokens_overwritten.get(fragment, 0)
            assert accounted == beat.tokens - (
                learner.fragments.c_tokens[fragment] - learner.fragments.sent_tokens[fragment]
            )


def test_one_aggregate_per_fragment_crosses_and_the_learners_bases_are_the_syncers(aggregating):
    reduced = aggregating
    writer, reader = reduced.learners
    for _ in range(3):
        reduced.train(writer, 10)
        reduced.train(reader, 10)
        reduced.merge()
    history = reduced.syncer.home.history()
    assert [len(commit.aggregates) for commit in history] == [1] * len(history)
    assert all({m.learner for m in commit.merged} == {"east-0", "east-1"} for commit in history)
    for learner in reduced.learners:
        assert reduced.poll(learner)
        reduced.assert_bases_equal_the_syncers(learner)
    # payloads stay in the region: the syncer read aggregates only, and wrote no snapshot
    traffic = reduced.syncer.status(SyncerPhase.RUNNING).storage["east"].kinds
    assert "payload" not in traffic and traffic["aggregate"].bytes_down > 0
    assert "snapshot" not in traffic
    # consumed payloads and aggregates were deleted by the reducer, in the region
    assert reduced.bucket.payload_keys() == [] and aggregates.aggregate_keys(reduced.bucket) == []
    assert_every_token_merged_once(reduced)


def test_version_zero_is_built_in_the_region_and_learners_start_from_their_own(reduced):
    """No initial weights cross the WAN: the region's reducer and the learners build
    version 0 from the recipe's seed and check it against the head's digests."""
    assert reduced.reducer.initial_weights == "match"
    newcomer = reduced.learner("east-1")  # a fresh start, no checkpoint
    try:
        assert newcomer.fragments.installed and newcomer.fragments.base_version == {0: 0, 1: 0}
        reduced.assert_bases_equal_the_syncers(newcomer)
        assert newcomer.bucket.store.meter.snapshot().kinds.get("snapshot") is None  # nothing read but the head
    finally:
        newcomer.close()


def test_a_reducer_whose_version_zero_differs_from_the_syncers_refuses_to_reduce(reduced, secret):
    other_seed = reduced.spec.model_copy(
        update={
            "recipe": reduced.spec.recipe.model_copy(
                update={"training": reduced.spec.recipe.training.model_copy(update={"seed": 7})}
            )
        }
    )
    for version in reduced.bucket.snapshot_versions():  # a region with nothing to start from but the seed
        reduced.bucket.delete_snapshot(version)
    stranger = Reducer(other_seed, "east", secret)
    stranger.start()
    stranger.turn()
    assert stranger.initial_weights == "differ" and stranger.replica is None
    assert aggregates.read_reducer_status(reduced.bucket).initial_weights == "differ"


def test_the_regions_snapshot_equals_the_syncers_weights_and_a_late_learner_installs_it(reduced):
    writer, reader = reduced.learners
    while reduced.syncer.state.version < 6:
        reduced.train(writer, 10)
        reduced.merge()
    head = reduced.bucket.read_head()
    assert head.snapshot_version == 6 and head.recent_from == 3
    snapshot = reduced.bucket.read_snapshot(Version(6))
    from diloco_cli.codec import decode_payload

    tensors = decode_payload(snapshot, reduced.secret).tensors
    for name, value in reduced.syncer.state.theta.items():
        assert torch.equal(tensors[name], value), name
    assert reduced.bucket.snapshot_versions() == [3, 6]  # older ones removed in the region
    late = reduced.learner("east-1", start=False)  # no checkpoint, and version 0 is too old to start from
    try:
        late.poller.initial = {n: p.detach().clone() for n, p in late.model.named_parameters()}
        assert sorted(reduced.poll(late)) == [0, 1]
        reduced.assert_bases_equal_the_syncers(late)
        assert late.bucket.store.meter.snapshot().kinds["snapshot"].bytes_down > 0
    finally:
        late.close()


def test_a_region_that_missed_a_publication_holds_its_next_aggregate_until_caught_up(aggregating, monkeypatch):
    """Under K=M the region misses a publication (its bucket refuses the update): its
    reducer cannot tell the aggregate it sent merged, so the next sends wait at it rather
    than go out anchored at a version the syncer left; once the region is caught up they
    are forwarded anchored anew, and each is merged once: nothing is discarded."""
    reduced = aggregating
    writer, reader = reduced.learners
    syncer_bucket = reduced.syncer.buckets["east"]
    publish = syncer_bucket.publish_update

    def refused(*args, **kwargs):
        raise StorageError("writing global/updates/... failed after 3 tries: Service Unavailable")

    reduced.train(writer, 10)  # fragment 0 of both, at step 10
    reduced.train(reader, 10)
    reduced.reducer.turn(read_heartbeats=True)
    monkeypatch.setattr(syncer_bucket, "publish_update", refused)
    versions = reduced.syncer.state.fragment_versions
    syncer_turns_until(reduced, lambda: versions[FragmentIndex(0)] > 0)  # merged, but the region misses it
    merged_as = versions[FragmentIndex(0)]
    assert "east" in reduced.syncer.publication.behind
    reduced.train(writer, 10)
    reduced.train(reader, 10)
    reduced.reducer.turn(read_heartbeats=True)
    assert [r.anchor for r in reduced.reducer.in_flight.values() if r.fragment == 0] == [0]  # only the first
    assert {item.fragment for item in reduced.reducer.waiting.values()} >= {0}  # the next sends wait
    syncer_turns_until(reduced, lambda: not reduced.syncer.observer.observed)
    assert versions[FragmentIndex(0)] == merged_as
    monkeypatch.setattr(syncer_bucket, "publish_update", publish)
    reduced.syncer.publication.catch_up_soon()
    reduced.merge()
    assert reduced.reducer.counts["voided"] == 0
    history = reduced.syncer.home.history()
    merged = [(m.learner, m.sequence) for commit in history if commit.fragment == 0 for m in commit.merged]
    assert sorted(merged) == sorted(set(merged)) and len(merged) == 4  # both learners' two sends, once each
    assert [a.anchor for commit in history if commit.fragment == 0 for a in commit.aggregates] == [0, merged_as]
    for learner in reduced.learners:
        reduced.poll(learner)
        reduced.assert_bases_equal_the_syncers(learner)


def test_a_send_from_a_base_its_reducer_has_not_reached_waits_there_instead_of_a_resync(aggregating, monkeypatch):
    """A reducer behind its region (the newest update cannot be read yet) while its
    learners already train from it: their sends wait at the reducer until its copy has
    their base, then are merged; none is retired and nobody is told to resync."""
    reduced = aggregating
    for learner in reduced.learners:
        reduced.train(learner, 20)
    reduced.merge()
    for learner in reduced.learners:
        reduced.train(learner, 20)
    reduced.reducer.turn(read_heartbeats=True)  # forwarded from bases the reducer has

    def unreadable(version, fragment):
        raise StorageError(f"reading global/updates/{version:010d}-{fragment:03d}.dlc failed: Service Unavailable")

    monkeypatch.setattr(reduced.reducer.replica, "add", unreadable)
    behind = reduced.reducer.replica.version
    syncer_turns_until(reduced, lambda: reduced.syncer.state.version > behind)
    for learner in reduced.learners:
        assert sorted(reduced.poll(learner)) and max(learner.fragments.base_version.values()) > behind
        reduced.train(learner, 20)  # sends from bases the reducer has not reached
    for _ in range(3):
        reduced.reducer.turn(read_heartbeats=True)
        reduced.syncer.turn()
    assert reduced.reducer.replica.version == behind
    newer = [item for item in reduced.reducer.waiting.values() if item.send.base_version > behind]
    assert newer and not any(record.resync for record in reduced.reducer.in_flight.values())
    monkeypatch.undo()
    reduced.merge()
    history = reduced.syncer.home.history()
    assert not [r.key for commit in history for r in commit.retired]
    merged = {(m.learner, commit.fragment, m.sequence) for commit in history for m in commit.merged}
    for learner, fragment in {
        (item.send.learner, item.fragment) for item in newer
    }:  # the newest of each (it supersedes)
        newest = max(i.send.sequence for i in newer if (i.send.learner, i.fragment) == (learner, fragment))
        assert (learner, fragment, newest) in merged
    for learner in reduced.learners:
        reduced.poll(learner)
        reduced.assert_bases_equal_the_syncers(learner)
    assert_every_token_merged_once(reduced)


def test_a_damaged_update_its_window_needs_is_reported_rewritten_and_the_stale_send_merged(aggregating):
    """An update older than the head lists but still in the reducer's window, damaged at
    rest after the region's copy took it in: the reducer reports it rather than fail, the
    syncer rewrites it from its commits, and the stale send that needed it is merged.
    The reader never installs, so its sends stay from base 0 while the writer's move on."""
    reduced = aggregating
    writer, reader = reduced.learners
    store = reduced.bucket.store
    while reduced.syncer.state.version < 8:
        reduced.train(writer, 10)
        reduced.train(reader, 10)
        reduced.merge()
        reduced.poll(writer)
    assert set(reader.fragments.base_version.values()) == {0}
    key = reduced.bucket.layout.update_key(Version(1), FragmentIndex(0))
    assert (1, 0) not in reduced.bucket.read_head().recent  # the head no longer lists it, the window has it
    good = store.get(key)
    damaged = bytearray(good)
    damaged[-40] ^= 0x10
    store.put(key, bytes(damaged))
    reduced.train(writer, 10)
    reduced.train(reader, 10)  # anchoring its sends needs update 1
    for _ in range(3):  # met every turn, reported once (until REPEAT_SECONDS pass)
        reduced.reducer.turn(read_heartbeats=True)
    latest = reduced.reducer.refusals.latest
    assert (latest.kind, latest.key) == ("update", key) and reduced.reducer.refusals.counts["update"] == 1
    assert not [
        r
        for r in reduced.reducer.in_flight.values()
        if r.fragment == 0
        and r.serial > 0
        and r.sends
        and r.anchor == reduced.syncer.state.fragment_versions[FragmentIndex(0)]
    ]
    reduced.merge()
    assert reduced.bucket.store.get(key) == good
    history = reduced.syncer.home.history()
    late = [m for commit in history[-2:] for m in commit.merged if m.learner == "east-1"]
    assert late and {m.base_version for m in late} == {0}
    assert_every_token_merged_once(reduced)


def test_a_reducer_killed_between_turns_goes_on_from_the_bucket(reduced, secret):
    writer, reader = reduced.learners
    reduced.train(writer, 10)
    reduced.train(reader, 10)
    reduced.reducer.turn(read_heartbeats=True)  # forwards, then it is "killed"
    in_flight = sorted(reduced.reducer.in_flight)
    errors = {p: sorted(e) for p, e in reduced.reducer.aggregation.errors.items()}
    reduced.reducer = Reducer(reduced.spec, "east", secret)
    reduced.reducer.start()
    assert sorted(reduced.reducer.in_flight) == in_flight
    reduced.reducer.turn()
    assert {p: sorted(e) for p, e in reduced.reducer.aggregation.errors.items()} == errors
    assert reduced.reducer.aggregation.epoch == 2  # serials go on above the first start's
    for _ in range(2):
        reduced.train(writer, 10)
        reduced.train(reader, 10)
        reduced.merge()
    for learner in reduced.learners:
        reduced.poll(learner)
        reduced.assert_bases_equal_the_syncers(learner)
    assert_every_token_merged_once(reduced)


def test_a_region_past_its_damaged_snapshots_writes_a_snapshot_of_its_present(reduced):
    writer, _ = reduced.learners
    while reduced.syncer.state.version < 3:
        reduced.train(writer, 10)
        reduced.merge()
    for version in reduced.bucket.snapshot_versions():  # every fallback damaged too
        data = bytearray(reduced.bucket.store.get(snapshot_key(version)))
        data[-40] ^= 0x10
        reduced.bucket.store.put(snapshot_key(version), bytes(data))
    late = reduced.learner("east-1", start=False)
    try:
        late.poller.initial = None  # it cannot build version 0 itself: it needs the snapshot
        assert not reduced.poll(late) and late.refusals.counts["snapshot"] >= 1
        late.heartbeats.beat(wait=10)
        # the region's copy has moved past the damaged snapshot's version: the reducer writes
        # a snapshot of its present, newer than any the syncer named
        reduced.reducer.turn(read_heartbeats=True)
        present = reduced.reducer.replica.version
        assert present == reduced.syncer.state.version > reduced.bucket.read_head().snapshot_version
        assert present in reduced.bucket.snapshot_versions()
        assert sorted(reduced.poll(late)) == [0, 1]
        reduced.assert_bases_equal_the_syncers(late)
    finally:
        late.close()


# ------------------------------------------------------------ relays under K < M


def test_under_k_below_m_each_send_is_relayed_and_the_syncer_anchors_it(reduced):
    """K=1 of 2: no aggregate is anchored in the region (one anchored at a version a
    merge without it left would be worth nothing); each send is relayed as it is, merged
    once, and once merged its relay (by the syncer) and its payload (by the reducer) go."""
    writer, reader = reduced.learners
    for _ in range(3):
        reduced.train(writer, 10)
        reduced.merge()
        reduced.train(reader, 10)
        reduced.merge()
    history = reduced.syncer.home.history()
    merged = [m for commit in history for m in commit.merged]
    assert merged and not [a for commit in history for a in commit.aggregates]
    assert all(m.key.startswith("east:relays/") and m.aggregate is None for m in merged)
    assert {m.learner for m in merged} == {"east-0", "east-1"}
    for _ in range(2):  # the syncer's next scan, then the reducer's next turn
        reduced.syncer.turn()
        reduced.reducer.turn(read_heartbeats=True)
    assert not reduced.bucket.relay_keys() and not reduced.bucket.payload_keys()
    assert not reduced.reducer.relayed and reduced.reducer.counts["sends"] == len(merged)
    for learner in reduced.learners:
        reduced.poll(learner)
        reduced.assert_bases_equal_the_syncers(learner)
    assert_every_token_merged_once(reduced)


def test_a_merge_of_relayed_sends_is_the_merge_of_the_learners_payloads_bit_for_bit(reduced, secret):
    """Golden: both learners' sends relayed, from different bases (the reader's older),
    merged in one round; the syncer's new weights are, bit for bit, those of a merge
    round over the learners' own payloads (as a syncer reading them directly computes it)."""
    writer, reader = reduced.learners
    store = reduced.bucket.store
    reduced.train(reader, 10)  # from base 0, held back (a slow upload) while the writer moves on
    slow = {key: store.get(key) for key in store.list("payloads/east-1")}
    for key in slow:
        store.delete(key)
    reduced.train(writer, 10)
    reduced.merge()
    reduced.poll(writer)
    reduced.train(writer, 10)  # from the newer bases
    for key, data in slow.items():
        store.put(key, data)
    reduced.reducer.turn(read_heartbeats=True)
    payloads = {key: reduced.bucket.read_payload(key) for key in reduced.bucket.payload_keys()}
    records = {key: reduced.bucket.payload_record(key) for key in payloads}
    assert {relay.removeprefix("relays/") for relay in reduced.bucket.relay_keys()} == {
        key.removeprefix("payloads/") for key in payloads
    }
    syncer = reduced.syncer
    fragment = FragmentIndex(0)
    expected = {name: t.clone() for name, t in syncer.state.fragment_theta(fragment).items()}
    window = UpdateWindow(syncer.recipe.sync.window_versions)
    for version, _ in [(v, p) for v, p in syncer.state.index if p == fragment]:
        blob = reduced.bucket.store.get(reduced.bucket.layout.update_key(version, fragment))
        window.record(version, lambda drift, b=blob: apply_update(drift, b, secret))
    arrivals = [
        RoundInput(r.learner, r.base_version, r.c_steps, r.c_tokens, lambda b=payloads[k]: b)
        for k, r in sorted(records.items())
        if r.fragment == fragment
    ]
    assert min(a.base_version for a in arrivals) < syncer.state.fragment_versions[fragment]  # one is anchored
    recipe = syncer.recipe
    optimizer = NesterovOuterOptimizer(recipe.outer_learning_rate, recipe.sync.outer_momentum)
    optimizer.load_state_tensors(syncer.state.optimizer.state_tensors())
    publisher = ExactPublisher(recipe.sync.update_codec, secret)
    publisher.load_carry_tensors(syncer.state.publisher.carry_tensors())  # the publication error carried
    merge_round(
        fragment,
        Version(syncer.state.version + 1),
        arrivals,
        expected,
        window,
        optimizer,
        publisher,
        secret,
        mean_names=syncer.fragments[fragment].mean_names,
    )
    before = syncer.state.fragment_versions[fragment]
    syncer_turns_until(reduced, lambda: syncer.state.fragment_versions[fragment] > before)
    merged = [m for m in syncer.home.history()[-1].merged]
    assert sorted(m.learner for m in merged) == ["east-0", "east-1"]
    for name, value in syncer.state.fragment_theta(fragment).items():
        assert torch.equal(value, expected[name]), name


# ------------------------------------------------- the same mathematics as the syncer's


def learner_payload(secret, learner, delta, spec):
    meta = {"learner": learner, "fragment": 0, "base_version": 0, "c_steps": 10, "c_tokens": 1000}
    return encode_payload(delta.items(), spec, secret, meta)


@pytest.mark.parametrize("mean_names", [{"embed"}, {"embed", "w", "b"}], ids=["rda", "mean"])
def test_with_one_learner_per_region_merging_through_reducers_gives_the_direct_merge(mean_names):
    """Two regions of one learner each: the syncer merging the two payloads itself, and
    merging the two regions' aggregates, give the same weights (fp32 aggregates: within
    float rounding, 1e-6 relative; the stated tolerance).  Outer step with Nesterov
    momentum 0.9, embedding merged by weighted mean, the rest by RDA (``sync.merge:
    rda``) or every tensor by the mean (``mean``: then the golden by hand, the first
    Nesterov step of the mean delta, Theta - 0.7 * (1 + 0.9) * mean)."""
    secret = RunSecret(bytes(range(32)))
    spec = CodecSpec(codec="fp32", zstd_level=0)
    generator = torch.Generator().manual_seed(5)
    shapes = {"embed": (16, 8), "w": (8, 8), "b": (8,)}
    theta = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    deltas = [
        {name: 0.01 * torch.randn(shape, generator=generator) for name, shape in shapes.items()} for _ in range(2)
    ]
    payloads = [learner_payload(secret, f"r{i}-0", delta, spec) for i, delta in enumerate(deltas)]
    inputs = [RoundInput(LearnerId(f"r{i}-0"), Version(0), 10, 1000, lambda p=p: p) for i, p in enumerate(payloads)]

    def merged(arrivals=(), parts=()):
        parameters = {name: value.clone() for name, value in theta.items()}
        merge_round(
            FragmentIndex(0),
            Version(1),
            arrivals,
            parameters,
            UpdateWindow(4),
            NesterovOuterOptimizer(0.7, 0.9),
            ExactPublisher(spec, secret),
            secret,
            mean_names=mean_names,
            aggregates=parts,
        )
        return parameters

    direct = merged(arrivals=inputs)
    parts = []
    for i, arrival in enumerate(inputs):  # each region's reducer: its one learner into an aggregate
        accumulator = MergeAccumulator(shapes, mean_names)
        accumulate_arrivals(FragmentIndex(0), [arrival], shapes, UpdateWindow(4), secret, accumulator)
        blob = encode_aggregate(accumulator.partial(), spec, secret, {"fragment": 0, "anchor": 0, "serial": i})
        parts.append(AggregateInput(f"r{i}:aggregates/000-{i:012d}.dlc", lambda b=blob: b))
    through_reducers = merged(parts=parts)
    for name in shapes:
        moved = (direct[name] - theta[name]).abs().max()
        assert moved > 1e-4, name  # the merge moved the weights
        assert torch.allclose(through_reducers[name], direct[name], rtol=1e-6, atol=1e-6 * float(moved)), name
        by_hand = theta[name] - 0.7 * 1.9 * (deltas[0][name] + deltas[1][name]) / 2
        assert torch.allclose(direct[name], by_hand, atol=1e-6) == (name in mean_names), name


def test_an_aggregate_decodes_to_the_sums_it_was_made_of_and_carries_its_quantization_error():
    secret = RunSecret(bytes(range(32)))
    shapes = {"embed": (64,), "w": (32, 8)}
    generator = torch.Generator().manual_seed(1)
    accumulator = MergeAccumulator(shapes, {"embed"})
    for weight in (3.0, 1.0):
        accumulator.add({name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}, weight)
    part = accumulator.partial()
    exact, meta = decode_aggregate(encode_aggregate(part, CodecSpec(codec="fp32"), secret, {"anchor": 2}), secret)
    assert meta["anchor"] == 2 and exact.total_weight == 4.0 and exact.count == 2
    assert torch.allclose(exact.unit_sums["w"], part.unit_sums["w"]) and exact.norm_sums["w"] == pytest.approx(
        part.norm_sums["w"]
    )
    assert torch.allclose(exact.mean_sums["embed"], part.mean_sums["embed"])
    residuals = {"unit/w": torch.zeros(32, 8), "mean/embed": torch.zeros(64)}
    coarse, _ = decode_aggregate(encode_aggregate(part, CodecSpec(codec="int4"), secret, {}, residuals), secret)
    # the error kept is what the int4 aggregate lost (in units of the mean direction)
    lost = part.unit_sums["w"] / part.total_weight - coarse.unit_sums["w"] / coarse.total_weight
    assert torch.allclose(residuals["unit/w"], lost, atol=1e-6) and residuals["unit/w"].abs().max() > 0


def test_every_region_has_a_reducer_and_the_recipe_has_no_switch_for_it():
    """One topology: the recipe model has no ``reducers`` field (a recipe that still sets
    it is told what became of it), and every region of a run, a region of one learner
    too, has its reducer."""
    from pydantic import ValidationError

    from diloco_cli.config.loading import describe_validation_error
    from diloco_cli.config.recipe import SyncConfig

    assert "reducers" not in SyncConfig.model_fields
    with pytest.raises(ValidationError) as raised:
        Recipe.model_validate(deep_update(TINY_RECIPE, {"sync": {"reducers": False}}))
    message = describe_validation_error(raised.value, Recipe, "recipe.yaml")
    assert message.startswith("recipe.yaml: 'sync.reducers' is no longer a setting") and "remove the key" in message
    regions = RegionsFile.model_validate(
        {
            "regions": [
                {"name": "a", "bucket": "file:///tmp/a", "hosts": [{"learners": 2}]},
                {"name": "b", "bucket": "file:///tmp/b", "hosts": [{"learners": 1}]},
            ]
        }
    )
    recipe = Recipe.model_validate(deep_update(TINY_RECIPE, {"training": {"num_learners": 3}}))
    spec = resolve_run(recipe, regions, "r", __import__("pathlib").Path("/tmp"))
    assert [reducer.region for reducer in spec.reducers] == ["a", "b"]


def test_a_damaged_snapshot_of_the_regions_present_version_is_rewritten_by_its_reducer(reduced):
    writer, _ = reduced.learners
    reduced.train(writer, 10)  # sends at steps 5 and 10: versions 1 and 2
    reduced.merge()
    reduced.train(writer, 5)  # the send at step 15: version 3, a snapshot version
    reduced.merge()
    assert (
        reduced.syncer.state.version
        == 3
        == reduced.reducer.replica.version
        == reduced.bucket.read_head().snapshot_version
    )
    for version in reduced.bucket.snapshot_versions():
        data = bytearray(reduced.bucket.store.get(snapshot_key(version)))
        data[-40] ^= 0x10
        reduced.bucket.store.put(snapshot_key(version), bytes(data))
    late = reduced.learner("east-1", start=False)
    try:
        late.poller.initial = None
        assert not reduced.poll(late)
        late.heartbeats.beat(wait=10)
        reduced.reducer.turn(read_heartbeats=True)  # no syncer turn: the region repairs itself
        assert sorted(reduced.poll(late)) == [0, 1]
        reduced.assert_bases_equal_the_syncers(late)
    finally:
        late.close()


def test_a_learner_that_stopped_going_on_is_reported_by_its_reducer_at_once(reduced):
    """The syncer ends a run only once each region's reducer has seen its learners' last
    heartbeats: a reducer writes its status when a learner finishes, not at its next
    status period (30 s in recipes/wan.yaml)."""
    from diloco_cli.store.documents import LearnerState

    reducer = reduced.reducer
    sync = reducer.recipe.sync.model_copy(update={"status_seconds": 3600.0})
    reducer.recipe = reducer.recipe.model_copy(update={"sync": sync})
    reducer.turn(read_heartbeats=True)  # its status period (an hour here) is spent
    written = aggregates.read_reducer_status(reduced.bucket).time
    learner = reduced.learners[0]
    learner.heartbeats.beat(LearnerState.TRAINING, wait=10)
    reducer.turn(read_heartbeats=True)
    assert aggregates.read_reducer_status(reduced.bucket).time == written  # nothing new to tell
    learner.heartbeats.beat(LearnerState.FINISHED, wait=10)
    finished = reduced.bucket.read_heartbeat(learner.me.id)
    reducer.turn(read_heartbeats=True)
    status = aggregates.read_reducer_status(reduced.bucket)
    assert status.time > written and status.heartbeats_seen[learner.me.id] == finished.time


def test_a_payload_its_reducer_refused_is_retired_in_the_syncers_ledger_also_after_a_restart(reduced, secret):
    """A learner's payload damaged at rest: the region's reducer refuses it, lists it in
    its status before removing it (so a reducer killed then still lists it), and the
    syncer retires it in its next commit, as it retires the payloads it refuses itself."""
    writer, _ = reduced.learners
    reduced.train(writer, 10)
    store = reduced.bucket.store
    keys = reduced.bucket.payload_keys()
    damaged = bytearray(store.get(keys[0]))
    damaged[-40] ^= 0x10
    store.put(keys[0], bytes(damaged))
    reduced.reducer.turn(read_heartbeats=True)
    assert reduced.reducer.refusals.counts["payload"] == 1 and keys[0] not in reduced.bucket.payload_keys()
    reduced.reducer = Reducer(reduced.spec, "east", secret)  # killed after it refused: it starts again
    reduced.reducer.start()
    assert reduced.reducer.refused_payloads == {keys[0]}
    reduced.syncer.turn(read_heartbeats=True)
    reduced.train(writer, 10)
    reduced.merge()
    retired = [r.key for commit in reduced.syncer.home.history() for r in commit.retired]
    assert retired.count(f"east:{keys[0]}") == 1
    assert not reduced.reducer.refused_payloads  # a merge of the same learner and fragment passed it


def test_a_restarted_reducer_continues_its_refusals(reduced, secret):
    """Issue 31, point 5: a reducer's refusals vanished from `status` after a SIGKILL;
    they continue across restarts, as its storage counts do."""
    from diloco_cli.codec import RunSecret
    from diloco_cli.store.documents import seal
    from diloco_cli.store.region import heartbeat_key

    learner = reduced.learners[0]
    learner.heartbeats.beat(wait=10)
    key = heartbeat_key(learner.me.id)
    reduced.bucket.store.put(key, seal(reduced.bucket.read_heartbeat(learner.me.id), key, RunSecret(bytes(32))))
    reduced.reducer.turn(read_heartbeats=True)
    learner.heartbeats.beat(wait=10)  # authentic again: the next start refuses nothing
    reduced.reducer._write_status()
    refused = aggregates.read_reducer_status(reduced.bucket).refusals
    assert refused.counts == {"heartbeat": 1}
    reduced.reducer = Reducer(reduced.spec, "east", secret)  # the first one was "killed" after its status
    reduced.reducer.start()
    reduced.reducer.turn(read_heartbeats=True)
    assert reduced.reducer.status().refusals == refused
