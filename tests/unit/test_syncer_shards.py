"""Syncer shards (``sync.shards: N``): N syncers, each over the fragments p with
p % N == s, with its own home, ledger, versions and head (``global/shard-<s>/``), driven
by hand beside real learners and the region's reducers (tests/support/harness.py)."""

import pytest
import torch

from diloco_cli.bandwidth.prices import load_prices
from diloco_cli.codec import RunSecret
from diloco_cli.config.chaos import parse_chaos, process_events
from diloco_cli.config.errors import ConfigError
from diloco_cli.config.recipe import Recipe
from diloco_cli.config.regions import RegionsFile
from diloco_cli.core.fragments import SyncerShard
from diloco_cli.core.types import FragmentIndex, Version
from diloco_cli.launch.resolve import resolve_run
from diloco_cli.launch.services import services
from diloco_cli.runtime.syncer.loop import Syncer
from diloco_cli.store.aggregates import read_reducer_status
from diloco_cli.store.documents import ControlNote, SyncerPhase
from diloco_cli.store.home import tokens_merged
from diloco_cli.views.report import collect_report
from diloco_cli.views.report import render_plain as render_report
from diloco_cli.views.run_state import collect_status
from diloco_cli.views.status import render_plain
from tests.support.harness import Harness
from tests.support.runs import TINY_RECIPE, deep_update

FRAGMENTS = 4


@pytest.fixture(params=[2, 1], ids=["aggregates", "relays"])
def sharded(request, tmp_path, secret):
    """K=M: the region's reducer forwards aggregates; K=1 of 2: it relays each send."""
    made = Harness(tmp_path, secret, quorum=request.param, shards=2, num_fragments=FRAGMENTS)
    yield made
    made.close()


def train_and_merge(harness, rounds=3):
    writer, reader = harness.learners
    for _ in range(rounds):
        harness.train(writer, 10)
        harness.train(reader, 10)
        harness.merge()
        for learner in harness.learners:
            harness.poll(learner)


def assert_every_send_merged_once_and_every_token_accounted(harness):
    """Across every shard's home: no send in two commits (or two shards), each shard's
    versions 1..n with its own fragments only, and each learner's tokens merged or
    overwritten, per fragment."""
    histories = [syncer.home.history() for syncer in harness.syncers]
    for shard, history in enumerate(histories):
        assert [commit.version for commit in history] == list(range(1, len(history) + 1))
        assert {commit.fragment % len(histories) for commit in history} == {shard}
    merged = [m.key for history in histories for commit in history for m in commit.merged]
    assert merged and len(merged) == len(set(merged)), "a send was merged twice"
    everything = [commit for history in histories for commit in history]
    for learner in harness.learners:
        learner.heartbeats.beat(wait=10)
        beat = harness.bucket.read_heartbeat(learner.me.id)
        for fragment in range(FRAGMENTS):
            accounted = tokens_merged(everything, learner.me.id, fragment) + beat.tokens_overwritten.get(fragment, 0)
            unsent = learner.fragments.c_tokens[fragment] - learner.fragments.sent_tokens[fragment]
            assert accounted == beat.tokens - unsent, (learner.me.id, fragment)


def test_two_shards_give_every_learner_the_syncers_bases_bit_for_bit_and_merge_each_send_once(sharded):
    train_and_merge(sharded)
    for shard, syncer in enumerate(sharded.syncers):
        assert sorted(syncer.state.fragment_versions) == [p for p in range(FRAGMENTS) if p % 2 == shard]
        assert syncer.state.version > 0
    for learner in sharded.learners:
        sharded.assert_bases_equal_the_syncers(learner)
    assert_every_send_merged_once_and_every_token_accounted(sharded)
    # each shard's objects under its own prefix; none where a run's only syncer puts them
    keys = sharded.bucket.store.list("global")
    assert keys and all(key.startswith(("global/shard-0/", "global/shard-1/")) for key in keys)
    for shard in range(2):
        view = sharded.bucket.for_syncer_shard(SyncerShard(shard, 2))
        assert sorted(view.read_head().fragment_versions) == [p for p in range(FRAGMENTS) if p % 2 == shard]
        assert {p for _, p in view.update_versions()} == {p for p in range(FRAGMENTS) if p % 2 == shard}


