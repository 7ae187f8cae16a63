"""Chaos: learners, reducers and the syncer (or its shards) killed and paused at random,
payloads, markers, aggregates, updates, snapshots and checkpoints damaged at rest, litter
dropped, for the first part of a run; then a region's bucket wiped, and a finished
learner's heartbeat replayed with one kept from before the strikes; then the run must
finish and its ledger audit clean (every shard's: nothing merged twice, nothing lost,
every base the syncer's), merges must have resumed within 30 s of the wipe, and the
replayed learner must never show as training again.

The short form runs in CI (``--chaos-seconds``, default 12); a longer one is the same
test with a larger value, e.g. ``python -m pytest tests/integration/test_chaos.py
--chaos-seconds 300``."""

import json
import re
import time

import pytest

from diloco_cli.launch.runs import load_run
from diloco_cli.store.region import PAYLOAD_KEY, RELAY_KEY, relayed_payload_key
from diloco_cli.views.run_state import collect_status, read_buckets
from tests.support.chaos import Chaos
from tests.support.runs import (
    TINY_RECIPE,
    assert_bases_are_the_syncers,
    deep_update,
    diloco,
    histories,
    wait_finished,
    wait_for,
    write_yaml,
)

pytestmark = pytest.mark.slow


def audit(runs_dir, name, damaged):
    """Nothing merged twice; every payload merged, retired, or below a merged one of its
    learner and fragment; each learner's last send merged unless it was damaged."""
    record = load_run(runs_dir, name)
    secret = record.secret()
    shards = histories(record.spec, secret)
    for shard in shards:  # each syncer shard numbers its own versions
        assert [c.version for c in shard] == list(range(1, len(shard) + 1))
    history = [commit for shard in shards for commit in shard]
    merged = [m.key for c in history for m in c.merged]
    retired = {r.key for c in history for r in c.retired}
    assert len(merged) == len(set(merged)), "an arrival was merged twice"
    assert not set(merged) & retired
    for commit in history:  # a payload damaged before it was read (by the syncer, or its reducer) was refused
        read_at = {aggregate.key: aggregate.made_at for aggregate in commit.aggregates}
        for payload in commit.merged:
            damaged_at = damaged.get(payload.key)
            read = read_at[payload.aggregate] if payload.aggregate else commit.time - commit.seconds
            assert damaged_at is None or damaged_at > read - 2.0, f"damaged {payload.key} was merged"
    newest: dict[tuple[str, int], int] = {}
    for key in merged:
        slot, sequence = send_of(key)
        newest[slot] = max(newest.get(slot, -1), sequence)
    consumed = {as_payload(key) for key in [*merged, *retired]}  # a relay stands for the send it copies
    for bucket in record.spec.buckets(secret):
        for key in bucket.payload_keys():  # --chaos keep-payloads: all are here
            name_ = f"{bucket.name}:{key}"
            slot, sequence = send_of(name_)
            assert name_ in consumed or sequence <= newest.get(slot, -1), f"{name_} was lost"
    return history


def as_payload(name: str) -> str:
    """The payload a qualified payload or relay key stands for."""
    region, key = name.split(":", 1)
    return f"{region}:{relayed_payload_key(key)}" if RELAY_KEY.match(key) else name


def send_of(name: str) -> tuple[tuple[str, int], int]:
    """(learner, fragment) and sequence of a qualified payload or relay key."""
    key = name.split(":", 1)[1]
    match = PAYLOAD_KEY.match(key) or RELAY_KEY.match(key)
    return (match["learner"], int(match["fragment"])), int(match["sequence"])


WIPE_RESUME_SECONDS = 30.0
"""Merges resume within this long of a region's wipe (issue 31)."""


def _every_syncer_heard_finished(record, learner: str) -> bool:
    syncers = read_buckets(record.spec, record.secret(), time.time()).syncers
    heard = [status.heartbeats.get(learner) for status in syncers.values()]
    return len(syncers) == record.spec.recipe.sync.shards and all(
        h is not None and h.state == "finished" for h in heard
    )


def wait_until(condition, timeout: float = 120) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def replay_over_the_first_finished(runs_dir, name, chaos) -> tuple[str, bool]:
    """Once a learner has finished, its heartbeat kept before the strikes (``training``)
    copied back over its final one; returns what was done, and whether the learner was
    shown training again before the run ended (it must not be, and the run must end on
    time: a replayed heartbeat is refused, not news)."""
    spec = load_run(runs_dir, name).spec
    status = wait_for(
        runs_dir,
        name,
        lambda s: s.state == "finished" or any(row.state == "finished" for row in s.learners),
        600,
        "a learner finishing",
    )
    if status.state == "finished":
        return "no replay: the run ended first", False
    learner = next(row.learner for row in status.learners if row.state == "finished")
    record = load_run(runs_dir, name)
    if not wait_until(
        lambda: _every_syncer_heard_finished(record, learner) or collect_status(spec).state == "finished"
    ):
        raise AssertionError(f"no syncer shard took in {learner}'s finished heartbeat within 120 s")
    if collect_status(spec).state == "finished":
        return "no replay: the run ended first", False
    # only now: a replay over a final heartbeat nobody had read yet leaves nothing to say it finished
    detail, training_again = chaos.replay_heartbeat(learner), False
    deadline = time.monotonic() + 300  # past it, the wait for the run's end says what held it
    while (status := collect_status(spec)).state != "finished" and time.monotonic() < deadline:
        row = next(row for row in status.learners if row.learner == learner)
        training_again |= row.state == "training"
        time.sleep(0.5)
    return detail, training_again


