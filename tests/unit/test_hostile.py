"""Hostile objects planted in a region's bucket while the syncer and the region's reducer
run (driven by hand, as in tests/support/harness.py): each is refused before any of it
reaches the global weights, counted by kind in the refusals of whoever read it (the
reducer reads the learners' payloads, the syncer what the reducer forwards), shown by
``diloco status``, and the real payloads go on merging after it.

What an attacker who can write to a bucket but does not hold the run's secret can plant:
frames tagged with another key or written by another run, authentic bytes moved to
where they do not belong (an older payload's body under a newer marker, a merged
payload copied to a new key or back to its own), frames whose header declares absurd
sizes or does not parse, keys that try to leave the ``payloads/`` prefix, a truncated
snapshot, a marker whose payload is gone, and a flood of junk keys.  (The keys that try to
leave the prefix in a real S3 bucket: tests/integration/test_hostile_s3.py.)
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from diloco_cli.codec import RunSecret
from diloco_cli.codec.frame import PREFIX
from diloco_cli.core.types import FragmentIndex
from diloco_cli.store.region import payload_key, snapshot_key
from tests.support.harness import Harness
from tests.support.hostile import (
    FOREIGN,
    assert_merges_go_on,
    assert_weights_unchanged,
    frame,
    fresh_sends,
    marker,
    marker_meta,
    merged_keys,
    plant,
    region_refusals,
    removed,
    shown,
    weights,
    with_declared_sizes,
)


@pytest.fixture
def harness(tmp_path, secret):
    """The tampering harness, sweeping leftovers a minute after it first sees them."""
    made = Harness(tmp_path, secret, leftover_seconds=60)
    yield made
    made.close()


# --------------------------------------------------------------------------- tests


def test_frames_tagged_with_another_key_or_by_another_run_are_refused_as_markers(harness):
    writer = harness.learners[0]
    harness.train(writer, 10)
    harness.merge()
    before, versions = weights(harness.syncer), dict(harness.syncer.state.fragment_versions)
    real = harness.bucket.store.get(snapshot_key(0))
    # another key, but this run's fingerprint copied from a real frame: the tag fails
    forged_key = payload_key("east-0", FragmentIndex(0), 1_000_900)
    forged = lambda data: data[:8] + real[8:16] + data[16:]  # noqa: E731
    plant(
        harness.bucket,
        forged_key,
        forged(frame(FOREIGN, marker_meta(forged_key))),
        forged(marker(FOREIGN, marker_meta(forged_key))),
    )
    # another run's payload and marker, authentic there
    other_run = RunSecret.generate()
    foreign_key = payload_key("east-1", FragmentIndex(1), 1_000_900)
    plant(
        harness.bucket,
        foreign_key,
        frame(other_run, marker_meta(foreign_key)),
        marker(other_run, marker_meta(foreign_key)),
    )
    harness.merge()
    assert_weights_unchanged(harness.syncer, before, versions)
    refusals = region_refusals(harness)
    assert refusals.counts == {"marker": 2}
    reasons = {note.key: note.reason for note in refusals.recent}
    assert "tag mismatch" in reasons[forged_key] and "another run's secret" in reasons[foreign_key]
    assert_merges_go_on(harness, [forged_key, foreign_key])
    assert not {forged_key, foreign_key} & set(harness.bucket.payload_keys())  # consumed by the commit, deleted
    region, text = shown(harness)
    assert region["refusals"] == {"marker": 2} and region["latest_refusal"]["kind"] == "marker"
    assert "refused in east: 2 marker" in text


def swap_older_body(harness, key, old):
    harness.bucket.store.put(key, old)


BODIES = {
    "another run's payload": lambda harness, key, old: harness.bucket.store.put(
        key, frame(RunSecret.generate(), marker_meta(key))
    ),
    "an older payload of the same learner": swap_older_body,
    "a truncated payload": lambda harness, key, old: harness.bucket.store.put(
        key, harness.bucket.store.get(key)[:-100]
    ),
    "no payload at all": lambda harness, key, old: harness.bucket.store.delete(key),
    "a huge declared header": lambda harness, key, old: harness.bucket.store.put(
        key, with_declared_sizes(harness.bucket.store.get(key), header_bytes=0xFFFF_FFFF)
    ),
    "a huge declared body": lambda harness, key, old: harness.bucket.store.put(
        key, with_declared_sizes(harness.bucket.store.get(key), body_bytes=1 << 63)
    ),
}


@pytest.mark.parametrize("body", list(BODIES))
def test_a_body_that_is_not_what_its_authentic_marker_describes_is_refused_and_moves_nothing(harness, body):
    """The marker is the learner's own; the bytes under it were replaced.  With K=1 the
    refused arrival is the only one of its round: no version may come of it (not even
    the outer momentum's step of an empty merge)."""
    writer = harness.learners[0]
    first = fresh_sends(harness, writer)
    fragment = FragmentIndex(0)
    old, old_base = (
        harness.bucket.store.get(first[fragment]),
        harness.bucket.marker_meta(first[fragment])["base_version"],
    )
    harness.merge()
    before, versions = weights(harness.syncer), dict(harness.syncer.state.fragment_versions)
    second = fresh_sends(harness, writer)
    assert (
        harness.bucket.marker_meta(second[fragment])["base_version"] == old_base
    )  # so the old body's metadata matches
    BODIES[body](harness, second[fragment], old)
    other = FragmentIndex(1)
    harness.merge()
    refusals = region_refusals(harness)
    assert refusals.counts == {"payload": 1} and refusals.latest.key == second[fragment]
    assert harness.syncer.state.fragment_versions[other] > versions[other]  # the real one merged
    assert harness.syncer.state.fragment_versions[fragment] == versions[fragment]
    for name in harness.syncer.fragments[fragment].parameter_names:
        assert torch.equal(harness.syncer.state.theta[name], before[name]), name
    assert_merges_go_on(harness, [second[fragment]])
    region, _ = shown(harness)
    assert region["refusals"] == {"payload": 1} and region["latest_refusal"]["key"] == second[fragment]


def test_a_merged_payload_copied_to_a_new_key_or_back_to_its_own_is_never_merged_again(harness):
    writer = harness.learners[0]
    sends = fresh_sends(harness, writer)
    key = sends[FragmentIndex(0)]
    payload, marker = harness.bucket.store.get(key), harness.bucket.store.get(key + ".ready")
    harness.merge()
    assert f"east:{key}" in merged_keys(harness.syncer) and key not in harness.bucket.payload_keys()
    before, versions = weights(harness.syncer), dict(harness.syncer.state.fragment_versions)
    # under a newer sequence and under another learner: the marker describes another payload
    newer, elsewhere = (
        payload_key("east-0", FragmentIndex(0), 1_000_500),
        payload_key("east-1", FragmentIndex(0), 1_000_500),
    )
    for copy in (newer, elsewhere):
        plant(harness.bucket, copy, payload, marker)
    # back under its own key: the ledger knows it as consumed; it is deleted unread
    plant(harness.bucket, key, payload, marker)
    harness.merge()
    assert_weights_unchanged(harness.syncer, before, versions)
    refusals = region_refusals(harness)
    assert refusals.counts == {"marker": 2} and all(
        "describes another payload" in note.reason for note in refusals.recent
    )
    assert key not in harness.bucket.payload_keys()
    assert_merges_go_on(harness, [newer, elsewhere])
    assert merged_keys(harness.syncer).count(f"east:{key}") == 1


def test_frames_with_absurd_or_unparsable_headers_are_refused_as_markers(harness):
    before, versions = weights(harness.syncer), dict(harness.syncer.state.fragment_versions)
    keys = [payload_key("east-0", FragmentIndex(0), 1_000_901 + n) for n in range(5)]  # beyond the real sends
    valid = marker(harness.secret, {})
    markers = [
        with_declared_sizes(valid, header_bytes=0xFFFF_FFFF),  # 4 GiB of header declared
        with_declared_sizes(valid, body_bytes=(1 << 64) - 1),
        with_declared_sizes(valid, header_bytes=3),  # a header that ends inside the JSON
        valid[: PREFIX.size - 3],  # not even a whole prefix
        PREFIX.pack(b"DLCO", 1, 0, bytes(8), 9, 0) + b"{not json" + bytes(32),
    ]
    for key, bad in zip(keys, markers):
        plant(harness.bucket, key, b"x", bad)
    harness.merge()
    assert_weights_unchanged(harness.syncer, before, versions)
    refusals = region_refusals(harness)
    assert refusals.counts == {"marker": 5}
    reasons = " | ".join(note.reason for note in refusals.recent)
    assert "beyond the limits" in reasons and "shorter than its 28-byte prefix" in reasons
    assert_merges_go_on(harness, keys)
    region, _ = shown(harness)
    assert region["refusals"] == {"marker": 5}


def test_a_truncated_snapshot_is_refused_by_a_newcomer_and_rewritten_by_its_reducer(harness):
    """The region's snapshots are its reducer's (it writes them from its copy of the
    global weights): a newcomer's refusal, reported in its heartbeat, has it write one again."""
    writer = harness.learners[0]
    for _ in range(3):
        harness.train(writer, 10)
        harness.merge()
    for version in harness.bucket.snapshot_versions():
        data = harness.bucket.store.get(snapshot_key(version))
        harness.bucket.store.put(snapshot_key(version), data[: len(data) // 2])
    newcomer = harness.learner("east-1", start=False)
    try:
        assert not harness.poll(newcomer)
        assert newcomer.refusals.counts["snapshot"] >= 1 and "frame declares" in newcomer.refusals.latest.reason
        newcomer.heartbeats.beat(wait=10)
        region, text = shown(harness)
        assert region["refusals"]["snapshot"] >= 1 and "snapshot" in text
        harness.reducer.turn(read_heartbeats=True)
        assert harness.reducer.refusals.counts.get("snapshot", 0) == 0  # it reads its own copy, not the snapshot
        assert len(harness.poll(newcomer)) == 2
        harness.assert_bases_equal_the_syncers(newcomer)
    finally:
        newcomer.close()


def test_a_flood_of_junk_keys_does_not_stall_the_syncer_and_is_swept(harness):
    """20,000 junk keys under payloads/: 19,000 that are no payload's (read by nobody,
    removed by the syncer's leftover sweeper) and 1,000 shaped like payloads with forged
    markers (each read once by the region's reducer and refused).  The real sends merge
    in the same turns."""
    root = Path(harness.bucket.store.root.removeprefix("file://")) / "payloads"
    for n in range(19_000):
        path = root / f"junk-{n % 50}" / (f"{n:05d}.bin" if n % 2 else f"{n:03d}-x.dlc.ready")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"junk")
    forged = marker(FOREIGN, {})
    shaped = [payload_key(f"mallory-{n % 7}", FragmentIndex(n % 2), 1_000_000 + n) for n in range(1_000)]
    for key in shaped:
        path = root.parent / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"junk")
        Path(f"{path}.ready").write_bytes(forged)
    before, versions = weights(harness.syncer), dict(harness.syncer.state.fragment_versions)
    started = time.monotonic()
    harness.reducer.turn()
    harness.syncer.turn()
    flooded = time.monotonic() - started
    assert flooded < 20, f"one turn over the flood took {flooded:.1f} s"
    assert_weights_unchanged(harness.syncer, before, versions)
    assert region_refusals(harness).counts == {"marker": 1_000}
    started = time.monotonic()
    assert_merges_go_on(harness, shaped)
    assert time.monotonic() - started < 30
    # the junk that is no payload is a leftover: removed once seen for leftover_seconds
    now = harness.syncer.clock()
    harness.syncer.sweep(now)
    assert removed(harness) == 0
    # a few thousand per sweep, in batched requests: the flood never holds up one turn long
    deletes_before = harness.syncer.buckets["east"].store.meter.snapshot().requests
    for sweep in range(1, 7):
        harness.syncer.sweep(now + harness.spec.recipe.sync.leftover_seconds + sweep)
        assert removed(harness) <= 5_000 * sweep
    assert removed(harness) >= 19_000
    requests = harness.syncer.buckets["east"].store.meter.snapshot().requests - deletes_before
    assert requests <= 6 + 25, (
        f"{requests} requests to sweep {removed(harness)} keys"
    )  # a listing per sweep, 1 per 1,000 keys
    assert not any(root.glob("junk-*/*")) and not any(root.glob("mallory-*/*"))
    region, text = shown(harness)
    assert region["refusals"] == {"marker": 1_000}
    assert f"removed {removed(harness)} leftovers" in text


def test_heartbeats_that_break_the_json_reader_are_refused_not_a_crash(harness):
    """json.loads raises RecursionError (not ValueError) on deep nesting, and
    hmac.compare_digest a TypeError on a non-ASCII tag: either escaped the scan and
    stopped the syncer."""
    harness.learners.pop().close()  # east-1 stops beating: nothing overwrites the planted documents
    for planted in (b'{"document": ' + b"[" * 100_000, '{"document": {}, "tag": "\u00e9"}'.encode()):
        harness.bucket.store.put("heartbeats/east-1.json", planted)
        harness.syncer.turn(read_heartbeats=True)
    refusals = region_refusals(harness)
    assert refusals.counts == {"heartbeat": 2}
    assert (
        "is not a sealed diloco document (RecursionError" in refusals.recent[0].reason
        and "tag mismatch" in refusals.latest.reason
    )
    region, text = shown(harness)  # status reads the last one too: refused there as well
    assert region["refusals"]["heartbeat"] == 3 and "heartbeat" in text
    assert_merges_go_on(harness, [])