def run_once(tmp_path, secret, shards):
    harness = Harness(tmp_path, secret, shards=shards, num_fragments=FRAGMENTS)
    try:
        train_and_merge(harness)
        theta = {}
        for fragment in harness.syncers[0].fragments:
            owner = harness.syncer_of(fragment.index).state
            theta.update({name: owner.theta[name].clone() for name in fragment.parameter_names})
        learner = {name: p.detach().clone() for name, p in harness.learners[0].model.named_parameters()}
        return theta, learner
    finally:
        harness.close()


def test_the_sharded_merge_gives_the_unsharded_weights_for_the_same_arrivals(tmp_path, secret):
    """Fragments are independent (each its own versions, window, momentum, carried
    publication error): the same sends, merged by one syncer or by two shards, give the
    same global weights and the same learners, bit for bit."""
    one, one_learner = run_once(tmp_path / "one", secret, shards=1)
    two, two_learner = run_once(tmp_path / "two", secret, shards=2)
    torch.manual_seed(Recipe.model_validate(TINY_RECIPE).training.seed)
    seeded = dict(Recipe.model_validate(TINY_RECIPE).model.build().named_parameters())
    assert any(not torch.equal(one[name], seeded[name]) for name in one)
    for name in one:
        assert torch.equal(one[name], two[name]), name
    for name in one_learner:
        assert torch.equal(one_learner[name], two_learner[name]), name


def test_a_killed_shard_restarts_from_its_home_and_merges_nothing_twice(tmp_path, secret):
    harness = Harness(tmp_path, secret, shards=2, num_fragments=FRAGMENTS)
    try:
        train_and_merge(harness, rounds=2)
        before = harness.syncers[1].state
        restarted = Syncer(harness.spec, secret, syncer_shard=1)  # shard 1 killed, and started again
        restarted.start()
        assert restarted.state.version == before.version
        assert restarted.state.fragment_versions == before.fragment_versions
        for fragment in (1, 3):
            for name in harness.syncers[0].fragments[fragment].parameter_names:
                assert torch.equal(restarted.state.theta[name], before.theta[name]), name
        harness.syncers[1] = restarted
        train_and_merge(harness, rounds=2)
        assert harness.syncers[1].state.version > before.version
        for learner in harness.learners:
            harness.assert_bases_equal_the_syncers(learner)
        assert_every_send_merged_once_and_every_token_accounted(harness)
    finally:
        harness.close()


def test_a_resync_asked_by_one_shard_reinstalls_that_shards_fragments_alone(sharded):
    train_and_merge(sharded, rounds=1)
    learner = sharded.learners[0]
    sharded.poll(learner)
    shard = sharded.syncers[1]
    shard.notes.resync(learner.me.id, "east", FragmentIndex(1), "a test asks")
    assert sharded.poll(learner) == {}  # every fragment at the head: nothing to reinstall
    assert learner.poller.resync_seen == {0: 0, 1: 1}  # and answered
    for trained in sharded.learners:  # every head moves past the learner's bases, which it does not poll
        sharded.train(trained, 10)
    sharded.merge()
    shard.notes.resync(learner.me.id, "east", FragmentIndex(1), "a test asks again")
    installed = sharded.poll(learner)
    assert installed[1] is False and installed[3] is False  # overwritten (a resync never keeps unsent work)
    keeps = sharded.spec.recipe.keeps_unsent_work
    assert {p: installed[p] for p in (0, 2)} == {0: keeps, 2: keeps}  # shard 0's as any install
    assert learner.poller.resync_seen == {0: 0, 1: 2}
    assert sharded.poll(learner) == {}  # answered once
    sharded.assert_bases_equal_the_syncers(learner)