@pytest.mark.parametrize(("shards", "quorum"), [(1, None), (2, 1)], ids=["one-syncer", "two-syncer-shards-relays-k1"])
def test_chaos_then_a_clean_audit(tmp_path, request, shards, quorum):
    """One syncer at K = M (the reducers forward aggregates), two syncer shards at K = 1
    (the reducers relay each send): the same strikes, the same audits."""
    seconds = request.config.getoption("--chaos-seconds")
    runs_dir, name = tmp_path / "runs", "chaos"
    changes = {
        "training": {"num_learners": 3, "inner_steps": 800 + 40 * seconds, "checkpoint_every_steps": 30},
        "sync": {
            "shards": shards,
            "quorum": quorum,
            "num_fragments": 2 * shards,
            "leftover_seconds": 3,
            "snapshot_every": 4,
            "liveness_timeout_seconds": 15,
        },
    }
    recipe = write_yaml(tmp_path / "tiny.yaml", deep_update(TINY_RECIPE, changes))
    regions = write_yaml(
        tmp_path / "regions.yaml",
        {
            "regions": [
                {
                    "name": "east",
                    "bucket": f"file://{tmp_path}/buckets/east",
                    "hosts": [{"name": "local", "learners": 2}],
                },
                {
                    "name": "west",
                    "bucket": f"file://{tmp_path}/buckets/west",
                    "hosts": [{"name": "local", "learners": 1}],
                },
            ]
        },
    )
    up = ("up", str(recipe), "--regions", str(regions), "--name", name, "--runs-dir", str(runs_dir))
    diloco(*up, "--chaos", "keep-payloads")  # the audit reads every payload
    wait_for(runs_dir, name, lambda s: s.version >= 2, 120, "version 2")
    chaos = Chaos(runs_dir, name, seed=request.config.getoption("--chaos-seed"))
    chaos.keep_heartbeats()  # authentic, and soon old: one is replayed over a finished learner's
    deadline = time.monotonic() + seconds
    forced = ("kill syncer", "kill reducer") if shards > 1 else ()  # with shards, every third strike kills one
    strikes = 0
    while time.monotonic() < deadline and collect_status(load_run(runs_dir, name).spec).state != "finished":
        chaos.strike(forced[strikes // 3 % 2] if forced and strikes % 3 == 2 else None)
        strikes += 1
        time.sleep(1.0)
    chaos.calm()
    rows = collect_status(load_run(runs_dir, name).spec).learners
    training = [row.learner for row in rows if row.state != "finished"]
    wiped_at = chaos.wipe("east")  # the last strike: a learner killed after it would start over from nothing
    replayed, training_again = replay_over_the_first_finished(runs_dir, name, chaos)
    try:
        status = wait_finished(runs_dir, name, timeout=300 + 2 * seconds)
    except AssertionError as error:
        raise AssertionError(f"chaos events: {chaos.events}") from error
    record = load_run(runs_dir, name)
    commits = sorted(c.time for shard in histories(record.spec, record.secret()) for c in shard)
    resumed = next((t - wiped_at for t in commits if t > wiped_at), None)
    print(f"chaos: merges resumed {resumed} s after the wipe (learners training then: {training}); {replayed}")
    assert not training or (resumed is not None and resumed <= WIPE_RESUME_SECONDS), (resumed, chaos.events)
    assert all(row.state == "finished" for row in status.learners), status.learners
    audit(runs_dir, name, chaos.damaged)
    assert_bases_are_the_syncers(runs_dir, name)
    assert not [path for path in chaos.litter if path.exists()], "litter was not swept"
    shown = json.loads(diloco("status", name, "-o", "json", "--runs-dir", str(runs_dir)).stdout)
    assert shown["state"] == "finished" and not shown["syncer"]["given_up"], shown["problems"]
    assert len(shown["syncer_shards"]) == (shards if shards > 1 else 0)
    for syncer in chaos.syncers:
        assert "Traceback" not in (runs_dir / name / "logs" / f"{syncer}.log").read_text(), (
            f"{syncer} crashed (killed is fine)"
        )
    if shards > 1:
        assert any(re.fullmatch(r"kill syncer syncer-\d", event) for event in chaos.events), chaos.events
    assert not training_again, f"{replayed}: the learner was shown training again"
