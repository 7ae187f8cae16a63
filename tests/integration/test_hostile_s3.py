"""Hostile keys in a real S3 bucket (moto): S3 keys are opaque strings, so keys that try to
leave the ``payloads/`` prefix are refused and never touch what they name (the other hostile
objects, in file:// buckets: tests/unit/test_hostile.py)."""

from __future__ import annotations

import time

from tests.support.harness import Harness
from tests.support.hostile import (
    FOREIGN,
    assert_merges_go_on,
    assert_weights_unchanged,
    marker,
    plant,
    shown,
    weights,
)


def test_keys_that_leave_the_payload_prefix_in_s3_are_refused_and_never_touch_what_they_name(tmp_path, secret, s3):
    """S3 keys are opaque strings: ``payloads/../x`` is a key of its own, not a path."""
    url = s3.create_bucket(f"hostile-{time.monotonic_ns()}")
    harness = Harness(
        tmp_path, secret, bucket=url + "/{run}", storage_options={"endpoint_url": s3.endpoint_url}, leftover_seconds=60
    )
    try:
        escaping = [
            "payloads/../000-000001000001.dlc",
            "payloads/..%2F/000-000001000002.dlc",
            "payloads/./001-000001000003.dlc",
        ]
        stray = ["payloads//abs/000-000001000004.dlc", "payloads/east-0/../../global/head.json"]
        decoy = "000-000001000001.dlc"  # where the first would land if ".." were resolved
        harness.bucket.store.put(decoy, b"not a diloco object")
        for key in escaping + stray:
            plant(harness.bucket, key, b"x", marker(FOREIGN, {}))
        before, versions = weights(harness.syncer), dict(harness.syncer.state.fragment_versions)
        harness.merge()
        assert_weights_unchanged(harness.syncer, before, versions)
        refusals = harness.reducer.refusals  # the region's reducer reads the payloads
        assert refusals.counts == {"marker": len(escaping)}
        assert {note.key for note in refusals.recent} == set(escaping)
        assert_merges_go_on(harness, escaping)
        listed = harness.bucket.store.list("", include_partial=True)
        assert not set(escaping) & set(listed) and decoy in listed
        now = harness.syncer.clock()
        harness.syncer.sweep(now)
        harness.syncer.sweep(now + harness.spec.recipe.sync.leftover_seconds)
        listed = harness.bucket.store.list("", include_partial=True)
        assert not any(key.startswith(tuple(stray)) for key in listed) and decoy in listed
        assert harness.bucket.read_head().version == harness.syncer.state.version
        region, _ = shown(harness)
        assert region["refusals"] == {"marker": len(escaping)}
    finally:
        harness.close()