def test_shard_zero_evaluates_the_whole_model_and_never_a_half_stale_one(sharded):
    train_and_merge(sharded, rounds=2)
    zero, one = sharded.syncers
    whole = {**zero.state.theta}
    for fragment in (1, 3):
        whole.update({name: one.state.theta[name] for name in zero.fragments[fragment].parameter_names})
    composed = zero.evaluator.evaluate(zero.state.theta, zero.state.version, tokens=0)
    expected = zero.evaluator.evaluate(whole, zero.state.version, tokens=0, whole=True)
    stale = zero.evaluator.evaluate(zero.state.theta, zero.state.version, tokens=0, whole=True)
    assert composed.loss == expected.loss != stale.loss
    assert not one.evaluator.enabled and one.state.evaluations == []
    # shard 1's head cannot be read (damaged): no evaluation, rather than one of a half-stale model
    key = sharded.bucket.for_syncer_shard(SyncerShard(1, 2)).layout.head_key
    sharded.bucket.store.put(key, sharded.bucket.store.get(key).replace(b'"version"', b'"versio"'))
    assert zero.evaluator.evaluate(zero.state.theta, zero.state.version, tokens=0) is None


def test_the_status_shows_each_shard_and_the_run_as_their_sum(sharded):
    train_and_merge(sharded, rounds=2)
    for syncer in sharded.syncers:
        syncer.write_status(SyncerPhase.RUNNING)
    status = collect_status(sharded.spec, sharded.secret)
    assert [shard.name for shard in status.syncer_shards] == ["syncer-0", "syncer-1"]
    versions = [syncer.state.version for syncer in sharded.syncers]
    assert [shard.version for shard in status.syncer_shards] == versions and status.version == sum(versions)
    assert status.syncer.merges == sum(syncer.state.merges for syncer in sharded.syncers)
    assert status.state == "running" and status.heldout_loss is not None
    text = render_plain(status)
    assert "2 syncer shards:" in text and "syncer-0: running; version" in text and "syncer-1: running" in text
    assert f"(version {status.heldout_version} of syncer-0)" in text
    if sharded.reducers:
        assert [(r.region, r.shard) for r in status.reducers] == [("east", 0), ("east", 1)]
        assert "reducer east (shard 1): running" in text
    east = status.regions[0]
    assert east.syncer_down > 0 and east.syncer_up > 0
    report = collect_report(sharded.spec, sharded.secret, load_prices())
    assert [row.name for row in report.syncers] == ["syncer-0", "syncer-1"]
    assert all(row.bytes_up > 0 and row.merges > 0 and row.home_bytes > 0 for row in report.syncers)
    written = sum(row.bytes_up for row in report.syncers)
    assert written == sum(link.bytes_up for link in report.links if link.source == "east" and link.bucket == "east") - (
        sum(beat.storage.bytes_up for beat in collect_heartbeats(sharded))
        + sum(r.storage.bytes_up for r in read_reducers(sharded))
    )
    shown = render_report(report)
    assert "per syncer shard" in shown and "syncer-1" in shown


def collect_heartbeats(harness):
    return [harness.bucket.read_heartbeat(learner.me.id) for learner in harness.learners]


def read_reducers(harness):
    views = harness.bucket.syncer_shards(len(harness.syncers))
    return [status for view in views if (status := read_reducer_status(view)) is not None]


def recipe(**sync):
    return Recipe.model_validate(deep_update(TINY_RECIPE, {"sync": sync}))


def regions(**syncer):
    return RegionsFile.model_validate(
        {
            "regions": [
                {
                    "name": "east",
                    "bucket": "file:///tmp/east",
                    "hosts": [{"name": "e1", "address": "10.0.0.1", "learners": 2}],
                }
            ],
            "syncer": syncer,
        }
    )


def test_more_shards_than_fragments_are_refused():
    with pytest.raises(ValueError, match="sync.shards N=3 exceeds sync.num_fragments P=2"):
        recipe(shards=3)


def test_shards_are_placed_as_the_regions_file_says_each_with_a_home_of_its_own(tmp_path):
    spec = resolve_run(recipe(shards=2), regions(shard_hosts=["local", "e1"]), "r", tmp_path)
    assert [(s.name, s.host, s.region) for s in spec.syncer_shards] == [
        ("syncer-0", "local", None),
        ("syncer-1", "e1", "east"),
    ]
    homes = [s.home for s in spec.syncer_shards]
    assert homes == [f"file://{tmp_path}/r/syncer/shard-0", "file:///tmp/east/r/syncer/shard-1"]
    found = [(s.name, s.host, s.arguments) for s in services(spec) if s.kind == "syncer"]
    assert found == [
        ("syncer-0", "local", ("_syncer", "--shard", "0")),
        ("syncer-1", "e1", ("_syncer", "--shard", "1")),
    ]
    everywhere = resolve_run(recipe(shards=2), regions(), "r", tmp_path)  # default: where the syncer goes
    assert [(s.host, s.region) for s in everywhere.syncer_shards] == [("e1", "east")] * 2
    with pytest.raises(ConfigError, match="names 1 host"):
        resolve_run(recipe(shards=2), regions(shard_hosts=["local"]), "r", tmp_path)
    with pytest.raises(ConfigError, match="'w9' is not 'local' nor a host"):
        resolve_run(recipe(shards=2), regions(shard_hosts=["local", "w9"]), "r", tmp_path)


def test_one_syncer_keeps_the_layout_and_names_of_a_run_without_shards(tmp_path):
    spec = resolve_run(recipe(), regions(), "r", tmp_path)
    assert spec.syncer.shards == () and [s.name for s in spec.syncer_shards] == ["syncer"]
    assert spec.syncer_shards[0].home == spec.syncer.home
    assert [(s.name, s.arguments) for s in services(spec) if s.kind == "syncer"] == [("syncer", ("_syncer",))]
    view = spec.bucket("east", RunSecret(bytes(32))).for_syncer_shard(spec.syncer_shard(0))
    layout = view.layout
    assert (layout.head_key, layout.status_key, layout.update_key(Version(3), FragmentIndex(1))) == (
        "global/head.json",
        "global/syncer.json",
        "global/updates/0000000003-001.dlc",
    )
    assert (layout.control_key("east-0"), layout.reducer_status_key, layout.reducer_name) == (
        "control/east-0.json",
        "reducer/status.json",
        "reducer",
    )


def test_the_membership_notes_are_shard_zeros_and_each_shard_writes_its_own_resyncs(sharded):
    """Shard 0 alone speaks for the run's membership (drain, data slices, H_m); a note of
    shard 1 carries nothing but its resync requests, under its prefix."""
    assert [syncer.speaks_for_membership for syncer in sharded.syncers] == [True, False]
    drained = sharded.spec.model_copy(
        update={"learners": tuple(s.model_copy(update={"drain": s.id == "east-1"}) for s in sharded.spec.learners)}
    )
    for syncer in sharded.syncers:
        syncer.spec = drained
        syncer._follow_manifest()
    views = [sharded.bucket.for_syncer_shard(SyncerShard(shard, 2)) for shard in range(2)]
    assert views[0].read_control("east-1").drain and views[1].read_control("east-1") == ControlNote()
    assert sharded.bucket.store.exists("global/shard-0/control/east-1.json")


def test_chaos_kills_random_syncer_shards_and_moves_no_other_event():
    plan = parse_chaos("seed=3,kill-learner=2/min,kill-syncer=2/min,kill-reducer=1/min")
    learners, reducers = ["a-0", "a-1"], ["reducer-a"]
    one = process_events(plan, learners, reducers, horizon=3600)
    two = process_events(plan, learners, reducers, horizon=3600, syncers=["syncer-0", "syncer-1"])
    assert {e.target for e in one if "syncer" in e.target} == {"syncer"}
    assert {e.target for e in two if "syncer" in e.target} == {"syncer-0", "syncer-1"}
    rename = lambda events: [(e.at_seconds, e.action, "syncer" if "syncer" in e.target else e.target) for e in events]  # noqa: E731
    assert rename(one) == rename(two)


def test_resume_starts_every_shard_again_when_learners_come_back_and_the_learners_after_their_heads(
    tmp_path, monkeypatch
):
    """Learners restarted after the syncer shards finished need them to merge what they
    send: resume starts the shards and the reducers with them, first, and the learners
    only once the shards republished their heads (one that read the old end would leave)."""
    from diloco_cli.launch import operations

    spec = resolve_run(recipe(shards=2), regions(shard_hosts=["local", "local"]), "r", tmp_path)
    processes = [*(s.name for s in spec.syncer_shards), *(r.name for r in spec.reducers), "east-0"]
    rows = [
        {"process": name, "supervisor_alive": False, "supervisor": "finished" if name != "east-0" else "failed"}
        for name in processes
    ]
    record = type("Record", (), {"spec": spec, "name": "r"})()
    monkeypatch.setattr(operations, "probe_run", lambda record: rows)
    calls = []
    start = lambda record, names, how, emit: calls.append(sorted(names)) or names  # noqa: E731
    monkeypatch.setattr(operations, "start_processes", start)
    monkeypatch.setattr(operations, "wait_for_open_heads", lambda record, timeout: calls.append("wait") or True)
    assert operations.resume_run(record) == sorted(["east-0", "syncer-0", "syncer-1", "reducer-east"])
    assert calls == [sorted(["syncer-0", "syncer-1", "reducer-east"]), "wait", ["east-0"]]
    lines = []
    monkeypatch.setattr(operations, "wait_for_open_heads", lambda record, timeout: False)
    operations.resume_run(record, emit=lines.append)
    assert lines[0].strip().startswith("waiting for the syncer"), lines
    assert any("has not republished its head" in line and "diloco status r" in line for line in lines), lines


def test_resume_waits_for_coordinators_still_finishing_the_first_end_and_starts_them_again(tmp_path, monkeypatch):
    """Resumed the moment the run ended, the syncer and a reducer may still be writing
    their last words (alive, the head already finished): resume waits for them to exit
    and starts them again before the learner, which would otherwise read the first end's
    head and leave (seen on CI: the learner left, the run never finished again)."""
    from diloco_cli.launch import operations

    spec = resolve_run(recipe(shards=1), regions(shard_hosts=["local"]), "r", tmp_path)
    coordinators = [*(s.name for s in spec.syncer_shards), *(r.name for r in spec.reducers)]
    probes = iter([True, True, False])  # alive at the first probe and the first wait, then gone

    def probe(record):
        alive = next(probes)
        rows = [{"process": name, "supervisor_alive": alive, "supervisor": "running"} for name in coordinators]
        return rows + [{"process": "east-0", "supervisor_alive": False, "supervisor": "failed"}]

    record = type("Record", (), {"spec": spec, "name": "r"})()
    monkeypatch.setattr(operations, "probe_run", probe)
    monkeypatch.setattr(operations, "_some_head_finished", lambda record: True)
    monkeypatch.setattr(operations.time, "sleep", lambda seconds: None)
    calls = []
    start = lambda record, names, how, emit: calls.append(sorted(names)) or names  # noqa: E731
    monkeypatch.setattr(operations, "start_processes", start)
    monkeypatch.setattr(operations, "wait_for_open_heads", lambda record, timeout: calls.append("wait") or True)
    lines = []
    assert operations.resume_run(record, emit=lines.append) == sorted([*coordinators, "east-0"])
    assert calls == [sorted(coordinators), "wait", ["east-0"]]
    assert "to finish the run's first end" in lines[0], lines
    # a run that goes on (no head finished): live coordinators are left running
    probes = iter([True])
    monkeypatch.setattr(operations, "_some_head_finished", lambda record: False)
    calls.clear()
    assert operations.resume_run(record) == ["east-0"]
    assert [call for call in calls if call] == [["east-0"]]


def test_resume_waits_for_a_head_that_says_the_run_goes_on(tmp_path):
    """The wait reads every region's head as the learners will: the first end's head
    (finished) holds it back, the one a restarted syncer republishes lets it go."""
    from diloco_cli.launch.operations import wait_for_open_heads
    from diloco_cli.launch.runs import load_run
    from tests.support.runs_on_disk import published_run

    runs_dir, _ = published_run(tmp_path, finished=True)
    record = load_run(runs_dir, "made")
    buckets = record.spec.buckets(record.secret())
    head = buckets[0].read_head()
    assert head is not None and not head.finished
    assert wait_for_open_heads(record, timeout=0)
    buckets[-1].write_head(head.model_copy(update={"finished": True}))
    assert not wait_for_open_heads(record, timeout=0.3, poll_seconds=0.1)
    buckets[-1].write_head(head)
    assert wait_for_open_heads(record, timeout=0)
